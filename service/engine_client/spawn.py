"""The engine process spawned, and spawned early: the server starts it before its pre-flight checks,
so that its imports (torch and the engine: 4 s on a 2-core CPU) run while this process checks the
flags and the model (which imports them too). Torch-free, so that starting it costs nothing first.
The process loads nothing until EngineProcess.start sends its WorkerSpec; if the server never starts,
it is killed as this one exits.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from typing import Any

from service.engine_client.worker import worker_main

_early: tuple[Any, Any] | None = None  # (process, pipe end) started by start_early, for the next engine


def new_process() -> tuple[Any, Any]:
    """An engine process, started, and the gRPC process's end of its pipe."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=worker_main, args=(child_conn, os.getpid()), name="graphserve-engine", daemon=True)
    process.start()
    child_conn.close()
    return process, conn


def start_early() -> None:
    global _early
    if _early is None:
        _early = new_process()
        # Before multiprocessing's own exit handler (atexit runs the last registered first), which
        # would wait for this process: it ignores SIGTERM, and waits for its spec until the pipe closes.
        atexit.register(_close_unclaimed)


def _close_unclaimed() -> None:
    """At exit, an early process no engine took (a pre-flight check failed): it has loaded nothing, so
    it is killed rather than left to finish its imports."""
    global _early
    if _early is not None:
        process, conn = _early
        _early = None
        process.kill()
        process.join(5)
        conn.close()


def take_process() -> tuple[Any, Any]:
    """The process start_early started, or a new one."""
    global _early
    started, _early = _early, None
    return started or new_process()
