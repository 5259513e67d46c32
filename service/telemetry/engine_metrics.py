"""The engine's metrics: requests by finish reason, running and waiting gauges, latencies, tokens,
also under vLLM's names (vllm_metrics.py).

`EngineMetrics` is the engine's EngineObserver, so it lives where the engine runs: in the engine
process (service/engine_client/worker.py), or in the test's process for an in-process engine. The gRPC process
exports its families on each scrape (metrics.EngineMetricsCollector): nothing per token crosses
the pipe or runs on the gRPC process's event loop.

The hooks run on the engine thread; they only touch prometheus-client objects (thread-safe) and a
dict that only the engine thread uses, so `families` may be called from any thread.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase

from service.engine.host_tier import HostTierStats
from service.engine.request import Finish, FinishReason
from service.engine.sequence import Sequence, SequenceStatus
from service.telemetry.vllm_metrics import VllmCollector

# Seconds. TTFT spans a warm batch-1 prefill (ms) to a long prompt behind a full queue (tens of s).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# A replayed graph step is ~1-10 ms on a GPU; eager CPU steps and stalls reach seconds.
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
               0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
                    60.0, 120.0, 300.0, 600.0)
# What the engine thread spent on one graph capture (submit and commit): the target is ~0.
STALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Adapter names are chosen by operators, not clients, but there may be many: the first this many get a
# label of their own, later ones share "other" (the base model is "base").
MAX_ADAPTER_LABELS = 32
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 20.0, 40.0, 80.0, 160.0)




def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of per-request token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class StepHistogram(Histogram):
    """A Histogram that also observes one value many times in one call: a step's streams mostly saw
    the same inter-token gap, and one observation per token was the engine thread's largest metric
    cost per step. It does what Histogram.observe does, on prometheus-client's fields of it (_sum,
    _buckets, _upper_bounds): tests/unit/test_metrics.py reads the counts back from a scrape."""

    def observe_times(self, amount: float, count: int) -> None:
        """observe(amount), `count` times."""
        self._raise_if_not_observable()
        self._sum.inc(amount * count)
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(count)


def _advance(counters: tuple[Counter, ...], counts: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    """Counters that mirror counts kept since start elsewhere: each advances by what its count gained
    since `before` (the counts last exported); returns counts, the next call's `before`."""
    for counter, now, was in zip(counters, counts, before, strict=True):
        if now > was:
            counter.inc(now - was)
    return counts


