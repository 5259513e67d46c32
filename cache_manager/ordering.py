"""When captures and releases run: beside serving, or (tensor parallelism) in an order every rank follows.

A strategy given to the GraphCache when it is made. `BesideServing` (the default) leaves the jobs to
the capture thread: between steps the cache only commits what it finished. `RankOrder` (with
`GraphCacheConfig.inline_capture`) runs them on the engine thread, at the same point of the step
sequence on every rank: rank 0's cache decides, `publish` tells the other ranks what it is about to
run (cache_manager/mirror.py follows), then it runs them.
"""

from __future__ import annotations

from collections.abc import Callable

from cache_manager.capturer import Capturer, ops_of
from cache_manager.mirror import GraphOp


class BesideServing:
    """Captures and releases on the capture thread; nothing waits for the engine or other ranks."""

    deferred = False  # captures wait for an idle engine

    def engine_busy(self) -> bool:
        return False

    def between_steps(self, capturer: Capturer | None, commit: Callable[[], int],
                      retry_wanted: Callable[[], None]) -> int:
        """Commit what the capture thread finished; returns how many jobs."""
        return commit()

    def step_ops(self, capturer: Capturer | None) -> list[GraphOp]:
        """The queued ops that travel with the next step (none here)."""
        return []

    def run_step_ops(self, capturer: Capturer | None) -> None:
        """Run what `step_ops` named, on this thread."""


class RankOrder(BesideServing):
    """Tensor parallelism: captures and releases wait in a queue until the engine thread runs them.

    A capture stops every rank's step loop (85-196 ms a graph on two H200s), so with `busy` (the
    engine's: whether it has work) captures run only while the engine has none, one at a time, the
    engine asked before each (releases at the head of the queue run at once); meanwhile a capture
    that traffic asks for evicts nothing (`deferred`: the dispatcher asks again once the engine is
    idle) and the warm start waits. Without `busy` (a cache no engine drives: tests) the queued ops
    travel with the next step instead: rank 0 sends them with the planned descriptor (`step_ops`)
    and runs them (`run_step_ops`) before it executes. `publish(ops)` is called with the ops that run
    between steps, just before they run here.
    """

    def __init__(self, publish: Callable[[list[GraphOp]], None] | None = None,
                 busy: Callable[[], bool] | None = None) -> None:
        self._publish = publish
        self._busy = busy
        self.deferred = busy is not None

    def engine_busy(self) -> bool:
        return self._busy is not None and self._busy()

    def between_steps(self, capturer: Capturer | None, commit: Callable[[], int],
                      retry_wanted: Callable[[], None]) -> int:
        """Commit what the last step ran (it travelled with the step), ask again for what waited
        for an idle engine, then run the queue (after publishing each batch) and commit it, until
        it is empty or, with `busy`, the engine has work (then only leading releases run)."""
        count = commit()
        if capturer is None:
            return count
        if not self.engine_busy():
            retry_wanted()
        while capturer.queued:
            jobs = capturer.take_queued(max_captures=0 if self.engine_busy() else 1)
            if not jobs:
                break
            if self._publish is not None:
                self._publish(ops_of(jobs))
            capturer.run_jobs(jobs)
            count += commit()
        return count

    def step_ops(self, capturer: Capturer | None) -> list[GraphOp]:
        return capturer.queued_ops() if capturer is not None and not self.deferred else []

    def run_step_ops(self, capturer: Capturer | None) -> None:
        if capturer is not None and not self.deferred:
            capturer.run_queued()
