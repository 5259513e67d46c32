"""The warm start: the graphs captured before serving and in its background, from the stats of earlier runs."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from cache_manager.ops import OpOutcome, OpResult
from cache_manager.ordering import BesideServing
from cache_manager.recorder import StatsRecorder
from cache_manager.residency import Residency
from cache_manager.sizes import BatchDescriptor, CudaGraphMode, GraphFamily, PaddingTable
from cache_manager.step import DecodeStep

log = structlog.get_logger("cache_manager")


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


class WarmStart:
    """A queue of graphs to capture within the budget, evicting nothing, one at a time (so each
    estimate sees the previous measurement): the stats' hot buckets, most replayed first (a warm
    start), else the largest size of each family, which every step of it can pad into (a cold start;
    with inline capture a cover of sizes, so that a step pads to at most twice its size where the
    allowed sizes allow). Without `pad_single_rows` every family's size 1 comes second (`lone_rows`):
    such a step runs eagerly until its own graph exists. Engine thread only.
    """

    def __init__(self, residency: Residency, stats: StatsRecorder, tables: dict[CudaGraphMode, PaddingTable],
                 families: list[GraphFamily], lone_rows: list[BatchDescriptor], enabled: bool, inline: bool,
                 order: BesideServing, clock: Callable[[], float]) -> None:
        self.residency = residency
        self.tables = tables
        self._clock = clock
        self.families = families
        self.order = order
        self.queue: deque[BatchDescriptor] = deque()
        self.warming: BatchDescriptor | None = None  # the warm-start capture in flight
        if not enabled:
            return
        self.queue.extend(k for k in stats.hot_buckets() if k in residency.buckets)
        if not self.queue:
            # Cold: the largest size of each family first, so that while traffic asks for its own
            # sizes, their steps pad into a graph instead of running eagerly (an eager step beside a
            # capture shares the interpreter with it and slows most). Base graphs before LoRA ones.
            for group in sorted({(f.lora, f.query_tokens) for f in families}):
                covers = {f: _cover(tables[f.mode].sizes) if inline else [tables[f.mode].largest]
                          for f in families if (f.lora, f.query_tokens) == group}
                for i in range(max(map(len, covers.values()), default=0)):
                    self.queue.extend(f.at(c[i]) for f, c in covers.items() if i < len(c))
        if lone_rows:  # eager until captured (under tensor parallelism until the engine is idle)
            rest = [d for d in self.queue if d not in lone_rows]
            self.queue = deque(rest[:1] + lone_rows + rest[1:])

    def step(self) -> bool:
        """Submit at most one queued graph, within budget (no eviction); True if one was submitted."""
        if self.residency.capturer is None or self.warming is not None or self.order.engine_busy():
            return False  # (busy: a deferred capture would hold its budget until the engine is idle)
        now = self._clock()
        while self.queue:
            key = self.queue.popleft()
            b = self.residency.buckets[key]
            if b.graph is not None or b.in_backoff(now) or key in self.residency.pending:
                continue
            outcome, message = self.residency.request_capture(key, set(), evict="none")
            if outcome is OpOutcome.OVER_BUDGET:
                log.info("graph_warm_start_skipped", bucket=str(key), reason=message)
                continue
            self.warming = key
            return True
        return False

    def committed(self, key: BatchDescriptor, result: OpResult) -> None:
        """A capture was committed (or dropped): the next warm capture may go."""
        if key == self.warming:
            self.warming = None
            if result.outcome is OpOutcome.OVER_BUDGET:
                log.info("graph_warm_start_skipped", bucket=str(key), reason=result.message)

    def prepare(self, timeout_s: float, steps: dict[GraphFamily, DecodeStep], device: torch.device, inline: bool,
                poll_until: Callable[[Callable[[], bool], float], bool]) -> StartupReport:
        """Before serving, on the thread that will own the cache: make sure no early step waits on
        a kernel compile or a capture. First every allowed size of each family runs once on scratch
        inputs (Triton compiles its specializations, cuBLAS picks its kernels: work that a first step
        of a new size, or a capture beside it, used to do while streams waited); then the queue is
        captured until it is empty or `timeout_s` has passed. Whatever is left is captured in the
        background once serving.

        With inline capture (tensor parallelism) the eager pass is skipped: its collectives would
        need the other ranks to run the same steps, which only captures are mirrored for."""
        report = StartupReport()
        if self.residency.capturer is None or timeout_s <= 0:
            return report
        started = time.monotonic()
        deadline = started + timeout_s
        if not inline:
            with torch.inference_mode():
                for family in self.families:
                    for size in self.tables[family.mode].sizes:
                        if time.monotonic() > deadline:
                            break
                        steps[family].run_scratch(size)
                        report.kernels_warmed += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        report.kernels_s = time.monotonic() - started
        while time.monotonic() < deadline:
            if self.warming is None and not self.step():
                break
            key = self.warming
            if not poll_until(lambda: self.warming is None, max(0.0, deadline - time.monotonic())):
                break  # still capturing: it commits in the background once serving
            if key is not None and self.residency.buckets[key].graph is not None:
                report.captured.append(str(key))
        report.left = [str(k) for k in ([self.warming] if self.warming is not None else []) + list(self.queue)]
        report.seconds = time.monotonic() - started
        return report


def _cover(sizes: tuple[int, ...]) -> list[int]:
    """Sizes from `sizes` (sorted) that every size pads into at twice itself or less (where the list
    has a size in each such range): the largest, then the smallest at least half of it, and so on
    down to the smallest."""
    out = [sizes[-1]]
    while below := [s for s in sizes if s < out[-1]]:
        half = [s for s in below if 2 * s >= out[-1]]
        out.append(half[0] if half else below[-1])
    return out