class EngineMetrics:
    """The engine's metrics in a registry of their own; implements the EngineObserver protocol."""

    def __init__(self, model_name: str = "", max_seq_len: int = 2048,
                 capturing: Callable[[], bool] = lambda: False) -> None:
        """`model_name`: the served model, the model_name label of the vllm: series; `max_seq_len` bounds
        the buckets of the per-request token histograms; `capturing`: whether a graph capture is in
        flight now (asked on the engine thread)."""
        # prometheus-client's switch is process-wide: no family of this process exports _created samples
        # (a gauge series per counter and histogram that nobody queries).
        disable_created_metrics()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("graphserve_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FinishReason:
            self.requests.labels(reason.value)
        self.running = Gauge("graphserve_requests_running", "Requests holding a KV slot.", registry=r)
        self.waiting = Gauge("graphserve_requests_waiting", "Requests queued for admission.", registry=r)
        self.ttft = Histogram("graphserve_time_to_first_token_seconds", "Arrival to first completion token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = StepHistogram("graphserve_inter_token_latency_seconds", "Time between a request's completion tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("graphserve_request_duration_seconds", "Arrival to finish (end-to-end).",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.queue_time = Histogram("graphserve_queue_time_seconds", "Arrival to admission into a KV slot.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.graph_capture_stall = Histogram(
            "graphserve_graph_capture_stall_seconds",
            "Engine-thread time one graph capture cost the serving steps (the recording runs beside them).",
            buckets=STALL_BUCKETS, registry=r)
        self.step_gap = Histogram(
            "graphserve_step_gap_seconds",
            "Time between consecutive engine steps that delivered tokens while streams ran: the gap each "
            "running stream saw, whatever caused it; capturing: whether a graph capture was in flight.",
            ["capturing"], buckets=ITL_BUCKETS, registry=r)
        self.step_gap_max = Gauge("graphserve_step_gap_max_seconds",
                                  "The longest step gap since start (see graphserve_step_gap_seconds).",
                                  ["capturing"], registry=r)
        self._gap_children = {flag: (self.step_gap.labels(str(flag).lower()), self.step_gap_max.labels(str(flag).lower()))
                              for flag in (False, True)}
        self._gap_max = {False: 0.0, True: 0.0}
        self.capturing = capturing
        self.prompt_tokens = Counter("graphserve_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.request_prompt_tokens = Histogram("graphserve_request_prompt_tokens", "Prompt tokens of each finished "
                                               "sequence.", buckets=one_two_five(max_seq_len), registry=r)
        self.request_generation_tokens = Histogram("graphserve_request_generation_tokens", "Completion tokens of "
                                                   "each finished sequence.", buckets=one_two_five(max_seq_len),
                                                   registry=r)
        self.generated_tokens = Counter("graphserve_generated_tokens", "Completion tokens sampled.", registry=r)
        self.stats_save_failures = Gauge("graphserve_graph_stats_save_failures",
                                         "Stats-file saves that failed since start.", registry=r)
        self.stats_save_stalled = Gauge("graphserve_graph_stats_save_stalled",
                                        "1 while a stats-file save has run longer than the save interval.", registry=r)
        self.adapter_requests = Counter("graphserve_adapter_requests", "Finished requests by LoRA adapter "
                                        "(base: none; other: adapters beyond the label limit).", ["adapter"], registry=r)
        self.adapter_tokens = Counter("graphserve_adapter_generated_tokens", "Completion tokens by LoRA adapter.",
                                      ["adapter"], registry=r)
        self.kv_blocks = Gauge("graphserve_kv_blocks", "KV blocks by state: used (held by requests), free (held by "
                               "none; cached ones included) and cached (registered in the prefix cache, used or free).",
                               ["state"], registry=r)
        self.prefix_queries = Counter("graphserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("graphserve_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "computed again).", registry=r)
        self.host_cache_hits = Counter("graphserve_kv_host_cache_hits", "Prompt tokens copied back from the host "
                                       "tier under the prefix cache instead of computed (also counted in "
                                       "graphserve_prefix_cache_hits).", registry=r)
        self.host_cache_stored = Counter("graphserve_kv_host_cache_stored_blocks", "KV blocks the device pool "
                                         "evicted into the host tier.", registry=r)
        self.host_cache_bytes = Gauge("graphserve_kv_host_cache_bytes", "The host tier under the prefix cache: bytes "
                                      "of the blocks it holds (used) and its bound (capacity); absent when off.",
                                      ["state"], registry=r)
        self.preemptions = Counter("graphserve_preemptions", "Running requests that gave their KV blocks back (the "
                                   "pool was full) and recomputed them later.", registry=r)
        self.spec_drafts = Counter("graphserve_spec_decode_num_drafts", "Verify rows of speculative decoding "
                                   "(decodes that had a draft).", registry=r)
        self.spec_draft_tokens = Counter("graphserve_spec_decode_num_draft_tokens", "Draft tokens proposed and "
                                         "verified.", registry=r)
        self.spec_accepted_tokens = Counter("graphserve_spec_decode_num_accepted_tokens", "Draft tokens the target "
                                            "accepted (each verify row also emits one token of the target's).",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("graphserve_spec_decode_num_accepted_tokens_per_pos", "Accepted draft "
                                             "tokens by their position in the draft (0: the first).", ["position"],
                                             registry=r)
        self.spec_acceptance_length = Histogram("graphserve_spec_decode_acceptance_length", "Tokens a verify row "
                                                "emitted (accepted draft tokens + 1).",
                                                buckets=tuple(range(1, 18)), registry=r)
        self.spec_k = Histogram("graphserve_spec_decode_k", "Steps with decodes by the most draft tokens a decode "
                                "was offered (adaptive k: from measured acceptance and the batch size; 0: none, "
                                "speculation off at that batch size or no row able to take a draft).",
                                buckets=tuple(range(0, 17)), registry=r)
        self.spec_k_last = Gauge("graphserve_spec_decode_k_last", "The k of the latest step with decodes "
                                 "(graphserve_spec_decode_k).", registry=r)
        self.masks_sat_out = Counter("graphserve_constraint_masks_sat_out", "Decode rows whose grammar mask was not "
                                     "done a quarter of --constraint-mask-timeout-ms into their step: each sat the step "
                                     "out (its token came a step later).", registry=r)
        self.masks_failed = Counter("graphserve_constraint_masks_failed", "Rows whose grammar mask failed its "
                                    "request in a step: over --constraint-mask-timeout-ms of CPU, over a quarter of it "
                                    "step after step, or the grammar library giving up.", registry=r)
        self.speculating = False  # a server with speculative decoding (set by on_speculation)
        self._mask_counts = (0, 0)  # sat-out and failed mask rows as last exported
        self._block_counts = (0, 0, 0)  # prefix queries, hits, preemptions as last exported
        self._host_counts = (0, 0)  # host-tier hit tokens, stored blocks as last exported
        self._adapter_labels: set[str] = set()  # engine thread only
        self._adapter_token_counters: dict[str, MetricWrapperBase] = {}  # label -> its child: one lookup per token batch
        # sequence key -> (time of its latest token, completion tokens seen); engine thread only.
        self._last_token: dict[str, tuple[float, int]] = {}
        # Set by whoever knows them (the engine process, on each scrape); read by VllmCollector.
        self.kv_cache_usage = 0.0  # fraction of the KV cache in use, 0..1
        # (running adapters, waiting adapters, adapter slots, time.time() of the update); None: adapters off
        self.lora_requests: tuple[tuple[str, ...], tuple[str, ...], int, float] | None = None
        self.cache_config: dict[str, str] | None = None  # set once the KV cache is sized (set_cache_config)
        r.register(VllmCollector(self, model_name))

    def set_cache_config(self, block_size: int, cache_dtype: str, enable_prefix_caching: bool, num_gpu_blocks: int) -> None:
        """The KV cache as sized at start, for vllm:cache_config_info (vLLM's label names)."""
        self.cache_config = {"block_size": str(block_size), "cache_dtype": cache_dtype,
                             "enable_prefix_caching": str(enable_prefix_caching), "num_gpu_blocks": str(num_gpu_blocks)}

    def set_kv_cache_usage(self, used: int, total: int) -> None:
        """KV blocks held by requests of `total`."""
        self.kv_cache_usage = used / total if total > 0 else 0.0

    def set_host_cache(self, stats: HostTierStats, block_size: int) -> None:
        """The host tier as of now; its counts since start advance the counters."""
        self.host_cache_bytes.labels("used").set(stats.bytes_used)
        self.host_cache_bytes.labels("capacity").set(stats.num_slots * stats.bytes_per_block)
        self._host_counts = _advance((self.host_cache_hits, self.host_cache_stored),
                                     (stats.hits * block_size, stats.stored), self._host_counts)

    def set_kv_blocks(self, used: int, free: int, cached: int, prefix_queries: int, prefix_hits: int,
                      preemptions: int) -> None:
        """The block pool as of now; the counts since start advance the counters."""
        for state, value in (("used", used), ("free", free), ("cached", cached)):
            self.kv_blocks.labels(state).set(value)
        self._block_counts = _advance((self.prefix_queries, self.prefix_hits, self.preemptions),
                                      (prefix_queries, prefix_hits, preemptions), self._block_counts)

    def set_constraint_masks(self, sat_out: int, failed: int) -> None:
        """The mask filler's counts since start advance the counters."""
        self._mask_counts = _advance((self.masks_sat_out, self.masks_failed), (sat_out, failed), self._mask_counts)

    def set_lora_requests(self, running: Iterable[str], waiting: Iterable[str], max_lora: int) -> None:
        """The adapters of running requests and of waiting ones, and the adapter slots, as of now."""
        self.lora_requests = (tuple(running), tuple(waiting), max_lora, time.time())

    def set_stats_saves(self, failures: int, stalled: bool) -> None:
        self.stats_save_failures.set(failures)
        self.stats_save_stalled.set(1 if stalled else 0)

    def families(self) -> list[Metric]:
        """Every metric family with its current samples (they pickle: the gRPC process exports them)."""
        return list(self.registry.collect())

    # ---- EngineObserver (engine thread) --------------------------------------------------------

    def on_step(self, num_running: int, num_waiting: int, num_decode: int, num_prefill: int) -> None:
        self.set_queue(num_running, num_waiting)

    def on_step_gap(self, seconds: float) -> None:
        capturing = bool(self.capturing())
        histogram, maximum = self._gap_children[capturing]
        histogram.observe(seconds)
        if seconds > self._gap_max[capturing]:
            self._gap_max[capturing] = seconds
            maximum.set(seconds)

    def on_speculation(self, num_drafts: int, num_draft_tokens: int, accepted: list[int]) -> None:
        """A step's verify rows (the engine builder reports an empty one at start when speculation is on)."""
        self.speculating = True  # the vllm:spec_decode_* series are exported from now on
        self.spec_drafts.inc(num_drafts)
        self.spec_draft_tokens.inc(num_draft_tokens)
        self.spec_accepted_tokens.inc(sum(accepted))
        for n in accepted:
            self.spec_acceptance_length.observe(n + 1)
            for position in range(n):
                self.spec_accepted_per_pos.labels(str(position)).inc()

    def on_speculative_k(self, k: int) -> None:
        self.spec_k.observe(k)
        self.spec_k_last.set(k)

    def on_tokens(self, seqs: list[Sequence], now: float) -> None:
        """One new completion token of each of `seqs` (already appended), read at `now`: one step's.
        The counters move once per step and adapter, not once per sequence (this runs for every
        token of every stream on the engine thread)."""
        self.generated_tokens.inc(len(seqs))
        adapters = collections.Counter(seq.request.adapter for seq in seqs)
        for name, n in adapters.items():
            label = self.adapter_label(name)
            counter = self._adapter_token_counters.get(label)
            if counter is None:
                counter = self._adapter_token_counters[label] = self.adapter_tokens.labels(label)
            counter.inc(n)
        last = self._last_token
        gaps: dict[float, int] = {}  # the time of a sequence's previous token -> sequences: mostly one per step
        finished = SequenceStatus.FINISHED
        for seq in seqs:
            seen = len(seq.completion_token_ids)
            previous = last.get(seq.key)
            if seen == 1:  # the prefill's token: the request's first
                arrival = seq.request.arrival_time
                self.prompt_tokens.inc(seq.num_prompt_tokens)
                self.ttft.observe(max(0.0, now - arrival))
                if seq.scheduled_at is not None:
                    self.queue_time.observe(max(0.0, seq.scheduled_at - arrival))
            elif previous is not None:
                gaps[previous[0]] = gaps.get(previous[0], 0) + 1
            if seq.status is not finished:
                last[seq.key] = (now, seen)
            elif previous is not None:
                del last[seq.key]
        for previous_at, n in gaps.items():
            self.itl.observe_times(max(0.0, now - previous_at), n)

    def on_finish(self, seq: Sequence, finish: Finish) -> None:
        self.requests.labels(finish.reason.value).inc()
        self.adapter_requests.labels(self.adapter_label(seq.request.adapter)).inc()
        self.duration.observe(finish.total_seconds)
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_generation_tokens.observe(finish.completion_tokens)
        # The engine may report the last token after the finish: keep its time until on_tokens uses it.
        entry = self._last_token.get(seq.key)
        if entry is None or entry[1] >= finish.completion_tokens:
            self._last_token.pop(seq.key, None)

    def adapter_label(self, name: str) -> str:
        """The metric label of an adapter: its name, "base", or "other" past MAX_ADAPTER_LABELS names."""
        if not name:
            return "base"
        if name in self._adapter_labels:
            return name
        if len(self._adapter_labels) < MAX_ADAPTER_LABELS:
            self._adapter_labels.add(name)
            return name
        return "other"

    # ---- any thread ----------------------------------------------------------------------------

    def set_queue(self, num_running: int, num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    @property
    def tracked_requests(self) -> int:
        """Requests whose latest token time is kept for inter-token latency (bounded by running)."""
        return len(self._last_token)
