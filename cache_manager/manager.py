"""GraphCache: picks replay, lazy capture or eager for each decode step, under a memory budget."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import structlog
import torch

from cache_manager.backend import CudaGraphBackend, GraphBackend, replay_rows
from cache_manager.budget import choose_victims, resolve_budget
from cache_manager.capturer import CaptureJob, ops_of
from cache_manager.config import DEFAULT_BUDGET_FRACTION, GraphCacheConfig
from cache_manager.mirror import GraphOp
from cache_manager.ops import GraphsUnavailableError, OpOutcome, OpResult
from cache_manager.recorder import StatsRecorder
from cache_manager.residency import Residency
from cache_manager.sizes import FULL, PIECEWISE, BatchDescriptor, CudaGraphMode, PaddingTable
from cache_manager.snapshot import CacheSnapshot, RequestedSize
from cache_manager.stats import StatsTables
from cache_manager.step import DecodeStep
from cache_manager.store import Fingerprint, StatsStore

log = structlog.get_logger("cache_manager")


class GraphCache:
    """Serves `run(n)` by replaying the graph of the smallest allowed size >= n, capturing it lazily
    beside serving.

    Contract: only the engine thread calls `run`, `poll`, `warm_step`, `maybe_save`, `save`, `close`
    and the operator operations (`capture_async`, `evict_async`, `set_budget_async`, `reset_stats`,
    and their blocking forms, which with deferred inline captures return only once the engine has
    been idle), between steps; `snapshot()` may be called from any thread. Before
    `run(n)` the caller has written rows [0, n) of the step's static inputs; the cache pads rows
    [n, S). The returned tensor may be a view of a graph's static output: it is valid until the next
    call into the cache (clone to keep it).

    A capture never blocks the step that asked for it: that step runs now, padded to a larger
    captured graph if one exists, else eager; the capture thread (capturer.py) records the graph and
    `poll` swaps it in between steps. Operator captures and warm start take the same path. Graphs of
    the last replayed bucket and of the bucket being served are "in use" and never evicted by
    traffic. Graphs run only in mode FULL on a CUDA device (or with an explicit backend, as tests
    do); otherwise every step is eager and only requested sizes are counted. `notify` (any thread)
    is called when the capture thread has a result to commit, so an idle engine can wake to `poll`.

    `run` is `plan` (which graph, or eager; queue captures and evictions) then `execute`. With
    `config.inline_capture` (tensor parallelism) captures and releases wait in a queue until the
    engine thread runs them, on every rank at the same point: `poll` hands the queued ops to
    `publish_ops` (the other ranks) and runs them here, then commits. A capture there stops every
    rank's step loop (85-196 ms a graph on two H200s), so with `engine_busy` set (the engine's)
    captures run only while it has no work, one at a time (releases at the head of the queue run at
    once); meanwhile steps pad into a larger graph, a capture that traffic asks for evicts nothing
    (an idle `poll` asks again, evicting by policy), and the warm start waits. A cold start captures
    a cover of sizes (the largest, then the smallest at least half of it, and so on), so that a step
    pads to at most twice its size where the allowed sizes allow. Without `engine_busy` (a cache no
    engine drives: tests) the queued ops may instead travel with the next step: rank 0 sends them
    with the planned descriptor (`queued_ops`) and runs them (`run_queued`) before it executes.
    """

    def __init__(
        self,
        step: DecodeStep,
        config: GraphCacheConfig,
        device: torch.device,
        fingerprint: Fingerprint,
        backend: GraphBackend | None = None,
        *,
        piecewise_step: DecodeStep | None = None,
        clock: Callable[[], float] = time.time,
        notify: Callable[[], None] | None = None,
        on_capture_stall: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.fingerprint = fingerprint
        self._clock = clock
        self._lock = threading.RLock()
        self.steps: dict[CudaGraphMode, DecodeStep] = {FULL: step}
        self._tables = {FULL: PaddingTable(config.sizes)}
        if piecewise_step is not None and config.piecewise_sizes:
            self.steps[PIECEWISE] = piecewise_step
            self._tables[PIECEWISE] = PaddingTable(config.piecewise_sizes)
        for kind, table in self._tables.items():
            assert table.largest <= self.steps[kind].max_batch, f"{kind.value} static inputs must hold its largest size"
        self.disabled_reason: str | None = None
        if config.mode is CudaGraphMode.NONE:
            self.disabled_reason = "mode none"
        elif backend is None and self.device.type != "cuda":
            self.disabled_reason = f"device {self.device.type} has no CUDA graphs"
        elif config.mode.has_piecewise and PIECEWISE not in self.steps:
            self.disabled_reason = f"mode {config.mode.value} needs a piecewise step and piecewise sizes"
        self.mode = CudaGraphMode.NONE if self.disabled_reason else config.mode
        self._kinds = frozenset(self.mode.kinds)  # serves() runs several times a step
        self.backend: GraphBackend | None = None
        budget_bytes = 0
        if self.graphs_enabled:
            self.backend = (backend if backend is not None
                            else CudaGraphBackend(self.device, synchronize=config.inline_capture))
            budget_bytes = resolve_budget(
                config.memory_budget, self.backend.total_memory(), DEFAULT_BUDGET_FRACTION
            )
        store = StatsStore(config.stats_file, fingerprint) if config.stats_file else None
        self.stats = StatsRecorder(
            store, config.save_interval_s, config.replay_log_interval_s, clock, self._lock
        )
        # A one-row step that may not pad runs eagerly without its own graph (an FP8 8B model: 17 ms a
        # step against 2.8): size 1 of each kind is kept from eviction by policy or budget (a few MB)
        # and captured right after the first size at start.
        lone_rows = [] if config.pad_single_rows else [
            BatchDescriptor(k, 1) for k in self.mode.kinds if self._tables[k].sizes[0] == 1]
        self.residency = Residency(
            self.steps,
            self.backend,
            # Mode none lists (and counts) the FULL sizes all the same: what graphs would serve.
            {kind: table.sizes for kind, table in self._tables.items() if kind in (config.mode.kinds or (FULL,))},
            budget_bytes,
            self.stats,
            clock,
            self._lock,
            config.heat_half_life_s,
            config.failure_backoff_s,
            config.max_failure_backoff_s,
            notify=lambda: self.notify() if self.notify is not None else None,
            on_stall=lambda seconds: self.on_capture_stall(seconds) if self.on_capture_stall is not None else None,
            inline=config.inline_capture,
            kept=frozenset(lone_rows),
        )
        # Inline capture with other ranks: called with the queued ops just before `poll` runs them here.
        self.publish_ops: Callable[[list[GraphOp]], None] | None = None
        # Inline capture: whether the engine has work now (requests queued, running or in flight); set,
        # captures and releases wait for it to have none (a capture stops every rank's steps).
        self.engine_busy: Callable[[], bool] | None = None
        self._wanted: dict[BatchDescriptor, None] = {}  # sizes traffic asked for that need evictions (in order)
        # Both settable after construction: the engine that wakes and the metrics come later.
        self.notify = notify
        self.on_capture_stall = on_capture_stall
        self._buckets = self.residency.buckets
        self._warm_queue: deque[BatchDescriptor] = deque()
        if self.graphs_enabled and config.warm_start:
            self._warm_queue.extend(k for k in self.stats.hot_buckets() if k in self._buckets)
            if not self._warm_queue:
                # A cold start: the largest size of each kind first, so that while traffic asks for
                # its own sizes, their steps pad into a graph instead of running eagerly (an eager
                # step beside a capture shares the interpreter with it and slows most). Inline
                # (tensor parallelism), where serving captures wait for an idle engine: a cover.
                covers = {k: _cover(self._tables[k].sizes) if config.inline_capture else [self._tables[k].largest]
                          for k in self.mode.kinds}
                for i in range(max(map(len, covers.values()), default=0)):
                    self._warm_queue.extend(BatchDescriptor(k, c[i]) for k, c in covers.items() if i < len(c))
            if lone_rows:  # eager until captured (under tensor parallelism until the engine is idle)
                rest = [d for d in self._warm_queue if d not in lone_rows]
                self._warm_queue = deque(rest[:1] + lone_rows + rest[1:])
        self._warming: BatchDescriptor | None = None  # the warm-start capture in flight
        self.sharing: GraphCache | None = None  # the cache under the same budget (share_budget_with)

    # ---- serving ------------------------------------------------------------------------------

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

    def share_budget_with(self, other: GraphCache) -> None:
        """Both caches under one budget: each counts what the other holds and has reserved, so that
        together they never exceed it (each evicts only its own graphs). Both must be driven by one
        engine thread."""
        mine, theirs = self.residency, other.residency
        mine.shared_bytes = lambda: theirs.used_bytes + theirs.reserved_bytes
        theirs.shared_bytes = lambda: mine.used_bytes + mine.reserved_bytes
        self.sharing, other.sharing = other, self

    def serves(self, kind: CudaGraphMode) -> bool:
        """Whether steps of this kind (FULL: uniform decode; PIECEWISE: any step) can replay graphs."""
        return kind in self._kinds

    def descriptor(self, n: int, kind: CudaGraphMode = FULL) -> BatchDescriptor | None:
        """The key of the graph that would serve n rows (FULL) or tokens (PIECEWISE); None: eager
        above the largest size."""
        bucket = self._tables[kind].bucket_for(n)
        return None if bucket is None else BatchDescriptor(kind, bucket)

    def run(self, n: int, kind: CudaGraphMode = FULL) -> torch.Tensor:
        """Run the step of this kind over rows (FULL) or tokens (PIECEWISE) [0, n) of its static
        inputs: replayed from the smallest captured size >= n, or eager."""
        return self.execute(self.plan(n, kind))

    def plan(self, n: int, kind: CudaGraphMode = FULL) -> StepPlan:
        """Decide how the step of n rows or tokens runs: the captured graph that replays it, or eager
        and why. Commits finished captures first; may submit a capture and evictions."""
        step = self.steps[kind]
        if not 1 <= n <= step.max_batch:
            raise ValueError(f"{kind.value} step size {n} is outside [1, {step.max_batch}]")
        now = self._clock()
        requested = BatchDescriptor(kind, n)
        if not self.serves(kind):
            return StepPlan(requested, None, None, "mode_none", now)
        self._commit_done()
        key = self.descriptor(n, kind)
        if key is None:
            return StepPlan(requested, None, None, "above_max", now)
        target, reason = self._select(key, now)
        return StepPlan(requested, key, target, reason, now)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run a planned step (before any other call into the cache)."""
        requested, target, now = plan.requested, plan.target, plan.now
        step, n = self.steps[requested.mode], requested.padded_size
        if target is None:
            self.stats.eager(requested, plan.bucket, plan.reason, now)
            return step.run(n)
        b = self._buckets[target]
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
        meanwhile the step pads to a larger captured graph of its kind if there is one (a one-row
        step only with `pad_single_rows`)."""
        b = self._buckets[key]
        b.bump(now, self.config.heat_half_life_s)
        if b.graph is not None:
            return key, ""
        if b.in_backoff(now):
            reason = "failed"
        elif key in self.residency.pending:
            reason = "capturing"
        else:
            in_use = self.residency.last_replayed
            protect = {key} | ({in_use} if in_use is not None else set())
            # Deferred captures (tensor parallelism) would hold their victims out of service until the
            # engine is idle: none now; an idle `poll` asks again, evicting by policy.
            deferred = self.engine_busy is not None
            outcome, _ = self.residency.request_capture(key, protect, evict="none" if deferred else "policy")
            reason = "capturing" if outcome is None else "budget"
            if outcome is not None and deferred:
                self._wanted[key] = None
        alone = key.padded_size == 1 and not self.config.pad_single_rows
        larger = None if alone else self.residency.larger_captured(key)
        return (larger, "") if larger is not None else (None, reason)

    # ---- results from the capture thread --------------------------------------------------------

    def poll(self) -> int:
        """Between steps: commit finished captures and account finished releases; returns how many.
        Inline capture: first runs queued releases and captures (after `publish_ops`), and again for
        what the commits queued (evictions), until none is left or, with `engine_busy`, the engine
        has work (then only the releases at the head of the queue run)."""
        capturer = self.residency.capturer
        if capturer is None or not capturer.inline:
            return self._commit_done()
        count = self._commit_done()  # what the last step ran (it travelled with the step)
        if self._wanted and not self._busy():
            self._request_wanted()
        # Releases at the head of the queue run now (no rank waits on them); captures one at a time
        # while the engine is idle, the engine asked before each: a request that arrives meanwhile
        # waits for one capture at most.
        while capturer.queued:
            jobs = capturer.take_queued(max_captures=0 if self._busy() else 1)
            if not jobs:
                break
            if self.publish_ops is not None:
                self.publish_ops(ops_of(jobs))
            capturer.run_jobs(jobs)
            count += self._commit_done()
        return count

    def _busy(self) -> bool:
        return self.engine_busy is not None and self.engine_busy()

    def _request_wanted(self) -> None:
        """The sizes traffic asked for while the engine was busy that did not fit without evictions:
        requested again, evicting by policy (most recently asked first)."""
        now = self._clock()
        for key in reversed(list(self._wanted)):
            b = self._buckets[key]
            if b.graph is None and key not in self.residency.pending and not b.in_backoff(now):
                in_use = self.residency.last_replayed
                self.residency.request_capture(key, {key} | ({in_use} if in_use is not None else set()), evict="policy")
        self._wanted.clear()

    def queued_ops(self) -> list[GraphOp]:
        """Inline capture: the captures and releases to run with the next step, in order (for the
        other ranks); none while they wait for an idle engine (`engine_busy`): `poll` runs them."""
        capturer = self.residency.capturer
        return capturer.queued_ops() if capturer is not None and self.engine_busy is None else []

    def run_queued(self) -> None:
        """Inline capture: run what `queued_ops` named, on this thread; the next `poll` or `plan`
        commits them."""
        if self.residency.capturer is not None and self.engine_busy is None:
            self.residency.capturer.run_queued()

    def _commit_done(self) -> int:
        capturer = self.residency.capturer
        if capturer is None:
            return 0
        done = capturer.take_done()
        for job in done:
            if isinstance(job, CaptureJob):
                result = self.residency.commit(job)
                if job.key == self._warming:
                    self._warming = None
                    if result.outcome is OpOutcome.OVER_BUDGET:
                        log.info("graph_warm_start_skipped", bucket=str(job.key), reason=result.message)
            else:
                result = self.residency.released(job)
            for waiter in job.waiters:
                waiter(result)
        return len(done)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until every capture and release submitted so far is committed (tests and benchmarks;
        never on the serving path: with deferred inline captures it waits for an idle engine)."""
        if not self._poll_until(lambda: not (self.residency.pending or self.residency.releasing_bytes), timeout):
            raise TimeoutError(f"graph captures still pending after {timeout} s")

    def warm_step(self) -> bool:
        """Submit at most one hot bucket from the warm-start queue, within budget (no eviction);
        one at a time, so each estimate sees the previous measurement. True if one was submitted."""
        if not self.graphs_enabled or self._warming is not None or self._busy():
            return False  # (busy: a deferred capture would hold its budget until the engine is idle)
        now = self._clock()
        while self._warm_queue:
            key = self._warm_queue.popleft()
            b = self._buckets[key]
            if b.graph is not None or b.in_backoff(now) or key in self.residency.pending:
                continue
            outcome, message = self.residency.request_capture(key, set(), evict="none")
            if outcome is OpOutcome.OVER_BUDGET:
                log.info("graph_warm_start_skipped", bucket=str(key), reason=message)
                continue
            self._warming = key
            return True
        return False

    def prepare(self, timeout_s: float) -> StartupReport:
        """Before serving, on the thread that will own the cache: make sure no early step waits on
        a kernel compile or a capture. First every allowed size of each served kind runs once on
        scratch inputs (Triton compiles its specializations, cuBLAS picks its kernels: work that a
        first step of a new size, or a capture beside it, used to do while streams waited); then
        the warm-start queue is captured (a cold start: the largest size of each kind, which every
        step can pad into; a warm start: the stats' hot sizes; without `pad_single_rows` size 1
        second) until it is empty or `timeout_s` has passed. Whatever is left is captured in the
        background once serving, as before.

        With inline capture (tensor parallelism) the eager pass is skipped: its collectives would
        need the other ranks to run the same steps, which only captures are mirrored for."""
        report = StartupReport()
        if not self.graphs_enabled or timeout_s <= 0:
            return report
        started = time.monotonic()
        deadline = started + timeout_s
        if not self.config.inline_capture:
            with torch.inference_mode():
                for kind in self.mode.kinds:
                    for size in self._tables[kind].sizes:
                        if time.monotonic() > deadline:
                            break
                        self.steps[kind].run_scratch(size)
                        report.kernels_warmed += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        report.kernels_s = time.monotonic() - started
        while time.monotonic() < deadline:
            if self._warming is None and not self.warm_step():
                break
            key = self._warming
            if not self._poll_until(lambda: self._warming is None, max(0.0, deadline - time.monotonic())):
                break  # still capturing: it commits in the background once serving
            if key is not None and self._buckets[key].graph is not None:
                report.captured.append(str(key))
        report.left = [str(k) for k in ([self._warming] if self._warming is not None else []) + list(self._warm_queue)]
        report.seconds = time.monotonic() - started
        return report

    # ---- operator operations ------------------------------------------------------------------

    def _check_ops(self, sizes: Iterable[int], kind: CudaGraphMode | str) -> tuple[list[int], CudaGraphMode]:
        if not self.graphs_enabled:
            raise GraphsUnavailableError(self.disabled_reason or "disabled")
        kind = CudaGraphMode.parse(kind)
        if kind not in self.mode.kinds:
            kinds = ", ".join(k.value for k in self.mode.kinds)
            raise ValueError(f"mode {self.mode.value} keeps no {kind.value} graphs; kinds here: {kinds}")
        sizes = list(sizes)
        self._tables[kind].check_allowed(sizes)
        return sizes, kind

    def capture_async(self, sizes: Iterable[int], kind: CudaGraphMode | str = FULL) -> Future:
        """Capture the given allowed sizes through the capture thread (ignores failure back-off; may
        evict unprotected graphs). The future gets {size: OpResult} once every capture is committed."""
        sizes, kind = self._check_ops(sizes, kind)
        results = _Results(sizes)
        keys = {s: BatchDescriptor(kind, s) for s in sizes}
        for s, key in keys.items():
            b = self._buckets[key]
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

    def evict_async(self, sizes: Iterable[int], kind: CudaGraphMode | str = FULL) -> Future:
        """Evict the given sizes; the future gets {size: OpResult} once the device got the memory back."""
        sizes, kind = self._check_ops(sizes, kind)
        results = _Results(sizes)
        for s in sizes:
            key = BatchDescriptor(kind, s)
            if self._buckets[key].graph is None:
                results.set(s, OpResult(OpOutcome.NOT_CAPTURED, f"{key} is not captured"))
            else:
                self.residency.evict(key, "operator", lambda r, s=s: results.set(s, r))
        return results.future

    def set_budget_async(self, value: str | float) -> Future:
        """Set the budget (bytes, fraction or string) and evict by policy until the graphs fit it. The
        future gets {key: OpResult} of this cache's evictions; a cache sharing the budget gets it too,
        and its evictions are in `set_shared_budget_async`'s second future."""
        return self.set_shared_budget_async(value)[0]

    def set_shared_budget_async(self, value: str | float) -> list[Future]:
        """Set the one budget of this cache and of the cache sharing it (share_budget_with), and evict
        by policy until the graphs of both fit it together: the victims are chosen among both caches'
        graphs, the lowest recent replays per byte first, whichever cache holds them. Kept graphs
        (`Residency.kept`) stay, over the budget if it is below them (logged). One future per cache,
        this one's first, each of {key: OpResult} with that cache's evictions."""
        caches = [self] if self.sharing is None else [self, self.sharing]
        total = self.backend.total_memory() if self.backend is not None else 0
        budget = resolve_budget(value, total)
        for cache in caches:
            with cache._lock:
                cache.residency.budget_bytes = budget
        over = sum(cache.used_bytes for cache in caches) - budget
        victims: list[tuple[GraphCache, BatchDescriptor]] = []
        if over > 0:
            now = self._clock()
            candidates = [dataclasses.replace(c, size=(cache, c.size))
                          for cache in caches for c in cache.residency.candidates(set(), now)]
            # None: even all of them free too little (bytes still being released): evict them all.
            victims = choose_victims(candidates, over) or [c.size for c in candidates]
            kept = [(str(k), b.graph.nbytes) for cache in caches for k, b in cache.residency.buckets.items()
                    if k in cache.residency.kept and b.graph is not None]
            kept_bytes = sum(nbytes for _, nbytes in kept)
            if kept_bytes > budget:
                log.warning("graph_budget_below_kept_graphs", budget_bytes=budget,
                            kept=[name for name, _ in kept], kept_bytes=kept_bytes,
                            reason="a lone row's graph is kept (it may not pad into a larger one); "
                                   "graphctl evict removes it")
        return [cache._evict_to_fit([k for owner, k in victims if owner is cache], budget) for cache in caches]

    def _evict_to_fit(self, victims: list[BatchDescriptor], budget: int) -> Future:
        results = _Results(victims)
        for k in victims:
            self.residency.evict(k, "budget", lambda r, k=k: results.set(
                k, OpResult(OpOutcome.EVICTED, f"evicted {k} to fit {budget} bytes", r.bytes)))
        return results.future

    def capture(self, sizes: Iterable[int], kind: CudaGraphMode | str = FULL) -> dict[int, OpResult]:
        return self._wait(self.capture_async(sizes, kind))

    def evict(self, sizes: Iterable[int], kind: CudaGraphMode | str = FULL) -> dict[int, OpResult]:
        return self._wait(self.evict_async(sizes, kind))

    def set_budget(self, value: str | float) -> dict[BatchDescriptor, OpResult]:
        return self._wait(self.set_budget_async(value))

    def _wait(self, future: Future) -> dict[int, OpResult]:
        """Blocking form for the thread that owns the cache: polls until the future is done."""
        self._poll_until(future.done)
        return future.result()

    def _poll_until(self, done: Callable[[], bool], timeout: float = math.inf) -> bool:
        """Commit finished jobs until `done()`; False if `timeout` seconds passed first. Raises if the
        capture thread has died (waiting on it would wait forever)."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.poll() == 0:
                if time.monotonic() > deadline:
                    return False
                self._check_capturer()
                time.sleep(0.001)
        return True

    def _check_capturer(self) -> None:
        capturer = self.residency.capturer
        if capturer is not None and not capturer.alive:
            raise RuntimeError("the graph capture thread has stopped")

    def reset_stats(self) -> None:
        """Zero all counters, since start and persisted; measurements of live graphs are kept."""
        self.stats.reset(
            {k: (b.graph.nbytes, b.graph.capture_ms) for k, b in self._buckets.items() if b.graph is not None}
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
                "captured": [str(k) for k, b in sorted(self._buckets.items()) if b.graph is not None],
                "used_bytes": self.used_bytes,
            },
        )

    def save(self) -> bool:
        """Write the cumulative stats now and wait for it (bounded); never raises. False when they
        could not be written (True without a stats file: nothing to save)."""
        return self.stats.store is None or self.stats.save(self._clock())

    def close(self, timeout: float = 30.0) -> bool:
        """Save the stats, stop the capture thread (queued captures are not started) and release every
        graph; returns save()'s result. A capture that does not end within `timeout` leaves its graphs
        to process exit."""
        saved = self.save()
        self._warm_queue.clear()
        if not self.residency.close(timeout):
            log.warning("graph_capture_thread_hung", timeout_s=timeout)
        return saved

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            persisted = self.stats.persisted()
            session = self.stats.session
            entries = [
                b.entry(session.buckets.get(k), persisted.buckets.get(k), k in self.residency.kept)
                for k, b in sorted(self._buckets.items())
            ]
            return CacheSnapshot(
                mode=self.mode.value,
                configured_mode=self.config.mode.value,
                disabled_reason=self.disabled_reason,
                device=str(self.device),
                budget_bytes=self.budget_bytes,
                used_bytes=self.used_bytes,
                capture_sizes=self.config.sizes,
                piecewise_sizes=self._tables[PIECEWISE].sizes if PIECEWISE in self._tables else (),
                max_batch=self.config.max_batch,
                buckets=tuple(entries),
                requested_since_start={k: c.requests for k, c in sorted(session.requested.items())},
                requested_persisted={k: c.requests for k, c in sorted(persisted.requested.items())},
                requested_detail=tuple(
                    RequestedSize(k.padded_size, k.mode.value, c.requests, c.replays, dict(c.eager))
                    for k, c in sorted(session.requested.items())
                ),
                warm_queue=tuple(self._warm_queue),
                stats_file=str(self.stats.store.path) if self.stats.store else None,
                last_save_time=self.stats.last_save_time,
            )


def _cover(sizes: tuple[int, ...]) -> list[int]:
    """Sizes from `sizes` (sorted) that every size pads into at twice itself or less (where the list
    has a size in each such range): the largest, then the smallest at least half of it, and so on
    down to the smallest."""
    out = [sizes[-1]]
    while below := [s for s in sizes if s < out[-1]]:
        half = [s for s in below if 2 * s >= out[-1]]
        out.append(half[0] if half else below[-1])
    return out


@dataclass
class StartupReport:
    """What `prepare` did before serving."""

    kernels_warmed: int = 0  # sizes run once eagerly on scratch inputs
    kernels_s: float = 0.0
    captured: list[str] = dataclasses.field(default_factory=list)  # graphs captured before serving
    left: list[str] = dataclasses.field(default_factory=list)  # warm-start sizes left to the background
    seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        return bool(self.left)


@dataclass(slots=True)
class StepPlan:
    """How one step runs: `target`'s graph replays it, or (None) it runs eagerly for `reason`."""

    requested: BatchDescriptor  # kind and real size n
    bucket: BatchDescriptor | None  # the size n pads to; None above the largest
    target: BatchDescriptor | None  # the graph replayed (the bucket's or a larger captured one)
    reason: str  # why eager ("" when replayed)
    now: float


class _Results:
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
