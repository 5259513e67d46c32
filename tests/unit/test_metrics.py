"""Metrics as Prometheus scrapes them: counts and labels in the exposition text. The engine's
metrics (EngineMetrics) are observed where the engine runs; the server's Metrics exports them."""

from __future__ import annotations

import dataclasses
import pickle
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_manager import (
    BatchDescriptor,
    BucketCounters,
    BucketEntry,
    BucketState,
    CacheSnapshot,
    CudaGraphMode,
    RequestedSize,
)
from service.engine.request import Finish, FinishReason, GenerationRequest, SamplingParams
from service.engine.sequence import Sequence, SequenceStatus
from service.telemetry.engine_metrics import EngineMetrics
from service.telemetry.metrics import Metrics


def scrape(metrics: Metrics | EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, keyed by (sample name, sorted labels)."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def make_seq(request_id: str, prompt_len: int, max_tokens: int, arrival: float = 10.0) -> Sequence:
    request = GenerationRequest(request_id, list(range(1, prompt_len + 1)),
                                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0), arrival_time=arrival)
    return Sequence(request)


def finish_of(seq: Sequence, reason: FinishReason, now: float) -> Finish:
    arrival = seq.request.arrival_time
    return Finish(reason, seq.num_prompt_tokens, seq.num_completion_tokens,
                  queue_seconds=(seq.scheduled_at or now) - arrival,
                  time_to_first_token_seconds=(seq.first_token_at or now) - arrival,
                  total_seconds=now - arrival)


def server_metrics(engine: EngineMetrics | None = None) -> Metrics:
    """The server's metrics exporting an in-process engine's, as pickled across the pipe."""
    m = Metrics()
    engine = engine if engine is not None else EngineMetrics()
    m.set_engine_source(lambda: pickle.loads(pickle.dumps(engine.families())))
    return m


def run_to_length(m: EngineMetrics, seq: Sequence, token_times: list[float], scheduled: float) -> None:
    """Feed the hooks in the engine's order: the last token's on_tokens comes after on_finish."""
    seq.status, seq.scheduled_at = SequenceStatus.RUNNING, scheduled
    for i, now in enumerate(token_times):
        seq.completion_token_ids.append(100 + i)
        seq.first_token_at = seq.first_token_at or now
        if i == len(token_times) - 1:
            seq.status = SequenceStatus.FINISHED
            m.on_finish(seq, finish_of(seq, FinishReason.LENGTH, now))
        m.on_tokens([seq], now)


