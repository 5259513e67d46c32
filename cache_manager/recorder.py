"""Counting every decision of the cache, and persisting the counts on a schedule."""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from cache_manager.sizes import BatchDescriptor
from cache_manager.stats import StatsTables
from cache_manager.store import StatsStore

log = structlog.get_logger("cache_manager")


class StatsRecorder:
    """Since-start counters (`session`) on top of the counters of earlier runs (`loaded`).

    `persisted()` is their merge: what the stats file holds after the next save. `maybe_save` writes
    it when something changed and `save_interval_s` passed since the last attempt, and emits the
    periodic `graph_replay_totals` aggregate (never a log line per step). Every mutation takes the
    lock it is given, the same one the cache's snapshot takes, so reads from other threads are
    consistent.
    """

    def __init__(
        self,
        store: StatsStore | None,
        save_interval_s: float,
        replay_log_interval_s: float,
        clock: Callable[[], float],
        lock: threading.RLock,
    ) -> None:
        self.store = store
        self.save_interval_s = save_interval_s
        self.replay_log_interval_s = replay_log_interval_s
        self._lock = lock
        self.loaded = store.load() if store else StatsTables()
        self.session = StatsTables()
        self.last_save_time: float | None = None
        self._dirty = False
        self._last_save_attempt = clock()
        self._last_totals = clock()
        self._replays = 0
        self._eager = 0

    def replay(self, n: BatchDescriptor, bucket: BatchDescriptor, now: float) -> None:
        with self._lock:
            rc = self.session.req(n)
            rc.requests += 1
            rc.replays += 1
            rc.last_use = now
            bc = self.session.bucket(bucket)
            bc.replays += 1
            bc.padded_rows += bucket.padded_size - n.padded_size
            bc.last_use = now
            self._replays += 1
            self._dirty = True

    def eager(self, n: BatchDescriptor, bucket: BatchDescriptor | None, reason: str, now: float) -> None:
        with self._lock:
            rc = self.session.req(n)
            rc.requests += 1
            rc.add_eager(reason)
            rc.last_use = now
            if bucket is not None:
                bc = self.session.bucket(bucket)
                bc.add_eager(reason)
                bc.last_use = now
            self._eager += 1
            self._dirty = True

    def capture(self, bucket: BatchDescriptor, nbytes: int, ms: float) -> None:
        with self._lock:
            bc = self.session.bucket(bucket)
            bc.captures += 1
            bc.bytes = nbytes
            bc.capture_ms = ms
            self._dirty = True

    def failure(self, bucket: BatchDescriptor) -> None:
        with self._lock:
            self.session.bucket(bucket).failures += 1
            self._dirty = True

    def eviction(self, bucket: BatchDescriptor) -> None:
        with self._lock:
            self.session.bucket(bucket).evictions += 1
            self._dirty = True

    def measured_bytes(self, kind: object) -> dict[int, int]:
        """Latest measured bytes per bucket size of one graph kind, this run's over an earlier run's."""
        out = {k.padded_size: c.bytes for k, c in self.loaded.buckets.items() if c.bytes and k.mode == kind}
        out.update({k.padded_size: c.bytes for k, c in self.session.buckets.items() if c.bytes and k.mode == kind})
        return out

    def last_use(self, bucket: BatchDescriptor) -> float:
        c = self.session.buckets.get(bucket)
        return c.last_use if c is not None and c.last_use is not None else 0.0

    def hot_buckets(self) -> list[BatchDescriptor]:
        """Buckets replayed in earlier runs, most replayed first (the warm-start order)."""
        hot = [(c.replays, s) for s, c in self.loaded.buckets.items() if c.replays > 0]
        return [s for _, s in sorted(hot, key=lambda t: (-t[0], t[1]))]

    def persisted(self) -> StatsTables:
        with self._lock:
            return self.loaded.merged(self.session)

    def reset(self, live: dict[BatchDescriptor, tuple[int, float]]) -> None:
        """Zero every counter, since start and persisted; keep the measurements of live graphs."""
        with self._lock:
            self.loaded = StatsTables()
            self.session = StatsTables()
            for s, (nbytes, ms) in live.items():
                self.session.bucket(s).bytes = nbytes
                self.session.bucket(s).capture_ms = ms
            self._dirty = True

    def maybe_save(self, now: float, totals: Callable[[], dict]) -> None:
        if now - self._last_totals >= self.replay_log_interval_s:
            if self._replays or self._eager:
                log.info(
                    "graph_replay_totals",
                    replays=self._replays,
                    eager=self._eager,
                    interval_s=round(now - self._last_totals, 1),
                    **totals(),
                )
            self._replays = self._eager = 0
            self._last_totals = now
        if self._dirty and now - self._last_save_attempt >= self.save_interval_s:
            self.save(now)

    def save(self, now: float) -> bool:
        """Write the cumulative counters now; False (and a warning, from the store) on failure."""
        if self.store is None:
            return False
        self._last_save_attempt = now
        if not self.store.save(self.persisted()):
            return False
        with self._lock:
            self._dirty = False
            self.last_save_time = now
        return True
