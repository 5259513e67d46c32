"""Prometheus metrics: request latencies and token counts from the engine, rejections from the
servicer, and the graph cache's counters read from its latest snapshot on each scrape.

Each `Metrics` owns its registry (tests run several servers in one process). The engine calls the
`on_*` hooks on its thread; they only touch prometheus-client objects (thread-safe) and a dict that
only the engine thread uses. Graph metrics are not pushed: a collector calls the snapshot source
when Prometheus scrapes, on the HTTP server's thread, so the source must be cheap and thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.engine.request import Finish, FinishReason
from service.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from cache_manager import CacheSnapshot

log = structlog.get_logger("graphserve.metrics")

# Seconds. TTFT spans a warm batch-1 prefill (ms) to a long prompt behind a full queue (tens of s).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# A replayed graph step is ~1-10 ms on a GPU; eager CPU steps and stalls reach seconds.
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
               0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
                    60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 20.0, 40.0, 80.0, 160.0)

GraphSource = Callable[[], "CacheSnapshot | None"]


class GraphCacheCollector(Collector):
    """Exports the graph cache's since-start counters from the snapshot the source returns.

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
        replays = CounterMetricFamily("graphserve_graph_replays", "Decode steps served by replaying a captured graph.",
                                      labels=["bucket"])
        padded = CounterMetricFamily("graphserve_graph_padded_rows", "Padding rows run by replays (wasted rows).",
                                     labels=["bucket"])
        capture_s = GaugeMetricFamily("graphserve_graph_capture_seconds",
                                      "Duration of the latest capture of each bucket.", labels=["bucket"])
        bucket_bytes = GaugeMetricFamily("graphserve_graph_bucket_bytes",
                                         "Measured memory of each bucket's latest capture.", labels=["bucket"])
        states: dict[str, int] = {}
        captures = evictions = failures = 0
        for b in snap.buckets:
            label = [str(b.size)]
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
        eager: dict[str, int] = {}
        for r in snap.requested_detail:
            for reason, count in r.eager_fallbacks.items():
                eager[reason] = eager.get(reason, 0) + count
        fallbacks = CounterMetricFamily("graphserve_graph_eager_fallbacks",
                                        "Decode steps run eagerly, by reason.", labels=["reason"])
        for reason, count in sorted(eager.items()):
            fallbacks.add_metric([reason], count)
        buckets = GaugeMetricFamily("graphserve_graph_buckets", "Allowed graph sizes by state.", labels=["state"])
        for state, count in sorted(states.items()):
            buckets.add_metric([state], count)
        yield replays
        yield padded
        yield fallbacks
        yield CounterMetricFamily("graphserve_graph_captures", "Graphs captured.", value=captures)
        yield CounterMetricFamily("graphserve_graph_evictions", "Graphs evicted.", value=evictions)
        yield CounterMetricFamily("graphserve_graph_capture_failures", "Captures that failed.", value=failures)
        yield GaugeMetricFamily("graphserve_graph_memory_bytes", "Memory held by captured graphs.",
                                value=snap.used_bytes)
        yield GaugeMetricFamily("graphserve_graph_memory_budget_bytes", "Memory budget for captured graphs.",
                                value=snap.budget_bytes)
        yield capture_s
        yield bucket_bytes
        yield buckets

    def _snapshot(self) -> CacheSnapshot | None:
        if self.source is None:
            return None
        try:
            return self.source()
        except Exception:
            log.warning("graph_snapshot_failed", exc_info=True)
            return None


class Metrics:
    """All of graphserve's metrics, in a registry of its own; implements the EngineObserver protocol."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("graphserve_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FinishReason:
            self.requests.labels(reason.value)
        self.running = Gauge("graphserve_requests_running", "Requests holding a KV slot.", registry=r)
        self.waiting = Gauge("graphserve_requests_waiting", "Requests queued for admission.", registry=r)
        self.ttft = Histogram("graphserve_time_to_first_token_seconds", "Arrival to first completion token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("graphserve_inter_token_latency_seconds", "Time between a request's completion tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("graphserve_request_duration_seconds", "Arrival to finish (end-to-end).",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.queue_time = Histogram("graphserve_queue_time_seconds", "Arrival to admission into a KV slot.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("graphserve_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generated_tokens = Counter("graphserve_generated_tokens", "Completion tokens sampled.", registry=r)
        self.rejections = Counter("graphserve_requests_rejected", "Requests refused before the engine, by reason.",
                                  ["reason"], registry=r)
        self.graphs = GraphCacheCollector()
        r.register(self.graphs)
        # sequence key -> (time of its latest token, completion tokens seen); one thread only.
        self._last_token: dict[str, tuple[float, int]] = {}
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ---- EngineObserver (engine thread) --------------------------------------------------------

    def on_step(self, num_running: int, num_waiting: int, num_decode: int, num_prefill: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def on_tokens(self, seq: Sequence, count: int, now: float) -> None:
        """`count` new completion tokens of `seq` (already appended), sampled at `now`."""
        self._tokens(seq.key, count, now, seq.num_completion_tokens, seq.request.arrival_time, seq.num_prompt_tokens,
                     seq.scheduled_at, seq.status is SequenceStatus.FINISHED)

    def on_finish(self, seq: Sequence, finish: Finish) -> None:
        self._finish(seq.key, finish.reason.value, finish.total_seconds, finish.completion_tokens)

    def record(self, records: list[tuple]) -> None:
        """The same observations made in the engine process, as its step messages carry them:
        ("t", key, count, now, seen, arrival, prompt_tokens, scheduled_at, finished) per on_tokens,
        ("f", key, reason, total_seconds, completion_tokens) per on_finish. One thread calls this."""
        for r in records:
            if r[0] == "t":
                self._tokens(*r[1:])
            else:
                self._finish(*r[1:])

    def _tokens(self, key: str, count: int, now: float, seen: int, arrival: float, prompt_tokens: int,
                scheduled_at: float | None, finished: bool) -> None:
        self.generated_tokens.inc(count)
        previous = self._last_token.pop(key, None)
        if seen == count:  # the prefill's tokens: the request's first
            self.prompt_tokens.inc(prompt_tokens)
            self.ttft.observe(max(0.0, now - arrival))
            if scheduled_at is not None:
                self.queue_time.observe(max(0.0, scheduled_at - arrival))
        elif previous is not None:
            gap = max(0.0, now - previous[0]) / count
            for _ in range(count):
                self.itl.observe(gap)
        if not finished:
            self._last_token[key] = (now, seen)

    def _finish(self, key: str, reason: str, total_seconds: float, completion_tokens: int) -> None:
        self.requests.labels(reason).inc()
        self.duration.observe(total_seconds)
        # The engine may report the last token after the finish: keep its time until on_tokens uses it.
        entry = self._last_token.get(key)
        if entry is None or entry[1] >= completion_tokens:
            self._last_token.pop(key, None)

    # ---- servicer (event loop) -----------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    # ---- graph cache ---------------------------------------------------------------------------

    def set_graph_source(self, source: GraphSource) -> None:
        """`source` is called on every scrape (HTTP thread); it returns a recent snapshot or None."""
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

    @property
    def tracked_requests(self) -> int:
        """Requests whose latest token time is kept for inter-token latency (bounded by running)."""
        return len(self._last_token)
