"""Plain-data snapshot of the cache's state, for the admin RPC (which converts it to protobuf)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cache_manager.sizes import BatchDescriptor
from cache_manager.stats import Counters


class BucketState(str, enum.Enum):
    CAPTURED = "captured"
    NOT_CAPTURED = "not_captured"
    CAPTURING = "capturing"
    EVICTED = "evicted"
    FAILED = "failed"


@dataclass(frozen=True)
class BucketCounters:
    replays: int = 0
    padded_rows: int = 0
    eager_fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count
    failures: int = 0
    captures: int = 0
    evictions: int = 0

    @classmethod
    def of(cls, c: Counters) -> BucketCounters:
        return cls(c.replays, c.padded_rows, dict(c.eager), c.failures, c.captures, c.evictions)


@dataclass(frozen=True)
class BucketEntry:
    """One allowed size of one graph kind. `since_start` counts this process; `persisted` includes
    earlier runs."""

    size: int
    kind: str  # "full" (rows of a uniform-decode step) or "piecewise" (tokens of any step)
    state: BucketState
    bytes: int  # measured at the latest capture (0 if never measured)
    capture_ms: float
    last_use: float | None  # wall time
    retry_at: float | None  # wall time when a FAILED bucket may be captured again
    since_start: BucketCounters
    persisted: BucketCounters
    kept: bool = False  # no eviction by traffic or budget, only an operator's (GraphCacheConfig.pad_single_rows)


@dataclass(frozen=True)
class RequestedSize:
    """One requested (unpadded) size: how it was served."""

    size: int
    kind: str
    requests: int
    replays: int
    eager_fallbacks: dict[str, int]


@dataclass(frozen=True)
class CacheSnapshot:
    mode: str  # effective mode: "none" on CPU even if another was configured
    configured_mode: str
    disabled_reason: str | None
    device: str
    budget_bytes: int
    used_bytes: int
    capture_sizes: tuple[int, ...]
    max_batch: int
    buckets: tuple[BucketEntry, ...]
    requested_since_start: dict[BatchDescriptor, int]  # histogram: (kind, unpadded size) -> requests
    requested_persisted: dict[BatchDescriptor, int]
    requested_detail: tuple[RequestedSize, ...]  # since start
    warm_queue: tuple[BatchDescriptor, ...]
    stats_file: str | None
    last_save_time: float | None
    piecewise_sizes: tuple[int, ...] = ()  # token counts of the piecewise graphs (empty: none)