def test_a_finished_request_counts_tokens_and_latencies() -> None:
    m = EngineMetrics()
    seq = make_seq("r1", prompt_len=5, max_tokens=4, arrival=10.0)
    run_to_length(m, seq, [10.5, 10.51, 10.53, 10.56], scheduled=10.2)
    s = scrape(m)
    assert value(s, "graphserve_requests_total", finish_reason="length") == 1
    assert value(s, "graphserve_requests_total", finish_reason="abort") == 0  # every reason is exported
    assert value(s, "graphserve_prompt_tokens_total") == 5
    assert value(s, "graphserve_generated_tokens_total") == 4
    assert value(s, "graphserve_time_to_first_token_seconds_count") == 1
    assert value(s, "graphserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(s, "graphserve_queue_time_seconds_sum") == pytest.approx(0.2)
    assert value(s, "graphserve_request_duration_seconds_sum") == pytest.approx(0.56)
    # Three gaps (10 ms, 20 ms, 30 ms), the last one measured after the finish was reported.
    assert value(s, "graphserve_inter_token_latency_seconds_count") == 3
    assert value(s, "graphserve_inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(s, "graphserve_inter_token_latency_seconds_bucket", le="0.01") == 1
    assert value(s, "graphserve_inter_token_latency_seconds_bucket", le="0.02") == 2
    assert m.tracked_requests == 0


def test_streams_of_one_step_count_one_gap_each() -> None:
    """Three streams decode together, a fourth joins late: every token after a stream's first is one
    inter-token gap, in the bucket of its own gap, as if each had been observed alone."""
    m = EngineMetrics()
    seqs = [make_seq(f"r{i}", prompt_len=3, max_tokens=100) for i in range(4)]
    for seq in seqs:
        seq.status, seq.scheduled_at = SequenceStatus.RUNNING, 10.0

    def step(batch: list[Sequence], now: float) -> None:
        for seq in batch:
            seq.completion_token_ids.append(7)
        m.on_tokens(batch, now)

    step(seqs[:3], 10.1)  # first tokens: no gap
    step(seqs[:3], 10.104)  # three 4 ms gaps
    step(seqs, 10.119)  # three 15 ms gaps; the fourth's first token
    step(seqs, 10.179)  # four 60 ms gaps
    s = scrape(m)
    assert value(s, "graphserve_generated_tokens_total") == 3 + 3 + 4 + 4
    assert value(s, "graphserve_inter_token_latency_seconds_count") == 10
    assert value(s, "graphserve_inter_token_latency_seconds_sum") == pytest.approx(3 * 0.004 + 3 * 0.015 + 4 * 0.06)
    assert value(s, "graphserve_inter_token_latency_seconds_bucket", le="0.005") == 3
    assert value(s, "graphserve_inter_token_latency_seconds_bucket", le="0.02") == 6
    assert value(s, "graphserve_inter_token_latency_seconds_bucket", le="0.05") == 6
    assert value(s, "graphserve_inter_token_latency_seconds_bucket", le="0.075") == 10
    assert value(s, "graphserve_time_to_first_token_seconds_count") == 4


def families_of(metrics: Metrics) -> dict[str, str]:
    """Family name -> type, as a scraper parses the exposition text."""
    text = generate_latest(metrics.registry).decode()
    return {family.name: family.type for family in text_string_to_metric_families(text)}


VLLM = {"model_name": "builtin:tiny", "engine": "0"}


def test_the_vllm_series_count_what_the_graphserve_ones_count_under_vllms_names_and_labels() -> None:
    engine = EngineMetrics(model_name="builtin:tiny")
    m = server_metrics(engine)
    run_to_length(engine, make_seq("r1", prompt_len=5, max_tokens=4), [10.5, 10.51, 10.53, 10.56], scheduled=10.2)
    for i, reason in enumerate([FinishReason.EOS, FinishReason.STOP, FinishReason.ABORT]):
        seq = make_seq(f"f{i}", prompt_len=3, max_tokens=8)
        seq.status = SequenceStatus.FINISHED
        engine.on_finish(seq, finish_of(seq, reason, 11.0))
    engine.on_step(num_running=3, num_waiting=7, num_decode=2, num_prefill=1)
    types = families_of(m)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert types[name] == "gauge"
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert types[name] == "counter"
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert types[name] == "histogram"
    assert "vllm:lora_requests_info" not in types  # a server without adapter slots, as vLLM's without LoRA
    s = scrape(m)
    assert value(s, "vllm:num_requests_running", **VLLM) == 3
    assert value(s, "vllm:num_requests_waiting", **VLLM) == 7
    assert value(s, "vllm:prompt_tokens_total", **VLLM) == 5
    assert value(s, "vllm:generation_tokens_total", **VLLM) == 4
    # eos and stop are vLLM's "stop"; every reason exported from the start
    assert value(s, "vllm:request_success_total", finished_reason="stop", **VLLM) == 2
    assert value(s, "vllm:request_success_total", finished_reason="length", **VLLM) == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort", **VLLM) == 1
    assert value(s, "vllm:time_to_first_token_seconds_count", **VLLM) == 1
    assert value(s, "vllm:time_to_first_token_seconds_sum", **VLLM) == pytest.approx(0.5)
    assert value(s, "vllm:inter_token_latency_seconds_count", **VLLM) == 3
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="+Inf", **VLLM) == 3
    assert value(s, "vllm:e2e_request_latency_seconds_count", **VLLM) == 4
    assert value(s, "vllm:request_queue_time_seconds_sum", **VLLM) == pytest.approx(0.2)
    assert value(s, "graphserve_requests_total", finish_reason="eos") == 1  # the graphserve_ series are unchanged


def test_kv_cache_usage_is_a_fraction_of_what_the_engine_reports() -> None:
    engine = EngineMetrics(model_name="builtin:tiny")
    m = server_metrics(engine)
    assert value(scrape(m), "vllm:kv_cache_usage_perc", **VLLM) == 0
    engine.set_kv_cache_usage(3, 4)
    assert value(scrape(m), "vllm:kv_cache_usage_perc", **VLLM) == 0.75
    engine.set_kv_cache_usage(0, 0)
    assert value(scrape(m), "vllm:kv_cache_usage_perc", **VLLM) == 0


def test_lora_requests_info_is_one_series_of_the_current_adapters_valued_at_its_update_time() -> None:
    engine = EngineMetrics(model_name="builtin:tiny")
    m = server_metrics(engine)
    before = time.time()
    engine.set_lora_requests(["sql"], ["chat", "poet"], max_lora=2)
    s = scrape(m)
    lora = {k: v for k, v in s.items() if k[0] == "vllm:lora_requests_info"}
    key = ("vllm:lora_requests_info", (("max_lora", "2"), ("running_lora_adapters", "sql"),
                                       ("waiting_lora_adapters", "chat,poet")))
    assert list(lora) == [key]
    assert before <= lora[key] <= time.time()
    engine.set_lora_requests([], [], max_lora=2)
    lora = {k for k in scrape(m) if k[0] == "vllm:lora_requests_info"}
    assert lora == {("vllm:lora_requests_info", (("max_lora", "2"), ("running_lora_adapters", ""),
                                                 ("waiting_lora_adapters", "")))}


def test_a_one_token_request_has_a_ttft_and_no_inter_token_latency() -> None:
    m = EngineMetrics()
    run_to_length(m, make_seq("r1", 2, 1), [10.1], scheduled=10.0)
    s = scrape(m)
    assert value(s, "graphserve_time_to_first_token_seconds_count") == 1
    assert value(s, "graphserve_inter_token_latency_seconds_count") == 0
    assert m.tracked_requests == 0


def test_aborts_in_the_queue_and_mid_stream_count_as_abort_and_leave_nothing_tracked() -> None:
    m = EngineMetrics()
    queued = make_seq("queued", 3, 8)
    queued.status = SequenceStatus.FINISHED
    m.on_finish(queued, finish_of(queued, FinishReason.ABORT, 11.0))
    running = make_seq("running", 3, 8)
    running.status, running.scheduled_at = SequenceStatus.RUNNING, 10.1
    for i, now in enumerate([10.2, 10.3]):
        running.completion_token_ids.append(i)
        m.on_tokens([running], now)
    assert m.tracked_requests == 1
    running.status = SequenceStatus.FINISHED
    m.on_finish(running, finish_of(running, FinishReason.ABORT, 10.4))
    s = scrape(m)
    assert value(s, "graphserve_requests_total", finish_reason="abort") == 2
    assert value(s, "graphserve_time_to_first_token_seconds_count") == 1  # the queued one never had a token
    assert value(s, "graphserve_prompt_tokens_total") == 3
    assert value(s, "graphserve_generated_tokens_total") == 2
    assert value(s, "graphserve_request_duration_seconds_count") == 2
    assert m.tracked_requests == 0


def test_one_step_s_tokens_count_once_per_step_and_time_each_stream() -> None:
    m = EngineMetrics()
    seqs = [make_seq(f"r{i}", 2, 10) for i in range(3)]
    for seq in seqs:
        seq.status, seq.scheduled_at = SequenceStatus.RUNNING, 10.0
    for i, now in enumerate([10.1, 10.13, 10.2]):
        for seq in seqs:
            seq.completion_token_ids.append(i)
        m.on_tokens(seqs, now)
    s = scrape(m)
    assert value(s, "graphserve_generated_tokens_total") == 9
    assert value(s, "graphserve_time_to_first_token_seconds_count") == 3
    assert value(s, "graphserve_inter_token_latency_seconds_count") == 6
    assert value(s, "graphserve_inter_token_latency_seconds_sum") == pytest.approx(3 * 0.1)


def test_step_sets_running_and_waiting_and_rejections_count_by_reason() -> None:
    engine = EngineMetrics()
    m = server_metrics(engine)
    engine.on_step(num_running=3, num_waiting=7, num_decode=2, num_prefill=1)
    m.rejected("invalid_argument")
    m.rejected("invalid_argument")
    m.rejected("queue_full")
    s = scrape(m)
    assert value(s, "graphserve_requests_running") == 3
    assert value(s, "graphserve_requests_waiting") == 7
    assert value(s, "graphserve_requests_rejected_total", reason="invalid_argument") == 2
    assert value(s, "graphserve_requests_rejected_total", reason="queue_full") == 1


def test_the_server_exports_the_engine_families_as_the_engine_scrapes_them() -> None:
    engine = EngineMetrics()
    m = server_metrics(engine)
    m.set_graph_source(snapshot)
    run_to_length(engine, make_seq("r1", prompt_len=5, max_tokens=4), [10.5, 10.51, 10.53, 10.56], scheduled=10.2)
    m.rejected("queue_full")
    exported = generate_latest(m.registry).decode()
    assert generate_latest(engine.registry).decode() in exported  # names, types, help, labels, values
    s = scrape(m)
    assert value(s, "graphserve_requests_total", finish_reason="stop") == 0
    assert value(s, "graphserve_requests_rejected_total", reason="queue_full") == 1
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="1") == 40


