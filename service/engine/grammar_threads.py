"""What the grammar workers share: a thread's CPU time, the idle priority for background work,
and giving freed grammar memory back to the operating system (few malloc arenas, trimmed).

Budgets are CPU time, not wall time: a worker that waits for a busy core is not over its budget, so
an innocent constraint is never failed because the host was loaded; a hostile one burns CPU and is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("graphserve.engine")


def thread_cpu_seconds(ident: int) -> float:
    """CPU seconds the live thread `ident` (threading.get_ident()) has used; 0.0 where the platform
    cannot tell (then budgets fall back to their wall-clock limits)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):
        return 0.0


class WorkerThreads:
    """A pool's daemon worker threads, kept so that closing the pool can wait for them to end.

    A worker frees its torch tensors (its scratch bitmask) as it ends, and torch releases and retakes
    the GIL inside that free: a daemon thread that retakes it once the interpreter has begun to exit
    is ended there, inside C++, and the process aborts ("terminate called without an active
    exception", seen on Ctrl-C of the Python API). So a pool's close waits, within a bound, for its
    idle workers; one stuck in a hostile grammar is not waited for beyond the bound."""

    CLOSE_WAIT_S = 1.0  # idle workers end in milliseconds; this bounds the wait for a stuck one

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target = target
        self._name = name
        self._threads: list[threading.Thread] = []

    def spawn(self) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=self._target, name=self._name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for the workers to end (call after waking them to close)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def run_when_idle(native_id: int | None = None) -> None:
    """Let a thread (native_id; the calling thread by default) run only on CPU time that nothing else
    wants: Linux's SCHED_IDLE, nice 19 where that policy is missing. Best effort. For compiles and
    for mask workers whose result is thrown away, so that the threads serving streams come first.
    A nice value alone did not do it: a thread at nice 10, alone on one of two cores, kept 95% of it
    while the engine thread waited 10-17 ms per step in the other's run queue; a core running only
    SCHED_IDLE threads counts as idle, and a waking engine thread takes it at once."""
    tid = threading.get_native_id() if native_id is None else native_id
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        pass


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> int:
    """Bytes the process has allocated with malloc now (glibc's mallinfo2: in use, mmapped chunks
    included); the grammar library allocates there. Unlike RSS it falls when memory is freed and does
    not hide an allocation that reuses freed pages. Process-wide: other threads' allocations meanwhile
    count too. The resident set size where mallinfo2 is missing (not glibc, or before 2.33)."""
    if _mallinfo2 is not None:
        info = _mallinfo2()
        return info.uordblks + info.hblkhd
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryTrimmer:
    """Gives memory freed by the grammar library back to the operating system (glibc's malloc_trim).

    A hostile grammar can make the library allocate hundreds of MB; freed, glibc keeps most of it in
    its arenas (measured: +130 MB of RSS after one such grammar was dropped, back to the start after
    a trim). `request()` is cheap and safe from any thread (a Matcher's finalizer calls it); a daemon
    thread trims at most once per `interval` seconds after a request.
    """

    def __init__(self, interval: float = 1.0) -> None:
        self._wanted = threading.Event()
        self._interval = interval
        self._trim = _malloc_trim()
        self.trims = 0
        if self._trim is not None:
            threading.Thread(target=self._run, name="graphserve-grammar-trim", daemon=True).start()

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            time.sleep(self._interval)  # matchers are often dropped together: one trim for all
            self._wanted.clear()
            self._trim(0)
            self.trims += 1


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(count: int = 2) -> bool:
    """Caps glibc's malloc arenas for this process at `count`, unless the operator chose a cap
    (MALLOC_ARENA_MAX, or arena_max in GLIBC_TUNABLES). Call it before threads start: glibc gives
    each new thread that allocates an arena of its own, up to 8 per core, and a hostile grammar's freed
    memory, left between live chunks in many arenas, is not returned by malloc_trim. On 16 cores the
    engine process kept +126 MB after 100 hostile constraints, +28 MB with 2 arenas (bench/results/
    h100-20261205-hostile). Returns whether the cap was set (False: chosen already, or not glibc)."""
    if os.environ.get("MALLOC_ARENA_MAX") or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _libc_function("mallopt")
    return bool(mallopt is not None and mallopt(_M_ARENA_MAX, count) == 1)


def _libc_function(name: str, restype: type | None = None):  # -> ctypes function | None
    library = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    if function is not None and restype is not None:
        function.restype = restype
    return function


def _malloc_trim():  # -> Callable[[int], int] | None
    return _libc_function("malloc_trim")


_mallinfo2 = _libc_function("mallinfo2", _MallInfo2)
