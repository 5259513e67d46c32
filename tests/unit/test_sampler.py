"""Sampler: greedy, batch-invariant seeded sampling, the sampled distribution, top-k / top-p."""

from __future__ import annotations

import pytest
import torch

from service.engine.request import SamplingParams
from service.engine.sampler import (
    SampleRow,
    SamplingBatch,
    TokenHistory,
    _as_int32,
    _hash32,
    gumbel_noise,
    sample,
    unpack_logprobs,
)
from service.model.kernels.sampling import apply_penalties_torch

V = 8
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0])  # distinct, unsorted


def draw(logits_row: torch.Tensor, params: SamplingParams, counters: range) -> torch.Tensor:
    """One row per counter, the same logits: independent draws of one request's distribution."""
    batch = SamplingBatch.build([(params, c) for c in counters], "cpu")
    return sample(logits_row.expand(len(counters), -1).contiguous(), batch).tokens


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.build([(SamplingParams(temperature=0.0, seed=i), i) for i in range(5)], "cpu")
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch).tokens, logits.argmax(dim=-1))
    # Mixed with sampled rows, greedy rows still take the argmax.
    params = [(SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i), i) for i in range(5)]
    out = sample(logits, SamplingBatch.build(params, "cpu")).tokens
    assert out.dtype == torch.int64 and out.shape == (5,)
    assert torch.equal(out[1::2], logits.argmax(dim=-1)[1::2])


def test_a_step_of_plain_greedy_rows_needs_no_batch_and_anything_more_is_not_plain() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, SamplingBatch.greedy()).tokens, logits.argmax(dim=-1))
    assert SamplingParams(temperature=0.0).plain_greedy
    for more in ({"temperature": 0.7}, {"logit_bias": ((3, 5.0),)}, {"min_tokens": 2}, {"logprobs": 0},
                 {"presence_penalty": 0.5}, {"repetition_penalty": 1.2}):
        assert not SamplingParams(**{"temperature": 0.0, **more}).plain_greedy, more


def test_row_result_is_independent_of_batch_composition_and_order() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 100, generator=gen)
    params = [
        (SamplingParams(temperature=0.8, seed=11), 0),
        (SamplingParams(temperature=1.0, top_p=0.9, seed=12), 3),
        (SamplingParams(temperature=1.3, top_k=5, seed=13), 7),
        (SamplingParams(temperature=0.0), 2),
        (SamplingParams(temperature=0.7, top_k=20, top_p=0.5, seed=2**64 - 1), 1),
        (SamplingParams(temperature=1.0, seed=2**63 + 5), 9)  # above int64,
    ]
    full = sample(logits, SamplingBatch.build(params, "cpu")).tokens
    for row in range(6):  # alone: stages such as top_k differ from the full batch
        alone = sample(logits[row:row + 1], SamplingBatch.build([params[row]], "cpu")).tokens
        assert alone.item() == full[row].item()
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    shuffled = sample(logits[perm], SamplingBatch.build([params[i] for i in perm], "cpu")).tokens
    assert torch.equal(shuffled, full[perm])


def test_different_seeds_and_counters_give_different_draws() -> None:
    logits = torch.zeros(1000)  # uniform: any token is equally likely
    a = draw(logits, SamplingParams(seed=1), range(200))
    b = draw(logits, SamplingParams(seed=2), range(200))
    assert (a != b).float().mean() > 0.9
    assert len(set(a.tolist())) > 150  # counters decorrelate the draws of one request
    assert torch.equal(a, draw(logits, SamplingParams(seed=1), range(200)))  # and they reproduce


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_distribution_matches_softmax_over_temperature() -> None:
    n = 40_000
    for temperature in (0.5, 1.0, 2.0):
        tokens = draw(LOGITS, SamplingParams(temperature=temperature, seed=123), range(n))
        counts = torch.bincount(tokens, minlength=V).double()
        probs = torch.softmax(LOGITS.double() / temperature, dim=0)
        # 7 degrees of freedom: P(chi2 > 29) < 1e-4, and the hash makes the outcome deterministic.
        assert chi_square(counts, probs) < 29.0, (temperature, counts / n, probs)


def test_temperature_sharpens_the_distribution() -> None:
    top = int(LOGITS.argmax())
    share = {t: (draw(LOGITS, SamplingParams(temperature=t, seed=5), range(4000)) == top).float().mean()
             for t in (0.3, 1.0, 3.0)}
    assert share[0.3] > share[1.0] > share[3.0]
    for t, observed in share.items():
        assert abs(observed - torch.softmax(LOGITS / t, dim=0)[top]) < 0.03