def test_an_engine_that_does_not_answer_costs_the_scrape_its_families_only() -> None:
    m = Metrics()

    def timed_out() -> list:
        raise TimeoutError

    m.set_engine_source(timed_out)
    m.set_graph_source(snapshot)
    m.rejected("queue_full")
    s = scrape(m)
    assert value(s, "graphserve_requests_running") is None
    assert value(s, "graphserve_requests_rejected_total", reason="queue_full") == 1
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="1") == 40


def bucket(size: int, state: BucketState, nbytes: int, capture_ms: float, counters: BucketCounters) -> BucketEntry:
    return BucketEntry(size, "full", state, nbytes, capture_ms, None, None, since_start=counters,
                       persisted=BucketCounters(replays=10**6))


def snapshot() -> CacheSnapshot:
    """Sizes 1, 2, 4 (max batch 6). As the manager records them: a size-3 step that fell back for
    budget counts in requested size 3 and in bucket 4; steps of 5 and 6 (above 4) only per size."""
    buckets = (
        bucket(1, BucketState.CAPTURED, 22 << 20, 20.0, BucketCounters(replays=40, captures=1)),
        bucket(2, BucketState.EVICTED, 30 << 20, 25.0, BucketCounters(replays=7, padded_rows=0, captures=1, evictions=1)),
        bucket(4, BucketState.FAILED, 0, 0.0, BucketCounters(replays=0, eager_fallbacks={"budget": 2, "failed": 1},
                                                             failures=1)),
    )
    requested = (
        RequestedSize(1, "full", 40, 40, {}),
        RequestedSize(2, "full", 7, 7, {}),
        RequestedSize(3, "full", 3, 0, {"budget": 2, "failed": 1}),
        RequestedSize(5, "full", 4, 0, {"above_max": 4}),
        RequestedSize(6, "full", 1, 0, {"above_max": 1}),
    )
    return CacheSnapshot(
        mode="full", configured_mode="full", disabled_reason=None, device="cuda:0",
        budget_bytes=64 << 20, used_bytes=22 << 20, capture_sizes=(1, 2, 4), max_batch=6, buckets=buckets,
        requested_since_start={BatchDescriptor(CudaGraphMode.FULL, r.size): r.requests for r in requested},
        requested_persisted={},
        requested_detail=requested, warm_queue=(), stats_file=None, last_save_time=None,
    )


