"""GraphCache: every graph of a runner (decode, prefill pieces, LoRA) keyed by one descriptor, under one budget."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

import structlog
import torch

from cache_manager.backend import CudaGraphBackend, GraphBackend
from cache_manager.budget import resolve_budget
from cache_manager.capturer import CaptureJob
from cache_manager.config import DEFAULT_BUDGET_FRACTION, GraphCacheConfig
from cache_manager.dispatch import Dispatcher, StepPlan
from cache_manager.hooks import EngineHooks
from cache_manager.mirror import GraphOp
from cache_manager.operations import Kind, Operations
from cache_manager.ops import OpResult
from cache_manager.ordering import BesideServing, RankOrder
from cache_manager.recorder import StatsRecorder
from cache_manager.residency import Residency
from cache_manager.sizes import FULL, PIECEWISE, BatchDescriptor, CudaGraphMode, GraphFamily, PaddingTable, family_order
from cache_manager.snapshot import CacheSnapshot, take_snapshot
from cache_manager.stats import StatsTables
from cache_manager.step import DecodeStep
from cache_manager.store import Fingerprint, StatsStore
from cache_manager.warm import StartupReport, WarmStart

log = structlog.get_logger("cache_manager")


class GraphCache:
    """Serves each step by replaying the graph of the smallest allowed size >= n of the step's
    family, capturing it lazily beside serving; one budget, one eviction policy, one stats file and
    one snapshot for every family (a family is a descriptor without its size: the graph kind, FULL
    or PIECEWISE, and whether the graphs add the LoRA products; `steps` maps each to the step object
    that records it). It is made of one part per lifecycle: the dispatcher (dispatch.py: which
    family, which graph, pad to what, or eager), the residency (residency.py: budget, eviction,
    capture queue), the warm start (warm.py), the operator operations (operations.py) and the stats
    (recorder.py, store.py); `order` (ordering.py) says when captures run: beside serving on the
    capture thread, or with tensor parallelism between steps in the order every rank follows; `hooks`
    is its line to the engine that drives it (hooks.py).

    Contract: only the engine thread calls `plan*`, `execute`, `run`, `poll`, `between_steps`,
    `warm_step`, `maybe_save`, `save`, `close` and the operator operations (whose blocking forms,
    with deferred inline captures, return only once the engine has been idle), between steps;
    `snapshot()` may be called from any thread. Before a step the caller has written rows [0, n) of
    the step's static inputs; the cache pads rows [n, S). The returned tensor may be a view of a
    graph's static output: it is valid until the next call into the cache (clone to keep it).

    Graphs of the last replayed bucket and of the bucket being served are "in use" and never evicted
    by traffic. Graphs run only in a mode with graphs on a CUDA device (or with an explicit backend,
    as tests do); otherwise every step is eager and only requested sizes are counted.
    """

    def __init__(
        self,
        steps: DecodeStep | Mapping[GraphFamily, DecodeStep],
        config: GraphCacheConfig,
        device: torch.device,
        fingerprint: Fingerprint,
        backend: GraphBackend | None = None,
        *,
        hooks: EngineHooks | None = None,
        order: BesideServing | None = None,
        lora_fingerprint: Fingerprint | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """steps: one step (FULL graphs only) or one per family; PIECEWISE ones count only with piecewise
        sizes. order: RankOrder exactly with `config.inline_capture` (default: RankOrder() then, else
        BesideServing()). lora_fingerprint: the fingerprint of the LoRA graphs' stats file of earlier
        versions (`<stats file>.lora`), whose counters are merged in at load."""
        self.config = config
        self.device = torch.device(device)
        self.fingerprint = fingerprint
        self._clock = clock
        self._lock = threading.RLock()
        self.hooks = hooks if hooks is not None else EngineHooks()
        self.order = order if order is not None else RankOrder() if config.inline_capture else BesideServing()
        if isinstance(self.order, RankOrder) != config.inline_capture:
            raise ValueError("a RankOrder orders inline captures: give one exactly with inline_capture")
        given = dict(steps) if isinstance(steps, Mapping) else {GraphFamily(FULL): steps}
        tables = {FULL: PaddingTable(config.sizes)}
        if config.piecewise_sizes:
            tables[PIECEWISE] = PaddingTable(config.piecewise_sizes)
        self.steps = {f: given[f] for f in sorted(given, key=family_order) if f.mode in tables}
        assert GraphFamily(FULL) in self.steps, "the FULL step is every cache's"
        for family, step in self.steps.items():
            assert tables[family.mode].largest <= step.max_batch, f"{family} static inputs must hold its largest size"
        self.disabled_reason: str | None = None
        if config.mode is CudaGraphMode.NONE:
            self.disabled_reason = "mode none"
        elif backend is None and self.device.type != "cuda":
            self.disabled_reason = f"device {self.device.type} has no CUDA graphs"
        elif config.mode.has_piecewise and GraphFamily(PIECEWISE) not in self.steps:
            self.disabled_reason = f"mode {config.mode.value} needs a piecewise step and piecewise sizes"
        self.mode = CudaGraphMode.NONE if self.disabled_reason else config.mode
        self.tables = tables
        # The families kept; mode none lists (and counts) the FULL sizes all the same: what graphs would serve.
        listed = [f for f in self.steps if f.mode in (config.mode.kinds or (FULL,))]
        served = [f for f in listed if f.mode in self.mode.kinds]
        self.backend: GraphBackend | None = None
        budget_bytes = 0
        if self.graphs_enabled:
            self.backend = (backend if backend is not None
                            else CudaGraphBackend(self.device, synchronize=config.inline_capture))
            budget_bytes = resolve_budget(config.memory_budget, self.backend.total_memory(), DEFAULT_BUDGET_FRACTION)
        store = StatsStore(config.stats_file, fingerprint, lora_fingerprint) if config.stats_file else None
        self.stats = StatsRecorder(store, config.save_interval_s, config.replay_log_interval_s, clock, self._lock)
        # A one-row step that may not pad runs eagerly without its own graph (an FP8 8B model: 17 ms a
        # step against 2.8): size 1 of each family is kept from eviction by policy or budget (a few MB)
        # and captured right after the first size at start.
        lone_rows = [] if config.pad_single_rows else [f.at(1) for f in served if tables[f.mode].sizes[0] == 1]
        self.residency = Residency(
            self.steps, self.backend, [f.at(s) for f in listed for s in tables[f.mode].sizes], budget_bytes,
            self.stats, clock, self._lock, config.heat_half_life_s, config.failure_backoff_s,
            config.max_failure_backoff_s, self.hooks, inline=config.inline_capture, kept=frozenset(lone_rows),
        )
        self.dispatcher = Dispatcher(self.mode, tables, self.steps, self.residency, self.stats, config, self.order,
                                     clock, self._commit)
        self.warm = WarmStart(self.residency, self.stats, tables, served, lone_rows,
                              self.graphs_enabled and config.warm_start, config.inline_capture, self.order, clock)
        self.operations = Operations(self.residency, self.stats, tables, served, self.mode, self.disabled_reason, clock)

    # ---- state ------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.residency.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self.residency.used_bytes

    @property
    def capturing(self) -> bool:
        """Whether a capture is submitted and not yet committed (any thread; a moment's answer)."""
        return bool(self.residency.pending)

    @property
    def graphs_enabled(self) -> bool:
        return self.mode is not CudaGraphMode.NONE

    @property
    def has_lora(self) -> bool:
        """Whether the cache holds LoRA families (the runner has adapter slots)."""
        return any(f.lora for f in self.steps)

    # ---- steps (dispatch.py) ----------------------------------------------------------------

    def serves(self, kind: CudaGraphMode) -> bool:
        return self.dispatcher.serves(kind)

    def descriptor(self, n: int, kind: Kind = FULL) -> BatchDescriptor | None:
        return self.dispatcher.descriptor(n, GraphFamily.parse(kind))

    def plan_step(self, num_tokens: int, num_decode_rows: int, lora: bool = False, query_tokens: int = 1) -> StepPlan:
        """The plan of a step of `num_tokens` tokens whose first `num_decode_rows` are decode rows of
        `query_tokens` tokens each (speculative verify rows: 1 + k)."""
        return self.dispatcher.plan(self.dispatcher.requested(num_tokens, num_decode_rows, lora, query_tokens))

    def plan(self, n: int, kind: Kind = FULL) -> StepPlan:
        """The plan of a step of n rows (FULL) or tokens (PIECEWISE) of this family."""
        return self.dispatcher.plan(GraphFamily.parse(kind).at(n))

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.dispatcher.execute(plan)

    def run(self, n: int, kind: Kind = FULL) -> torch.Tensor:
        return self.execute(self.plan(n, kind))

    # ---- between steps ----------------------------------------------------------------------

    def poll(self) -> int:
        """Commit finished captures and account finished releases (with inline capture: run the queued
        ones first, as `order` allows); returns how many."""
        return self.order.between_steps(self.residency.capturer, self._commit, self.dispatcher.retry_wanted)

    def between_steps(self) -> None:
        """The engine's work between two steps: commit, start the next warm capture, save the stats."""
        self.poll()
        if self.warm_step() and self.config.inline_capture:
            self.poll()  # captured and committed now, at this step boundary
        self.maybe_save()

    def queued_ops(self) -> list[GraphOp]:
        """Inline capture without an engine to wait for: the ops to send with the next step."""
        return self.order.step_ops(self.residency.capturer)

    def run_queued(self) -> None:
        """Inline capture: run what `queued_ops` named; the next `poll` or plan commits them."""
        self.order.run_step_ops(self.residency.capturer)

    def warm_step(self) -> bool:
        """Submit at most one warm-start capture (warm.py); True if one was submitted."""
        return self.warm.step()

    def prepare(self, timeout_s: float) -> StartupReport:
        """Before serving: warm the kernels, then capture the warm start within `timeout_s` (warm.py)."""
        if not self.graphs_enabled:
            return StartupReport()
        return self.warm.prepare(timeout_s, self.steps, self.device, self.config.inline_capture, self._poll_until)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until every capture and release submitted so far is committed (tests and benchmarks;
        never on the serving path: with deferred inline captures it waits for an idle engine)."""
        if not self._poll_until(lambda: not (self.residency.pending or self.residency.releasing_bytes), timeout):
            raise TimeoutError(f"graph captures still pending after {timeout} s")

    def _commit(self) -> int:
        done = self.residency.commit_done()
        for job, result in done:
            if isinstance(job, CaptureJob):
                self.warm.committed(job.key, result)
        return len(done)

    def _poll_until(self, done: Callable[[], bool], timeout: float = math.inf) -> bool:
        """Commit finished jobs until `done()`; False if `timeout` seconds passed first. Raises if the
        capture thread has died (waiting on it would wait forever)."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.poll() == 0:
                if time.monotonic() > deadline:
                    return False
                capturer = self.residency.capturer
                if capturer is not None and not capturer.alive:
                    raise RuntimeError("the graph capture thread has stopped")
                time.sleep(0.001)
        return True

    # ---- operator operations (operations.py) ------------------------------------------------

    def capture_async(self, sizes: Iterable[int], kind: Kind = FULL) -> Future:
        return self.operations.capture_async(sizes, kind)

    def evict_async(self, sizes: Iterable[int], kind: Kind = FULL) -> Future:
        return self.operations.evict_async(sizes, kind)

    def set_budget_async(self, value: str | float) -> Future:
        return self.operations.set_budget_async(value)

    def reset_stats(self) -> None:
        self.operations.reset_stats()

    def capture(self, sizes: Iterable[int], kind: Kind = FULL) -> dict[int, OpResult]:
        return self._wait(self.capture_async(sizes, kind))

    def evict(self, sizes: Iterable[int], kind: Kind = FULL) -> dict[int, OpResult]:
        return self._wait(self.evict_async(sizes, kind))

    def set_budget(self, value: str | float) -> dict[BatchDescriptor, OpResult]:
        return self._wait(self.set_budget_async(value))

    def _wait(self, future: Future) -> dict:
        """Blocking form for the thread that owns the cache: polls until the future is done."""
        self._poll_until(future.done)
        return future.result()

    # ---- persistence and state --------------------------------------------------------------

    def persisted_stats(self) -> StatsTables:
        """Cumulative counters: earlier runs (loaded) plus this run."""
        return self.stats.persisted()

    def maybe_save(self) -> None:
        """Called by the engine every step: saves when dirty and the interval passed; logs totals."""
        self.stats.maybe_save(self._clock(), lambda: {
            "captured": [str(k) for k, b in sorted(self.residency.buckets.items()) if b.graph is not None],
            "used_bytes": self.used_bytes,
        })

    def save(self) -> bool:
        """Write the cumulative stats now and wait for it (bounded); never raises. False when they
        could not be written (True without a stats file: nothing to save)."""
        return self.stats.store is None or self.stats.save(self._clock())

    def close(self, timeout: float = 30.0) -> bool:
        """Save the stats, stop the capture thread (queued captures are not started) and release every
        graph; returns save()'s result. A capture that does not end within `timeout` leaves its graphs
        to process exit."""
        saved = self.save()
        self.warm.queue.clear()
        if not self.residency.close(timeout):
            log.warning("graph_capture_thread_hung", timeout_s=timeout)
        return saved

    def snapshot(self) -> CacheSnapshot:
        """The cache's state as plain data (any thread)."""
        with self._lock:
            return take_snapshot(self)
