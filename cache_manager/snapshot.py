"""Plain-data snapshot of the cache's state, for the admin RPC (which converts it to protobuf)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from cache_manager.sizes import PIECEWISE, BatchDescriptor, family_order
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
    """One allowed size of one graph family (kind and LoRA flag). `since_start` counts this process;
    `persisted` includes earlier runs."""

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
    lora: bool = False  # the graph of steps with adapter rows (the descriptor's LoRA flag)


@dataclass(frozen=True)
class RequestedSize:
    """One requested (unpadded) size: how it was served."""

    size: int
    kind: str
    requests: int
    replays: int
    eager_fallbacks: dict[str, int]
    lora: bool = False


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
    lora_used_bytes: int = 0  # of used_bytes: what the LoRA graphs hold


class _Cache(Protocol):
    """What a snapshot reads of the cache (manager.GraphCache; named here, not imported: the cache
    imports this module)."""

    stats: Any
    residency: Any
    mode: Any
    config: Any
    disabled_reason: str | None
    device: Any
    budget_bytes: int
    used_bytes: int
    tables: dict
    warm: Any


def take_snapshot(cache: _Cache) -> CacheSnapshot:
    """The cache's state (the caller holds the cache's lock): every family's buckets, base ones first."""
    persisted, session = cache.stats.persisted(), cache.stats.session
    residency = cache.residency
    buckets = sorted(residency.buckets.items(), key=lambda kb: (family_order(kb[0].family), kb[0]))
    return CacheSnapshot(
        mode=cache.mode.value,
        configured_mode=cache.config.mode.value,
        disabled_reason=cache.disabled_reason,
        device=str(cache.device),
        budget_bytes=cache.budget_bytes,
        used_bytes=cache.used_bytes,
        lora_used_bytes=sum(b.graph.nbytes for k, b in buckets if k.lora and b.graph is not None),
        capture_sizes=cache.config.sizes,
        piecewise_sizes=cache.tables[PIECEWISE].sizes if PIECEWISE in cache.tables else (),
        max_batch=cache.config.max_batch,
        buckets=tuple(b.entry(session.buckets.get(k), persisted.buckets.get(k), k in residency.kept) for k, b in buckets),
        requested_since_start={k: c.requests for k, c in sorted(session.requested.items())},
        requested_persisted={k: c.requests for k, c in sorted(persisted.requested.items())},
        requested_detail=tuple(
            RequestedSize(k.padded_size, k.mode.value, c.requests, c.replays, dict(c.eager), k.lora)
            for k, c in sorted(session.requested.items())
        ),
        warm_queue=tuple(cache.warm.queue),
        stats_file=str(cache.stats.store.path) if cache.stats.store else None,
        last_save_time=cache.stats.last_save_time,
    )