def test_graph_metrics_come_from_the_snapshot_on_each_scrape() -> None:
    m = server_metrics()
    current = {"snap": snapshot()}
    m.set_graph_source(lambda: current["snap"])
    s = scrape(m)
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="1") == 40
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="2") == 7  # since start, not persisted
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="4") == 0
    assert value(s, "graphserve_graph_captures_total") == 2
    assert value(s, "graphserve_graph_evictions_total") == 1
    assert value(s, "graphserve_graph_capture_failures_total") == 1
    assert value(s, "graphserve_graph_memory_bytes") == 22 << 20
    assert value(s, "graphserve_graph_memory_budget_bytes") == 64 << 20
    assert value(s, "graphserve_graph_capture_seconds", kind="full", bucket="1") == pytest.approx(0.020)
    assert value(s, "graphserve_graph_capture_seconds", kind="full", bucket="4") is None  # never captured
    assert value(s, "graphserve_graph_buckets", state="captured") == 1
    # Each eager step once: not again for the bucket it would have padded to.
    assert value(s, "graphserve_graph_eager_fallbacks_total", kind="full", reason="budget") == 2
    assert value(s, "graphserve_graph_eager_fallbacks_total", kind="full", reason="failed") == 1
    assert value(s, "graphserve_graph_eager_fallbacks_total", kind="full", reason="above_max") == 5
    current["snap"] = None  # no snapshot yet (model loading): the rest still scrapes
    s = scrape(m)
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="1") is None
    assert value(s, "graphserve_requests_waiting") == 0


