"""Live per-bucket state: the graph (if any), lifecycle state, demand heat and failure back-off."""

from __future__ import annotations

from dataclasses import dataclass

from cache_manager.backend import CapturedGraph
from cache_manager.budget import decay
from cache_manager.sizes import BatchDescriptor
from cache_manager.snapshot import BucketCounters, BucketEntry, BucketState
from cache_manager.stats import Counters


@dataclass
class Bucket:
    """One allowed size of one graph family. Holds the only reference to its graph, so dropping it
    frees the pool."""

    key: BatchDescriptor
    state: BucketState = BucketState.NOT_CAPTURED
    graph: CapturedGraph | None = None
    addresses: tuple[int, ...] = ()  # step input addresses at capture, for the debug check
    heat: float = 0.0  # decayed count of recent requests served by or meant for this bucket
    heat_time: float = 0.0
    backoff_s: float = 0.0  # current back-off; doubles on each consecutive failure
    retry_at: float | None = None

    @property
    def size(self) -> int:
        return self.key.padded_size

    def bump(self, now: float, half_life_s: float) -> None:
        self.heat = self.heat_at(now, half_life_s) + 1.0
        self.heat_time = now

    def heat_at(self, now: float, half_life_s: float) -> float:
        return decay(self.heat, now - self.heat_time, half_life_s)

    def in_backoff(self, now: float) -> bool:
        return self.state is BucketState.FAILED and self.retry_at is not None and now < self.retry_at

    def fail(self, now: float, first_backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s = first_backoff_s if self.backoff_s == 0 else min(self.backoff_s * 2, max_backoff_s)
        self.retry_at = now + self.backoff_s
        self.state = BucketState.FAILED
        self.graph = None

    def captured(self, graph: CapturedGraph, addresses: tuple[int, ...]) -> None:
        self.graph = graph
        self.addresses = addresses
        self.state = BucketState.CAPTURED
        self.backoff_s = 0.0
        self.retry_at = None

    def entry(self, since_start: Counters | None, persisted: Counters | None, kept: bool = False) -> BucketEntry:
        """Snapshot entry; bytes and capture time are the live graph's, else the latest measured."""
        live = self.graph
        return BucketEntry(
            size=self.size,
            kind=self.key.mode.value,
            state=self.state,
            bytes=live.nbytes if live is not None else (persisted.bytes if persisted else 0),
            capture_ms=live.capture_ms if live is not None else (persisted.capture_ms if persisted else 0.0),
            last_use=persisted.last_use if persisted else None,
            retry_at=self.retry_at,
            since_start=BucketCounters.of(since_start) if since_start else BucketCounters(),
            persisted=BucketCounters.of(persisted) if persisted else BucketCounters(),
            kept=kept,
            lora=self.key.lora,
        )
