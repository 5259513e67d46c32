"""The garbage collector in a real server: start-up's objects frozen out of later collections, and a
`gc_pause` warning only for a collection that can pause streams (none for start-up's own)."""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2

from service.proto import inference_pb2_grpc
from tests.support.server import generate, greedy

SERVING = health_pb2.HealthCheckResponse.SERVING


def test_a_server_freezes_its_start_up_heap_and_reports_no_start_up_collection_as_a_pause(process_factory) -> None:  # noqa: ANN001
    proc = process_factory("--log-level", "info")
    proc.wait_for_health(SERVING)
    with grpc.insecure_channel(proc.address) as channel:
        _, finished = generate(inference_pb2_grpc.InferenceStub(channel), **greedy("a garbage collector", 4))
    assert finished.usage.completion_tokens == 4
    events = [json.loads(line) for line in proc.log_text().splitlines() if line.startswith("{")]
    serving = next(e for e in events if e["event"] == "serving")
    # the model, torch, grpc and the tokenizer: hundreds of thousands of objects no collection walks again
    assert serving["gc_frozen_objects"] > 100_000
    # start-up's collections (~0.2-0.4 s on a loaded machine) paused no stream: none is a gc_pause warning
    pauses = [e for e in events if e["event"] == "gc_pause" and e["process"] == "grpc"]
    assert not pauses, pauses
