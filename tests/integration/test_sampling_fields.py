"""The sampling fields OpenAI clients send (logprobs, penalties, min_p, min_tokens, logit bias) on a
real model forward, against transformers' logits and logits processors on the same weights."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from service.llm import LLM, SamplingParams
from service.model.builtin import ensure_builtin
from tests.support.lora import hf_model

PROMPTS = ["Explain CUDA graphs", "The quick brown fox", "Once upon a time there was"]
STEPS = 16


@pytest.fixture(scope="module")
def llm(model_cache_dir) -> Iterator[LLM]:  # noqa: ANN001
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=8, max_seq_len=256,
             device="cpu", dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model_cache_dir):  # noqa: ANN001, ANN201 - transformers' model on the same weights
    return hf_model(ensure_builtin("tiny", model_cache_dir))


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [len, V]


def hf_greedy(model, prompt: list[int], process, steps: int = STEPS, eos: int | None = None) -> list[int]:  # noqa: ANN001
    """Greedy decoding with `process(ids [1, n], logits [1, V]) -> logits`, one full forward per token."""
    ids = list(prompt)
    for _ in range(steps):
        logits = process(torch.tensor([ids]), hf_logits(model, ids)[-1:].clone())
        token = int(logits.argmax())
        if token == eos:
            break
        ids.append(token)
    return ids[len(prompt):]


def encode(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=True)


def test_logprobs_equal_log_softmax_of_transformers_logits(llm: LLM, reference) -> None:  # noqa: ANN001
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5))
    for request in outs:
        [out] = request.outputs
        prompt = request.prompt_token_ids
        assert len(out.logprobs) == len(out.token_ids) == STEPS
        expected = hf_logits(reference, prompt + out.token_ids).log_softmax(dim=-1)
        for i, (token, lps) in enumerate(zip(out.token_ids, out.logprobs)):
            row = expected[len(prompt) - 1 + i]
            # greedy: the sampled token is the best one, so the 5 best are all the entries
            assert len(lps) == 5 and next(iter(lps)) == token and lps[token].rank == 1
            assert lps[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            # Each reported top token has the model's log-probability, they are the 5 best, ranked.
            assert [lp.logprob for lp in lps.values()] == pytest.approx([row[t].item() for t in lps], abs=1e-4)
            assert [lp.logprob for lp in lps.values()] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
            assert [lp.rank for lp in lps.values()] == [1, 2, 3, 4, 5]


def test_logprobs_zero_reports_the_sampled_token_only_and_none_reports_nothing(llm: LLM) -> None:
    only, plain = (o.outputs[0] for o in llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=0), SamplingParams(temperature=0.7, seed=3, max_tokens=6)]))
    assert [list(lps) for lps in only.logprobs] == [[t] for t in only.token_ids]
    assert all(lp.logprob <= 0 and lp.rank >= 1 for lps in only.logprobs for lp in lps.values())
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_repetition_penalty_equals_transformers(llm: LLM, reference) -> None:  # noqa: ANN001
    processor = RepetitionPenaltyLogitsProcessor(1.8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True,
                                                repetition_penalty=1.8))
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(reference, out.prompt_token_ids, processor)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] != [p.outputs[0].token_ids for p in plain], "the penalty should change something"


def test_presence_and_frequency_penalties_follow_the_openai_formula(llm: LLM, reference) -> None:  # noqa: ANN001
    presence, frequency = 0.8, 0.6

    def penalize(prompt_len: int):  # noqa: ANN202
        def process(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            for token, count in Counter(ids[0, prompt_len:].tolist()).items():  # the completion only
                logits[0, token] -= presence + frequency * count
            return logits
        return process

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True,
                                                presence_penalty=presence, frequency_penalty=frequency))
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(reference, out.prompt_token_ids, penalize(len(out.prompt_token_ids)))


def test_min_tokens_and_logit_bias_equal_transformers_processors(llm: LLM, reference) -> None:  # noqa: ANN001
    eos = llm.tokenizer.eos_token_id
    prompt = encode(llm, PROMPTS[0])
    processors = LogitsProcessorList([SequenceBiasLogitsProcessor({(eos,): 100.0}),
                                      MinNewTokensLengthLogitsProcessor(len(prompt), 5, eos)])
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=5,
                                                  logit_bias={eos: 100.0}))[0].outputs
    assert out.token_ids == hf_greedy(reference, prompt, processors, eos=eos)
    assert len(out.token_ids) == 5 and out.finish_reason == "stop" and out.stop_reason is None  # EOS
    # A bias of -100 forbids the greedy token; +100 forces one.
    [free] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs
    [banned] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                     logit_bias={t: -100.0 for t in set(free.token_ids)}))[0].outputs
    assert not set(banned.token_ids) & set(free.token_ids)
    [forced] = llm.generate([prompt], SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True,
                                                     logit_bias={123: 100.0}))[0].outputs
    assert forced.token_ids == [123] * 8


def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    prompt = encode(llm, PROMPTS[1])
    [free] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs
    stop = llm.tokenizer.decode(free.token_ids[1:3])
    [early] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop))[0].outputs
    [held] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop,
                                                   min_tokens=6))[0].outputs
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    assert len(held.token_ids) >= 6 and held.text.startswith(free.text[:len(stop)])


def test_seeded_sampling_with_every_field_reproduces_whatever_shares_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.05, seed=11, max_tokens=12, ignore_eos=True,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2,
                            logit_bias={50: 3.0})
    [alone] = llm.generate([PROMPTS[2]], params)[0].outputs
    crowd = llm.generate(PROMPTS + [PROMPTS[2]], [SamplingParams(temperature=1.0, seed=i, max_tokens=12,
                                                                 repetition_penalty=1.5) for i in range(3)] + [params])
    [last] = crowd[-1].outputs
    assert last.token_ids == alone.token_ids
    assert last.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
    assert [lps[t].logprob for t, lps in zip(last.token_ids, last.logprobs)] == pytest.approx(
        [lps[t].logprob for t, lps in zip(alone.token_ids, alone.logprobs)], abs=1e-5)


@pytest.mark.parametrize(("params", "needle"), [
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101.0}), "logit_bias[3]"),
    (dict(min_tokens=40, max_tokens=10), "min_tokens"),
])
def test_bad_sampling_fields_are_clear_errors(llm: LLM, params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        llm.generate(["hi"], SamplingParams(**params))


def test_penalized_requests_survive_preemption_with_their_tokens(model_cache_dir) -> None:  # noqa: ANN001
    """Over a pool too small for all of them, penalized streams are preempted and recompute; their
    token history is rebuilt, so each gets the tokens it gets with room."""
    prompts = [[(7 * i + 3 * j) % 700 + 3 for j in range(40)] for i in range(10)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=100, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.4) for i in range(10)]
    results = {}
    for memory in ("1966080", "64MiB"):  # 60 blocks of 32 KiB, then ample
        with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=10, max_seq_len=256,
                 device="cpu", dtype="float32", kv_cache_memory=memory, enable_prefix_caching=False) as small:
            results[memory] = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
            preemptions = small._engine.engine.scheduler.block_stats().preemptions
        assert (preemptions > 0) == (memory == "1966080")
    assert results["1966080"] == results["64MiB"]
