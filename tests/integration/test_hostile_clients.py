"""Clients that do what well-behaved ones never do: open many streams and read nothing, send bytes
that are not a request, burst an idle server, reuse another client's request id."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
import structlog

from service.proto import inference_pb2, inference_pb2_grpc
from tests.support.h2client import StallingClient
from tests.support.server import ServerThread, generate, greedy, running_server

GENERATE = "/graphserve.v1.Inference/Generate"


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def long_request(max_tokens: int, **extra) -> bytes:  # noqa: ANN003
    return inference_pb2.GenerateRequest(**greedy("an unread story", max_tokens, **extra)).SerializeToString()


def metric(server: ServerThread, name: str, **labels: str) -> float:
    return server.app.metrics.registry.get_sample_value(name, labels or None) or 0.0


@pytest.fixture
def start(model_cache_dir):  # noqa: ANN001, ANN201
    servers: list = []

    def start(*argv: str) -> ServerThread:
        cm = running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256", *argv])
        servers.append(cm)
        return cm.__enter__()

    yield start
    for cm in reversed(servers):
        cm.__exit__(None, None, None)


def test_one_connection_cannot_take_every_stream_slot(start) -> None:  # noqa: ANN001
    server = start("--max-concurrent-streams", "8", "--max-streams-per-connection", "4",
                   "--stream-stall-timeout", "60")
    hostile = StallingClient(server.address)
    try:
        for _ in range(8):  # all sent before the server's settings arrive: the server must refuse the excess
            hostile.start_call(GENERATE, long_request(200))
        hostile.pump(1.0)
        assert hostile.max_concurrent_streams == 4
        assert wait_until(lambda: len(server.app.streams.active) == 4, 10), len(server.app.streams.active)
        time.sleep(0.5)
        assert len(server.app.streams.active) == 4
        _, finished = generate(server.stub(), **greedy("another client", 4))
        assert finished.usage.completion_tokens == 4
    finally:
        hostile.close()
    assert wait_until(lambda: not server.app.streams.active and server.app.engine.num_running == 0)


def test_by_default_one_connection_gets_at_most_half_the_streams(start) -> None:  # noqa: ANN001
    # The per-connection default (512) is above this global cap: without the halving one connection would take all 16.
    server = start("--max-concurrent-streams", "16", "--stream-stall-timeout", "60")
    hostile = StallingClient(server.address)
    try:
        for _ in range(20):
            hostile.start_call(GENERATE, long_request(200))
        hostile.pump(1.0)
        assert hostile.max_concurrent_streams == 8
        assert wait_until(lambda: len(server.app.streams.active) == 8, 10), len(server.app.streams.active)
        time.sleep(0.3)
        assert len(server.app.streams.active) == 8
        _, finished = generate(server.stub(), **greedy("another client", 4))
        assert finished.usage.completion_tokens == 4
    finally:
        hostile.close()
    assert wait_until(lambda: not server.app.streams.active and server.app.engine.num_running == 0)


def test_a_stream_whose_client_reads_nothing_is_aborted_after_the_stall_timeout(start) -> None:  # noqa: ANN001
    # Two connections of two streams each: a connection may hold at most half of --max-concurrent-streams.
    server = start("--max-concurrent-streams", "4", "--stream-stall-timeout", "4")
    hostile, second = StallingClient(server.address), StallingClient(server.address)
    try:
        streams = [c.start_call(GENERATE, long_request(100)) for c in (hostile, hostile)]
        others = [c.start_call(GENERATE, long_request(100)) for c in (second, second)]
        assert wait_until(lambda: len(server.app.streams.active) == 4, 10)
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub(), **greedy("blocked for now", 4))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The slots come back once the stall timeout passed, while the hostile socket stays open.
        assert wait_until(lambda: not server.app.streams.active, 30)
        _, finished = generate(server.stub(), **greedy("served again", 4))
        assert finished.usage.completion_tokens == 4
        assert wait_until(lambda: server.app.engine.num_running == 0, 10)
        assert metric(server, "graphserve_requests_rejected_total", reason="stream_stalled") == 4
        hostile.pump(0.5)
        second.pump(0.5)
        assert all(hostile.status_of(s) is None or hostile.status_of(s)["grpc-status"] != "0" for s in streams)
        assert all(second.status_of(s) is None or second.status_of(s)["grpc-status"] != "0" for s in others)
    finally:
        hostile.close()
        second.close()


def test_an_unread_stream_stops_generating_at_the_backlog_bound(start) -> None:  # noqa: ANN001
    server = start("--max-stream-backlog-tokens", "16", "--stream-stall-timeout", "60")
    hostile = StallingClient(server.address)
    try:
        hostile.start_call(GENERATE, long_request(240))
        generated = lambda: metric(server, "graphserve_generated_tokens_total")  # noqa: E731
        assert wait_until(lambda: generated() >= 16, 30)
        hostile.pump(2.0)  # time for 240 tokens many times over, were they generated
        first = generated()
        hostile.pump(1.0)
        # The bound, plus the steps the engine ran before the pause reached it (a loaded machine).
        assert first == generated() and first <= 16 + 48, f"{first} tokens generated for an unread stream"
        assert server.app.engine.num_running == 1  # paused, holding its slot: a reader would get every token
        _, finished = generate(server.stub(), **greedy("a reader is not slowed", 4))
        assert finished.usage.completion_tokens == 4
    finally:
        hostile.close()
    assert wait_until(lambda: not server.app.streams.active and server.app.engine.num_running == 0)


def test_a_slow_reader_gets_every_token(start) -> None:  # noqa: ANN001
    server = start("--max-stream-backlog-tokens", "4")
    call = server.stub().Generate(inference_pb2.GenerateRequest(**greedy("read slowly", 60)), timeout=60)
    tokens, finished = [], None
    for response in call:
        time.sleep(0.05)
        if response.WhichOneof("kind") == "chunk":
            tokens += response.chunk.token_ids
        else:
            finished = response.finished
    assert finished.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == finished.usage.completion_tokens == 60
    _, fast = generate(server.stub(), **greedy("read slowly", 60))
    assert fast.usage.completion_tokens == 60


def test_undecodable_bytes_are_invalid_argument_logged_and_counted(server: ServerThread) -> None:
    raw = server.channel().unary_stream(GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    not_utf8 = bytes([0x12, 2, 0xFF, 0xFE])  # field 2 (text), 2 bytes that are not UTF-8
    before = metric(server, "graphserve_requests_rejected_total", reason="undecodable")
    with structlog.testing.capture_logs() as logs:
        for body in (b"\xff\xff\xff\xff", not_utf8):
            with pytest.raises(grpc.RpcError) as info:
                list(raw(body, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "do not decode as the Generate request" in info.value.details()
            assert "Error" not in info.value.details()  # no internal exception class
    assert metric(server, "graphserve_requests_rejected_total", reason="undecodable") == before + 2
    assert any(e["event"] == "request_undecodable" for e in logs)
    _, finished = generate(server.stub(), **greedy("still serving", 2))
    assert finished.usage.completion_tokens == 2


def test_a_burst_to_an_idle_server_fills_the_slots_then_the_queue(start) -> None:  # noqa: ANN001
    server = start("--max-running-seqs", "2", "--max-waiting-requests", "4", "--max-seq-len", "2048")
    stub = server.stub()
    calls = [stub.Generate(inference_pb2.GenerateRequest(**greedy(f"burst {i}", 2000)), timeout=120)
             for i in range(20)]
    outcomes: list[grpc.StatusCode | None] = []
    lock = threading.Lock()

    def first(call) -> None:  # noqa: ANN001
        try:
            next(call)
            code = None
        except grpc.RpcError as exc:
            code = exc.code()
        with lock:
            outcomes.append(code)

    threads = [threading.Thread(target=first, args=(call,), daemon=True) for call in calls]
    for t in threads:
        t.start()
    try:
        rejected = lambda: sum(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in outcomes)  # noqa: E731
        assert wait_until(lambda: rejected() >= 14, 30)
        time.sleep(1.0)
        assert rejected() == 14, outcomes  # 2 running + 4 waiting admitted
        assert len(server.app.streams.active) == 6
    finally:
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(10)
    assert wait_until(lambda: server.app.engine.num_running == 0)


def test_request_ids_are_scoped_to_the_connection(start) -> None:  # noqa: ANN001
    server = start()

    def own_connection() -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(
            grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)]))

    alice, mallory = own_connection(), own_connection()
    call = alice.Generate(inference_pb2.GenerateRequest(**greedy("secret", 200, request_id="alice-42")), timeout=60)
    try:
        assert next(call).request_id == "alice-42"
        # Another connection learns nothing: its own stream with that id is served.
        chunks, finished = generate(mallory, **greedy("probe", 2, request_id="alice-42"))
        assert finished.usage.completion_tokens == 2
        # The same connection is told its id is in use.
        with pytest.raises(grpc.RpcError) as info:
            generate(alice, **greedy("again", 2, request_id="alice-42"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already streaming" in info.value.details()
    finally:
        call.cancel()


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_chat_flood_is_refused_quickly_in_bounded_memory_and_does_not_stall_another_stream(
        process_factory) -> None:  # noqa: ANN001
    from grpc_health.v1 import health_pb2

    proc = process_factory("--max-seq-len", "256")
    proc.wait_for_health(health_pb2.HealthCheckResponse.SERVING)
    stub = inference_pb2_grpc.InferenceStub(proc.channel)
    generate(stub, **greedy("warm up", 2))
    before = _peak_rss_bytes(proc.proc.pid)
    one_byte = inference_pb2.ChatMessage(role="user", content="x")

    def chat_bytes(count: int) -> bytes:
        return inference_pb2.GenerateRequest(messages=inference_pb2.ChatMessages(messages=[one_byte] * count)
                                             ).SerializeToString()

    floods = {  # 2.9 MB on the wire: took 7 s and 1.4 GB of the gRPC process before it was refused
        "many messages": (chat_bytes(260_000), "at most 1024 are allowed (--max-chat-messages)"),
        # Under 16 KiB of content: rendered and tokenized whole on the event loop, 1.2 s gaps elsewhere.
        "long conversation": (chat_bytes(1000), "prompt.messages has more than 255 tokens"),
    }
    # Sent as bytes: the flood costs this process (where the reader runs too) no serialization.
    raw = proc.channel.unary_stream(GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    stop, gaps, outcomes = threading.Event(), [], []

    def read_another_stream() -> None:
        while not stop.is_set():
            last = time.monotonic()
            for _ in stub.Generate(inference_pb2.GenerateRequest(**greedy("a reader", 200)), timeout=60):
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

    def flood(name: str) -> None:
        for _ in range(3):
            started = time.monotonic()
            try:
                list(raw(floods[name][0], timeout=60))
                outcomes.append((name, None, "", 0.0))
            except grpc.RpcError as exc:
                outcomes.append((name, exc.code(), exc.details(), time.monotonic() - started))

    reader = threading.Thread(target=read_another_stream)
    reader.start()
    time.sleep(0.3)
    flooders = [threading.Thread(target=flood, args=(name,)) for name in floods for _ in range(3)]
    for t in flooders:
        t.start()
    for t in flooders:
        t.join(120)
    stop.set()
    reader.join(60)
    assert len(outcomes) == 18
    for name, code, details, seconds in outcomes:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and floods[name][1] in details, (name, code, details)
        assert seconds < 3.0, (name, seconds)
    grown = _peak_rss_bytes(proc.proc.pid) - before
    assert grown < 150 << 20, f"peak RSS of the gRPC process grew by {grown >> 20} MiB"
    # One token every ~3 ms alone; a flood used to stop this stream for 1.2 s at a time.
    assert max(gaps) < 0.5, f"another stream waited {max(gaps):.2f} s for a token"
