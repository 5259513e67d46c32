"""The dispatcher: the only place that decides how a step runs.

For every step it decides, in one place: the graph family (FULL for a uniform decode, PIECEWISE for
any other step, each with LoRA when the step has adapter rows; or outside the graph cache, an eager
forward), then whether a captured graph replays it, padded to which size, or why it runs eagerly;
and it runs what it decided. A capture the step asks for never waits: the step pads into a larger
captured graph of its family meanwhile, or runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache_manager.backend import replay_rows
from cache_manager.config import GraphCacheConfig
from cache_manager.ordering import BesideServing
from cache_manager.recorder import StatsRecorder
from cache_manager.residency import Residency
from cache_manager.sizes import FULL, PIECEWISE, BatchDescriptor, CudaGraphMode, GraphFamily, PaddingTable
from cache_manager.step import DecodeStep


@dataclass(slots=True)
class StepPlan:
    """How one step runs: `target`'s graph replays it, or (None) it runs eagerly for `reason`."""

    requested: BatchDescriptor | None  # family and real size n; None: outside the graph cache (not counted)
    bucket: BatchDescriptor | None  # the size n pads to; None above the largest
    target: BatchDescriptor | None  # the graph replayed (the bucket's or a larger captured one)
    reason: str  # why eager ("" when replayed)
    now: float

    @property
    def kind(self) -> CudaGraphMode | None:
        """FULL (the decode step's inputs), PIECEWISE (the pieces' inputs) or None (an eager forward)."""
        return None if self.requested is None else self.requested.mode


