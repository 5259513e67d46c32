"""Parts that hang: an engine that stops answering during shutdown, a stats volume that blocks, and
prompts of a megabyte each. Every case ends in bounded time with what the user should see."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.proto import inference_pb2, inference_pb2_grpc
from tests.support.server import ServerThread, generate, greedy

SERVING = health_pb2.HealthCheckResponse.SERVING


def engine_pid_of(log_text: str) -> int:
    return next(json.loads(line) for line in log_text.splitlines() if '"model_loaded"' in line)["engine_pid"]


def test_sigterm_with_a_hung_engine_ends_streams_as_aborted_in_bounded_time_and_exits_nonzero(
        process_factory, tmp_path) -> None:  # noqa: ANN001
    stats = tmp_path / "stats.json"
    proc = process_factory("--drain-timeout", "2", "--engine-stop-timeout", "4", "--stats-file", str(stats))
    proc.wait_for_health(SERVING)
    engine_pid = engine_pid_of(proc.log_text())
    stub = inference_pb2_grpc.InferenceStub(proc.channel)
    responses = stub.Generate(inference_pb2.GenerateRequest(**greedy("Once upon a time", 2000)), timeout=120)
    assert next(responses).WhichOneof("kind") == "chunk"
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        proc.terminate()
        rest = list(responses)
        code = proc.wait(60)
        elapsed = time.monotonic() - started
    finally:
        try:
            os.kill(engine_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert rest[-1].finished.finish_reason == inference_pb2.FINISH_REASON_ABORT
    assert code != 0  # the engine had to be killed and the stats were not saved
    # Bounded by --drain-timeout + --engine-stop-timeout (6 s here), with room for a loaded machine;
    # it used to take 40 s (a fixed 30 s wait before the kill).
    assert elapsed < 20, f"shutdown took {elapsed:.1f} s"
    log = proc.log_text()
    assert "engine_not_answering" in log and "engine_process_kill" in log


def test_a_hung_stats_volume_does_not_stop_generation(model_cache_dir, tmp_path) -> None:  # noqa: ANN001
    stats = tmp_path / "stats.json"
    server = ServerThread(["--model-cache-dir", str(model_cache_dir), "--stats-file", str(stats),
                           "--engine-stop-timeout", "10"]).start()
    try:
        # The engine process writes its temp file here: as a FIFO with no reader, open() never returns.
        os.mkfifo(tmp_path / f".stats.json.tmp-{server.app.engine.process.pid}")

        def stalled() -> float:
            return server.app.metrics.registry.get_sample_value("graphserve_graph_stats_save_stalled") or 0.0

        deadline = time.monotonic() + 90
        while stalled() != 1:
            assert time.monotonic() < deadline, "the hung save was never reported"
            _, finished = generate(server.stub(), timeout=30, **greedy("keep generating", 8))
            assert finished.usage.completion_tokens == 8
        for _ in range(3):  # a save is hung right now, and generation goes on
            _, finished = generate(server.stub(), timeout=30, **greedy("still generating", 8))
            assert finished.usage.completion_tokens == 8
        health = health_pb2_grpc.HealthStub(server.channel())
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    finally:
        server.stop()
    assert server.app.exit_code != 0  # the stats could not be saved at shutdown


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_ten_megabyte_prompts_cost_memory_in_proportion_to_the_context(process_factory) -> None:  # noqa: ANN001
    proc = process_factory("--max-seq-len", "256")
    proc.wait_for_health(SERVING)
    stub = inference_pb2_grpc.InferenceStub(proc.channel)
    generate(stub, **greedy("warm up", 2))
    before = _peak_rss_bytes(proc.proc.pid)
    words = "the quick brown fox jumps over the lazy dog "
    text = (words * ((1 << 20) // len(words)))[: (1 << 20) - 64]  # just under the default --max-prompt-bytes
    errors: list[grpc.RpcError] = []

    def send() -> None:
        try:
            generate(stub, timeout=120, **greedy(text, 4))
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(errors) == 10
    assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than 255 tokens" in e.details() for e in errors)
    grown = _peak_rss_bytes(proc.proc.pid) - before
    # 10 MiB of text arrive; tokenizing all of it took the process from 351 MB to a 1.6 GB peak.
    assert grown < 300 << 20, f"peak RSS grew by {grown >> 20} MiB"
    _, finished = generate(stub, **greedy("still serving", 2))
    assert finished.usage.completion_tokens == 2
    plain = [line for line in proc.log_text().splitlines() if line.strip() and not line.startswith("{")]
    assert not plain, plain[:3]  # every line is a structured event, library warnings included


def test_a_long_prompt_without_whitespace_is_refused_by_token_count(server: ServerThread) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(server.stub(), **greedy("x" * 200_000, 4))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens; the context holds 512" in info.value.details()
