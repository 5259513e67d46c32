"""Generate over a real gRPC server on loopback with the built-in model."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from service.proto import inference_pb2
from tests.support.server import generate, generate_samples, greedy

PROMPTS = ["Once upon a time", "The quick brown fox", "graphs and caches", "hello", "日本語のテキスト", "a b c d e f"]


def test_stream_yields_exactly_max_tokens_with_finish_reason_length(server) -> None:
    chunks, finished = generate(server.stub(), **greedy("Once upon a time", 20))
    ids = [i for c in chunks for i in c.token_ids]
    assert len(ids) == 20
    assert finished.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert finished.usage.completion_tokens == 20
    assert finished.usage.prompt_tokens > 0
    assert finished.timings.total_seconds >= finished.timings.time_to_first_token_seconds > 0


def test_text_deltas_concatenate_to_the_decoded_completion(server) -> None:
    chunks, _ = generate(server.stub(), **greedy("日本語のテキスト", 40))
    ids = [i for c in chunks for i in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert text == server.app.tokenizer.decode(ids, skip_special_tokens=True)


def test_request_id_is_echoed_or_assigned(server) -> None:
    stub = server.stub()
    responses = list(stub.Generate(inference_pb2.GenerateRequest(request_id="mine-1", **greedy("hi", 3))))
    assert {r.request_id for r in responses} == {"mine-1"}
    responses = list(stub.Generate(inference_pb2.GenerateRequest(**greedy("hi", 3))))
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id


def test_token_id_prompt_and_stream_interval(server) -> None:
    chunks, finished = generate(server.stub(), token_ids=inference_pb2.TokenIds(ids=[5, 6, 7]),
                                sampling=inference_pb2.SamplingParams(temperature=0.0),
                                stopping=inference_pb2.StoppingCriteria(max_tokens=10, ignore_eos=True),
                                stream_interval=4)
    assert finished.usage.prompt_tokens == 3
    assert sum(len(c.token_ids) for c in chunks) == 10
    assert all(len(c.token_ids) >= 4 for c in chunks[:-1])


def test_seeded_sampling_is_reproducible_and_reported(server) -> None:
    request = dict(text="Once upon a time", sampling=inference_pb2.SamplingParams(temperature=1.0, seed=1234),
                   stopping=inference_pb2.StoppingCriteria(max_tokens=16, ignore_eos=True))
    a, fa = generate(server.stub(), **request)
    b, fb = generate(server.stub(), **request)
    # Chunk boundaries may differ (a lagging client gets merged chunks); the tokens may not.
    assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
    assert fa.seed == fb.seed == 1234
    _, fc = generate(server.stub(), text="x", stopping=inference_pb2.StoppingCriteria(max_tokens=2))
    assert fc.seed != 0  # assigned by the server and reported


def test_stop_token_id_ends_the_stream(server) -> None:
    chunks, _ = generate(server.stub(), **greedy("The quick brown fox", 12))
    ids = [i for c in chunks for i in c.token_ids]
    stop_id = ids[5]
    first = ids.index(stop_id)
    chunks, finished = generate(server.stub(), text="The quick brown fox",
                                sampling=inference_pb2.SamplingParams(temperature=0.0),
                                stopping=inference_pb2.StoppingCriteria(max_tokens=12, ignore_eos=True,
                                                                        stop_token_ids=[stop_id]))
    assert [i for c in chunks for i in c.token_ids] == ids[:first]
    assert finished.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert finished.stop_token_id == stop_id


def test_stop_string_is_not_streamed(server) -> None:
    chunks, _ = generate(server.stub(), **greedy("Once upon a time", 30))
    full = "".join(c.text for c in chunks)
    stop = full[10:13]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    cut = full.index(stop)
    chunks, finished = generate(server.stub(), text="Once upon a time",
                                sampling=inference_pb2.SamplingParams(temperature=0.0),
                                stopping=inference_pb2.StoppingCriteria(max_tokens=30, ignore_eos=True, stop=[stop]))
    assert "".join(c.text for c in chunks) == full[:cut]
    assert finished.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert finished.stop_string == stop


def test_sixteen_concurrent_streams_match_their_solo_runs(server) -> None:
    requests = [greedy(PROMPTS[i % len(PROMPTS)], 8 + 5 * i) for i in range(16)]
    stub = server.stub()
    solo = [[i for c in generate(stub, **r)[0] for i in c.token_ids] for r in requests]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda r: [i for c in generate(stub, **r)[0] for i in c.token_ids], requests))
    assert together == solo
    assert [len(t) for t in together] == [8 + 5 * i for i in range(16)]


def _wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    engine = server.app.engine
    while time.monotonic() < deadline:
        if engine.num_running == 0 and engine.num_waiting == 0 and engine.num_free_slots == 16:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: running={engine.num_running} waiting={engine.num_waiting}")


def test_cancelling_half_the_streams_leaves_the_others_correct(server) -> None:
    stub = server.stub()
    requests = [greedy(PROMPTS[i % len(PROMPTS)], 60) for i in range(16)]
    expected = {i: [t for c in generate(stub, **requests[i])[0] for t in c.token_ids] for i in range(0, 16, 2)}
    results: dict[int, object] = {}

    def consume(i: int) -> None:
        call = stub.Generate(inference_pb2.GenerateRequest(**requests[i]), timeout=60)
        ids = []
        try:
            for response in call:
                ids += response.chunk.token_ids
                if i % 2 == 1 and len(ids) >= 5:
                    call.cancel()
            results[i] = ids
        except grpc.RpcError as exc:
            results[i] = exc.code()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(16):
        if i % 2 == 0:
            assert results[i] == expected[i]
        else:
            assert results[i] == grpc.StatusCode.CANCELLED
    _wait_idle(server)


def test_deadline_aborts_the_request_and_frees_its_slot(server) -> None:
    stub = server.stub()
    # A deadline at a third of what the whole generation takes on this machine (CPU or a GPU with
    # graphs), so that it expires while the request is generating.
    started = time.monotonic()
    generate(stub, **greedy("Once upon a time", 480))
    deadline = (time.monotonic() - started) / 3
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, timeout=deadline, **greedy("Once upon a time", 480))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(server)


def test_model_info(server) -> None:
    info = server.stub().GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == server.app.model.spec.vocab_size
    assert info.max_sequence_length == 512


def test_resubmitting_a_cancelled_request_id_at_once_is_served(server) -> None:
    """The engine sees the abort of the first call after the second call's submit: both must be fine."""
    stub = server.stub()
    for _ in range(5):
        call = stub.Generate(inference_pb2.GenerateRequest(request_id="retry-me", **greedy("Once upon a time", 200)),
                             timeout=60)
        next(call)
        call.cancel()
        _, finished = generate(stub, request_id="retry-me", **greedy("Once upon a time", 5))
        assert finished.usage.completion_tokens == 5 and finished.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert server.app.engine.alive
    _wait_idle(server)


