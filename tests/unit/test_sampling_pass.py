"""The one sampling pass (sampler.sample_pass) against a straightforward reference, a row at a time,
for any combination of the fields a row may ask: temperature, min_p, top-k, top-p, the three
penalties, logit bias, bans, a grammar mask and logprobs, greedy rows among drawn ones, the rows
that ask for a stage padded to a power of two. And the pass is one graph: it traces without a host
sync or a branch on a tensor's value."""

from __future__ import annotations

import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine.request import SamplingParams
from service.engine.sampler import SampleRow, SamplingBatch, Stages, TokenHistory, gumbel_noise, sample, sample_pass
from service.model.kernels.bitmask import bitmask_words

V = 48
# Log-probabilities: the pass takes logsumexp over [B, V], the reference log_softmax over one row;
# over 2,000 random rows (logits N(0, 3^2), V = 48) they differed by at most 9.5e-7.
LOGPROB_ATOL = 1e-5
NEG_INF = float("-inf")


@st.composite
def sample_rows(draw: st.DrawFn) -> SampleRow:
    greedy = draw(st.booleans())
    params = SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 1, 3, 20])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.05])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
        seed=draw(st.integers(0, 2**64 - 1)),
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.25, 2.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7])),
        logit_bias=draw(st.dictionaries(st.integers(0, V - 1), st.sampled_from([-100.0, -1.5, 0.5, 100.0]), max_size=3)),
        logprobs=draw(st.sampled_from([None, 0, 1, 5])),
    )
    banned = tuple(draw(st.lists(st.integers(0, V - 1), max_size=2, unique=True)))
    return SampleRow(params, draw(st.integers(0, 1000)), 0, banned)


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[SampleRow], list[torch.Tensor | None], TokenHistory, torch.Tensor]:
    """A step: its rows (each its own history row), each row's allowed tokens (None: unconstrained;
    at least 8 allowed, so that bans and masks never leave a row without a token), the token
    history and the logits."""
    rows = draw(st.lists(sample_rows(), min_size=1, max_size=6))
    rows = [r._replace(history_row=b) for b, r in enumerate(rows)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    allowed = [(torch.randperm(V, generator=gen)[:draw(st.integers(8, V))] if draw(st.booleans()) else None)
               for _ in rows]
    allowed = [None if a is None else torch.zeros(V, dtype=torch.bool).index_fill_(0, a, True) for a in allowed]
    history = TokenHistory(len(rows), V, "cpu")
    for b in range(len(rows)):
        ids = torch.randint(0, V, (draw(st.integers(0, 12)),), generator=gen).tolist()
        split = draw(st.integers(0, len(ids)))
        history.reset(b, b, ids[:split], ids[split:])
    return rows, allowed, history, torch.randn(len(rows), V, generator=gen) * 3


def bitmask_of(allowed: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(constrained rows, their int32 bitmasks) as the runner hands them to the sampler."""
    rows = [b for b, a in enumerate(allowed) if a is not None]
    if not rows:
        return None
    masks = torch.zeros(len(rows), bitmask_words(V) * 32, dtype=torch.int64)
    for i, b in enumerate(rows):
        masks[i, :V] = allowed[b].long()
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (masks.view(len(rows), -1, 32) * weights).sum(-1)
    return torch.tensor(rows), ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the uint32 bits as int32


def reference(logits: torch.Tensor, row: SampleRow, allowed: torch.Tensor | None, counts: torch.Tensor,
              in_prompt: torch.Tensor) -> int:
    """The token one row samples, computed for that row alone, field by field, as documented."""
    p, x = row.params, logits.clone()
    if allowed is not None:
        x[~allowed] = NEG_INF
    for token, bias in p.logit_bias:
        x[token] += bias
    for token in row.banned:
        x[token] = NEG_INF
    if p.penalized:
        seen = (counts > 0) | in_prompt
        x = torch.where(seen & (x > 0), x / p.repetition_penalty, torch.where(seen, x * p.repetition_penalty, x))
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if p.greedy:
        return int(x.argmax())
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = NEG_INF
    order = x.argsort(descending=True, stable=True).tolist()
    if p.top_k > 0:
        x[order[p.top_k:]] = NEG_INF
    if p.top_p < 1:
        probs, mass = x.softmax(-1).tolist(), 0.0
        for rank, token in enumerate(order):
            if rank > 0 and mass >= p.top_p:
                x[token] = NEG_INF
            mass += probs[token]
    noise = gumbel_noise(torch.tensor([_int64(p.seed)]), torch.tensor([row.counter]), V)[0]
    return int((x + noise).argmax())


def _int64(seed: int) -> int:
    return seed - 2**64 if seed >= 2**63 else seed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_the_pass_equals_a_row_by_row_reference(step) -> None:  # noqa: ANN001
    rows, allowed, history, logits = step
    want = [reference(logits[b], r, allowed[b], history.counts[b], history.in_prompt[b]) for b, r in enumerate(rows)]
    counts_before = history.counts.clone()
    batch = SamplingBatch.build(rows, "cpu")
    batch.bitmask = bitmask_of(allowed)
    out = sample(logits, batch, history)
    assert out.tokens.tolist() == want
    # Only the penalized rows' tokens enter the history.
    added = torch.zeros_like(counts_before)
    for b, r in enumerate(rows):
        added[b, want[b]] += int(r.params.penalized)
    assert torch.equal(history.counts, counts_before + added)
    # Logprobs: the model's own (the raw logits), for the rows that asked, in their order.
    asked = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
    assert (out.logprobs is None) == (not asked)
    if asked:
        k = max(rows[b].params.logprobs for b in asked)
        assert tuple(out.logprobs.shape) == (len(asked), 2 + 2 * k)
        for packed, b in zip(out.logprobs, asked, strict=True):
            lp = logits[b].log_softmax(-1)
            top = lp.topk(k)
            torch.testing.assert_close(packed[0], lp[want[b]], atol=LOGPROB_ATOL, rtol=0)
            assert packed[1] == (lp >= lp[want[b]]).sum()  # rank 1 is the most likely
            torch.testing.assert_close(packed[2:2 + k], top.values, atol=LOGPROB_ATOL, rtol=0)
            assert packed[2 + k:].long().tolist() == top.indices.tolist()


def test_stages_follow_what_the_rows_ask() -> None:
    plain = SampleRow(SamplingParams(temperature=0.0), 0)
    assert SamplingBatch.build([plain, plain], "cpu").stages == Stages()
    drawn = SampleRow(SamplingParams(temperature=0.7, seed=1, top_p=0.9, logit_bias={1: 1.0, 2: -1.0}), 0, 0, (3,))
    batch = SamplingBatch.build([plain, drawn], "cpu")
    assert batch.stages == Stages(sampled=True, top_p=True, bias_slots=4)
    assert tuple(batch.bias[0].shape) == (2, 4)  # every row has the step's slots, the unused ones pad
    asking = [SampleRow(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.1), 0)] * 3
    batch = SamplingBatch.build([plain, *asking], "cpu")
    # Penalties and logprobs run on the rows that ask, padded to a power of two.
    assert batch.stages == Stages(penalty_rows=4, logprobs=3, logprob_rows=4)
    assert batch.penalties.rows.tolist() == [1, 2, 3, 4] and batch.penalties.counted.tolist() == [1, 1, 1, 0]
    assert batch.logprobs[0].tolist() == [1, 2, 3, 1]


def test_greedy_rows_take_the_argmax_of_their_processed_logits_among_drawn_rows() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(SamplingParams(temperature=0.0), 0), SampleRow(SamplingParams(temperature=1.0, seed=3, top_k=2), 0),
            SampleRow(SamplingParams(temperature=0.0, logit_bias={5: 100.0}), 0)]
    tokens = sample(logits, SamplingBatch.build(rows, "cpu")).tokens.tolist()
    assert tokens[0] == logits[0].argmax() and tokens[2] == 5


def test_the_pass_is_one_graph() -> None:
    """torch.compile with fullgraph fails on anything a CUDA graph cannot hold (a host sync such as
    .item(), a Python branch on a tensor's value); the eager backend only traces, so the check costs
    about two seconds on a CPU. The traced pass gives the eager pass's tokens and logprobs."""
    rows = [SampleRow(SamplingParams(temperature=0.8, seed=1, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                                     repetition_penalty=1.2, logit_bias={3: 1.0}, logprobs=2), 4, 0, (7,)),
            SampleRow(SamplingParams(temperature=0.0), 2, 1)]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    masks = torch.full((1, bitmask_words(V)), -1, dtype=torch.int32)
    masks[0, 0] = 0x7FFFFFF0  # tokens 0-3 and 31 not allowed in row 0
    bitmask = (torch.tensor([0]), masks)
    results = []
    for fn in (sample_pass, torch.compile(sample_pass, backend="eager", fullgraph=True)):
        history = TokenHistory(2, V, "cpu")
        history.reset(0, 0, [1, 2], [3, 9, 9])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's notes on the functools.cache'd helpers it traces through
            tokens, packed = fn(logits, SamplingBatch.build(rows, "cpu"), bitmask, history)
        results.append((tokens, packed, history.counts))
    (tokens, packed, counts), (traced_tokens, traced_packed, traced_counts) = results
    assert torch.equal(tokens, traced_tokens) and torch.equal(counts, traced_counts)
    torch.testing.assert_close(packed, traced_packed)
