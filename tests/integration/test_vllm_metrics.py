"""/metrics of a real server under vLLM's names, as the Gateway API Inference Extension's endpoint
picker reads them: queue and KV-cache gauges that follow open streams, LoRA adapters of running and
waiting requests, and counters that advance by what the clients saw."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.model import ensure_builtin
from service.proto import inference_pb2 as pb
from tests.support.lora import make_adapter
from tests.support.server import generate, greedy, running_server

MODEL = "builtin:tiny"  # the default --model: every vllm: series but lora_requests_info names it
LABELS = (("engine", "0"), ("model_name", MODEL))

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[dict[str, str], Samples]:
    """(family name -> type, samples by (name, sorted labels)) of one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return types, samples


def vllm(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted((*LABELS, *labels.items())))))


def wait_for(port: int, ok: Callable[[Samples], bool], seconds: float = 15) -> Samples:
    deadline = time.monotonic() + seconds
    while True:
        _, now = scrape(port)
        if ok(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_counters_and_histograms_advance_by_what_the_clients_saw(model_cache_dir) -> None:
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256"]) as server:
        port, stub = server.app.metrics_port, server.stub()
        types, before = scrape(port)
        assert not [n for n in types if n.endswith("_created")], "no _created series"
        assert {n: t for n, t in types.items() if n.startswith("vllm:")} == {
            "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
            "vllm:kv_cache_usage_perc": "gauge",
            "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
            "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
            "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
            "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
            "vllm:num_preemptions": "counter",
            "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
            "vllm:cache_config_info": "gauge",
        }  # no adapter slots: no vllm:lora_requests_info, as in vLLM without LoRA
        [(labels, value)] = [(dict(k[1]), v) for k, v in before.items() if k[0] == "vllm:cache_config_info"]
        assert value == 1 and labels["block_size"] == "16" and labels["cache_dtype"] == "auto"
        assert labels["enable_prefix_caching"] == "True" and int(labels["num_gpu_blocks"]) > 0 and labels["engine"] == "0"
        chunks, finished = generate(stub, **greedy("Once upon a time", 6))
        tokens = [t for c in chunks for t in c.token_ids]
        # The same prompt again, stopped by its third token: vLLM's "stop".
        _, stopped = generate(stub, text="Once upon a time", sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_tokens=6, stop_token_ids=[tokens[2]], ignore_eos=True))
        _, after = scrape(port)

    assert finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.usage.completion_tokens == tokens.index(tokens[2]) + 1

    def delta(name: str, **labels: str) -> float:
        return vllm(after, name, **labels) - vllm(before, name, **labels)

    prompt_tokens = finished.usage.prompt_tokens + stopped.usage.prompt_tokens
    completion_tokens = finished.usage.completion_tokens + stopped.usage.completion_tokens
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == completion_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == completion_tokens - 2
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == completion_tokens
    assert delta("vllm:request_generation_tokens_bucket", le="5.0") == 1  # the stopped one (3 tokens)
    assert delta("vllm:request_generation_tokens_count") == 2
    # The vllm: series are the graphserve_ ones renamed: the same counts.
    assert vllm(after, "vllm:generation_tokens_total") == after[("graphserve_generated_tokens_total", ())]
    assert vllm(after, "vllm:num_requests_running") == 0
    assert vllm(after, "vllm:kv_cache_usage_perc") == 0


