"""GraphCache: picks replay, lazy capture or eager for each decode step, under a memory budget."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import structlog
import torch

from cache_manager.backend import CudaGraphBackend, GraphBackend
from cache_manager.budget import resolve_budget
from cache_manager.config import DEFAULT_BUDGET_FRACTION, GraphCacheConfig
from cache_manager.ops import GraphsUnavailableError, OpOutcome, OpResult
from cache_manager.recorder import StatsRecorder
from cache_manager.residency import Residency
from cache_manager.sizes import BatchDescriptor, CudaGraphMode, PaddingTable
from cache_manager.snapshot import CacheSnapshot, RequestedSize
from cache_manager.stats import StatsTables
from cache_manager.step import DecodeStep
from cache_manager.store import Fingerprint, StatsStore

log = structlog.get_logger("cache_manager")


class GraphCache:
    """Serves `run(n)` by replaying the graph of the smallest allowed size >= n, capturing it lazily.

    Contract: only the engine thread calls `run`, `warm_step`, `maybe_save`, `save`, `close` and the
    operator operations (`capture`, `evict`, `set_budget`, `reset_stats`), between steps;
    `snapshot()` may be called from any thread. Before `run(n)` the caller has written rows [0, n) of
    the step's static inputs; the cache pads rows [n, S). The returned tensor may be a view of a
    graph's static output: it is valid until the next call into the cache (clone to keep it).
    Graphs of the last replayed bucket and of the bucket being served are "in use" and never evicted
    by traffic. Graphs run only in mode FULL on a CUDA device (or with an explicit backend, as tests
    do); otherwise every step is eager and only requested sizes are counted. Captures outside
    `run` (operator, warm start) pad all rows [0, S) first, since warm-up executes the step for real.
    """

    def __init__(
        self,
        step: DecodeStep,
        config: GraphCacheConfig,
        device: torch.device,
        fingerprint: Fingerprint,
        backend: GraphBackend | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.step = step
        self.config = config
        self.device = torch.device(device)
        self.fingerprint = fingerprint
        self._clock = clock
        self._lock = threading.RLock()
        self._table = PaddingTable(config.sizes)
        assert self._table.largest <= step.max_batch, "static inputs must hold the largest capture size"
        self.disabled_reason: str | None = None
        if config.mode is CudaGraphMode.NONE:
            self.disabled_reason = "mode none"
        elif backend is None and self.device.type != "cuda":
            self.disabled_reason = f"device {self.device.type} has no CUDA graphs"
        self.mode = CudaGraphMode.NONE if self.disabled_reason else CudaGraphMode.FULL
        self.backend: GraphBackend | None = None
        budget_bytes = 0
        if self.mode is CudaGraphMode.FULL:
            self.backend = backend if backend is not None else CudaGraphBackend(self.device)
            budget_bytes = resolve_budget(
                config.memory_budget, self.backend.total_memory(), DEFAULT_BUDGET_FRACTION
            )
        store = StatsStore(config.stats_file, fingerprint) if config.stats_file else None
        self.stats = StatsRecorder(
            store, config.save_interval_s, config.replay_log_interval_s, clock, self._lock
        )
        self.residency = Residency(
            step,
            self.backend,
            config.sizes,
            budget_bytes,
            self.stats,
            clock,
            self._lock,
            config.heat_half_life_s,
            config.failure_backoff_s,
            config.max_failure_backoff_s,
        )
        self._buckets = self.residency.buckets
        self._warm_queue: deque[int] = deque()
        if self.mode is CudaGraphMode.FULL and config.warm_start:
            self._warm_queue.extend(s for s in self.stats.hot_buckets() if s in self._buckets)

    # ---- serving ------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.residency.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self.residency.used_bytes

    @property
    def graphs_enabled(self) -> bool:
        return self.mode is CudaGraphMode.FULL

    def descriptor(self, n: int) -> BatchDescriptor | None:
        """The key of the graph that would serve n rows (None: eager above the largest size)."""
        bucket = self._table.bucket_for(n)
        return None if bucket is None else BatchDescriptor(self.mode, bucket)

    def run(self, n: int) -> torch.Tensor:
        if not 1 <= n <= self.step.max_batch:
            raise ValueError(f"batch size {n} is outside [1, max_batch={self.step.max_batch}]")
        now = self._clock()
        if not self.graphs_enabled:
            return self._eager(n, None, "mode_none", now)
        bucket = self._table.bucket_for(n)
        if bucket is None:
            return self._eager(n, None, "above_max", now)
        target, reason = self._select(n, bucket, now)
        if target is None:
            return self._eager(n, bucket, reason, now)
        b = self._buckets[target]
        if self.config.debug_check_addresses and self.step.input_addresses() != b.addresses:
            raise RuntimeError(
                f"static inputs moved since bucket {target} was captured: "
                f"{b.addresses} -> {self.step.input_addresses()}"
            )
        if n < target:
            self.step.set_padding_rows(n, target)
        assert b.graph is not None
        out = b.graph.replay()
        self.residency.last_replayed = target
        self.stats.replay(n, target, now)
        return out[:n]

    def _select(self, n: int, bucket: int, now: float) -> tuple[int | None, str]:
        """(bucket to replay, "") or (None, eager reason). May capture, evicting by policy."""
        b = self._buckets[bucket]
        b.bump(now, self.config.heat_half_life_s)
        if b.graph is not None:
            return bucket, ""
        if b.in_backoff(now):
            return None, "failed"
        self.step.set_padding_rows(n, bucket)  # warm-up executes the step: padding must be safe
        in_use = self.residency.last_replayed
        protect = {bucket} | ({in_use} if in_use is not None else set())
        outcome, _ = self.residency.try_capture(bucket, protect, evict="policy")
        if outcome is OpOutcome.CAPTURED:
            return bucket, ""
        if outcome is OpOutcome.OVER_BUDGET:
            larger = self.residency.larger_captured(bucket)
            return (larger, "") if larger is not None else (None, "budget")
        return None, "failed"

    def _eager(self, n: int, bucket: int | None, reason: str, now: float) -> torch.Tensor:
        self.stats.eager(n, bucket, reason, now)
        return self.step.run(n)

    # ---- capture / eviction -------------------------------------------------------------------

    def warm_step(self) -> bool:
        """Capture at most one hot bucket from the warm-start queue, within budget (no eviction)."""
        if not self.graphs_enabled:
            return False
        now = self._clock()
        while self._warm_queue:
            size = self._warm_queue.popleft()
            b = self._buckets[size]
            if b.graph is not None or b.in_backoff(now):
                continue
            self.step.set_padding_rows(0, size)
            outcome, message = self.residency.try_capture(size, set(), evict="none")
            if outcome is OpOutcome.OVER_BUDGET:
                log.info("graph_warm_start_skipped", bucket=size, reason=message)
            return outcome is OpOutcome.CAPTURED
        return False

    # ---- operator operations ------------------------------------------------------------------

    def _check_ops(self, sizes: Iterable[int]) -> list[int]:
        if not self.graphs_enabled:
            raise GraphsUnavailableError(self.disabled_reason or "disabled")
        sizes = list(sizes)
        self._table.check_allowed(sizes)
        return sizes

    def capture(self, sizes: Iterable[int]) -> dict[int, OpResult]:
        """Capture the given allowed sizes now (ignores failure back-off; may evict unprotected graphs)."""
        results: dict[int, OpResult] = {}
        done: set[int] = set()
        for s in self._check_ops(sizes):
            b = self._buckets[s]
            if b.graph is not None:
                results[s] = OpResult(OpOutcome.ALREADY_CAPTURED, f"{s} is already captured", b.graph.nbytes)
                done.add(s)
                continue
            self.step.set_padding_rows(0, s)
            outcome, message = self.residency.try_capture(s, done, evict="force")
            nbytes = b.graph.nbytes if b.graph is not None else 0
            results[s] = OpResult(outcome, message, nbytes)
            if outcome is OpOutcome.CAPTURED:
                done.add(s)
        return results

    def evict(self, sizes: Iterable[int]) -> dict[int, OpResult]:
        results: dict[int, OpResult] = {}
        for s in self._check_ops(sizes):
            if self._buckets[s].graph is None:
                results[s] = OpResult(OpOutcome.NOT_CAPTURED, f"{s} is not captured")
            else:
                freed = self.residency.evict(s, reason="operator")
                results[s] = OpResult(OpOutcome.EVICTED, f"evicted {s}; {freed} bytes returned", freed)
        return results

    def set_budget(self, value: str | float) -> dict[int, OpResult]:
        """Set the budget (bytes, fraction or string) and evict by policy until the graphs fit it."""
        total = self.backend.total_memory() if self.backend is not None else 0
        budget = resolve_budget(value, total)
        with self._lock:
            self.residency.budget_bytes = budget
        results: dict[int, OpResult] = {}
        over = self.used_bytes - budget
        if over > 0:
            victims = self.residency.victims(over, set(), math.inf, self._clock()) or [
                s for s, b in self._buckets.items() if b.graph is not None
            ]
            for s in victims:
                freed = self.residency.evict(s, reason="budget")
                results[s] = OpResult(OpOutcome.EVICTED, f"evicted {s} to fit {budget} bytes", freed)
        return results

    def reset_stats(self) -> None:
        """Zero all counters, since start and persisted; measurements of live graphs are kept."""
        self.stats.reset(
            {s: (b.graph.nbytes, b.graph.capture_ms) for s, b in self._buckets.items() if b.graph is not None}
        )

    # ---- persistence, logs, state -------------------------------------------------------------

    def persisted_stats(self) -> StatsTables:
        """Cumulative counters: earlier runs (loaded) plus this run."""
        return self.stats.persisted()

    def maybe_save(self) -> None:
        """Called by the engine every step: saves when dirty and the interval passed; logs totals."""
        self.stats.maybe_save(
            self._clock(),
            lambda: {
                "captured": sorted(s for s, b in self._buckets.items() if b.graph is not None),
                "used_bytes": self.used_bytes,
            },
        )

    def save(self) -> bool:
        """Write the cumulative stats now and wait for it (bounded); never raises. False when they
        could not be written (True without a stats file: nothing to save)."""
        return self.stats.store is None or self.stats.save(self._clock())

    def close(self) -> bool:
        """Save the stats and release every graph; returns save()'s result."""
        saved = self.save()
        self.residency.release_all()
        self._warm_queue.clear()
        return saved

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            persisted = self.stats.persisted()
            session = self.stats.session
            entries = [
                b.entry(session.buckets.get(s), persisted.buckets.get(s)) for s, b in self._buckets.items()
            ]
            return CacheSnapshot(
                mode=self.mode.value,
                configured_mode=self.config.mode.value,
                disabled_reason=self.disabled_reason,
                device=str(self.device),
                budget_bytes=self.budget_bytes,
                used_bytes=self.used_bytes,
                capture_sizes=self.config.sizes,
                max_batch=self.config.max_batch,
                buckets=tuple(entries),
                requested_since_start={n: c.requests for n, c in sorted(session.requested.items())},
                requested_persisted={n: c.requests for n, c in sorted(persisted.requested.items())},
                requested_detail=tuple(
                    RequestedSize(n, c.requests, c.replays, dict(c.eager))
                    for n, c in sorted(session.requested.items())
                ),
                warm_queue=tuple(self._warm_queue),
                stats_file=str(self.stats.store.path) if self.stats.store else None,
                last_save_time=self.stats.last_save_time,
            )
