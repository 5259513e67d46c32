"""vLLM's engine protocol (vllm.grpc.engine.VllmEngine) on the server's port, through a stub generated
from smg-grpc-proto: what a gateway sees, compared with what graphserve.v1 streams."""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import threading
import time
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as v
from transformers import AutoTokenizer

from service.proto import inference_pb2 as pb
from tests.support.server import generate

PROMPT = [5, 17, 99, 230, 41, 8]


@pytest.fixture(scope="module")
def engine(server) -> vllm_engine_pb2_grpc.VllmEngineStub:  # noqa: ANN001
    return vllm_engine_pb2_grpc.VllmEngineStub(server.channel())


def greedy_params(max_tokens: int, **extra) -> v.SamplingParams:  # noqa: ANN003
    return v.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def run(engine, request: v.GenerateRequest, timeout: float = 60) -> tuple[list, v.GenerateComplete]:  # noqa: ANN001
    chunks, complete = [], None
    for response in engine.Generate(request, timeout=timeout):
        assert complete is None, "a message arrived after the complete message"
        if response.WhichOneof("response") == "chunk":
            chunks.append(response.chunk)
        else:
            complete = response.complete
    assert complete is not None, "the stream ended without a complete message"
    return chunks, complete


def graphserve_ids(server, ids: list[int], max_tokens: int, **stopping) -> tuple[list[int], pb.Finished]:  # noqa: ANN001, ANN003
    chunks, finished = generate(server.stub(), token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0),
                                stopping=pb.StoppingCriteria(max_tokens=max_tokens, **stopping))
    return [t for c in chunks for t in c.token_ids], finished


def test_streamed_tokens_equal_graphserve_v1(server, engine) -> None:  # noqa: ANN001
    expected, _ = graphserve_ids(server, PROMPT, 20, ignore_eos=True)
    chunks, complete = run(engine, v.GenerateRequest(request_id="same-1", tokenized=v.TokenizedInput(input_ids=PROMPT),
                                                     sampling_params=greedy_params(20), stream=True))
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == expected
    assert all(c.completion_tokens == len(c.token_ids) and c.prompt_tokens == len(PROMPT) for c in chunks)
    assert list(complete.output_ids) == expected
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", len(PROMPT), 20)


def test_unstreamed_request_gets_one_complete_message(server, engine) -> None:  # noqa: ANN001
    expected, _ = graphserve_ids(server, PROMPT, 12, ignore_eos=True)
    chunks, complete = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT),
                                                     sampling_params=greedy_params(12), stream=False))
    assert chunks == []
    assert list(complete.output_ids) == expected


def test_text_input_is_tokenized_by_the_server(server, engine) -> None:  # noqa: ANN001
    ids = server.app.tokenizer.encode("Once upon a time", add_special_tokens=True)
    expected, _ = graphserve_ids(server, ids, 8, ignore_eos=True)
    _, complete = run(engine, v.GenerateRequest(text="Once upon a time", sampling_params=greedy_params(8), stream=True))
    assert list(complete.output_ids) == expected and complete.prompt_tokens == len(ids)


def test_stop_token_and_stop_string_are_reported_as_vllm_does(server, engine) -> None:  # noqa: ANN001
    free, _ = graphserve_ids(server, PROMPT, 16, ignore_eos=True)
    stop_id = free[5]
    _, complete = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), stream=True,
                                                sampling_params=greedy_params(16, stop_token_ids=[stop_id])))
    assert complete.finish_reason == "stop" and complete.WhichOneof("matched_stop") == "matched_token_id"
    assert complete.matched_token_id == stop_id
    assert list(complete.output_ids) == free[:free.index(stop_id)]
    text = server.app.tokenizer.decode(free, skip_special_tokens=True)
    stop = text.strip()[:2] if len(text.strip()) >= 4 else None
    if stop:
        ids, finished = graphserve_ids(server, PROMPT, 16, ignore_eos=True, stop=[stop])
        _, complete = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), stream=True,
                                                    sampling_params=greedy_params(16, stop=[stop])))
        assert complete.finish_reason == "stop" and complete.matched_stop_str == stop == finished.stop_string
        assert list(complete.output_ids) == ids


