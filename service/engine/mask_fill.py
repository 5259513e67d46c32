"""A step's grammar masks, filled on worker threads, each row under a CPU-time budget.

The engine thread hands over the step's constrained rows and waits; workers take rows one at a time
(the library releases the GIL while it computes a mask), so rows fill in parallel and a slow row
holds up only its own worker. A row that uses more than its budget of CPU is failed and abandoned:
the engine goes on with the step, the request ends with an error, and the worker, which cannot be
interrupted inside the library, finishes unobserved at the idle priority and exits while a new
one takes its place. So a constraint that turns expensive mid-stream (a lexer that blows up on a
later token) costs the other streams at most one budget, once.

A row that stays just under that budget step after step would slow every step of every stream as
much, so each matcher also keeps a CPU account: every fill earns a quarter of the budget and costs
its CPU time; a matcher whose debt passes two budgets fails. A legitimate row's occasional spike
(a few ms for a 128k vocabulary) drains; a sustained expensive one fails within a few steps.

Each worker fills its own scratch row and copies it into the step's bitmask only while the step
still waits for it: an abandoned worker never writes into a bitmask the engine has moved on from.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.grammar_threads import WorkerThreads, run_when_idle, thread_cpu_seconds
from service.engine.structured import Matcher, allocate_bitmask

_QUEUED, _RUNNING, _DONE, _FAILED = range(4)
_WALL_FACTOR = 10  # a row may take this many times its CPU budget in wall time (a busy host) before it fails


@dataclass(eq=False)
class _Row:
    matcher: Matcher
    state: int = _QUEUED
    thread: int = 0
    native_thread: int = 0  # the thread's id for the scheduler (its priority)
    start_cpu: float = 0.0
    started_at: float = 0.0
    error: str | None = None  # the fill raised
    cpu: float = 0.0  # CPU seconds the fill took


class _Step:
    def __init__(self, matchers: list[Matcher], out: torch.Tensor) -> None:
        self.rows = [_Row(m) for m in matchers]
        self.out = out
        self.next = 0  # the first row no worker has taken
        self.left = len(matchers)  # rows neither done nor failed
        self.closed = False


class MaskFiller:
    def __init__(self, vocab_size: int, workers: int, budget_ms: float, max_abandoned: int = 8,
                 on_abandoned_done: Callable[[], None] | None = None) -> None:
        """on_abandoned_done: called when an abandoned row's fill returned (MemoryTrimmer.request)."""
        self.vocab_size = vocab_size
        self._on_abandoned_done = on_abandoned_done
        self.budget = budget_ms / 1000
        self.max_abandoned = max_abandoned
        self.failed_rows = 0  # rows failed over their budget, since start
        self._cond = threading.Condition()
        self._step: _Step | None = None
        self._workers = 0  # threads that take rows (abandoned ones excluded)
        self._abandoned = 0  # threads still inside an abandoned row
        self._closed = False
        self._threads = WorkerThreads(self._work, "graphserve-grammar-mask")
        for _ in range(max(1, workers)):
            self._spawn()

    def fill(self, matchers: list[Matcher], out: torch.Tensor) -> dict[int, str]:
        """out[i] = the mask of matchers[i], for each i (out: an int32 CPU bitmask, one row per
        matcher at least). Returns {i: why} for the rows that failed: over the budget, or the grammar
        library gave up on them; their rows of out allow every token (their tokens are discarded).
        The engine thread only; matchers are not used by anything else meanwhile."""
        if not matchers:
            return {}
        step = _Step(matchers, out)
        failed: dict[int, str] = {}
        wall_limit = self.budget * _WALL_FACTOR
        with self._cond:
            self._step = step
            self._cond.notify_all()
            while step.left:
                self._cond.wait(self.budget / 4)
                now = time.monotonic()
                for i, row in enumerate(step.rows):
                    if row.state != _RUNNING:
                        continue
                    cpu = thread_cpu_seconds(row.thread) - row.start_cpu
                    if cpu > self.budget or now - row.started_at > wall_limit:
                        row.state = _FAILED
                        step.left -= 1
                        failed[i] = (f"computing its token mask took over {self.budget * 1000:g} ms of CPU in one step "
                                     "(--constraint-mask-timeout-ms): simplify the constraint")
                        self._workers -= 1
                        self._abandoned += 1
                        run_when_idle(row.native_thread)  # its fill is thrown away when it returns
                        if self._abandoned <= self.max_abandoned:
                            self._spawn()  # the abandoned thread leaves when its row returns
                if self._workers == 0 and step.next < len(step.rows):  # every thread stuck: nobody left to fill
                    for i in range(step.next, len(step.rows)):
                        step.rows[i].state = _FAILED
                        failed[i] = "no grammar worker was free to compute its token mask"
                    step.left -= len(step.rows) - step.next
                    step.next = len(step.rows)
            step.closed = True
            self._step = None
        for i, row in enumerate(step.rows):
            if i in failed:
                continue
            m = row.matcher
            m.cpu_debt = max(0.0, m.cpu_debt + row.cpu - self.budget / 4)
            if row.error or m.error:
                failed[i] = row.error or f"the grammar library gave up on it: {m.error}"
            elif m.cpu_debt > 2 * self.budget:
                failed[i] = (f"its token masks kept taking more than {self.budget * 250:g} ms of CPU a step (a quarter "
                             "of --constraint-mask-timeout-ms, sustained): simplify the constraint")
        self.failed_rows += len(failed)
        for i in failed:
            out[i].fill_(-1)
        return failed

    def close(self) -> None:
        """End the workers (after the step they fill, if any), waiting a bounded time for them."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._threads.join(WorkerThreads.CLOSE_WAIT_S)

    def _spawn(self) -> None:
        self._workers += 1
        self._threads.spawn()

    def _work(self) -> None:
        with torch.inference_mode():  # the step's bitmask is an inference tensor (the runner's launch)
            self._take_rows()

    def _take_rows(self) -> None:
        scratch = allocate_bitmask(1, self.vocab_size, pin=False)
        ident, native = threading.get_ident(), threading.get_native_id()
        while self._fill_one(scratch, ident, native):
            pass

    def _fill_one(self, scratch: torch.Tensor, ident: int, native: int) -> bool:
        """Take and fill one row; False when this thread is to end. (A call per row: nothing of the
        row, its matcher above all, stays referenced while the thread waits for the next.)"""
        with self._cond:
            while True:
                step = self._step
                if step is not None and step.next < len(step.rows):
                    break
                step = None  # a finished step's rows are not held while waiting
                if self._closed:
                    return False
                self._cond.wait()
            i = step.next
            step.next += 1
            row = step.rows[i]
            row.state, row.thread, row.native_thread, row.started_at = _RUNNING, ident, native, time.monotonic()
            row.start_cpu = thread_cpu_seconds(ident)
        error = None
        try:
            row.matcher.fill_bitmask(scratch, 0)
        except Exception as exc:  # noqa: BLE001 - the row fails, the worker and the step go on
            error = f"computing its token mask failed: {exc}"
        cpu = thread_cpu_seconds(ident) - row.start_cpu
        with self._cond:
            if row.state == _FAILED:  # abandoned: another thread has taken this one's place
                self._abandoned -= 1
                if self._on_abandoned_done is not None:
                    self._on_abandoned_done()  # the grammar's memory can go back once its matcher is gone
                return False
            if error is None:
                step.out[i].copy_(scratch[0])
            row.state, row.error, row.cpu = _DONE, error, cpu
            step.left -= 1
            if not step.left:
                self._cond.notify_all()
        return True