class Dispatcher:
    """Decides and runs each step; engine thread only (see GraphCache's contract).

    `mode` is the effective one (NONE when graphs are off: every step of a family runs eagerly and
    is counted); `commit` commits finished captures before a decision.
    """

    def __init__(self, mode: CudaGraphMode, tables: dict[CudaGraphMode, PaddingTable],
                 steps: dict[GraphFamily, DecodeStep], residency: Residency, stats: StatsRecorder,
                 config: GraphCacheConfig, order: BesideServing, clock: Callable[[], float],
                 commit: Callable[[], int]) -> None:
        self.mode = mode
        self._kinds = frozenset(mode.kinds)  # serves() runs several times a step
        self.tables = tables
        self.steps = steps
        self.residency = residency
        self.stats = stats
        self.config = config
        self.order = order
        self._clock = clock
        self._commit = commit
        self.wanted: dict[BatchDescriptor, None] = {}  # sizes traffic asked for that need evictions (in order)

    def serves(self, kind: CudaGraphMode) -> bool:
        """Whether steps of this kind (FULL: uniform decode; PIECEWISE: any step) can replay graphs."""
        return kind in self._kinds

    def family(self, uniform_decode: bool, lora: bool, query_tokens: int = 1) -> GraphFamily | None:
        """A uniform decode runs as FULL (as PIECEWISE when the mode keeps only pieces); a uniform
        verify step (query_tokens > 1 in every row) as its own FULL family when a step for it is
        registered, else like any other step: PIECEWISE when the mode keeps pieces, else outside
        the graph cache (None)."""
        pieces_only = self.serves(PIECEWISE) and not self.serves(FULL)
        full = GraphFamily(FULL, lora, query_tokens)
        if uniform_decode and not pieces_only and (query_tokens == 1 or full in self.steps):
            family = full
        elif self.serves(PIECEWISE):
            family = GraphFamily(PIECEWISE, lora)
        else:
            return None
        assert family in self.steps, f"a step of {family} on a cache without its step (no adapter slots?)"
        return family

    def requested(self, num_tokens: int, num_decode_rows: int, lora: bool = False,
                  query_tokens: int = 1) -> BatchDescriptor | None:
        """The family of a step of `num_tokens` tokens whose first `num_decode_rows` rows are decode
        rows of `query_tokens` tokens each (1 + k for speculative verify rows), at its real size (rows
        for FULL, tokens for PIECEWISE); None: outside the graph cache."""
        family = self.family(num_decode_rows * query_tokens == num_tokens, lora, query_tokens)
        if family is None:
            return None
        return family.at(num_decode_rows if family.mode is FULL else num_tokens)

    def descriptor(self, n: int, family: GraphFamily) -> BatchDescriptor | None:
        """The key of the graph that would serve n rows (FULL) or tokens (PIECEWISE); None: eager
        above the largest size."""
        bucket = self.tables[family.mode].bucket_for(n)
        return None if bucket is None else family.at(bucket)

    def plan(self, requested: BatchDescriptor | None) -> StepPlan:
        """Decide how the step runs: the captured graph that replays it, or eager and why. Commits
        finished captures first; may submit a capture and evictions."""
        now = self._clock()
        if requested is None:
            return StepPlan(None, None, None, "", now)
        family, n = requested.family, requested.padded_size
        step = self.steps[family]
        if not 1 <= n <= step.max_batch:
            raise ValueError(f"{family} step size {n} is outside [1, {step.max_batch}]")
        if not self.serves(family.mode):
            return StepPlan(requested, None, None, "mode_none", now)
        self._commit()
        key = self.descriptor(n, family)
        if key is None:
            return StepPlan(requested, None, None, "above_max", now)
        target, reason = self._select(key, now)
        return StepPlan(requested, key, target, reason, now)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run a planned step (before any other call into the cache)."""
        requested, target, now = plan.requested, plan.target, plan.now
        assert requested is not None, "a step outside the graph cache runs its own forward"
        step, n = self.steps[requested.family], requested.padded_size
        if target is None:
            self.stats.eager(requested, plan.bucket, plan.reason, now)
            return step.run(n)
        b = self.residency.buckets[target]
        if self.config.debug_check_addresses and step.input_addresses() != b.addresses:
            raise RuntimeError(
                f"static inputs moved since {target} was captured: {b.addresses} -> {step.input_addresses()}"
            )
        assert b.graph is not None
        out = replay_rows(b.graph, step, n)
        self.residency.last_replayed = target
        self.stats.replay(requested, target, now)
        return out

    def _select(self, key: BatchDescriptor, now: float) -> tuple[BatchDescriptor | None, str]:
        """(graph to replay, "") or (None, eager reason). May submit a capture, evicting by policy;
        meanwhile the step pads to a larger captured graph of its family if there is one (a one-row
        step only with `pad_single_rows`)."""
        residency = self.residency
        b = residency.buckets[key]
        b.bump(now, self.config.heat_half_life_s)
        if b.graph is not None:
            return key, ""
        if b.in_backoff(now):
            reason = "failed"
        elif key in residency.pending:
            reason = "capturing"
        else:
            # Deferred captures (tensor parallelism) would hold their victims out of service until the
            # engine is idle: none now; an idle `poll` asks again (retry_wanted), evicting by policy.
            deferred = self.order.deferred
            outcome, _ = residency.request_capture(key, self._in_use(key), evict="none" if deferred else "policy")
            reason = "capturing" if outcome is None else "budget"
            if outcome is not None and deferred:
                self.wanted[key] = None
        alone = key.padded_size == 1 and not self.config.pad_single_rows
        larger = None if alone else residency.larger_captured(key)
        return (larger, "") if larger is not None else (None, reason)

    def retry_wanted(self) -> None:
        """The sizes traffic asked for while the engine was busy that did not fit without evictions:
        requested again, evicting by policy (most recently asked first)."""
        now = self._clock()
        for key in reversed(list(self.wanted)):
            b = self.residency.buckets[key]
            if b.graph is None and key not in self.residency.pending and not b.in_backoff(now):
                self.residency.request_capture(key, self._in_use(key), evict="policy")
        self.wanted.clear()

    def _in_use(self, key: BatchDescriptor) -> set[BatchDescriptor]:
        in_use = self.residency.last_replayed
        return {key} | ({in_use} if in_use is not None else set())