def test_top_k_one_is_greedy_and_top_k_stays_in_the_top_k() -> None:
    assert (draw(LOGITS, SamplingParams(top_k=1, seed=3), range(500)) == LOGITS.argmax()).all()
    top3 = set(LOGITS.topk(3).indices.tolist())
    tokens = draw(LOGITS, SamplingParams(temperature=2.0, top_k=3, seed=3), range(3000))
    assert set(tokens.tolist()) == top3
    counts = torch.bincount(tokens, minlength=V).double()
    probs = torch.zeros(V, dtype=torch.float64)
    idx = list(top3)
    probs[idx] = torch.softmax(LOGITS[idx].double() / 2.0, dim=0)  # renormalised over the kept
    assert chi_square(counts, probs) < 16.0  # 2 dof


def test_tiny_top_p_is_greedy() -> None:
    tokens = draw(LOGITS, SamplingParams(temperature=5.0, top_p=1e-6, seed=4), range(500))
    assert (tokens == LOGITS.argmax()).all()


def test_top_p_keeps_exactly_the_nucleus() -> None:
    # Probabilities 0.5, 0.25, 0.125, 0.0625, ... : top_p=0.8 needs the first three (0.875 >= 0.8),
    # not the fourth (the first three already hold 0.875).
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125])
    logits = probs.log()[torch.tensor([3, 0, 5, 1, 2, 4])]  # shuffled vocab order
    nucleus = {1, 3, 4}  # where 0.5, 0.25, 0.125 landed
    tokens = draw(logits, SamplingParams(top_p=0.8, seed=9), range(4000))
    assert set(tokens.tolist()) == nucleus
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.zeros(6, dtype=torch.float64)
    expected[[1, 3, 4]] = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64) / 0.875
    assert chi_square(counts, expected) < 16.0
    # top_p=1 disables the filter: every token shows up.
    assert len(set(draw(logits, SamplingParams(top_p=1.0, seed=9), range(4000)).tolist())) == 6


def test_noise_hash_is_lowbias32_on_uint32_bits() -> None:
    """The int32 hash must equal the uint32 reference bit for bit: that is what makes a seeded
    request reproduce across devices and torch builds."""
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 3_000_000_000, 0xFFFFFFFF, 2**40 + 7, -1]
    hashed = _hash32(_as_int32(torch.tensor(values, dtype=torch.int64)))
    assert [h & 0xFFFFFFFF for h in hashed.tolist()] == [reference(v & 0xFFFFFFFF) for v in values]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_equal_cpu_draws() -> None:
    """The hash is integer arithmetic, so the same (logits, seed, counter) give the same token."""
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(2)) * 3
    params = [(SamplingParams(temperature=(0.0, 0.6, 1.0, 1.5)[i % 4], top_p=(1.0, 0.9)[i % 2],
                              top_k=(0, 50, 0)[i % 3], seed=2**40 + i), i * 7) for i in range(64)]
    cpu = sample(logits, SamplingBatch.build(params, "cpu")).tokens
    cuda = sample(logits.cuda(), SamplingBatch.build(params, "cuda")).tokens
    assert cuda.device.type == "cuda"
    # Float rounding (log, softmax) may differ in the last ulp; a near-tie can then flip a row.
    assert (cpu == cuda.cpu()).float().mean() >= 0.97
    noise_cpu = gumbel_noise(torch.tensor([5, -1]), torch.tensor([0, 2**33]), 1000)
    noise_cuda = gumbel_noise(torch.tensor([5, -1]).cuda(), torch.tensor([0, 2**33]).cuda(), 1000)
    assert torch.allclose(noise_cpu, noise_cuda.cpu(), rtol=1e-5, atol=1e-5)


# ---- logits processing: penalties, min_p, logit bias, bans, log-probabilities -----------------

def _penalize(logits: torch.Tensor, p, history: TokenHistory) -> None:  # noqa: ANN001
    apply_penalties_torch(logits, p.rows, p.history_rows, history.counts, history.in_prompt, p.presence, p.frequency,
                          p.repetition)


def _history_for(rows: list[tuple[list[int], list[int]]], vocab: int) -> TokenHistory:
    history = TokenHistory(len(rows), vocab, "cpu")
    for row, (prompt, completion) in enumerate(rows):
        history.reset(row, row, prompt, completion)
    return history


