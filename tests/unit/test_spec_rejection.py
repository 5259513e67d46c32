"""Rejection sampling of speculative decoding on a tiny vocabulary: the tokens a verify row emits
follow the target's distribution (after temperature and top-k), whatever the draft proposes.

The engine samples the target's token after each of a row's tokens with the sampler's own noise
(seed, token index), keeps the draft's prefix that those tokens repeat and emits the target's token
at the first mismatch (service.engine.engine.accepted_length). For a draft that is a point mass on d
this is the standard rule: d stands with probability min(1, p(d) / 1) = p(d); otherwise the token
emitted is drawn from norm(max(0, p - 1[d])), p without d renormalized. The test checks all three
parts with chi-square statistics over 20,000 fixed seeds.

Tolerance: each statistic is compared with the 0.999 quantile of its chi-square distribution, so a
correct sampler fails for one seed set in a thousand; the seeds are fixed, so the result does not
vary between runs. The test can fail: a cell off by 2 points of probability (400 of ~6,000 draws)
alone adds about 400^2 / 6,000 = 27 to the statistic, above every threshold used here.
"""

from __future__ import annotations

import collections

import torch

from service.engine.engine import accepted_length
from service.engine.request import SamplingParams
from service.engine.sampler import SampleRow, SamplingBatch, sample

N = 20_000
VOCAB = 6
# The 0.999 quantiles of chi-square with 1..5 degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def target(logits: list[float], temperature: float, top_k: int) -> torch.Tensor:
    """The distribution the sampler draws from: softmax(logits / T) over the top k."""
    scaled = torch.tensor(logits) / temperature
    keep = scaled.topk(top_k).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[keep] = scaled[keep]
    return masked.softmax(-1)


def chi2(counts: collections.Counter, probs: torch.Tensor, total: int) -> tuple[float, int]:
    """The statistic over the cells of nonzero probability, and its degrees of freedom; a draw in a
    cell of zero probability is an error."""
    assert all(probs[x] > 0 for x in counts), counts
    cells = [x for x in range(len(probs)) if probs[x] > 0]
    stat = sum((counts[x] - total * float(probs[x])) ** 2 / (total * float(probs[x])) for x in cells)
    return stat, len(cells) - 1


def test_emitted_tokens_follow_the_target_for_a_point_mass_draft():
    rows = [[1.0, 2.0, 0.5, 1.5, -1.0, 0.2], [0.3, -0.5, 2.0, 1.0, 1.2, 0.0]]  # positions 0 and 1
    t, k = 0.9, 4
    p0, p1 = target(rows[0], t, k), target(rows[1], t, k)
    draft = (3, 2)  # two of the kept tokens, neither the most likely
    # Each seed's verify row: the target's token after the row's token (counter 0) and after the
    # first draft token (counter 1), as the runner samples them.
    params = [SamplingParams(temperature=t, top_k=k, seed=s) for s in range(N)]
    sample_rows = [SampleRow(p, j) for p in params for j in range(2)]
    logits = torch.tensor(rows * N, dtype=torch.float32)
    tokens = sample(logits, SamplingBatch.build(sample_rows, "cpu")).tokens.view(N, 2).tolist()

    emitted = [targets[: accepted_length(draft, targets) + 1] for targets in tokens]
    first = collections.Counter(e[0] for e in emitted)
    accepted = [e for e in emitted if e[0] == draft[0]]
    rejected = [e[0] for e in emitted if e[0] != draft[0]]

    # The first token emitted follows p0 ...
    stat, df = chi2(first, p0, N)
    assert stat < CHI2_999[df], (stat, df)
    # ... because d stands with probability p0(d) ...
    acceptance = torch.tensor([1 - p0[draft[0]], p0[draft[0]]])
    stat, df = chi2(collections.Counter([1] * len(accepted) + [0] * len(rejected)), acceptance, N)
    assert stat < CHI2_999[df], (stat, len(accepted) / N, float(p0[draft[0]]))
    # ... and a rejection emits a draw from p0 without d, renormalized.
    residual = p0.clone()
    residual[draft[0]] = 0
    residual /= residual.sum()
    stat, df = chi2(collections.Counter(rejected), residual, len(rejected))
    assert stat < CHI2_999[df], stat
    # After an accepted first token, the next token emitted (the second draft token, or the
    # correction in its place) follows p1.
    stat, df = chi2(collections.Counter(e[1] for e in accepted), p1, len(accepted))
    assert stat < CHI2_999[df], stat
    assert 0 < sum(e[1] == draft[1] for e in accepted) < len(accepted)  # both outcomes occurred


def test_a_greedy_row_keeps_the_longest_prefix_matching_the_argmax():
    assert accepted_length((4, 5, 6), [4, 5, 6, 9]) == 3  # all, then the bonus token
    assert accepted_length((4, 5, 6), [4, 7, 6, 9]) == 1  # a mismatch ends the run even if later ones agree
    assert accepted_length((4,), [3, 4]) == 0
