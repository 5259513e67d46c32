"""Typed configuration of the graph cache, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cache_manager.budget import parse_memory_budget
from cache_manager.sizes import CudaGraphMode, default_capture_sizes, default_piecewise_sizes, validate_capture_sizes

DEFAULT_BUDGET_FRACTION = 0.1


@dataclass(frozen=True)
class GraphCacheConfig:
    """Graph cache settings.

    memory_budget: bytes (int), a fraction of device memory (float in (0, 1]) or a string accepted
    by `parse_memory_budget`; None means 0.1 of the device's total memory (about 14 GiB on an H200,
    room for dozens of decode graphs of a 1B model while leaving the KV cache its share).
    capture_sizes: the allowed sizes, as token counts (a uniform-decode batch of n rows is n tokens).
    FULL graphs use those up to max_batch, PIECEWISE graphs those up to max_tokens. None means
    `default_capture_sizes(max_batch)` for FULL and `default_piecewise_sizes(max_tokens)` for PIECEWISE.
    max_tokens: the largest step in tokens (0: no piecewise graphs).
    inline_capture: capture and release on the engine thread at step boundaries instead of on the
    capture thread (tensor parallelism: every rank must run them at the same point; capturer.py).
    pad_single_rows: while a one-row (one-token) step's own graph is captured, it may replay a larger
    captured graph. False for a model whose lone row is computed otherwise than rows in company (FP8
    weights: the batch-1 GEMV keeps the activation in bf16, the GEMMs quantize it), so that a lone
    stream's tokens do not depend on which graphs exist: such a step runs eagerly meanwhile, the
    start captures size 1 second, and only an operator's explicit eviction removes size 1's graphs.
    The sizes must then hold 1 (else a lone row would run in a larger graph once captured, eagerly
    before).
    """

    mode: CudaGraphMode | str
    capture_sizes: tuple[int, ...] | None
    max_batch: int
    memory_budget: str | int | float | None = None
    stats_file: Path | None = None
    warm_start: bool = True
    save_interval_s: float = 5.0
    debug_check_addresses: bool = False
    failure_backoff_s: float = 60.0
    max_failure_backoff_s: float = 3600.0
    heat_half_life_s: float = 300.0  # decay of "recent replays" in the eviction score
    replay_log_interval_s: float = 60.0  # period of the graph_replay_totals log event
    max_tokens: int = 0
    inline_capture: bool = False
    pad_single_rows: bool = True
    piecewise_sizes: tuple[int, ...] = field(default=(), init=False)  # derived: PIECEWISE token counts

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", CudaGraphMode.parse(self.mode))
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.capture_sizes is None:
            full = default_capture_sizes(self.max_batch)
            piecewise = default_piecewise_sizes(self.max_tokens) if self.max_tokens else ()
        else:
            given = validate_capture_sizes(tuple(self.capture_sizes), max(self.max_batch, self.max_tokens))
            full = tuple(s for s in given if s <= self.max_batch)
            piecewise = tuple(s for s in given if s <= self.max_tokens)
            if not full:
                raise ValueError(f"capture sizes {list(given)} hold none for a decode batch (<= {self.max_batch})")
            if not self.pad_single_rows and given[0] != 1:
                raise ValueError(f"capture sizes {list(given)} lack 1, which a one-row step that may not pad "
                                 "(pad_single_rows off) needs")
        object.__setattr__(self, "capture_sizes", full)
        object.__setattr__(self, "piecewise_sizes", piecewise)
        if isinstance(self.memory_budget, str):
            parse_memory_budget(self.memory_budget)  # raises with a clear message
        elif self.memory_budget is not None and (
            isinstance(self.memory_budget, bool) or self.memory_budget <= 0
        ):
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget!r}")
        if self.stats_file is not None:
            object.__setattr__(self, "stats_file", Path(self.stats_file))
        for name in ("save_interval_s", "failure_backoff_s", "max_failure_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The FULL graphs' batch sizes."""
        assert self.capture_sizes is not None
        return self.capture_sizes
