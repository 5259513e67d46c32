"""A real server process: health through start-up, graceful drain on SIGTERM, engine faults."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from service.proto import inference_pb2, inference_pb2_grpc
from tests.support.process import kill_mid_stream
from tests.support.server import generate, greedy

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_is_not_serving_while_loading_then_serving(process_factory) -> None:
    proc = process_factory(env={"GRAPHSERVE_TEST_FAULTS": "load_delay_s=3"})
    proc.wait_for_health(NOT_SERVING, timeout=30)
    assert proc.health_status("graphserve.v1.Inference") == NOT_SERVING
    proc.wait_for_health(SERVING, timeout=120)
    assert proc.health_status("graphserve.v1.Inference") == SERVING


def test_sigterm_while_the_model_loads_exits_at_once(process_factory) -> None:
    proc = process_factory(env={"GRAPHSERVE_TEST_FAULTS": "load_delay_s=60"})
    proc.wait_for_health(NOT_SERVING, timeout=30)
    started = time.monotonic()
    proc.terminate()
    assert proc.wait(30) == 0
    assert time.monotonic() - started < 15, "shutdown waited for the model load"
    assert "engine_process_kill" not in proc.log_text()  # nothing failed to stop: it was loading


def test_sigterm_finishes_the_stream_refuses_new_calls_saves_stats_and_exits_0(process_factory, tmp_path) -> None:
    stats = tmp_path / "state" / "stats.json"
    stats.parent.mkdir()
    proc = process_factory("--stats-file", str(stats), "--drain-timeout", "60")
    proc.wait_for_health(SERVING)
    stub = inference_pb2_grpc.InferenceStub(proc.channel)
    result: dict[str, object] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        tokens = []
        call = stub.Generate(inference_pb2.GenerateRequest(**greedy("Once upon a time", 400)), timeout=120)
        for response in call:
            if response.WhichOneof("kind") == "chunk":
                tokens += response.chunk.token_ids
                first_chunk.set()
            else:
                result["finished"] = response.finished
        result["tokens"] = tokens

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(60)
    proc.terminate()
    proc.wait_for_health(NOT_SERVING, timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **greedy("too late", 4))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.details()
    thread.join(120)
    assert result["finished"].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert len(result["tokens"]) == 400
    assert proc.wait(60) == 0, proc.log_text()[-3000:]
    saved = json.loads(stats.read_text())
    assert saved  # written at shutdown; its contents are the graph cache's own tests' business


def test_drain_timeout_aborts_streams_with_finish_reason_abort(process_factory) -> None:
    proc = process_factory("--drain-timeout", "0.5")
    proc.wait_for_health(SERVING)
    stub = inference_pb2_grpc.InferenceStub(proc.channel)
    responses = stub.Generate(inference_pb2.GenerateRequest(**greedy("Once upon a time", 2000)), timeout=120)
    first = next(responses)
    assert first.WhichOneof("kind") == "chunk"
    proc.terminate()
    rest = list(responses)
    assert rest[-1].finished.finish_reason == inference_pb2.FINISH_REASON_ABORT
    assert proc.wait(60) == 0


def test_a_failing_decode_step_fails_streams_turns_unhealthy_and_exits_nonzero(process_factory, tmp_path) -> None:
    stats = tmp_path / "stats.json"
    proc = process_factory("--stats-file", str(stats), env={"GRAPHSERVE_TEST_FAULTS": "decode_raise_after=20"})
    proc.wait_for_health(SERVING)
    stub = inference_pb2_grpc.InferenceStub(proc.channel)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, timeout=60, **greedy("Once upon a time", 200))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine failed" in info.value.details()
    assert time.monotonic() - started < 30
    assert proc.wait(60) != 0
    assert stats.exists()
    assert "engine_failed" in proc.log_text()


def test_a_killed_engine_process_fails_streams_and_the_server_exits_nonzero(process_factory) -> None:
    """The engine runs in its own process; if that process dies (OOM killer, a crash in a kernel),
    open streams end with UNAVAILABLE at once, health turns NOT_SERVING and the server exits 1."""
    proc = process_factory()
    proc.wait_for_health(SERVING)
    loaded = next(json.loads(line) for line in proc.log_text().splitlines() if '"model_loaded"' in line)
    error, seconds = kill_mid_stream(proc.channel, loaded["engine_pid"])
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine process exited" in error.details()
    assert seconds < 10
    assert proc.wait(60) == 1
    assert "engine_dead" in proc.log_text()


def test_the_engine_process_exits_when_the_server_is_killed(process_factory) -> None:
    """SIGKILL leaves the server no time to stop its engine: the engine process sees its pipe close
    and exits, instead of holding the device as an orphan."""
    proc = process_factory()
    proc.wait_for_health(SERVING)
    engine_pid = next(json.loads(line) for line in proc.log_text().splitlines() if '"model_loaded"' in line)["engine_pid"]
    generate(inference_pb2_grpc.InferenceStub(proc.channel), timeout=60, **greedy("Once upon a time", 4))
    proc.proc.kill()
    proc.wait(10)
    assert _gone_within(engine_pid, 30)


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    return not _running(pid)


def _running(pid: int) -> bool:
    """True while pid is a live process (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_loading_engine_process_exits_when_the_server_is_killed(process_factory) -> None:
    """Killed during a long model load, the server leaves no engine process loading on its own."""
    proc = process_factory(env={"GRAPHSERVE_TEST_FAULTS": "load_delay_s=60"})
    deadline = time.monotonic() + 60
    started = []
    while time.monotonic() < deadline and not started:
        started = [json.loads(line) for line in proc.log_text().splitlines() if '"engine_process_started"' in line]
        time.sleep(0.1)
    engine_pid = started[0]["pid"]
    assert _running(engine_pid)
    proc.proc.kill()
    proc.wait(10)
    assert _gone_within(engine_pid, 10)