def test_repetition_penalty_equals_transformers_processor() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen) * 3
    rows = [([1, 2, 3], [5, 5, 7]), ([0, 39], []), ([4], [4, 4, 9, 30])]
    penalty = 1.7
    history = _history_for(rows, 40)
    batch = SamplingBatch.build([SampleRow(SamplingParams(temperature=0.0, repetition_penalty=penalty), 0, r)
                                 for r in range(3)], "cpu")
    got = sample(logits, batch, history).tokens  # (adds the sampled tokens to the history)
    history = _history_for(rows, 40)
    for r, (prompt, completion) in enumerate(rows):
        ids = torch.tensor([prompt + completion])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[r:r + 1].clone())
        assert got[r].item() == expected.argmax().item()
        processed = logits[r:r + 1].clone()  # the processed logits themselves
        _penalize(processed, SamplingBatch.build([SampleRow(SamplingParams(repetition_penalty=penalty, seed=0), 0, r)],
                                                 "cpu").penalties, history)
        torch.testing.assert_close(processed, expected)


def test_presence_and_frequency_penalties_count_completion_tokens_only() -> None:
    logits = torch.zeros(1, 10)
    history = _history_for([([2, 2, 3], [3, 5, 5, 5])], 10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, seed=0)
    _penalize(logits, SamplingBatch.build([SampleRow(params, 0, 0)], "cpu").penalties, history)
    expected = torch.zeros(1, 10)
    expected[0, 3] = -(0.5 + 0.25 * 1)
    expected[0, 5] = -(0.5 + 0.25 * 3)  # the prompt's 2 is not penalized
    torch.testing.assert_close(logits, expected)


def test_sampled_tokens_enter_the_history_on_the_device() -> None:
    history = _history_for([([1], []), ([1], [])], 6)
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 9.0, 8.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    rows = [SampleRow(params, 0, 1), SampleRow(SamplingParams(temperature=0.0), 0, 0)]  # row 1 of the batch is plain
    assert sample(logits, SamplingBatch.build(rows, "cpu"), history).tokens.tolist() == [2, 4]
    assert history.counts[1, 2] == 1 and history.counts.sum() == 1  # only the penalized row counts
    # The next step sees it: 5 - 2 < 4.
    assert sample(logits, SamplingBatch.build(rows, "cpu"), history).tokens.tolist() == [3, 4]


def test_min_p_keeps_what_transformers_keeps() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.tensor([3.0, 2.9, 2.0, 1.0, 0.5, -1.0, 2.5, 0.0])
    kept = MinPLogitsWarper(min_p=0.3)(None, logits.unsqueeze(0).clone())[0].isfinite()
    drawn = set(draw(logits, SamplingParams(min_p=0.3, seed=5), range(600)).tolist())
    assert drawn == set(kept.nonzero().flatten().tolist())


def test_logit_bias_forces_and_forbids_and_bans_win() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(dim=-1)
    rows = [SampleRow(SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)), 0),
            SampleRow(SamplingParams(temperature=0.0, logit_bias=((int(top[1]), -100.0),)), 0)]
    got = sample(logits, SamplingBatch.build(rows, "cpu")).tokens.tolist()
    assert got[0] == 7 and got[1] != top[1].item()
    banned = [SampleRow(SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)), 0, 0, (7,))]
    assert sample(logits[:1], SamplingBatch.build(banned, "cpu")).tokens.item() != 7


def test_logprobs_are_the_models_log_softmax_before_processing() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6))
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=5, logit_bias=((9, 100.0),)), 0),
            SampleRow(SamplingParams(temperature=0.0), 0),
            SampleRow(SamplingParams(temperature=1.0, seed=1, logprobs=0), 3)]
    batch = SamplingBatch.build(rows, "cpu")
    out = sample(logits, batch)
    reference = logits.log_softmax(dim=-1)
    first, third = unpack_logprobs(out.logprobs.tolist(), batch.logprobs[2])
    assert out.tokens[0].item() == 9
    assert first.rank == int((reference[0] >= reference[0, 9]).sum())  # vLLM's rank: 1 is the most likely
    assert first.logprob == pytest.approx(reference[0, 9].item(), abs=1e-6)
    top = reference[0].topk(5)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert third.top == () and third.logprob == pytest.approx(reference[2, out.tokens[2]].item(), abs=1e-6)
