"""Tensor-parallel ranks for tests: one spawned process per rank, each reporting one result."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.server import free_port


def run_ranks(target: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> dict[int, Any]:
    """Runs target(rank, world, port, *args) in `world` spawned processes (a free port for the group's
    store) and returns {rank: what target returned}. A rank that does not answer in time fails the test."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_report, args=(target, out, r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, value = pickle.loads(out.get(timeout=timeout))
            if not ok:
                pytest.fail(f"rank {rank} failed: {value}")
            results[rank] = value
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(results))} did not answer within {timeout} s")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def _report(target: Callable[..., Any], out: Any, rank: int, *args: Any) -> None:
    import torch.distributed as dist

    try:
        result = (rank, True, target(rank, *args))
        # Every rank leaves the group before any exits: a rank whose peers (or store host) vanished
        # mid-collective may abort, and a process that aborts while sending its result breaks the queue.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        result = (rank, False, repr(exc))
    # Plain pickle bytes: a tensor put on the queue as it is travels as a file descriptor that the
    # parent can no longer fetch once this process has exited.
    out.put(pickle.dumps(result))
