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

A decode row whose mask is not ready a quarter budget into the step sits the step out (when the
engine allows it: `deferrable`): the step goes on, the engine discards that row's token and computes
the same position again next step, and the worker finishes the mask in the background (at the idle
priority, then it exits and a new one takes its place) for the next step to copy, while the budget
keeps counting its CPU. So a row that turns expensive holds the other streams' step a quarter budget,
not a whole one. A row that completes a prompt cannot sit out (its prompt would be computed again).

Each worker fills its own scratch row and copies it into the step's bitmask only while the step
still waits for it (a row that sat out keeps a copy of its own): a worker never writes into a
bitmask the engine has moved on from.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from service.engine.grammar_threads import WorkerThreads, run_when_idle, thread_cpu_seconds
from service.engine.structured import Matcher, allocate_bitmask

_QUEUED, _RUNNING, _DONE, _FAILED = range(4)
_WALL_FACTOR = 10  # a row may take this many times its CPU budget in wall time (a busy host) before it fails


@dataclass(eq=False)
class _Row:
    matcher: Matcher | None  # None once its fill returned
    state: int = _QUEUED
    step: _Step | None = None  # the step waiting for it (None once it sat one out)
    index: int = 0  # its row in that step
    thread: int = 0
    native_thread: int = 0  # the thread's id for the scheduler (its priority)
    start_cpu: float = 0.0
    started_at: float = 0.0
    background: bool = False  # sat a step out while running: its thread ends with it
    error: str | None = None  # the fill raised
    cpu: float = 0.0  # CPU seconds the fill took


class _Step:
    def __init__(self, matchers: list[Matcher], rows: list[_Row], out: torch.Tensor) -> None:
        self.matchers = matchers
        self.rows = rows
        self.out = out
        self.queue = collections.deque(i for i, r in enumerate(rows) if r.state == _QUEUED)  # rows no worker took
        self.left = 0  # rows neither done nor failed nor sat out


