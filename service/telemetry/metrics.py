"""The gRPC process's /metrics: rejections from the servicer, and on each scrape the engine
process's metrics and the graph cache's counters, both read from the engine process.

Nothing here runs per token: the engine's metrics are observed in the engine process
(engine_metrics.EngineMetrics) and read when Prometheus scrapes. The collectors call their sources
on the HTTP server's thread, never on the event loop; a source that fails or does not answer in
time costs the scrape its families, not the scrape itself.

Each `Metrics` owns its registry (tests run several servers in one process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from cache_manager import CacheSnapshot

log = structlog.get_logger("graphserve.metrics")

GraphSource = Callable[[], "CacheSnapshot | None"]
EngineSource = Callable[[], list[Metric]]


class EngineMetricsCollector(Collector):
    """Exports the engine's metric families (engine_metrics.EngineMetrics) as the source returns them."""

    def __init__(self) -> None:
        self.source: EngineSource | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        try:
            families = self.source()
        except Exception:
            log.warning("engine_metrics_failed", exc_info=True)
            return
        yield from families


class GraphCacheCollector(Collector):
    """Exports the graph cache's since-start counters from the snapshot the source returns: the base
    graphs' as graphserve_graph_*, the LoRA graphs' (steps with adapter rows; only when the cache
    has them) as the same families under graphserve_lora_graph_*. The memory gauges split what
    counts against the one budget: the LoRA graphs' bytes there, everything else here.

    Eager fallbacks come from the requested-size table only: the manager counts every eager step
    there, and additionally in its bucket's counters when the size maps to a bucket, so adding the
    bucket table too would count those steps twice.
    """

    def __init__(self) -> None:
        self.source: GraphSource | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        yield from _families("graphserve_graph", snap, lora=False)
        if any(b.lora for b in snap.buckets):
            yield from _families("graphserve_lora_graph", snap, lora=True)

    def _snapshot(self) -> CacheSnapshot | None:
        if self.source is None:
            return None
        try:
            return self.source()
        except Exception:
            log.warning("graph_snapshot_failed", exc_info=True)
            return None


def _families(prefix: str, snap: CacheSnapshot, lora: bool) -> Iterator[Metric]:
    """The families of the base graphs or of the LoRA graphs (`lora`) of one snapshot."""
    # kind: "full" (bucket = rows of a uniform-decode step) or "piecewise" (bucket = tokens of any step)
    replays = CounterMetricFamily(f"{prefix}_replays", "Steps served by replaying a captured graph.",
                                  labels=["kind", "bucket"])
    padded = CounterMetricFamily(f"{prefix}_padded_rows", "Padding rows (or tokens) run by replays.",
                                 labels=["kind", "bucket"])
    capture_s = GaugeMetricFamily(f"{prefix}_capture_seconds",
                                  "Duration of the latest capture of each bucket.", labels=["kind", "bucket"])
    bucket_bytes = GaugeMetricFamily(f"{prefix}_bucket_bytes",
                                     "Measured memory of each bucket's latest capture.", labels=["kind", "bucket"])
    states: dict[str, int] = {}
    captures = evictions = failures = 0
    for b in snap.buckets:
        if b.lora != lora:
            continue
        label = [b.kind, str(b.size)]
        c = b.since_start
        replays.add_metric(label, c.replays)
        padded.add_metric(label, c.padded_rows)
        if b.capture_ms > 0:
            capture_s.add_metric(label, b.capture_ms / 1000.0)
        if b.bytes > 0:
            bucket_bytes.add_metric(label, b.bytes)
        captures += c.captures
        evictions += c.evictions
        failures += c.failures
        state = getattr(b.state, "value", str(b.state))
        states[state] = states.get(state, 0) + 1
    eager: dict[tuple[str, str], int] = {}
    for r in snap.requested_detail:
        if r.lora != lora:
            continue
        for reason, count in r.eager_fallbacks.items():
            eager[r.kind, reason] = eager.get((r.kind, reason), 0) + count
    fallbacks = CounterMetricFamily(f"{prefix}_eager_fallbacks",
                                    "Steps run eagerly, by graph kind and reason.", labels=["kind", "reason"])
    for (kind, reason), count in sorted(eager.items()):
        fallbacks.add_metric([kind, reason], count)
    buckets = GaugeMetricFamily(f"{prefix}_buckets", "Allowed graph sizes by state.", labels=["state"])
    for state, count in sorted(states.items()):
        buckets.add_metric([state], count)
    yield replays
    yield padded
    yield fallbacks
    yield CounterMetricFamily(f"{prefix}_captures", "Graphs captured.", value=captures)
    yield CounterMetricFamily(f"{prefix}_evictions", "Graphs evicted.", value=evictions)
    yield CounterMetricFamily(f"{prefix}_capture_failures", "Captures that failed.", value=failures)
    held = snap.lora_used_bytes if lora else snap.used_bytes - snap.lora_used_bytes
    yield GaugeMetricFamily(f"{prefix}_memory_bytes", "Memory held by captured graphs.", value=held)
    yield GaugeMetricFamily(f"{prefix}_memory_budget_bytes", "Memory budget for captured graphs.",
                            value=snap.budget_bytes)
    yield capture_s
    yield bucket_bytes
    yield buckets


class Metrics:
    """The gRPC process's metrics registry and its /metrics server."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # process-wide: no _created samples (engine_metrics.EngineMetrics says why)
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.engine = EngineMetricsCollector()  # first: the families keep their order in the scrape
        r.register(self.engine)
        self.rejections = Counter("graphserve_requests_rejected", "Requests refused before the engine, by reason.",
                                  ["reason"], registry=r)
        self.auth_failures = Counter("graphserve_admin_auth_failures",
                                     "Admin calls refused for a missing or wrong token.", registry=r)
        self.model_info = Gauge("graphserve_model_info", "The served model (1): its name and architecture.",
                                ["model", "architecture"], registry=r)
        self.graphs = GraphCacheCollector()
        r.register(self.graphs)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ---- servicer (event loop) -----------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def undecodable(self) -> None:
        self.rejected("undecodable")

    def auth_failed(self) -> None:
        self.auth_failures.inc()

    def set_model(self, model: str, architecture: str) -> None:
        """The served model, once it has loaded: graphserve_model_info{model, architecture} 1."""
        self.model_info.labels(model, architecture).set(1)

    # ---- sources read on each scrape (HTTP thread) ---------------------------------------------

    def set_engine_source(self, source: EngineSource) -> None:
        """`source` returns the engine's metric families, e.g. EngineMetrics.families or a remote read of them."""
        self.engine.source = source

    def set_graph_source(self, source: GraphSource) -> None:
        """`source` returns a recent graph-cache snapshot or None."""
        self.graphs.source = source

    # ---- HTTP /metrics -------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 picks a free port); returns the bound port."""
        if self._server is not None:
            raise RuntimeError("the metrics server is already running")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_port
        log.info("metrics_listening", address=f"{host}:{bound}")
        return bound

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = self._thread = None
