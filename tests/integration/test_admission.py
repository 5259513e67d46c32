"""Overload and size limits: RESOURCE_EXHAUSTED at once, INVALID_ARGUMENT naming the limit, nothing lost."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from service.proto import inference_pb2, inference_pb2_grpc
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
        # A connection each: a connection may hold at most half of --max-concurrent-streams (here 1).
        channel = grpc.insecure_channel(small_server.address, options=[("grpc.use_local_subchannel_pool", 1)])
        results[name] = generate(inference_pb2_grpc.InferenceStub(channel), **greedy("Once upon a time", tokens))[1]

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


def test_n_samples_count_as_n_waiting_requests(small_server) -> None:
    """--max-waiting-requests 1 with one running: a request for 2 samples would queue 2 (one runs,
    the other waits behind the running one) over an empty queue: refused; one sample is admitted.
    (Its own connection: the server allows one stream per connection here, so on the long one's the
    call would wait, client-side, until that one ended.)"""
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(small_server.address,
                                                                   options=[("grpc.use_local_subchannel_pool", 1)]))
    engine = small_server.app.engine
    long_one = threading.Thread(target=lambda: generate(small_server.stub(), **greedy("Once upon a time", 300)))
    long_one.start()
    _wait(lambda: engine.num_running == 1)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, n=2, **greedy("two samples", 5))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in info.value.details()
    assert generate(stub, n=1, **greedy("one sample", 5))[1].usage.completion_tokens == 5
    long_one.join(120)
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


def test_a_request_waiting_for_an_adapter_slot_does_not_block_base_requests(model_cache_dir, tmp_path) -> None:  # noqa: ANN001
    from service.model import ensure_builtin
    from tests.support.h2client import StallingClient
    from tests.support.lora import make_adapter

    model_dir = ensure_builtin("tiny", model_cache_dir)
    modules = ",".join(f"{n}={make_adapter(model_dir, tmp_path / n, seed=i + 1, r=4)}" for i, n in enumerate("ab"))
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256", "--lora-modules", modules,
                         "--max-loras", "1", "--stream-stall-timeout", "60"]) as server:
        engine = server.app.engine
        hostile = StallingClient(server.address)  # reads nothing: its stream on "a" holds the adapter slot
        try:
            hostile.start_call("/graphserve.v1.Inference/Generate", inference_pb2.GenerateRequest(
                **greedy("never read", 200, adapter="a")).SerializeToString())
            _wait(lambda: engine.num_running == 1)
            waiting = server.stub().Generate(inference_pb2.GenerateRequest(**greedy("needs b", 4, adapter="b")),
                                             timeout=60)
            first = threading.Thread(target=lambda: next(waiting), daemon=True)
            first.start()
            _wait(lambda: len(server.app.streams.active) == 2)
            time.sleep(0.5)
            assert first.is_alive() and engine.num_running == 1  # "b" waits for the slot
            started = time.monotonic()
            _, finished = generate(server.stub(), **greedy("base model", 4))
            # It used to wait behind "b" for the stall timeout (27.5 s in the report).
            assert finished.usage.completion_tokens == 4 and time.monotonic() - started < 5
            assert first.is_alive() and engine.num_running == 1  # "b" still waits for the slot
        finally:
            hostile.close()  # the stream on "a" is cancelled: its slot goes to "b"
        first.join(30)
        assert not first.is_alive()
        assert [r.WhichOneof("kind") for r in waiting][-1] == "finished"


def test_one_channel_with_a_hundred_and_fifty_streams_at_once_loses_none(model_cache_dir) -> None:  # noqa: ANN001
    """The official client on one channel, 150 streams open at once, in waves that end together (the
    closed loop of a load generator, a gateway's connection): every stream completes. A client that
    opens more streams than the connection's HTTP/2 limit, or opens new ones while the server is
    still closing the last wave's, gets REFUSED_STREAM (UNAVAILABLE) from the server, which is why
    the default limit leaves room far above what one client holds."""
    import asyncio

    async def drive(address: str) -> list[object]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            gate = asyncio.Semaphore(150)

            async def one(i: int) -> object:
                async with gate:
                    try:
                        messages = [m async for m in stub.Generate(inference_pb2.GenerateRequest(
                            **greedy(f"stream {i}", 4)), timeout=120)]
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return messages[-1].finished.usage.completion_tokens

            return await asyncio.gather(*(one(i) for i in range(450)))

    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "150",
                         "--max-seq-len", "256"]) as server:
        results = asyncio.run(drive(server.address))
        assert results == [4] * 450, {r for r in results if r != 4}
        _wait(lambda: server.app.engine.num_running == 0 and not server.app.streams.active)