def _stop_string_in(text: str) -> str:
    """Two visible characters from about a third into text."""
    for start in range(len(text) // 3, len(text) - 1):
        piece = text[start:start + 2]
        if piece.strip() and "\ufffd" not in piece and piece.isprintable():
            return piece
    raise AssertionError(f"no stop string to pick in {text!r}")


def test_concurrent_streams_with_stop_strings_and_cancels_match_graphserve_v1(server, engine) -> None:  # noqa: ANN001
    """Twelve streams at once (token ids only: the engine decodes their text for stop strings
    alone), half with a stop string, three cancelled after their first ids: each other one streams
    every id once and in order, the ids graphserve.v1 gives the same request, ending at the same
    stop; a cancelled one a prefix of them."""
    prompts = [[5 + i, 17, 99, 230 - i, 41, 8 + 3 * i] for i in range(12)]
    cancelled = {3, 7, 11}  # long enough not to end before the cancel
    max_tokens = {i: 200 if i in cancelled else 24 for i in range(12)}
    stops: dict[int, str] = {}
    expected: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        chunks, _ = generate(server.stub(), token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens[i], ignore_eos=True))
        stop = [_stop_string_in("".join(c.text for c in chunks))] if i % 2 == 0 else []
        expected[i], finished = graphserve_ids(server, prompt, max_tokens[i], ignore_eos=True, stop=stop)
        if stop:
            assert finished.stop_string == stop[0]
            stops[i] = stop[0]

    def consume(i: int) -> tuple[list[int], object]:
        call = engine.Generate(v.GenerateRequest(
            request_id=f"together-{i}", tokenized=v.TokenizedInput(input_ids=prompts[i]), stream=True,
            sampling_params=greedy_params(max_tokens[i], stop=[stops[i]] if i in stops else [])), timeout=60)
        ids, complete = [], None
        try:
            for response in call:
                if response.WhichOneof("response") == "chunk":
                    ids += response.chunk.token_ids
                    if i in cancelled and len(ids) >= 2:
                        call.cancel()
                else:
                    complete = response.complete
            return ids, complete
        except grpc.RpcError as exc:
            return ids, exc.code()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(consume, range(12)))
    for i, (ids, end) in enumerate(results):
        if i in cancelled:
            assert end == grpc.StatusCode.CANCELLED and ids == expected[i][:len(ids)], i
            continue
        assert ids == list(end.output_ids) == expected[i], i
        if i in stops:
            assert (end.finish_reason, end.matched_stop_str) == ("stop", stops[i]), i
        else:
            assert (end.finish_reason, end.completion_tokens) == ("length", 24), i


def test_abort_ends_the_stream_and_frees_the_slot(server, engine) -> None:  # noqa: ANN001
    call = engine.Generate(v.GenerateRequest(request_id="to-abort", tokenized=v.TokenizedInput(input_ids=PROMPT),
                                             sampling_params=greedy_params(400), stream=True), timeout=60)
    first = next(call)
    assert first.WhichOneof("response") == "chunk"
    engine.Abort(v.AbortRequest(request_ids=["to-abort", "never-seen"]), timeout=10)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 400
    deadline = time.monotonic() + 10
    while server.app.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.app.engine.num_running == 0


def test_cancelled_call_is_aborted_in_the_engine(server, engine) -> None:  # noqa: ANN001
    call = engine.Generate(v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT),
                                             sampling_params=greedy_params(400), stream=True), timeout=60)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while (server.app.engine.num_running or server.app.streams.active) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.app.engine.num_running == 0 and not server.app.streams.active


