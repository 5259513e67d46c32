"""A real `graphserve serve` start: its timeline in the log, readiness only once every step kind has
a path, and the compile cache kept in a directory across starts."""

from __future__ import annotations

import json

from grpc_health.v1 import health_pb2

from service.config import version
from service.proto import inference_pb2_grpc
from tests.support.server import generate, greedy

SERVING = health_pb2.HealthCheckResponse.SERVING

# What each process reports, in the order a start runs it (the engine's own phases carry "engine.").
GRPC_PHASES = ["imports", "config", "server_imports", "grpc_listening", "engine_ready", "tokenizer", "serving"]
ENGINE_PHASES = ["engine.imports", "engine.model_config", "engine.tokenizer", "engine.kernel_self_checks",
                 "engine.model_build", "engine.weights_read", "engine.weights_loaded", "engine.kv_pool",
                 "engine.warmup", "engine.startup_graphs", "engine.engine_started"]


def events(proc, name: str) -> list[dict]:  # noqa: ANN001
    return [e for e in (json.loads(line) for line in proc.log_text().splitlines() if line.startswith("{"))
            if e.get("event") == name]


def started(process_factory, *argv: str):  # noqa: ANN001, ANN201
    """A server that reached SERVING and answered two requests, then stopped (its log complete)."""
    proc = process_factory("--admin-port", "0", *argv)
    proc.wait_for_health(SERVING, timeout=180)
    for _ in range(2):
        chunks, finished = generate(inference_pb2_grpc.InferenceStub(proc.channel), **greedy("Hello there", 4))
        assert finished.usage.completion_tokens == 4 and chunks
    proc.terminate()
    assert proc.wait(60) == 0
    return proc


def test_the_start_up_timeline_is_logged_once_with_every_phase_in_order(process_factory) -> None:
    """And readiness is its last phase: health turns SERVING only after the eager warm-up (a prompt
    chunk and a decode step: every step kind's path on a CPU) and the start-up graphs' time."""
    proc = started(process_factory)
    [timeline] = events(proc, "startup_timeline")
    seconds = timeline["seconds"]
    assert list(seconds) == sorted(seconds, key=seconds.get), "phases are listed in the order they ended"
    for phases in (GRPC_PHASES, ENGINE_PHASES):
        assert [p for p in seconds if p in phases] == phases
    # The engine loads between the port opening and the engine reporting ready.
    assert seconds["grpc_listening"] <= seconds["engine.imports"] <= seconds["engine.engine_started"] \
        <= seconds["engine_ready"]
    assert timeline["serving_s"] == seconds["serving"] > 0
    assert list(seconds) == list(timeline["durations"])
    assert abs(sum(timeline["durations"].values()) - seconds["serving"]) < 0.01
    assert seconds["engine.warmup"] <= seconds["engine.startup_graphs"] < seconds["serving"]
    assert list(seconds)[-1] == "serving"
    # The first token written to a client closes the start, logged once (two requests were served)
    [first] = events(proc, "startup_first_token")
    assert first["seconds"] >= seconds["serving"] and first["after_serving_s"] >= 0


def test_the_compile_cache_is_reused_on_the_next_start_and_ignored_when_its_key_changes(
        process_factory, tmp_path) -> None:
    cache = tmp_path / "compile-cache"
    first = started(process_factory, "--compile-cache-dir", str(cache))
    [miss] = events(first, "compile_cache_miss")
    assert miss["reason"] == "no results for this key"
    stored = sorted(cache.glob("fast_path-*.json"))
    assert [str(p) for p in stored] == [miss["file"]]
    assert json.loads(stored[0].read_text())["key"]["dtype"] == "torch.float32"

    again = started(process_factory, "--compile-cache-dir", str(cache))
    [hit] = events(again, "compile_cache_hit")
    assert hit["file"] == miss["file"] and not events(again, "compile_cache_miss")
    assert [e.get("source") for e in events(again, "fast_path")] == ["compile_cache"]

    # Another dtype is another key: checked again and stored beside the first, which stays.
    other = started(process_factory, "--compile-cache-dir", str(cache), "--dtype", "bfloat16")
    [other_miss] = events(other, "compile_cache_miss")
    assert not events(other, "compile_cache_hit") and other_miss["file"] != miss["file"]
    assert sorted(cache.glob("fast_path-*.json")) == sorted([*stored, cache / other_miss["file"].split("/")[-1]])


def test_a_cache_file_recorded_for_another_key_is_ignored_and_rewritten(process_factory, tmp_path) -> None:
    """As a file left by another version or GPU under the same name would be (or a damaged one)."""
    cache = tmp_path / "compile-cache"
    started(process_factory, "--compile-cache-dir", str(cache))
    [path] = cache.glob("fast_path-*.json")
    record = json.loads(path.read_text())
    record["key"]["graphserve"] = "0.0.0-older"
    path.write_text(json.dumps(record))
    second = started(process_factory, "--compile-cache-dir", str(cache))
    [miss] = events(second, "compile_cache_miss")
    assert miss["reason"] == "recorded for another key" and miss["file"] == str(path)
    assert json.loads(path.read_text())["key"]["graphserve"] == version()  # this version's results now
