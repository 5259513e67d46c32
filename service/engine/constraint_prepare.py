"""A request's constraint made ready off the engine thread: compiled (or found cached), copied into
the request's own matcher, and its first token mask computed, on grammar worker threads, under a
CPU-time budget.

The first mask is where a small hostile constraint costs most (the grammar library builds its lexer
lazily: `p{1000}{1129}`, 13 bytes, took 1-3 s of CPU for one mask), so it is computed here, where a
slow one fails its own request alone; the engine then admits a matcher whose lexer is warm.

Contract:
- `prepare(c, done)` never blocks on grammar work: done(Matcher | Exception) is called once, from a
  worker thread, from the budget watcher, or at once (a cached constraint, a full queue). The
  exception is InvalidConstraint (the request's fault: INVALID_ARGUMENT) or ConstraintsBusy (every
  worker is taken: RESOURCE_EXHAUSTED, retry later).
- A job over its budget is abandoned: its `done` gets InvalidConstraint at once, and its thread,
  which cannot be interrupted inside the library, finishes unobserved and exits; a new worker takes
  its place (at most `max_abandoned` such threads at a time). Workers are daemon threads: a stuck
  compile never holds up the process's exit.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from service.engine.constraint_limits import ConstraintLimits, InvalidConstraint
from service.engine.grammar_threads import WorkerThreads, heap_bytes, run_when_idle, thread_cpu_seconds
from service.engine.request import Constraint
from service.engine.structured import GrammarCompiler, Matcher, allocate_bitmask

log = structlog.get_logger("graphserve.engine")

Done = Callable[[Matcher | Exception], None]
_WALL_FACTOR = 10  # a job may wait this many times its CPU budget in wall time (a busy host) before it fails
_WATCH_INTERVAL_S = 0.01


class ConstraintsBusy(Exception):
    """Every grammar worker is taken and the queue is full: retry later."""


@dataclass(eq=False)
class _Job:
    constraint: Constraint
    done: Done
    queued_at: float
    started_at: float | None = None
    start_cpu: float = 0.0
    thread: int | None = None  # the worker's ident while it runs the job
    settled: bool = False  # done was called (by the worker or the watcher)


@dataclass
class PrepareStats:
    prepared: int = 0  # jobs run to a matcher
    refused: int = 0  # jobs whose constraint failed to compile
    timed_out: int = 0  # jobs over their budget
    busy: int = 0  # jobs refused for a full queue
    cache_hits: int = 0
    seconds: list[float] = field(default_factory=list)  # CPU seconds of the recent jobs (the last 256)


class ConstraintPreparer:
    def __init__(self, compiler: GrammarCompiler, limits: ConstraintLimits, workers: int = 1,
                 max_abandoned: int = 4, on_huge_freed: Callable[[], None] | None = None) -> None:
        self.compiler = compiler
        self.limits = limits
        self.max_abandoned = max_abandoned
        self.stats = PrepareStats()
        self._on_huge_freed = on_huge_freed
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: set[_Job] = set()
        self._abandoned = 0  # threads still inside an abandoned job
        self._cond = threading.Condition()
        self._closed = False
        self._threads = WorkerThreads(self._work, "graphserve-grammar")
        for _ in range(max(1, workers)):
            self._spawn()
        threading.Thread(target=self._watch, name="graphserve-grammar-watch", daemon=True).start()

    @property
    def budget(self) -> float:
        return self.limits.constraint_compile_timeout

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._running)

    def prepare(self, c: Constraint, done: Done) -> None:
        """Make a matcher for c, its first mask computed; done(Matcher | Exception) once, maybe now."""
        proto = self.compiler.cached(c)
        if proto is not None:  # compiled and its first mask measured when it was kept: cheap
            self.stats.cache_hits += 1
            done(self.compiler.new_matcher(proto))
            return
        with self._cond:
            full = len(self._queue) + len(self._running) >= self.limits.max_pending_constraints
            if not full and not self._closed:
                self._queue.append(_Job(c, done, time.monotonic()))
                self._cond.notify_all()
                return
            self.stats.busy += 1
        done(ConstraintsBusy(f"{self.limits.max_pending_constraints} constraints are being compiled, the limit "
                             "(--max-pending-constraints): retry later"))

    def prepare_now(self, c: Constraint) -> Matcher:
        """prepare, waiting for the result (the Python API checks a request's constraint before it
        submits anything); raises InvalidConstraint or ConstraintsBusy."""
        result: list[Matcher | Exception] = []
        ready = threading.Event()

        def done(r: Matcher | Exception) -> None:
            result.append(r)
            ready.set()

        self.prepare(c, done)
        ready.wait()
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0]

    def close(self) -> None:
        """Refuse new jobs and wake the workers so they end (a running compile finishes first); waits a
        bounded time for them."""
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for job in queued:
            self._settle(job, ConstraintsBusy("the server is shutting down"))
        self._threads.join(WorkerThreads.CLOSE_WAIT_S)

    # ---- worker threads ------------------------------------------------------------------------

    def _spawn(self) -> None:
        self._threads.spawn()

    def _work(self) -> None:
        run_when_idle()
        scratch = allocate_bitmask(1, self.compiler.vocab_size, pin=False)
        ident = threading.get_ident()
        while self._work_one(scratch, ident):
            pass

    def _work_one(self, scratch: torch.Tensor, ident: int) -> bool:
        """Run one job; False when this thread is to end. (A call per job: nothing of it, its matcher
        above all, stays referenced while the thread waits for the next.)"""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            job = self._queue.popleft()
            job.thread, job.started_at, job.start_cpu = ident, time.monotonic(), thread_cpu_seconds(ident)
            self._running.add(job)
        result = self._run(job, scratch)
        with self._cond:
            self._running.discard(job)
            abandoned = job.settled  # the watcher gave up on it: this thread's place was taken
            if abandoned:
                self._abandoned -= 1
        if abandoned:
            del result
            if self._on_huge_freed is not None:
                self._on_huge_freed()
            return False
        self._settle(job, result)
        return True

    def _run(self, job: _Job, scratch: torch.Tensor) -> Matcher | Exception:
        c = job.constraint
        heap = heap_bytes()
        try:
            proto = self.compiler.cached(c)
            if proto is None:
                proto = self.compiler.compile(c)
            matcher = self.compiler.new_matcher(proto)
            matcher.fill_bitmask(scratch, 0)  # builds the lexer the first steps need
        except InvalidConstraint as exc:
            self.stats.refused += 1
            return exc
        except Exception as exc:  # noqa: BLE001 - this request fails; the worker goes on
            log.warning("constraint_prepare_failed", kind=c.kind, error=repr(exc))
            self.stats.refused += 1
            return InvalidConstraint(f"preparing it failed: {exc}")
        if matcher.error:
            self.stats.refused += 1
            return InvalidConstraint(f"the grammar library gave up on it at its start: {matcher.error}")
        cpu = thread_cpu_seconds(job.thread or 0) - job.start_cpu
        nbytes = max(0, heap_bytes() - heap)
        # A grammar kept only if its compile and first mask were cheap: a cache hit skips this worker.
        kept = cpu <= self.budget / 4 and self.compiler.keep(c, proto, nbytes)
        if not kept:
            matcher = self.compiler.new_matcher(proto, huge=True)  # its memory goes back when it is garbage
        matcher.keep_mask(scratch, 0)  # the engine's first fill copies it (the same position)
        self.stats.prepared += 1
        self.stats.seconds = self.stats.seconds[-255:] + [cpu]
        if cpu > self.budget / 4 or not kept:
            log.info("constraint_prepared", kind=c.kind, cpu_ms=round(cpu * 1000, 1), mb=round(nbytes / 2**20, 1),
                     cached=kept)
        return matcher

    # ---- budget watcher ------------------------------------------------------------------------

    def _watch(self) -> None:
        while self._check_budgets():
            time.sleep(_WATCH_INTERVAL_S)

    def _check_budgets(self) -> bool:
        """Fail the jobs over their budget; False once closed and idle. (A call per round: no job, and
        so no matcher, stays referenced between rounds.)"""
        now = time.monotonic()
        over: list[tuple[_Job, str]] = []
        with self._cond:
            if self._closed and not self._running:
                return False
            wall_limit = self.budget * _WALL_FACTOR
            for job in list(self._running):
                cpu = thread_cpu_seconds(job.thread) - job.start_cpu if job.thread else 0.0
                if job.settled or (cpu <= self.budget and now - job.started_at <= wall_limit):
                    continue
                job.settled = True
                self._abandoned += 1
                over.append((job, f"compiling it and computing its first token mask took over {self.budget:g} s "
                                  "of CPU (--constraint-compile-timeout): simplify the constraint"))
                if self._abandoned <= self.max_abandoned and not self._closed:
                    self._spawn()  # the abandoned thread leaves when its job returns
            while self._queue and now - self._queue[0].queued_at > wall_limit:
                job = self._queue.popleft()
                job.settled = True
                over.append((job, "the grammar workers were busy for too long"))
        for job, message in over:
            self.stats.timed_out += 1
            log.warning("constraint_timeout", kind=job.constraint.kind, reason=message)
            job.done(InvalidConstraint(message) if job.started_at else ConstraintsBusy(message))
        return True

    def _settle(self, job: _Job, result: Matcher | Exception) -> None:
        with self._cond:
            if job.settled:
                return
            job.settled = True
        job.done(result)