def test_running_waiting_and_kv_cache_usage_follow_open_streams(model_cache_dir) -> None:
    """Two running rows: one long stream holds some KV blocks; three streams fill both rows and one
    waits, their blocks a larger share; the usage is the blocks held of the pool's, as graphserve's
    own block gauge says."""
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "2", "--max-seq-len", "2048"]
    with running_server(argv) as server:
        port, stub = server.app.metrics_port, server.stub()
        _, before = scrape(port)
        aborts = vllm(before, "vllm:request_success_total", finished_reason="abort")
        calls = [stub.Generate(pb.GenerateRequest(**greedy("stream 0", 2000)), timeout=120)]
        try:
            next(calls[0])  # its first token arrived: it runs
            now = wait_for(port, lambda s: vllm(s, "vllm:num_requests_running") == 1)
            assert vllm(now, "vllm:num_requests_running") == 1
            assert vllm(now, "vllm:num_requests_waiting") == 0
            one = vllm(now, "vllm:kv_cache_usage_perc")
            used, free = now["graphserve_kv_blocks", (("state", "used"),)], now["graphserve_kv_blocks", (("state", "free"),)]
            assert 0 < one < 0.5 and one == pytest.approx(used / (used + free), abs=2 / (used + free))
            calls += [stub.Generate(pb.GenerateRequest(**greedy(f"stream {i}", 2000)), timeout=120) for i in (1, 2)]
            now = wait_for(port, lambda s: vllm(s, "vllm:num_requests_waiting") == 1
                           and vllm(s, "vllm:num_requests_running") == 2)
            assert vllm(now, "vllm:num_requests_running") == 2
            assert vllm(now, "vllm:num_requests_waiting") == 1
            assert vllm(now, "vllm:kv_cache_usage_perc") > one  # two streams hold blocks now, the first more
        finally:
            for call in calls:
                call.cancel()
        # The scrape reads the engine's counts one after another while its thread runs: wait for a
        # snapshot where all of them have settled (a held block would keep the usage above 0 for good).
        now = wait_for(port, lambda s: vllm(s, "vllm:request_success_total", finished_reason="abort") == aborts + 3
                       and vllm(s, "vllm:kv_cache_usage_perc") == 0)
        assert vllm(now, "vllm:request_success_total", finished_reason="abort") == aborts + 3
        assert vllm(now, "vllm:num_requests_running") == 0
        assert vllm(now, "vllm:num_requests_waiting") == 0
        assert vllm(now, "vllm:kv_cache_usage_perc") == 0


def lora_info(samples: Samples) -> dict[str, str]:
    """The labels of the one vllm:lora_requests_info series (the endpoint picker reads the latest)."""
    series = [dict(labels) for name, labels in samples if name == "vllm:lora_requests_info"]
    assert len(series) == 1, series
    return series[0]


def test_lora_requests_info_names_the_adapters_of_running_and_waiting_requests(
        model_cache_dir, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One adapter slot, two adapters: a long stream of sql runs, a stream of chat waits for the slot."""
    tmp = tmp_path_factory.mktemp("vllm-lora")
    model_dir = ensure_builtin("tiny", model_cache_dir)
    modules = ",".join(f"{name}={make_adapter(model_dir, tmp / name, seed=i + 1)}"
                       for i, name in enumerate(["sql", "chat"]))
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "4", "--max-seq-len", "2048",
            "--lora-modules", modules, "--max-loras", "1", "--max-lora-rank", "8"]
    with running_server(argv) as server:
        port, stub = server.app.metrics_port, server.stub()
        types, idle = scrape(port)
        assert types["vllm:lora_requests_info"] == "gauge"
        assert lora_info(idle) == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        sql = stub.Generate(pb.GenerateRequest(**greedy("sql stream", 2000), adapter="sql"), timeout=120)
        chat = None
        try:
            next(sql)
            t0 = time.time()
            running = wait_for(port, lambda s: lora_info(s)["running_lora_adapters"] == "sql")
            assert lora_info(running) == {"max_lora": "1", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
            value = next(v for (name, _), v in running.items() if name == "vllm:lora_requests_info")
            assert t0 - 1 <= value <= time.time()  # the time of the update, as vLLM's
            chat = stub.Generate(pb.GenerateRequest(**greedy("chat stream", 4), adapter="chat"), timeout=120)
            both = wait_for(port, lambda s: lora_info(s)["waiting_lora_adapters"] == "chat")
            assert lora_info(both) == {"max_lora": "1", "running_lora_adapters": "sql",
                                       "waiting_lora_adapters": "chat"}
            assert vllm(both, "vllm:num_requests_running") == 1
            assert vllm(both, "vllm:num_requests_waiting") == 1
        finally:
            sql.cancel()
        # sql's slot is free: chat runs its four tokens and ends.
        assert list(chat)[-1].finished.usage.completion_tokens == 4
        done = wait_for(port, lambda s: lora_info(s)["running_lora_adapters"] == "")
        assert lora_info(done) == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_served_model_name_names_the_model_to_gateways_and_metrics(model_cache_dir) -> None:
    from smg_grpc_proto.generated import vllm_engine_pb2 as v
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    with running_server(["--model-cache-dir", str(model_cache_dir), "--served-model-name", "tiny-chat"]) as server:
        info = vllm_engine_pb2_grpc.VllmEngineStub(server.channel()).GetModelInfo(v.GetModelInfoRequest(), timeout=10)
        assert info.served_model_name == "tiny-chat"
        _, samples = scrape(server.app.metrics_port)
        assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "tiny-chat")))] == 0
