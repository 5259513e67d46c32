"""Prompt logprobs through both protocols on a real model forward, against transformers' log_softmax
of the same weights: whole prompts, prompts prefilled in chunks over several steps, prompts whose
prefix the cache holds, and n samples."""

from __future__ import annotations

import grpc
import pytest
import torch
from smg_grpc_proto.generated import vllm_engine_pb2 as v
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from service.llm import LLM, SamplingParams
from service.model.builtin import ensure_builtin
from service.proto import inference_pb2 as pb
from tests.support.lora import hf_model
from tests.support.server import generate, generate_samples, running_server

TOP = 3


@pytest.fixture(scope="module")
def reference(model_cache_dir):  # noqa: ANN001, ANN201 - transformers' model on the same weights
    return hf_model(ensure_builtin("tiny", model_cache_dir))


def expected_logprobs(model, prompt: list[int]) -> torch.Tensor:  # noqa: ANN001
    """[len - 1, V]: the log-probabilities at each position but the last, i.e. of prompt tokens 1.."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)


def check_against_reference(reference, prompt: list[int], got: list[tuple[float, list[tuple[int, float]]]]) -> None:  # noqa: ANN001
    expected = expected_logprobs(reference, prompt)
    assert len(got) == len(prompt) - 1
    for i, (logprob, top) in enumerate(got):
        assert logprob == pytest.approx(float(expected[i, prompt[i + 1]]), abs=1e-4), f"prompt token {i + 1}"
        values, ids = expected[i].topk(TOP)
        assert [t for t, _ in top] == ids.tolist(), f"top tokens at prompt position {i}"
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)


def graphserve_prompt_logprobs(chunk: pb.Chunk) -> list[tuple[float, list[tuple[int, float]]]]:
    return [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in chunk.prompt_logprobs]


def request(prompt: list[int], max_tokens: int = 4, prompt_logprobs: int = TOP, **sampling) -> dict:  # noqa: ANN003
    sampling = {"temperature": 0} | sampling
    return dict(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(prompt_logprobs=prompt_logprobs, **sampling),
                stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logprobs_equal_transformers_log_softmax(server, reference) -> None:  # noqa: ANN001
    prompt = prompt_of(40, 1)
    chunks, finished = generate(server.stub(), **request(prompt))
    check_against_reference(reference, prompt, graphserve_prompt_logprobs(chunks[0]))
    assert all(not c.prompt_logprobs for c in chunks[1:]), "prompt logprobs come in the first chunk only"
    assert finished.usage.completion_tokens == 4


def test_a_one_token_prompt_has_no_prompt_logprobs_and_still_completes(server) -> None:  # noqa: ANN001
    chunks, finished = generate(server.stub(), **request([7], max_tokens=3))
    assert not any(c.prompt_logprobs for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == 3 == finished.usage.completion_tokens


def test_chunked_prompts_and_cached_prefixes_still_give_every_prompt_token(model_cache_dir, reference) -> None:  # noqa: ANN001
    # A 16-token step budget: the 100-token prompt is prefilled over 7 steps, beside a decoding stream.
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "4", "--max-seq-len", "256",
            "--max-num-batched-tokens", "16"]
    prompt = prompt_of(100, 2)
    with running_server(argv) as srv:
        stub = srv.stub()
        plain = dict(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0),
                     stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True))
        _, first = generate(stub, **plain)  # puts the prompt's full blocks in the prefix cache
        _, cached = generate(stub, **plain)
        assert cached.usage.cached_prompt_tokens > 0 and first.usage.cached_prompt_tokens == 0
        chunks, finished = generate(stub, **request(prompt))
        check_against_reference(reference, prompt, graphserve_prompt_logprobs(chunks[0]))
        assert finished.usage.cached_prompt_tokens == 0, "a prompt asking for prompt logprobs is computed whole"
        plain_tokens = [t for c in generate(stub, **plain)[0] for t in c.token_ids]
        assert [t for c in chunks for t in c.token_ids] == plain_tokens, "the completion does not change"


def test_each_of_n_samples_carries_the_prompt_logprobs(server, reference) -> None:  # noqa: ANN001
    prompt = prompt_of(24, 3)
    chunks, finished = generate_samples(server.stub(), 2, **request(prompt, temperature=1.0, seed=5))
    for index in range(2):
        first = next(c for c in chunks if c.index == index)
        check_against_reference(reference, prompt, graphserve_prompt_logprobs(first))


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_protocol_input_logprobs_match_graphserve_v1(server, stream: bool) -> None:  # noqa: ANN001
    prompt = prompt_of(30, 4)
    expected = graphserve_prompt_logprobs(generate(server.stub(), **request(prompt))[0][0])
    engine = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
    messages = list(engine.Generate(v.GenerateRequest(
        request_id=f"prompt-logprobs-{stream}", tokenized=v.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=v.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)),
        timeout=60))
    with_input = [m.chunk if m.WhichOneof("response") == "chunk" else m.complete for m in messages
                  if (m.chunk if m.WhichOneof("response") == "chunk" else m.complete).HasField("input_logprobs")]
    assert len(with_input) == 1, "the prompt logprobs go out once"
    if stream:
        assert messages[0].WhichOneof("response") == "chunk" and messages[0].chunk.HasField("input_logprobs")
    got = with_input[0].input_logprobs
    assert list(got.token_ids) == prompt
    assert not got.token_logprobs[0].HasField("value") and not got.top_logprobs[0].values
    values = [e.value for e in got.token_logprobs[1:]]
    assert values == pytest.approx([lp for lp, _ in expected], abs=1e-6)
    assert [list(t.token_ids) for t in got.top_logprobs[1:]] == [[t for t, _ in top] for _, top in expected]


@pytest.mark.parametrize("value", [21, 1000])
def test_too_many_prompt_logprobs_is_invalid_argument(server, value: int) -> None:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        generate(server.stub(), **request([5, 6, 7], prompt_logprobs=value))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in err.value.details() and "20" in err.value.details()


def test_the_python_api_returns_prompt_logprobs_as_vllm_does(model_cache_dir, reference) -> None:  # noqa: ANN001
    prompts = [prompt_of(40, 5), prompt_of(7, 6)]
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=4, max_seq_len=256,
             max_num_batched_tokens=16, device="cpu", dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP))
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs must be in \[0, 20\]"):
            llm.generate(prompts[:1], SamplingParams(prompt_logprobs=21))
    for prompt, out, ref in zip(prompts, outs, plain):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        # vLLM's dicts: the prompt token (its own rank), then the top tokens by rank
        got = [(d[token].logprob, [(t, lp.logprob) for t, lp in sorted(d.items(), key=lambda e: e[1].rank)
                                   if lp.rank <= TOP])
               for token, d in zip(prompt[1:], out.prompt_logprobs[1:])]
        check_against_reference(reference, prompt, got)
        assert all(next(iter(d)) == token for token, d in zip(prompt[1:], out.prompt_logprobs[1:]))
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and ref.prompt_logprobs is None