def test_loads_report_a_running_request(server, engine) -> None:  # noqa: ANN001
    idle = engine.GetLoads(v.GetLoadsRequest(), timeout=10)
    assert idle.dp_rank_count == 1 and idle.loads[0].num_running_reqs == 0 and idle.loads[0].token_usage == 0
    call = engine.Generate(v.GenerateRequest(request_id="load-1", tokenized=v.TokenizedInput(input_ids=PROMPT),
                                             sampling_params=greedy_params(400), stream=True), timeout=60)
    next(call)
    busy = engine.GetLoads(v.GetLoadsRequest(), timeout=10).loads[0]
    engine.Abort(v.AbortRequest(request_ids=["load-1"]), timeout=10)
    list(call)
    assert busy.num_running_reqs == 1 and busy.max_running_requests == 16
    # KV usage in tokens of the blocks held (16 each): the prompt and the tokens so far, of the pool's
    assert busy.num_used_tokens % 16 == 0 and busy.num_used_tokens >= 16 and busy.max_total_num_tokens % 16 == 0
    assert busy.token_usage == pytest.approx(busy.num_used_tokens / busy.max_total_num_tokens)


def test_model_and_server_info(server, engine) -> None:  # noqa: ANN001
    info = engine.GetModelInfo(v.GetModelInfoRequest(), timeout=10)
    spec = server.app.model.spec
    assert info.served_model_name == "builtin:tiny" and info.is_generation and not info.supports_vision
    assert (info.vocab_size, info.max_context_length) == (spec.vocab_size, 512)
    assert list(info.eos_token_ids) == list(spec.eos_token_ids) and info.architectures == [spec.architecture]
    assert info.model_type == "llama" and info.tokenizer_path == info.model_path == server.app.model.model_path
    server_info = engine.GetServerInfo(v.GetServerInfoRequest(), timeout=10)
    assert server_info.server_type == "graphserve" and server_info.data_parallel_size == 1
    assert server_info.max_num_seqs == 16 and server_info.uptime_seconds > 0
    assert engine.HealthCheck(v.HealthCheckRequest(), timeout=10).healthy


def test_tokenizer_bundle_rebuilds_the_servers_tokenizer(server, engine, tmp_path) -> None:  # noqa: ANN001
    chunks = list(engine.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(archive.namelist())
        archive.extractall(tmp_path)
    remote = AutoTokenizer.from_pretrained(tmp_path)
    text = "Once upon a time, a graph was captured."
    assert remote.encode(text) == server.app.tokenizer.encode(text)
    conversation = [{"role": "user", "content": "hi"}]
    assert remote.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
        server.app.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_both_services_in_reflection_and_health(server) -> None:  # noqa: ANN001
    channel = server.channel()
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for s in answer.list_services_response.service}
    assert {"graphserve.v1.Inference", "vllm.grpc.engine.VllmEngine"} <= names
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine"), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


UNSUPPORTED = {
    "embeddings": ("Embed", v.EmbedRequest(tokenized=v.TokenizedInput(input_ids=PROMPT)), "UNIMPLEMENTED", "embeddings"),
    "profiler": ("StartProfile", common_pb2.StartProfileRequest(), "UNIMPLEMENTED", "profiler"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_what_graphserve_does_not_do_is_unimplemented(engine, name: str) -> None:  # noqa: ANN001
    method, request, code, needle = UNSUPPORTED[name]
    with pytest.raises(grpc.RpcError) as info:
        result = getattr(engine, method)(request, timeout=10)
        list(result) if not isinstance(result, type(request)) else None  # server-streaming calls
    assert info.value.code().name == code and needle in info.value.details()


def test_flush_cache_empties_the_prefix_cache(server, engine) -> None:  # noqa: ANN001
    prompt = list(range(40, 40 + 80))  # five full blocks of 16
    request = v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=prompt), sampling_params=greedy_params(2))
    _, first = run(engine, request)
    _, again = run(engine, request)
    assert again.cached_tokens >= 64, "the second request should find the first's blocks"
    answer = engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    assert answer.success, answer.message
    _, after = run(engine, request)
    assert after.cached_tokens == 0 and list(after.output_ids) == list(first.output_ids)


