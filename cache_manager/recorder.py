"""Counting every decision of the cache, and persisting the counts on a schedule."""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from cache_manager.sizes import BatchDescriptor, GraphFamily
from cache_manager.stats import StatsTables
from cache_manager.store import StatsStore

log = structlog.get_logger("cache_manager")

# At shutdown, how long the final save may take before the process exits without it.
SHUTDOWN_SAVE_TIMEOUT_S = 5.0


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
        self.save_failures = 0  # saves that failed (or never finished), for metrics
        self.save_stalled = False  # a save has been running for longer than the save interval
        self._saving: threading.Thread | None = None
        self._save_started = 0.0
        self._last_ok = False
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

    def measured_bytes(self, family: GraphFamily) -> dict[int, int]:
        """Latest measured bytes per bucket size of one graph family, this run's over an earlier run's."""
        out = {k.padded_size: c.bytes for k, c in self.loaded.buckets.items() if c.bytes and k.family == family}
        out.update({k.padded_size: c.bytes for k, c in self.session.buckets.items() if c.bytes and k.family == family})
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
            self.save_in_background(now)

    def save_in_background(self, now: float) -> None:
        """Take the counters now and write them on a save thread, never on the caller's (the engine
        thread): a slow or hung stats volume must not stop generation. While a save is still running
        the next one is skipped; one that runs past the save interval is logged once as stalled."""
        if self.store is None:
            return
        self._last_save_attempt = now
        running = self._saving
        if running is not None and running.is_alive():
            if not self.save_stalled and now - self._save_started > self.save_interval_s:
                self.save_stalled = True
                log.warning("graph_stats_save_stalled", path=str(self.store.path),
                            seconds=round(now - self._save_started, 1))
            return
        self._saving = self._start_save(now)

    def join(self, timeout: float) -> bool:
        """Wait for a background save to finish; False if one is still running."""
        running = self._saving
        if running is not None:
            running.join(timeout)
        return running is None or not running.is_alive()

    def save(self, now: float, timeout: float = SHUTDOWN_SAVE_TIMEOUT_S) -> bool:
        """Write the cumulative counters now and wait up to `timeout` (at shutdown); False (and a
        warning) on failure, or when the write did not finish in time."""
        if self.store is None:
            return False
        self._last_save_attempt = now
        if not self.join(timeout):
            log.warning("graph_stats_save_failed", path=str(self.store.path), error="an earlier save still hangs")
            return False
        self._saving = thread = self._start_save(now)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("graph_stats_save_failed", path=str(self.store.path), error=f"not done within {timeout} s")
            return False
        return self._last_ok

    def _start_save(self, now: float) -> threading.Thread:
        with self._lock:
            tables = self.loaded.merged(self.session)
            self._dirty = False  # changes from here on make it dirty again
        self._save_started = now
        thread = threading.Thread(target=self._write, args=(tables, now), name="graph-stats-save", daemon=True)
        thread.start()
        return thread

    def _write(self, tables: StatsTables, now: float) -> None:
        ok = self.store.save(tables)  # never raises; warns on failure
        with self._lock:
            self._last_ok = ok
            self.save_stalled = False
            if ok:
                self.last_save_time = now
            else:
                self.save_failures += 1
                self._dirty = True
