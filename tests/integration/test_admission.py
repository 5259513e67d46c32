"""Overload and size limits: RESOURCE_EXHAUSTED at once, INVALID_ARGUMENT naming the limit, nothing lost."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from service.proto import inference_pb2
from tests.support.server import generate, greedy, running_server


def _wait(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def small_server(model_cache_dir):  # noqa: ANN001, ANN201
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "1",
                         "--max-waiting-requests", "1", "--max-concurrent-streams", "3",
                         "--max-prompt-bytes", "1000", "--max-receive-message-bytes", "65536",
                         "--max-seq-len", "2048"]) as server:
        yield server


def test_full_queue_is_resource_exhausted_and_queued_work_completes(small_server) -> None:
    stub = small_server.stub()
    engine = small_server.app.engine
    results: dict[str, object] = {}

    def run(name: str, tokens: int) -> None:
        results[name] = generate(stub, **greedy("Once upon a time", tokens))[1]

    long_one = threading.Thread(target=run, args=("running", 600))
    long_one.start()
    _wait(lambda: engine.num_running == 1)
    queued = threading.Thread(target=run, args=("waiting", 5))
    queued.start()
    _wait(lambda: engine.num_waiting == 1)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **greedy("one too many", 5))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry later" in info.value.details()
    long_one.join(120)
    queued.join(120)
    assert results["running"].usage.completion_tokens == 600
    assert results["waiting"].usage.completion_tokens == 5
    _wait(lambda: engine.num_running == 0 and engine.num_free_slots == 1)


def test_prompt_over_the_byte_limit_names_the_limit(small_server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(small_server.stub(), **greedy("x" * 1001, 2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1000 bytes" in info.value.details() and "--max-prompt-bytes" in info.value.details()


def test_message_over_the_receive_limit_is_refused_by_the_transport(small_server) -> None:
    request = inference_pb2.GenerateRequest(text="x" * 100_000)  # 100 kB message, 64 kB limit
    with pytest.raises(grpc.RpcError) as info:
        list(small_server.stub().Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _, finished = generate(small_server.stub(), **greedy("still fine", 2))
    assert finished.usage.completion_tokens == 2