def tok(**params) -> v.GenerateRequest:  # noqa: ANN003
    return v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=v.SamplingParams(**params))


BAD_REQUESTS = {
    "no input": (v.GenerateRequest(), "input"),
    "empty text": (v.GenerateRequest(text=""), "text is empty"),
    "empty token ids": (v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=[])), "tokenized.input_ids is empty"),
    "token id past vocab": (v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=[1, 10**6])), "outside the vocabulary"),
    "prompt over the context": (v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=[1] * 600)), "--max-seq-len"),
    "oversize text": (v.GenerateRequest(text="x" * (2 * 1024 * 1024)), "--max-prompt-bytes"),
    "max_tokens over the limit": (tok(max_tokens=10**6), "sampling_params.max_tokens"),
    "max_tokens over the context": (tok(max_tokens=600), "sampling_params.max_tokens"),
    "negative temperature": (tok(temperature=-1), "sampling_params.temperature"),
    "top_p above one": (tok(top_p=1.5), "sampling_params.top_p"),
    "stop id past vocab": (tok(stop_token_ids=[10**6]), "sampling_params.stop_token_ids"),
    "empty stop string": (tok(stop=[""]), "sampling_params.stop"),
    "all logprobs": (tok(logprobs=-1), "sampling_params.logprobs"),
    "too many logprobs": (tok(logprobs=21), "sampling_params.logprobs"),
    "all prompt logprobs": (tok(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
    "n above the limit": (tok(n=17), "sampling_params.n"),
    "penalty out of range": (tok(frequency_penalty=2.5), "sampling_params.frequency_penalty"),
    "repetition penalty below zero": (tok(repetition_penalty=-1), "sampling_params.repetition_penalty"),
    "min_p above one": (tok(min_p=1.5), "sampling_params.min_p"),
    "min_tokens over max_tokens": (tok(min_tokens=9, max_tokens=4), "sampling_params.min_tokens"),
    "invalid json schema": (tok(json_schema='{"type": "object"'), "sampling_params.json_schema"),
    "structural tag": (tok(structural_tag='{"type": "structural_tag"}'), "sampling_params.structural_tag"),
    "logit bias past vocab": (tok(logit_bias={10**6: 5.0}), "sampling_params.logit_bias"),
    "logit bias too large": (tok(logit_bias={3: 500.0}), "sampling_params.logit_bias[3]"),
    "multimodal": (v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), mm_inputs=v.MultimodalInputs()),
                   "multimodal"),
    "pd transfer": (v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), kv_transfer_params_json="{}"),
                    "disaggregation"),
    "dp rank": (v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), data_parallel_rank=3), "data_parallel_rank"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_serving_continues(server, engine, name: str) -> None:  # noqa: ANN001
    request, needle = BAD_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as info:
        list(engine.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    _, complete = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT),
                                                sampling_params=greedy_params(3), stream=True))
    assert complete.completion_tokens == 3


