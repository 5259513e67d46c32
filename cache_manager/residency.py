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
from cache_manager.ops import OpOutcome
from cache_manager.recorder import StatsRecorder
from cache_manager.snapshot import BucketState
from cache_manager.step import DecodeStep

log = structlog.get_logger("cache_manager")


class Residency:
    """Owns the buckets (and so the only references to their graphs), the backend and the budget.

    `try_capture` is the one way a graph becomes resident: estimate its bytes (budget.py), evict by
    policy if it would not fit, capture, then enforce the budget on the measured bytes (evicting
    others or dropping the new graph). Graphs in `protect` are never evicted. A failed capture marks
    the bucket FAILED with a doubling back-off. Every event is counted in the recorder and logged
    (graph_captured, graph_evicted with the bytes the device got back, graph_capture_failed).
    """

    def __init__(
        self,
        step: DecodeStep,
        backend: GraphBackend | None,
        sizes: tuple[int, ...],
        budget_bytes: int,
        stats: StatsRecorder,
        clock: Callable[[], float],
        lock: threading.RLock,
        half_life_s: float,
        backoff_s: float,
        max_backoff_s: float,
    ) -> None:
        self.step = step
        self.backend = backend
        self.buckets = {s: Bucket(s) for s in sizes}
        self.budget_bytes = budget_bytes
        self.stats = stats
        self._clock = clock
        self._lock = lock
        self.half_life_s = half_life_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.last_replayed: int | None = None  # its output may still be read by the caller: in use
        # Bytes that released graphs did not give back to the device (measured at release). They
        # still occupy device memory, so they count against the budget like a live graph.
        self.unreclaimed_bytes = 0

    def larger_captured(self, size: int) -> int | None:
        larger = [s for s, b in self.buckets.items() if s > size and b.graph is not None]
        return min(larger) if larger else None

    def release_all(self) -> None:
        for b in self.buckets.values():
            if b.graph is not None:
                with self._lock:
                    graph, b.graph, b.state = b.graph, None, BucketState.NOT_CAPTURED
                self._release(graph)

    @property
    def used_bytes(self) -> int:
        held = sum(b.graph.nbytes for b in self.buckets.values() if b.graph is not None)
        return held + self.unreclaimed_bytes

    def _release(self, graph: CapturedGraph) -> int:
        freed = self.backend.release(graph)
        # A release can also free more than measured at capture (memory an earlier graph left behind).
        self.unreclaimed_bytes = max(0, self.unreclaimed_bytes + graph.nbytes - freed)
        return freed

    def victims(self, need: int, protect: set[int], max_score: float, now: float) -> list[int] | None:
        cands = [
            Candidate(s, b.graph.nbytes, b.heat_at(now, self.half_life_s), self.stats.last_use(s))
            for s, b in self.buckets.items()
            if b.graph is not None and s not in protect
        ]
        return choose_victims(cands, need, max_score)

    def _victims_for(
        self, b: Bucket, nbytes: int, need: int, protect: set[int], evict: str, now: float
    ) -> list[int] | None:
        """Graphs to evict so that `b` (of about `nbytes`) fits, or None when the mode allows none."""
        if evict == "none":
            return None
        # Traffic may only displace graphs worth no more per byte than the newcomer; operators any.
        max_score = math.inf if evict == "force" else b.heat_at(now, self.half_life_s) / max(nbytes, 1)
        return self.victims(need, protect, max_score, now)

    def try_capture(self, size: int, protect: set[int], evict: str) -> tuple[OpOutcome, str]:
        """Capture `size` within the budget.

        evict: "none" (warm start: only into free budget), "policy" (traffic: only graphs worth no
        more per byte than this one), "force" (operator: any graph not in `protect`).
        """
        b = self.buckets[size]
        now = self._clock()
        estimate = estimate_bytes(size, self.stats.measured_bytes())
        need = self.used_bytes + estimate - self.budget_bytes
        if need > 0:
            victims = self._victims_for(b, estimate, need, protect, evict, now)
            if victims is None:
                return OpOutcome.OVER_BUDGET, (
                    f"needs about {estimate} bytes; {self.used_bytes} of "
                    f"{self.budget_bytes} used and nothing evictable frees enough"
                )
            for v in victims:
                self.evict(v, reason="budget")
        prior_state = b.state
        with self._lock:
            b.state = BucketState.CAPTURING
        started = time.perf_counter()
        try:
            graph = self.backend.capture(self.step, size)
        except Exception as exc:  # noqa: BLE001 - any capture failure must leave the service serving
            return self._capture_failed(b, exc, now)
        # What the step that asked for it waited: warm-up runs, collection and memory measurement
        # included, which the graph's own capture_ms leaves out.
        stall_ms = (time.perf_counter() - started) * 1000.0
        self.stats.capture(size, graph.nbytes, graph.capture_ms)
        over = self.used_bytes + graph.nbytes - self.budget_bytes
        if over > 0:
            victims = self._victims_for(b, graph.nbytes, over, protect | {size}, evict, now)
            if victims is None:
                freed = self._release(graph)
                with self._lock:
                    b.state = (
                        BucketState.EVICTED
                        if prior_state is BucketState.EVICTED
                        else BucketState.NOT_CAPTURED
                    )
                log.info(
                    "graph_capture_dropped",
                    bucket=size,
                    bytes=graph.nbytes,
                    bytes_freed=freed,
                    used=self.used_bytes,
                    budget=self.budget_bytes,
                )
                return (
                    OpOutcome.OVER_BUDGET,
                    f"measured {graph.nbytes} bytes does not fit the budget; dropped",
                )
            for v in victims:
                self.evict(v, reason="budget")
        with self._lock:
            b.captured(graph, self.step.input_addresses())
        log.info("graph_captured", bucket=size, bytes=graph.nbytes, ms=round(graph.capture_ms, 2),
                 stall_ms=round(stall_ms, 1))
        return OpOutcome.CAPTURED, f"captured {size}: {graph.nbytes} bytes in {graph.capture_ms:.1f} ms"

    def _capture_failed(self, b: Bucket, exc: BaseException, now: float) -> tuple[OpOutcome, str]:
        cleanup = getattr(self.backend, "cleanup_after_failure", None)
        if cleanup is not None:
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - best effort; the bucket is already marked failed
                pass
        with self._lock:
            b.fail(now, self.backoff_s, self.max_backoff_s)
        self.stats.failure(b.size)
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("graph_capture_failed", bucket=b.size, reason=reason, retry_in_s=b.backoff_s)
        return OpOutcome.FAILED, reason

    def evict(self, size: int, reason: str) -> int:
        b = self.buckets[size]
        graph = b.graph
        assert graph is not None
        with self._lock:
            b.graph = None
            b.state = BucketState.EVICTED
        freed = self._release(graph)
        self.stats.eviction(size)
        if self.last_replayed == size:
            self.last_replayed = None
        log.info("graph_evicted", bucket=size, bytes=graph.nbytes, bytes_freed=freed, reason=reason)
        return freed