class MaskFiller:
    def __init__(self, vocab_size: int, workers: int, budget_ms: float, max_abandoned: int = 8,
                 on_abandoned_done: Callable[[], None] | None = None) -> None:
        """on_abandoned_done: called when an abandoned row's fill returned (MemoryTrimmer.request).
        max_abandoned: threads finishing rows no step waits for (abandoned, or sitting a step out)
        beyond which failed rows get no replacement worker and no row sits out."""
        self.vocab_size = vocab_size
        self._on_abandoned_done = on_abandoned_done
        # Called (from a worker) when a row that sat out is done: its sequence can be scheduled again.
        self.on_ready: Callable[[], None] | None = None
        self.budget = budget_ms / 1000
        self.max_abandoned = max_abandoned
        self.failed_rows = 0  # rows failed over their budget, since start
        self.sat_out_rows = 0  # rows that sat a step out, since start
        self._cond = threading.Condition()
        self._step: _Step | None = None
        self._workers = 0  # threads that take rows (those in the background excluded)
        self._background = 0  # threads still inside a row no step waits for
        self._closed = False
        self._threads = WorkerThreads(self._work, "graphserve-grammar-mask")
        for _ in range(max(1, workers)):
            self._spawn()

    def fill(self, matchers: list[Matcher], out: torch.Tensor,
             deferrable: Sequence[bool] | None = None) -> tuple[dict[int, str], list[int]]:
        """out[i] = the mask of matchers[i], for each i (out: an int32 CPU bitmask, one row per
        matcher at least). deferrable[i]: row i may sit this step out (None: none may). Returns
        ({i: why} for the rows that failed: over the budget, or the grammar library gave up on them;
        [i] of the rows that sat out); both kinds of rows allow every token (their tokens are
        discarded). The engine thread only; matchers are not used by anything else meanwhile, and a
        matcher that sat out does not move before its next fill."""
        if not matchers:
            return {}, []
        failed: dict[int, str] = {}
        sat_out: list[int] = []
        sit_out_at = time.monotonic() + self.budget / 4
        with self._cond:
            step = _Step(matchers, [self._row_of(m) for m in matchers], out)
            for i, row in enumerate(step.rows):
                if row.state == _DONE:  # failed after the step it sat out: row.error says why
                    continue
                if row.state == _RUNNING:  # still computing since a step it sat out
                    if self._over_budget(row, time.monotonic()):
                        failed[i] = self._over_budget_why()
                        row.state = _FAILED  # in the background already
                        continue
                    if deferrable is not None and deferrable[i]:
                        sat_out.append(i)  # at once: a row that sat out holds no step up again
                        continue
                row.step, row.index = step, i
                step.left += 1
            self._step = step
            self._cond.notify_all()
            while step.left:
                now = time.monotonic()
                self._cond.wait(self.budget / 4 if now >= sit_out_at else sit_out_at - now)
                now = time.monotonic()
                for i, row in enumerate(step.rows):
                    if row.state == _RUNNING and row.step is step and self._over_budget(row, now):
                        failed[i] = self._over_budget_why()
                        self._leave(step, row)
                if self._workers == 0 and step.queue:  # every thread stuck: nobody left to fill
                    while step.queue:
                        i = step.queue.popleft()
                        step.rows[i].state = _FAILED
                        step.left -= 1
                        failed[i] = "no grammar worker was free to compute its token mask"
                if deferrable is not None and step.left and now >= sit_out_at:
                    sat_out += self._sit_out(step, deferrable)
            self._step = None
        sitting = set(sat_out)
        for i, row in enumerate(step.rows):
            m = matchers[i]
            if i in sitting:
                continue
            m.mask_row = None
            if i in failed:
                continue
            m.cpu_debt = max(0.0, m.cpu_debt + row.cpu - self.budget / 4)
            if row.error or m.error:
                failed[i] = row.error or f"the grammar library gave up on it: {m.error}"
            elif m.cpu_debt > 2 * self.budget:
                failed[i] = (f"its token masks kept taking more than {self.budget * 250:g} ms of CPU a step (a quarter "
                             "of --constraint-mask-timeout-ms, sustained): simplify the constraint")
        self.failed_rows += len(failed)
        self.sat_out_rows += len(sat_out)
        for i in [*failed, *sat_out]:
            out[i].fill_(-1)
        return failed, sat_out

    def close(self) -> None:
        """End the workers (after the step they fill, if any), waiting a bounded time for them."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._threads.join(WorkerThreads.CLOSE_WAIT_S)

    def _over_budget(self, row: _Row, now: float) -> bool:
        return (thread_cpu_seconds(row.thread) - row.start_cpu > self.budget
                or now - row.started_at > self.budget * _WALL_FACTOR)

    def _over_budget_why(self) -> str:
        return (f"computing its token mask took over {self.budget * 1000:g} ms of CPU in one step "
                "(--constraint-mask-timeout-ms): simplify the constraint")

    @staticmethod
    def _row_of(m: Matcher) -> _Row:
        """m's row in a new step: the one computing its mask since a step it sat out (or that failed
        there), or a new one (whose fill copies the mask such a row left, Matcher.keep_mask). Under
        the lock."""
        row = m.mask_row
        return row if row is not None and row.state != _FAILED else _Row(m)

    def _sit_out(self, step: _Step, deferrable: Sequence[bool]) -> list[int]:
        """The rows that may sit out and are not done: a queued one is dropped (its next step queues
        it again), a running one goes on in the background. Under the lock."""
        out = []
        for i in list(step.queue):
            if deferrable[i]:  # nothing computed: its next step starts afresh
                step.queue.remove(i)
                step.left -= 1
                out.append(i)
        for i, row in enumerate(step.rows):
            if (deferrable[i] and row.state == _RUNNING and row.step is step
                    and (row.background or self._background < self.max_abandoned)):
                row.step = None
                step.matchers[i].mask_row = row  # its next step waits for it instead of starting again
                step.left -= 1
                if not row.background:
                    row.background = True
                    self._to_background(row)
                out.append(i)
        return out

    def _leave(self, step: _Step, row: _Row) -> None:
        """Fail a running row and leave its fill to finish unobserved. Under the lock."""
        row.state = _FAILED  # its fill is thrown away when it returns
        step.left -= 1
        if not row.background:
            row.background = True
            self._to_background(row)

    def _to_background(self, row: _Row) -> None:
        """The thread inside row takes no more rows: it yields the CPU to the engine, ends once the
        row's fill returns, and a new worker takes its place (while few are in the background)."""
        self._workers -= 1
        self._background += 1
        run_when_idle(row.native_thread)
        if self._background <= self.max_abandoned:
            self._spawn()

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
                if step is not None and step.queue:
                    break
                step = None  # a finished step's rows are not held while waiting
                if self._closed:
                    return False
                self._cond.wait()
            row = step.rows[step.queue.popleft()]
            row.state, row.thread, row.native_thread, row.started_at = _RUNNING, ident, native, time.monotonic()
            row.start_cpu = thread_cpu_seconds(ident)
        error = None
        matcher = row.matcher
        assert matcher is not None
        try:
            matcher.fill_bitmask(scratch, 0)
        except Exception as exc:  # noqa: BLE001 - the row fails, the worker and the step go on
            error = f"computing its token mask failed: {exc}"
        cpu = thread_cpu_seconds(ident) - row.start_cpu
        with self._cond:
            row.matcher = None  # a row its matcher keeps (one that sat out) holds no reference back
            if row.state == _FAILED:  # abandoned: another thread has taken this one's place
                self._background -= 1
                del matcher
                if self._on_abandoned_done is not None:
                    self._on_abandoned_done()  # the grammar's memory can go back once its matcher is gone
                return False
            waited = self._finish(row, matcher, scratch, error, cpu)
        if waited and self.on_ready is not None:
            self.on_ready()  # outside the lock: it takes the engine's
        return not row.background

    def _finish(self, row: _Row, matcher: Matcher, scratch: torch.Tensor, error: str | None, cpu: float) -> bool:
        """Record a row's fill; True if its sequence waits for it (it sat a step out). Under the lock."""
        row.state, row.error, row.cpu = _DONE, error, cpu
        if row.background:
            self._background -= 1
        if row.step is not None:  # a step waits for it
            if error is None:
                row.step.out[row.index].copy_(scratch[0])
            row.step.left -= 1
            if not row.step.left:
                self._cond.notify_all()
            return False
        if matcher.mask_row is not row:  # its sequence ended meanwhile
            return False
        if error is None and cpu > self.budget:
            row.error = self._over_budget_why()
        if row.error is None:  # the next fill copies the mask, and the row is forgotten
            matcher.mask_row = None
            matcher.cpu_debt = max(0.0, matcher.cpu_debt + cpu - self.budget / 4)  # that fill's is ~0
            matcher.keep_mask(scratch, 0)
        return True