def test_unknown_fields_are_refused_by_number(server, engine) -> None:  # noqa: ANN001
    """A newer gateway's field that this worker cannot read must not be dropped silently."""
    request = v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=greedy_params(3))
    wire = request.SerializeToString() + bytes([0xF8, 0x06, 0x01])  # field 111, varint 1
    call = server.channel().unary_stream("/vllm.grpc.engine.VllmEngine/Generate", request_serializer=None,
                                         response_deserializer=v.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        list(call(wire, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "field 111" in info.value.details()


def test_a_duplicate_request_id_is_refused_while_it_streams(server, engine) -> None:  # noqa: ANN001
    request = v.GenerateRequest(request_id="twice", tokenized=v.TokenizedInput(input_ids=PROMPT),
                                sampling_params=greedy_params(400), stream=True)
    call = engine.Generate(request, timeout=60)
    next(call)
    errors: list[grpc.RpcError] = []

    def second() -> None:
        try:
            list(engine.Generate(request, timeout=30))
        except grpc.RpcError as exc:
            errors.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(30)
    engine.Abort(v.AbortRequest(request_ids=["twice"]), timeout=10)
    list(call)
    assert errors and errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT and "already streaming" in errors[0].details()


def test_logprobs_stream_with_their_tokens_and_match_graphserve_v1(server, engine) -> None:  # noqa: ANN001
    params = greedy_params(10, logprobs=3)
    chunks, complete = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT),
                                                     sampling_params=params, stream=True))
    streamed = [t for c in chunks for t in c.output_logprobs.token_ids]
    assert streamed == [t for c in chunks for t in c.token_ids] == list(complete.output_ids)
    values = [lp for c in chunks for lp in c.output_logprobs.token_logprobs]
    tops = [top for c in chunks for top in c.output_logprobs.top_logprobs]
    assert len(values) == len(tops) == 10 and all(len(t.token_ids) == 3 for t in tops)
    # Greedy: the sampled token is the most likely one.
    assert [t.token_ids[0] for t in tops] == streamed
    assert values == pytest.approx([t.values[0] for t in tops])
    _, whole = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=params,
                                             stream=False))
    assert list(whole.output_logprobs.token_ids) == streamed
    assert list(whole.output_logprobs.token_logprobs) == pytest.approx(values, abs=1e-5)
    _, graphserve = generate(server.stub(), token_ids=pb.TokenIds(ids=PROMPT),
                             sampling=pb.SamplingParams(temperature=0, logprobs=3),
                             stopping=pb.StoppingCriteria(max_tokens=10, ignore_eos=True))
    theirs = [lp.logprob for c in _ for lp in c.logprobs]
    assert theirs == pytest.approx(values, abs=1e-5)


def test_penalties_bias_and_min_tokens_change_what_is_generated(server, engine) -> None:  # noqa: ANN001
    free, _ = graphserve_ids(server, PROMPT, 12, ignore_eos=True)
    request = v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT),
                                sampling_params=greedy_params(12, logit_bias={free[0]: -100.0}))
    _, complete = run(engine, request)
    assert complete.output_ids[0] != free[0]
    forced = v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT),
                               sampling_params=greedy_params(12, logit_bias={77: 100.0}))
    assert set(run(engine, forced)[1].output_ids) == {77}
    repeated = v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=greedy_params(
        12, logit_bias={77: 5.0}, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0))
    ids = list(run(engine, repeated)[1].output_ids)
    assert ids.count(77) < 12  # the penalties push back against the bias
    eos = server.app.tokenizer.eos_token_id
    early_end = v.SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, logit_bias={eos: 100.0})
    _, ended = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=early_end))
    assert (ended.finish_reason, ended.completion_tokens, len(ended.output_ids)) == ("stop", 6, 5)


def test_n_samples_share_the_prompt_and_each_reproduces_its_seed(server, engine) -> None:  # noqa: ANN001
    prompt = list(range(200, 240))  # two full blocks of 16 and 8 more
    params = v.SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True, n=3)
    for stream in (True, False):
        chunks, completes = [], []
        for response in engine.Generate(v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=prompt),
                                                          sampling_params=params, stream=stream), timeout=60):
            if response.WhichOneof("response") == "chunk":
                chunks.append(response.chunk)
            else:
                completes.append(response.complete)
        assert sorted(c.index for c in completes) == [0, 1, 2]
        by_index = {c.index: list(c.output_ids) for c in completes}
        if stream:
            for i in range(3):
                assert [t for c in chunks if c.index == i for t in c.token_ids] == by_index[i]
        assert len({tuple(ids) for ids in by_index.values()}) == 3, "the samples should differ"
        # The later samples took the first's full blocks from the prefix cache.
        assert sorted(c.cached_tokens for c in completes)[1:] == [32, 32]
        for i in range(3):  # sample i is the request with seed + i
            single = v.SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=10, ignore_eos=True)
            _, alone = run(engine, v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=prompt),
                                                     sampling_params=single))
            assert list(alone.output_ids) == by_index[i]
