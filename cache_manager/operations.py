"""The operator's operations on the graphs (graphctl capture, evict, budget, reset-stats).

Each is checked first (sizes against the allowed list, the family against those the mode keeps),
then handed to the residency; its future gets one OpResult per size (or descriptor) once the device
has done it: captures once committed, evictions once the memory is back. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future

import structlog

from cache_manager.budget import choose_victims, resolve_budget
from cache_manager.ops import GraphsUnavailableError, OpOutcome, OpResult
from cache_manager.recorder import StatsRecorder
from cache_manager.residency import Residency
from cache_manager.sizes import BatchDescriptor, CudaGraphMode, GraphFamily, PaddingTable

log = structlog.get_logger("cache_manager")

Kind = CudaGraphMode | GraphFamily | str  # "full", "piecewise+lora", ...


class Operations:
    def __init__(self, residency: Residency, stats: StatsRecorder, tables: dict[CudaGraphMode, PaddingTable],
                 families: list[GraphFamily], mode: CudaGraphMode, disabled_reason: str | None,
                 clock: Callable[[], float]) -> None:
        self.residency = residency
        self.stats = stats
        self.tables = tables
        self.families = families  # the families graphs are kept for
        self.mode = mode
        self.disabled_reason = disabled_reason
        self._clock = clock

    def capture_async(self, sizes: Iterable[int], kind: Kind) -> Future:
        """Capture the given allowed sizes through the capture thread (ignores failure back-off; may
        evict unprotected graphs). The future gets {size: OpResult} once every capture is committed."""
        sizes, family = self._check(sizes, kind)
        results = Results(sizes)
        keys = {s: family.at(s) for s in sizes}
        for s, key in keys.items():
            b = self.residency.buckets[key]
            if b.graph is not None:
                results.set(s, OpResult(OpOutcome.ALREADY_CAPTURED, f"{key} is already captured", b.graph.nbytes))
                continue
            # Every other size of this operation, captured now or later: committing one of them must
            # never evict another that the same operation reports as captured.
            protect = {k for k in keys.values() if k != key}
            outcome, message = self.residency.request_capture(key, protect, "force", lambda r, s=s: results.set(s, r))
            if outcome is not None:
                results.set(s, OpResult(outcome, message))
        return results.future

    def evict_async(self, sizes: Iterable[int], kind: Kind) -> Future:
        """Evict the given sizes; the future gets {size: OpResult} once the device got the memory back."""
        sizes, family = self._check(sizes, kind)
        results = Results(sizes)
        for s in sizes:
            key = family.at(s)
            if self.residency.buckets[key].graph is None:
                results.set(s, OpResult(OpOutcome.NOT_CAPTURED, f"{key} is not captured"))
            else:
                self.residency.evict(key, "operator", lambda r, s=s: results.set(s, r))
        return results.future

    def set_budget_async(self, value: str | float) -> Future:
        """Set the one budget (bytes, fraction or string) and evict by policy until every family's
        graphs together fit it: the lowest recent replays per byte first, LoRA or not. Kept graphs
        (`Residency.kept`) stay, over the budget if it is below them (logged). The future gets
        {descriptor: OpResult} of the evictions."""
        residency = self.residency
        backend = residency.backend
        budget = resolve_budget(value, backend.total_memory() if backend is not None else 0)
        residency.set_budget(budget)
        over = residency.used_bytes - budget
        victims: list[BatchDescriptor] = []
        if over > 0:
            candidates = residency.candidates(set(), self._clock())
            # None: even all of them free too little (bytes still being released): evict them all.
            victims = choose_victims(candidates, over) or [c.size for c in candidates]
            kept = [(str(k), b.graph.nbytes) for k, b in residency.buckets.items()
                    if k in residency.kept and b.graph is not None]
            kept_bytes = sum(nbytes for _, nbytes in kept)
            if kept_bytes > budget:
                log.warning("graph_budget_below_kept_graphs", budget_bytes=budget,
                            kept=[name for name, _ in kept], kept_bytes=kept_bytes,
                            reason="a lone row's graph is kept (it may not pad into a larger one); "
                                   "graphctl evict removes it")
        results = Results(victims)
        for k in victims:
            residency.evict(k, "budget", lambda r, k=k: results.set(
                k, OpResult(OpOutcome.EVICTED, f"evicted {k} to fit {budget} bytes", r.bytes)))
        return results.future

    def reset_stats(self) -> None:
        """Zero all counters, since start and persisted; measurements of live graphs are kept."""
        self.stats.reset({k: (b.graph.nbytes, b.graph.capture_ms)
                          for k, b in self.residency.buckets.items() if b.graph is not None})

    def _check(self, sizes: Iterable[int], kind: Kind) -> tuple[list[int], GraphFamily]:
        if self.disabled_reason is not None:
            raise GraphsUnavailableError(self.disabled_reason)
        family = GraphFamily.parse(kind)
        if family not in self.families:
            kinds = ", ".join(map(str, self.families))
            raise ValueError(f"mode {self.mode.value} keeps no {family} graphs; kinds here: {kinds}")
        sizes = list(sizes)
        self.tables[family.mode].check_allowed(sizes)
        return sizes, family


class Results:
    """Collects one OpResult per size (or key) of an operator operation; completes its future with the last."""

    def __init__(self, sizes: Iterable[Hashable]) -> None:
        self.future: Future = Future()
        self._order = list(sizes)
        self._results: dict[Hashable, OpResult] = {}
        if not self._order:
            self.future.set_result({})

    def set(self, size: Hashable, result: OpResult) -> None:
        self._results[size] = result
        if len(self._results) == len(self._order) and not self.future.done():
            self.future.set_result({s: self._results[s] for s in self._order})
