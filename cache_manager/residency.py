"""Which buckets hold a captured graph, under the memory budget: capture, eviction, failure."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import structlog

from cache_manager.backend import CapturedGraph, GraphBackend
from cache_manager.buckets import Bucket
from cache_manager.budget import Candidate, choose_victims, estimate_bytes
from cache_manager.capturer import CaptureJob, Capturer, Job, ReleaseJob
from cache_manager.hooks import EngineHooks
from cache_manager.ops import OpOutcome, OpResult
from cache_manager.recorder import StatsRecorder
from cache_manager.sizes import BatchDescriptor, GraphFamily
from cache_manager.snapshot import BucketState
from cache_manager.step import DecodeStep

log = structlog.get_logger("cache_manager")


class Residency:
    """Owns the buckets of every graph family (and so the only references to their graphs), the
    capture thread and the one budget they share.

    Engine thread only (state changes take the lock so snapshots from other threads are consistent).
    A graph becomes resident in two halves: `request_capture` estimates its bytes (budget.py),
    evicts by policy if it would not fit, reserves the estimate and hands the capture to the
    capture thread; `commit` (between steps) enforces the budget on the measured bytes (evicting
    others or dropping the new graph) and makes it replayable. Evicted graphs leave service at once
    and are released on the capture thread; their bytes count as used until the release is measured.
    Graphs in `protect` are never evicted, those in `kept` only by an operator's explicit eviction. A
    failed capture marks the bucket FAILED with a doubling back-off. Every event is counted in the
    recorder and logged (graph_captured with what the engine thread spent on it as `stall_ms`,
    graph_evicted with the bytes the device got back, graph_capture_failed, graph_capture_dropped).
    Eviction weighs every family's graphs alike (budget.py), LoRA graphs and base graphs together.
    """

    def __init__(
        self,
        steps: dict[GraphFamily, DecodeStep],
        backend: GraphBackend | None,
        keys: list[BatchDescriptor],
        budget_bytes: int,
        stats: StatsRecorder,
        clock: Callable[[], float],
        lock: threading.RLock,
        half_life_s: float,
        backoff_s: float,
        max_backoff_s: float,
        hooks: EngineHooks,
        inline: bool = False,
        kept: frozenset[BatchDescriptor] = frozenset(),
    ) -> None:
        self.steps = steps
        self.kept = kept
        self.backend = backend
        self.capturer = Capturer(backend, hooks.wake, inline) if backend is not None else None
        self.buckets = {key: Bucket(key) for key in keys}
        self.budget_bytes = budget_bytes
        self.stats = stats
        self._clock = clock
        self._lock = lock
        self.half_life_s = half_life_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.hooks = hooks  # told the seconds the engine thread spent on each capture (metrics)
        self.last_replayed: BatchDescriptor | None = None  # its output may still be read: in use
        # Bytes that released graphs did not give back to the device (measured at release). They
        # still occupy device memory, so they count against the budget like a live graph.
        self.unreclaimed_bytes = 0
        self.releasing_bytes = 0  # evicted graphs not yet released by the capture thread
        self.pending: dict[BatchDescriptor, CaptureJob] = {}  # submitted, not yet committed

    def larger_captured(self, key: BatchDescriptor) -> BatchDescriptor | None:
        """The smallest captured graph of the same family larger than `key` (a step pads only into its own family)."""
        larger = [k for k, b in self.buckets.items()
                  if k.family == key.family and k.padded_size > key.padded_size and b.graph is not None]
        return min(larger) if larger else None

    @property
    def used_bytes(self) -> int:
        """Device memory the graphs hold now: live, being released, and never given back."""
        held = sum(b.graph.nbytes for b in self.buckets.values() if b.graph is not None)
        return held + self.unreclaimed_bytes + self.releasing_bytes

    @property
    def committed_bytes(self) -> int:
        """What budget decisions count: used and reserved."""
        return self.used_bytes + self.reserved_bytes

    @property
    def reserved_bytes(self) -> int:
        """Estimated bytes of the captures in flight: budget decisions count them as used."""
        return sum(job.estimate for job in self.pending.values())

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            self.budget_bytes = budget_bytes

    def candidates(self, protect: set[BatchDescriptor], now: float) -> list[Candidate]:
        """The captured graphs eviction may consider: every one not in `protect` or `kept`."""
        return [
            Candidate(s, b.graph.nbytes, b.heat_at(now, self.half_life_s), self.stats.last_use(s))
            for s, b in self.buckets.items()
            if b.graph is not None and s not in protect and s not in self.kept
        ]

    def _victims_for(
        self, b: Bucket, nbytes: int, need: int, protect: set[BatchDescriptor], evict: str, now: float
    ) -> list[BatchDescriptor] | None:
        """Graphs to evict so that `b` (of about `nbytes`) fits, or None when the mode allows none."""
        if evict == "none":
            return None
        # Traffic may only displace graphs worth no more per byte than the newcomer; operators any.
        max_score = math.inf if evict == "force" else b.heat_at(now, self.half_life_s) / max(nbytes, 1)
        return choose_victims(self.candidates(protect, now), need, max_score)

    # ---- capture ------------------------------------------------------------------------------

    def request_capture(
        self, key: BatchDescriptor, protect: set[BatchDescriptor], evict: str,
        waiter: Callable[[OpResult], None] | None = None,
    ) -> tuple[OpOutcome | None, str]:
        """Submit a capture of `key` to the capture thread if its estimate fits the budget.

        evict: "none" (warm start: only into free budget), "policy" (traffic: only graphs worth no
        more per byte than this one), "force" (operator: any graph not in `protect` or `kept`). Returns
        (None, "") when submitted (or already in flight: `waiter` joins it), else the outcome that
        stopped it (OVER_BUDGET) with a message. A capture that cannot fit is never attempted.
        """
        assert self.capturer is not None
        started = time.perf_counter()
        if key in self.pending:
            if waiter is not None:
                self.pending[key].waiters.append(waiter)
            return None, ""
        b = self.buckets[key]
        now = self._clock()
        estimate = estimate_bytes(key.padded_size, self.stats.measured_bytes(key.family))
        committed = self.committed_bytes
        need = committed + estimate - self.budget_bytes
        if need > 0:
            victims = self._victims_for(b, estimate, need, protect, evict, now)
            if victims is None:
                return OpOutcome.OVER_BUDGET, (
                    f"needs about {estimate} bytes; {committed} of "
                    f"{self.budget_bytes} used or reserved and nothing evictable frees enough"
                )
            for v in victims:
                self.evict(v, reason="budget")
        job = CaptureJob(key, self.steps[key.family], evict, estimate, frozenset(protect))
        if waiter is not None:
            job.waiters.append(waiter)
        with self._lock:
            job.prior_state = b.state
            b.state = BucketState.CAPTURING
            self.pending[key] = job
        job.stall_s = time.perf_counter() - started
        self.capturer.submit(job)
        return None, ""

    def commit_done(self) -> list[tuple[Job, OpResult]]:
        """Between steps: commit the captures and account the releases the capture thread finished
        (with inline capture: that ran on this thread), telling each job's waiters; in order."""
        done = []
        for job in self.capturer.take_done() if self.capturer is not None else []:
            result = self.commit(job) if isinstance(job, CaptureJob) else self.released(job)
            for waiter in job.waiters:
                waiter(result)
            done.append((job, result))
        return done

    def commit(self, job: CaptureJob) -> OpResult:
        """Between steps: make a recorded graph replayable within the budget, or count its failure."""
        started = time.perf_counter()
        key, b = job.key, self.buckets[job.key]
        with self._lock:
            self.pending.pop(key, None)
        now = self._clock()
        if job.cancelled:
            with self._lock:
                b.state = job.prior_state
            return OpResult(OpOutcome.FAILED, f"capture of {key} cancelled: the cache is closing")
        if job.graph is None:
            return self._capture_failed(b, job.error, now)
        graph = job.graph
        self.stats.capture(key, graph.nbytes, graph.capture_ms)
        in_use = self.last_replayed  # the graph the step just planned may replay: never its victim
        protect = set(job.protect) | {key} | ({in_use} if in_use is not None else set())
        over = self.committed_bytes + graph.nbytes - self.budget_bytes
        if over > 0:
            victims = self._victims_for(b, graph.nbytes, over, protect, job.evict, now)
            if victims is None:
                with self._lock:
                    b.state = BucketState.EVICTED if job.prior_state is BucketState.EVICTED else BucketState.NOT_CAPTURED
                self._release(graph, key, "dropped")
                log.info("graph_capture_dropped", bucket=str(key), bytes=graph.nbytes, used=self.used_bytes,
                         budget=self.budget_bytes)
                return OpResult(OpOutcome.OVER_BUDGET, f"measured {graph.nbytes} bytes does not fit the budget; dropped")
            for v in victims:
                self.evict(v, reason="budget")
        with self._lock:
            b.captured(graph, job.step.input_addresses())
        # What the engine thread spent on this capture: the request and this commit. The recording,
        # warm-up and measurement ran on the capture thread (`ms` is the recording alone), or on the
        # engine thread with inline capture (tensor parallelism), which then counts them too.
        stall_s = job.stall_s + time.perf_counter() - started
        self.hooks.capture_stall(stall_s)
        log.info("graph_captured", bucket=str(key), bytes=graph.nbytes, ms=round(graph.capture_ms, 2),
                 stall_ms=round(stall_s * 1000.0, 3), ready_ms=round((time.perf_counter() - job.requested_at) * 1000.0, 1))
        return OpResult(OpOutcome.CAPTURED, f"captured {key}: {graph.nbytes} bytes in {graph.capture_ms:.1f} ms",
                        graph.nbytes)

    def _capture_failed(self, b: Bucket, exc: BaseException | None, now: float) -> OpResult:
        with self._lock:
            b.fail(now, self.backoff_s, self.max_backoff_s)
        self.stats.failure(b.key)
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("graph_capture_failed", bucket=str(b.key), reason=reason, retry_in_s=b.backoff_s)
        return OpResult(OpOutcome.FAILED, reason)

    # ---- eviction and release -----------------------------------------------------------------

    def evict(self, key: BatchDescriptor, reason: str, waiter: Callable[[OpResult], None] | None = None) -> int:
        """Take the graph out of service now; the capture thread releases it after its last replay.
        Returns its measured-at-capture bytes (the release reports what the device got back)."""
        b = self.buckets[key]
        graph = b.graph
        assert graph is not None
        with self._lock:
            b.graph = None
            b.state = BucketState.EVICTED
        self.stats.eviction(key)
        if self.last_replayed == key:
            self.last_replayed = None
        self._release(graph, key, reason, waiter)
        return graph.nbytes

    def _release(
        self, graph: CapturedGraph, key: BatchDescriptor, reason: str, waiter: Callable[[OpResult], None] | None = None
    ) -> None:
        assert self.capturer is not None
        job = ReleaseJob(graph, key, reason, self.backend.fence())
        if waiter is not None:
            job.waiters.append(waiter)
        with self._lock:
            self.releasing_bytes += graph.nbytes
        self.capturer.submit(job)

    def released(self, job: ReleaseJob) -> OpResult:
        """Between steps: account a finished release."""
        graph = job.graph
        with self._lock:
            self.releasing_bytes -= graph.nbytes
            # A release can also free more than measured at capture (memory an earlier graph left behind).
            self.unreclaimed_bytes = max(0, self.unreclaimed_bytes + graph.nbytes - job.freed)
        if job.reason != "dropped":
            log.info("graph_evicted", bucket=str(job.key), bytes=graph.nbytes, bytes_freed=job.freed, reason=job.reason)
        return OpResult(OpOutcome.EVICTED, f"evicted {job.key}; {job.freed} bytes returned", job.freed)

    def close(self, timeout: float) -> bool:
        """Stop the capture thread and release every graph on this thread; False if a capture hung."""
        if self.capturer is None:
            return True
        ended = self.capturer.close(timeout)
        if not ended:
            return False
        for job in self.capturer.take_done():  # recorded but never committed
            if isinstance(job, CaptureJob) and job.graph is not None:
                self.backend.release(job.graph)
        self.pending.clear()
        for b in self.buckets.values():
            if b.graph is not None:
                with self._lock:
                    graph, b.graph, b.state = b.graph, None, BucketState.NOT_CAPTURED
                self.backend.release(graph, self.backend.fence())
        return True
