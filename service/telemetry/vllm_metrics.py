"""The engine's metrics under vLLM's names (the `vllm:` series), beside the graphserve_ ones.

Clients written for vLLM read these: the Gateway API Inference Extension's endpoint picker scrapes
vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc and
vllm:lora_requests_info from each pod to pick an endpoint. Names, types, help texts and labels are
vLLM v1's (vllm/v1/metrics/loggers.py): every series carries `model_name` (the served model, as
--model names it) and `engine` ("0": one engine per server), except vllm:lora_requests_info, whose
only labels are its three, as in vLLM.

Nothing is observed twice: on each collect the series are built from the graphserve_ metrics (the
same counts; the histograms keep graphserve's finer buckets) and from what the scrape sets
(`EngineMetrics.set_kv_cache_usage`, `set_lora_requests`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Sample


class EngineMetricsView(Protocol):
    """What this collector reads of the engine's metrics (engine_metrics.EngineMetrics)."""

    running: MetricWrapperBase
    waiting: MetricWrapperBase
    prompt_tokens: MetricWrapperBase
    generated_tokens: MetricWrapperBase
    requests: MetricWrapperBase
    ttft: MetricWrapperBase
    itl: MetricWrapperBase
    duration: MetricWrapperBase
    queue_time: MetricWrapperBase
    prefix_queries: MetricWrapperBase
    prefix_hits: MetricWrapperBase
    preemptions: MetricWrapperBase
    request_prompt_tokens: MetricWrapperBase
    request_generation_tokens: MetricWrapperBase
    spec_drafts: MetricWrapperBase
    spec_draft_tokens: MetricWrapperBase
    spec_accepted_tokens: MetricWrapperBase
    spec_accepted_per_pos: MetricWrapperBase
    speculating: bool
    kv_cache_usage: float
    cache_config: dict[str, str] | None
    lora_requests: tuple[tuple[str, ...], tuple[str, ...], int, float] | None


ENGINE = "0"
# graphserve's finish reasons as vLLM's: an end-of-sequence token and a stop string or token are both "stop".
FINISHED_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}

Relabel = Callable[[dict[str, str]], dict[str, str]]


def _finished_reason(labels: dict[str, str]) -> dict[str, str]:
    return {"finished_reason": FINISHED_REASONS[labels["finish_reason"]]}


class VllmCollector:
    """Collects `engine`'s metrics as vLLM names them (a prometheus-client collector)."""

    def __init__(self, engine: EngineMetricsView, model_name: str) -> None:
        self.labels = {"model_name": model_name, "engine": ENGINE}
        self.engine = m = engine
        # (graphserve metric, vLLM name, vLLM help, labels of the graphserve sample -> vLLM's)
        self.views: list[tuple[MetricWrapperBase, str, str, Relabel | None]] = [
            (m.running, "vllm:num_requests_running", "Number of requests in model execution batches.", None),
            (m.waiting, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", None),
            (m.prompt_tokens, "vllm:prompt_tokens", "Number of prefill tokens processed.", None),
            (m.generated_tokens, "vllm:generation_tokens", "Number of generation tokens processed.", None),
            (m.requests, "vllm:request_success", "Count of successfully processed requests.", _finished_reason),
            (m.ttft, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", None),
            (m.itl, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", None),
            (m.duration, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", None),
            (m.queue_time, "vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", None),
            (m.prefix_queries, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", None),
            (m.prefix_hits, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", None),
            (m.preemptions, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", None),
            (m.request_prompt_tokens, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
            (m.request_generation_tokens, "vllm:request_generation_tokens", "Number of generation tokens processed.",
             None),
        ]
        # As in vLLM: only on a server with speculative decoding (EngineMetrics.speculating).
        self.spec_views: list[tuple[MetricWrapperBase, str, str, Relabel | None]] = [
            (m.spec_drafts, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", None),
            (m.spec_draft_tokens, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", None),
            (m.spec_accepted_tokens, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", None),
            (m.spec_accepted_per_pos, "vllm:spec_decode_num_accepted_tokens_per_pos",
             "Accepted tokens per draft position.", None),
        ]

    def collect(self) -> Iterator[Metric]:
        for metric, name, documentation, relabel in self.views + (self.spec_views if self.engine.speculating else []):
            for family in metric.collect():
                yield self._renamed(family, name, documentation, relabel)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=list(self.labels))
        kv.add_metric(list(self.labels.values()), self.engine.kv_cache_usage)
        yield kv
        cache = self.engine.cache_config
        if cache is not None:  # as vLLM: the config in labels, the value 1
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*cache, "engine"])
            info.add_metric([*cache.values(), ENGINE], 1.0)
            yield info
        lora = self.engine.lora_requests
        if lora is not None:  # as in vLLM: only on a server with adapter slots
            running, waiting, max_lora, at = lora
            family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                       labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            family.add_metric([str(max_lora), ",".join(waiting), ",".join(running)], at)
            yield family

    def _renamed(self, family: Metric, name: str, documentation: str, relabel: Relabel | None) -> Metric:
        """`family` as `name`, its samples with vLLM's labels; samples that map to the same labels
        are summed."""
        out = Metric(name, documentation, family.type)
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
        for s in family.samples:
            labels = {**self.labels, **(relabel(s.labels) if relabel is not None else s.labels)}
            sample_name = name + s.name[len(family.name):]
            key = (sample_name, tuple(sorted(labels.items())))
            seen = merged.get(key)
            if seen is None:
                merged[key] = s._replace(name=sample_name, labels=labels)
            else:
                merged[key] = seen._replace(value=seen.value + s.value)
        out.samples = list(merged.values())
        return out
