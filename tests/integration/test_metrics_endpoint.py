"""/metrics of a real server counts what its clients saw. The engine's metrics are observed in
the engine process and read from it on each scrape."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from service.engine.request import FinishReason
from service.proto import inference_pb2 as pb
from tests.support.server import generate, greedy, running_server


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_requests_tokens_latencies_and_rejections(model_cache_dir) -> None:
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256"]) as server:
        port = getattr(server.app, "metrics_port", None)
        if port is None:
            pytest.skip("metrics not wired")
        before = scrape(port)  # the start-up warm-up request already went through the engine
        for reason in FinishReason:  # every reason is exported from the start, at zero if unseen
            assert ("graphserve_requests_total", (("finish_reason", reason.value),)) in before
        stub = server.stub()
        prompts = {"Once upon a time": 5, "hello": 3, "graphs and caches": 8}
        prompt_tokens = 0
        for prompt, max_tokens in prompts.items():
            _, finished = generate(stub, **greedy(prompt, max_tokens))
            assert finished.usage.completion_tokens == max_tokens
            prompt_tokens += finished.usage.prompt_tokens
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_tokens=0)), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = scrape(port)

    n = len(prompts)
    assert delta(before, after, "graphserve_requests_total", finish_reason="length") == n
    assert delta(before, after, "graphserve_generated_tokens_total") == sum(prompts.values())
    assert delta(before, after, "graphserve_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "graphserve_time_to_first_token_seconds_count") == n
    assert delta(before, after, "graphserve_request_duration_seconds_count") == n
    assert delta(before, after, "graphserve_queue_time_seconds_count") == n
    assert delta(before, after, "graphserve_inter_token_latency_seconds_count") == sum(prompts.values()) - n
    # One stream at a time: every gap between two of its tokens is a step gap; no graphs on the CPU.
    assert delta(before, after, "graphserve_step_gap_seconds_count", capturing="false") == sum(prompts.values()) - n
    assert delta(before, after, "graphserve_step_gap_seconds_count", capturing="true") == 0
    assert 0 < after[("graphserve_step_gap_max_seconds", (("capturing", "false"),))] < 30
    assert delta(before, after, "graphserve_requests_rejected_total", reason="invalid_argument") == 1
    assert after[("graphserve_requests_running", ())] == 0
    assert after[("graphserve_requests_waiting", ())] == 0


def test_running_and_waiting_gauges_follow_open_streams(model_cache_dir) -> None:
    """Two KV slots and four long streams (whichever arrive first run): two run, two wait, as the
    engine process reports it."""
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "2", "--max-seq-len", "2048"]
    with running_server(argv) as server:
        stub = server.stub()
        calls = [stub.Generate(pb.GenerateRequest(**greedy(f"stream {i}", 2000)), timeout=120) for i in range(4)]
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                now = scrape(server.app.metrics_port)
                if now[("graphserve_requests_running", ())] == 2 and now[("graphserve_requests_waiting", ())] == 2:
                    break
                time.sleep(0.1)
            assert now[("graphserve_requests_running", ())] == 2
            assert now[("graphserve_requests_waiting", ())] == 2
        finally:
            for call in calls:
                call.cancel()


def test_a_scrape_answers_without_the_engine_families_while_the_engine_process_does_not(server) -> None:
    """A frozen engine process costs the scrape the engine's families, within Prometheus's default
    scrape timeout (10 s); the gRPC process's own families still come, and the engine's come back."""
    port = server.app.metrics_port
    with pytest.raises(grpc.RpcError):  # a rejection: counted in the gRPC process
        list(server.stub().Generate(pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_tokens=0)),
                                    timeout=30))
    pid = server.app.engine.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            frozen = scrape(port)
            seconds = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert seconds < 10
    assert frozen[("graphserve_requests_rejected_total", (("reason", "invalid_argument"),))] >= 1
    assert not any(name.startswith(("graphserve_requests_running", "graphserve_generated_tokens")) for name, _ in frozen)
    assert "engine_metrics_failed" in [e["event"] for e in logs]
    _, finished = generate(server.stub(), **greedy("thawed", 4))
    assert finished.usage.completion_tokens == 4
    thawed = scrape(port)
    assert thawed[("graphserve_requests_running", ())] == 0
    assert thawed[("graphserve_generated_tokens_total", ())] >= 4