def test_the_lora_graphs_of_the_one_snapshot_have_families_of_their_own() -> None:
    """One cache holds base and LoRA graphs; the scrape splits them by the descriptor's LoRA flag, the
    memory too (the two gauges add up to what counts against the one budget)."""
    m = server_metrics()
    base = snapshot()
    current = {"snap": base}
    m.set_graph_source(lambda: current["snap"])
    assert value(scrape(m), "graphserve_lora_graph_memory_bytes") is None  # no LoRA graphs: no LoRA families
    lora = dataclasses.replace(bucket(2, BucketState.CAPTURED, 8 << 20, 30.0, BucketCounters(replays=5, captures=1)),
                               lora=True)
    current["snap"] = dataclasses.replace(
        base, buckets=(*base.buckets, lora), used_bytes=base.used_bytes + (8 << 20), lora_used_bytes=8 << 20,
        requested_detail=(*base.requested_detail, RequestedSize(2, "full", 5, 5, {}, lora=True),
                          RequestedSize(3, "full", 1, 0, {"budget": 1}, lora=True)))
    s = scrape(m)
    assert value(s, "graphserve_lora_graph_replays_total", kind="full", bucket="2") == 5
    assert value(s, "graphserve_graph_replays_total", kind="full", bucket="2") == 7  # the base graph's own
    assert value(s, "graphserve_lora_graph_memory_bytes") == 8 << 20
    assert value(s, "graphserve_graph_memory_bytes") == 22 << 20
    assert value(s, "graphserve_lora_graph_memory_budget_bytes") == value(s, "graphserve_graph_memory_budget_bytes")
    assert value(s, "graphserve_lora_graph_buckets", state="captured") == 1
    assert value(s, "graphserve_graph_buckets", state="captured") == 1
    assert value(s, "graphserve_lora_graph_eager_fallbacks_total", kind="full", reason="budget") == 1
    assert value(s, "graphserve_graph_eager_fallbacks_total", kind="full", reason="budget") == 2


def test_a_failing_source_does_not_break_the_scrape() -> None:
    m = server_metrics()

    def broken() -> CacheSnapshot:
        raise RuntimeError("boom")

    m.set_graph_source(broken)
    s = scrape(m)
    assert value(s, "graphserve_requests_running") == 0
    assert value(s, "graphserve_graph_memory_bytes") is None


def test_instances_have_their_own_registries() -> None:
    a, b = Metrics(), Metrics()
    a.rejected("queue_full")
    assert value(scrape(a), "graphserve_requests_rejected_total", reason="queue_full") == 1
    assert value(scrape(b), "graphserve_requests_rejected_total", reason="queue_full") is None


def test_serve_on_a_free_port_exposes_metrics_and_close_stops_it() -> None:
    m = server_metrics()
    m.set_graph_source(snapshot)
    port = m.serve("127.0.0.1", 0)
    try:
        assert port > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "graphserve_requests_waiting 0.0" in body
        assert 'graphserve_graph_replays_total{bucket="1",kind="full"} 40.0' in body
    finally:
        m.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
