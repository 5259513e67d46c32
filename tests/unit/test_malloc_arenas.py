"""The engine process caps glibc's malloc arenas (limit_malloc_arenas): without a cap each thread
that allocates gets an arena of its own, and hostile grammars' freed memory stays spread over them.
Each case runs in a fresh interpreter (the cap must come before threads start) and counts the
arenas glibc reports (malloc_stats prints one "Arena N:" block per arena)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

THREADS = 8
PROGRAM = textwrap.dedent(f"""
    import ctypes, ctypes.util, sys, threading
    from service.engine.grammar_threads import limit_malloc_arenas
    capped = limit_malloc_arenas(2) if sys.argv[1] == "cap" else None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    together = threading.Barrier({THREADS})

    def allocate():  # every thread alive and allocating at once, as the grammar workers are
        together.wait()
        blocks = [libc.malloc(4096) for _ in range(200)]
        together.wait()
        for b in blocks:
            libc.free(b)

    threads = [threading.Thread(target=allocate) for _ in range({THREADS})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(capped, flush=True)
    libc.malloc_stats()
""")


def arenas(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60,
                          env=clean | env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr.count("Arena ")


def test_threads_share_two_arenas_once_capped() -> None:
    assert arenas("cap") == ("True", 2)
    _, uncapped = arenas("none")
    assert uncapped > 2  # the case the cap is for: glibc gave the threads arenas of their own


def test_an_operators_own_cap_is_kept() -> None:
    assert arenas("cap", MALLOC_ARENA_MAX="3") == ("False", 3)
