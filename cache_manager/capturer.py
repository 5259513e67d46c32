"""The capture thread: records graphs and releases evicted ones beside the serving engine thread.

Why a thread: a capture runs a warm-up forward, records the step and measures its pool (7-60 ms on
an H200 for a 1B model); a release waits for the graph's last replay and empties the allocator's
cache (which synchronizes the device). Done on the engine thread, every stream froze meanwhile.
Here the engine thread only decides (what to capture, what to evict, what fits the budget) and
commits results between steps; this thread does the slow device work and reports back.

Contract: `submit_*` and `take_done` are called by the engine thread only. Jobs run one at a time,
in order. The engine thread is woken through `notify` when a job finishes so an idle engine commits
it without waiting for traffic. The thread starts with the first job and is stopped by `close`.

Inline (tensor parallelism): no thread. NCCL communicators are not thread-safe, and a capture's
warm-up collectives beside the serving stream's could meet other ranks' collectives in another
order and deadlock. Jobs wait in `queued` until the engine thread takes and runs them (`take_queued`,
`run_jobs`) between steps, after rank 0 has told the other ranks to run the same ones (mirror.py);
the engine thread stalls for the capture, and the stall is what the job reports (`stall_s`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from cache_manager.backend import CapturedGraph, GraphBackend
from cache_manager.mirror import CAPTURE, RELEASE, GraphOp
from cache_manager.sizes import BatchDescriptor
from cache_manager.step import DecodeStep

log = structlog.get_logger("cache_manager")


@dataclass
class CaptureJob:
    key: BatchDescriptor
    step: DecodeStep  # the step whose graph is recorded (FULL: the decode step; PIECEWISE: the pieces)
    evict: str  # what the commit may evict to fit the measured bytes: "none", "policy" or "force"
    estimate: int  # bytes reserved in the budget until the commit
    protect: frozenset[int] = frozenset()  # never evicted for this capture
    requested_at: float = field(default_factory=time.perf_counter)
    graph: CapturedGraph | None = None  # set when recorded
    error: BaseException | None = None  # set when the capture failed
    cancelled: bool = False
    waiters: list[Callable[[Any], None]] = field(default_factory=list)  # called with the OpResult
    prior_state: Any = None  # the bucket's state before it became CAPTURING
    stall_s: float = 0.0  # engine-thread time spent submitting it


@dataclass
class ReleaseJob:
    graph: CapturedGraph
    key: BatchDescriptor
    reason: str
    after: Any = None  # the backend's fence: the graph's last replay is queued before it
    freed: int = 0  # measured when released
    waiters: list[Callable[[Any], None]] = field(default_factory=list)


Job = CaptureJob | ReleaseJob


def ops_of(jobs: list[Job]) -> list[GraphOp]:
    """What jobs do, in order: what the other ranks must do at the same point (inline capture)."""
    return [GraphOp(CAPTURE if isinstance(job, CaptureJob) else RELEASE, job.key) for job in jobs]


class Capturer:
    """One background thread that runs capture and release jobs for the cache, in submission order."""

    def __init__(self, backend: GraphBackend, notify: Callable[[], None] | None = None, inline: bool = False) -> None:
        self.backend = backend
        self.notify = notify
        self.inline = inline
        self.queued: list[Job] = []  # inline: submitted, not yet run
        self._bound = False
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: collections.deque[Job] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Job) -> None:
        assert not self._closed, "submit after close"
        if self.inline:
            self.queued.append(job)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="graphserve-capture", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def take_done(self) -> list[Job]:
        """Finished jobs since the last call, in completion order."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def queued_ops(self) -> list[GraphOp]:
        """Inline: what the queued jobs do, in order (what the other ranks must do at the same point)."""
        return ops_of(self.queued)

    def take_queued(self, max_captures: int) -> list[Job]:
        """Inline: the queued jobs before the (max_captures + 1)-th capture, in order (max_captures 0:
        the releases at the head of the queue), taken off the queue: the caller runs them with `run_jobs`."""
        taken, captures = 0, 0
        for job in self.queued:
            if isinstance(job, CaptureJob):
                if captures == max_captures:
                    break
                captures += 1
            taken += 1
        jobs, self.queued = self.queued[:taken], self.queued[taken:]
        return jobs

    def run_queued(self) -> int:
        """Inline: run every queued job on this thread, in order; `take_done` then has them. Returns how many."""
        jobs, self.queued = self.queued, []
        return self.run_jobs(jobs)

    def run_jobs(self, jobs: list[Job]) -> int:
        """Inline: run these jobs (taken from the queue) on this thread, in order; `take_done` then has them."""
        if jobs and not self._bound:
            self.backend.bind_thread()
            self._bound = True
        for job in jobs:
            started = time.perf_counter()
            self._run(job, None)
            if isinstance(job, CaptureJob):
                job.stall_s += time.perf_counter() - started  # the engine thread waited for all of it
            self._done.append(job)
        return len(jobs)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop after the job in hand (queued captures are not started); False if it did not end in time."""
        self._closed = True
        if self.inline:  # queued releases run (no other rank waits on them); captures are cancelled
            for job in self.queued:
                if isinstance(job, CaptureJob):
                    job.cancelled = True
                else:
                    self._run(job, None)
                self._done.append(job)
            self.queued = []
            return True
        if self._thread is None:
            return True
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """False once the thread has ended (closed); waiting on it then would wait forever."""
        return self._thread is None or self._thread.is_alive()

    def _loop(self) -> None:
        bind_error: BaseException | None = None
        try:
            self.backend.bind_thread()
        except Exception as exc:  # noqa: BLE001 - every capture then fails (and backs off); serving goes on
            log.error("capture_thread_bind_failed", error=repr(exc))
            bind_error = exc
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closed and isinstance(job, CaptureJob):
                job.cancelled = True
            else:
                self._run(job, bind_error)
            self._done.append(job)
            if self.notify is not None:
                try:
                    self.notify()
                except Exception:  # noqa: BLE001 - a wake-up is an optimisation; the next step commits anyway
                    log.warning("capture_notify_failed", exc_info=True)

    def _run(self, job: Job, bind_error: BaseException | None) -> None:
        if isinstance(job, CaptureJob):
            try:
                if bind_error is not None:
                    raise RuntimeError(f"the capture thread could not use the device: {bind_error!r}")
                job.graph = self.backend.capture(job.step, job.key.padded_size)
            except Exception as exc:  # noqa: BLE001 - any failure backs the bucket off; serving goes on
                job.error = exc
                try:
                    self.backend.cleanup_after_failure()
                except Exception:  # noqa: BLE001 - best effort; the bucket is marked failed anyway
                    log.warning("capture_cleanup_failed", exc_info=True)
            return
        try:
            job.freed = self.backend.release(job.graph, job.after)
        except Exception:  # noqa: BLE001 - the graph is dropped either way; its bytes count as unreclaimed
            log.warning("graph_release_failed", bucket=str(job.key), exc_info=True)
            job.freed = 0