def test_n_samples_stream_interleaved_each_with_its_seed(server) -> None:
    stub = server.stub()
    request = dict(text="Once upon a time", sampling=inference_pb2.SamplingParams(temperature=1.0, seed=9),
                   stopping=inference_pb2.StoppingCriteria(max_tokens=12, ignore_eos=True))
    chunks, finished = generate_samples(stub, 4, **request)
    assert [f.seed for f in finished] == [9, 10, 11, 12] and all(f.usage.completion_tokens == 12 for f in finished)
    for i in range(len(finished)):
        alone, _ = generate(stub, text="Once upon a time", sampling=inference_pb2.SamplingParams(temperature=1.0, seed=9 + i),
                            stopping=request["stopping"])
        assert [t for c in chunks if c.index == i for t in c.token_ids] == [t for c in alone for t in c.token_ids]
    for bad in (0, 17):
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, n=bad, **request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16]" in info.value.details()


def test_cancelling_an_n_sample_stream_frees_every_sample(server) -> None:
    call = server.stub().Generate(inference_pb2.GenerateRequest(n=3, **greedy("Once upon a time", 400)), timeout=60)
    seen = set()
    for response in call:
        seen.add(response.chunk.index)
        if len(seen) == 3:
            call.cancel()
            break
    assert server.app.engine.num_running == 3
    _wait_idle(server)
