"""Batched token sampling: one pass over the step's logits (`sample_pass`) with per-row parameter
tensors and no host syncs.

The pass applies, in vLLM's order, the grammar masks, logit bias and bans, the presence / frequency /
repetition penalties, temperature, min-p, top-k and top-p, draws, and computes the top
log-probabilities; greedy rows take the argmax. Which stages run, and over how many rows, is decided
on the host from the step's rows (`Stages`): the penalties, masks and logprobs run only on the rows
that ask (padded to a power of two), so the pass's work and shapes never depend on a tensor's
value and it can be captured in a graph per Stages. A step of plain greedy rows runs the argmax alone.

Randomness comes from a counter-based integer hash of (seed, counter, vocab index) computed with
torch integer ops on the logits' device, not from a torch.Generator: a row's token depends only on
its own logits, seed and counter. It is the same whatever else shares the batch, in any row order,
eager or replayed in a CUDA graph, and a retried or resumed request reproduces its tokens. The
integer noise is bit-identical on CPU and GPU; its final float log may differ in the last ulp, so a
near-tie between two tokens can rarely resolve differently across devices. Sampling is Gumbel-max: argmax(logits / T + Gumbel noise)
draws exactly from softmax(logits / T) restricted to the kept (top-k / top-p) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from service.engine.request import SamplingParams, TokenLogprobs
from service.model.device_copy import copy_parts, to_device
from service.model.kernels.sampling import apply_bitmask, apply_penalties

_MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32's multipliers, the second as the int32 with the same bits
_C2 = 0x846CA68B - (1 << 32)
_UNIFORM_BITS = 23  # (k + 0.5) * 2**-23 for k < 2**23 is exact in float32 and strictly inside (0, 1)


class SampleRow(NamedTuple):
    """One sampling row of a step, as the runner knows it."""

    params: SamplingParams
    counter: int  # index of the completion token being sampled (pending ones included)
    history_row: int = 0  # its row in the TokenHistory (the KV slot); read only with penalties
    banned: tuple[int, ...] = ()  # ids it may not sample now (EOS and stop ids before min_tokens)


@dataclass(frozen=True)
class Stages:
    """Which parts of sample_pass a step runs, and over how many rows: facts about its rows that the
    host knows when it builds the step. With the batch size, the vocabulary and the number of mask
    rows they alone decide the pass's work and shapes, never a tensor's values, so a captured graph of
    the pass is keyed by them like any other static input. A stage no row uses is skipped whole.

    The penalties, the masks and the logprobs run only on the rows that ask, a list padded to a
    power of two (`_slots`) so that a few shapes serve every step; padding rows point at a scratch
    row of the pass (penalties, masks) or repeat a real row (logprobs, read-only) and are never read.
    Where a stage runs over all rows (the draw, the bias), a row that does not use it gets the
    identity (temperature 1 for greedy rows, min_p 0, top_k 0, top_p 1, bias slots of 0.0)."""

    sampled: bool = False  # some row draws (temperature > 0): temperature, min_p, top-k, top-p, noise
    min_p: bool = False
    top_k: bool = False
    top_p: bool = False
    penalty_rows: int = 0  # rows in the penalty stage (the penalized ones, padded); 0: none
    bias_slots: int = 0  # logit-bias and ban entries per row (a power of two; 0: no row has any)
    logprobs: int | None = None  # top log-probabilities per row (the largest k a row asks); None: none asks
    logprob_rows: int = 0  # rows in the logprob stage (those that ask, padded)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, built once per step on the host (one copy per
    dtype): [B] for the draw, [B, S] for the bias, and per stage row for the penalties and logprobs.
    A stage's tensors are None when `stages` leaves it out."""

    stages: Stages
    temperature: Tensor | None = None  # [B] float32, 0 = greedy
    seed: Tensor | None = None  # [B] int64
    counter: Tensor | None = None  # [B] int64, index of the token being generated
    top_p: Tensor | None = None  # [B] float32, 1 = disabled
    top_k: Tensor | None = None  # [B] int64, 0 = disabled
    min_p: Tensor | None = None  # [B] float32, 0 = disabled
    bias: tuple[Tensor, Tensor] | None = None  # ids [B, S] int64, values [B, S] float32 (-inf bans; padding 0, 0.0)
    penalties: Penalties | None = None
    # (rows that ask [L padded], their largest k, k per real row): `sample` hands back the first L.
    logprobs: tuple[Tensor, int, list[int]] | None = None
    # Structured outputs: (rows [C] on the device, their grammar masks int32 [C, words], pinned host
    # memory on CUDA) from service/engine/structured.py; `sample` pads them for the pass.
    bitmask: tuple[Tensor, Tensor] | None = None

    @property
    def all_greedy(self) -> bool:
        return not self.stages.sampled

    @classmethod
    def greedy(cls) -> SamplingBatch:
        """A step whose rows are all SamplingParams.plain_greedy: the argmax, nothing built or copied
        per row (the common case of a greedy load: 0.1-0.2 ms of host time a step at 256 rows)."""
        return cls(Stages())

    @classmethod
    def build(cls, rows: list[SampleRow] | list[tuple], device: torch.device | str) -> SamplingBatch:
        rows = [SampleRow(*r) for r in rows]
        ps = [r.params for r in rows]
        scratch = len(rows)  # the pass's scratch row, where padding rows point
        drawn = [p for p in ps if not p.greedy]
        additions = [list(r.params.logit_bias) + [(t, float("-inf")) for t in r.banned] for r in rows]
        penalized = [b for b, p in enumerate(ps) if p.penalized]
        with_logprobs = [b for b, p in enumerate(ps) if p.logprobs is not None]
        stages = Stages(
            sampled=bool(drawn), min_p=any(p.min_p > 0 for p in drawn), top_k=any(p.top_k > 0 for p in drawn),
            top_p=any(p.top_p < 1.0 for p in drawn), penalty_rows=_slots(len(penalized)),
            bias_slots=_slots(max(map(len, additions), default=0)),
            logprobs=max((ps[b].logprobs for b in with_logprobs), default=None), logprob_rows=_slots(len(with_logprobs)),
        )
        floats: list[list[float]] = []
        ints: list[list[int]] = []
        if stages.sampled:
            floats.append([p.temperature for p in ps])
            ints += [[0 if p.greedy else _to_int64(p.seed) for p in ps],  # a greedy row draws nothing
                     [_to_int64(r.counter) for r in rows]]
        if stages.top_p:
            floats.append([1.0 if p.greedy else p.top_p for p in ps])
        if stages.top_k:
            ints.append([0 if p.greedy else p.top_k for p in ps])
        if stages.min_p:
            floats.append([0.0 if p.greedy else p.min_p for p in ps])
        if penalized:
            pad = stages.penalty_rows - len(penalized)  # identity rows on the scratch row, counted 0 times
            floats += [[ps[b].presence_penalty for b in penalized] + [0.0] * pad,
                       [ps[b].frequency_penalty for b in penalized] + [0.0] * pad,
                       [ps[b].repetition_penalty for b in penalized] + [1.0] * pad]
            ints += [penalized + [scratch] * pad, [rows[b].history_row for b in penalized] + [0] * pad,
                     [1] * len(penalized) + [0] * pad]
        if stages.bias_slots:
            padded = [a + [(0, 0.0)] * (stages.bias_slots - len(a)) for a in additions]
            ints.append([t for a in padded for t, _ in a])
            floats.append([v for a in padded for _, v in a])
        if with_logprobs:
            ints.append(with_logprobs + with_logprobs[:1] * (stages.logprob_rows - len(with_logprobs)))
        f, i = iter(copy_parts(floats, torch.float32, device)), iter(copy_parts(ints, torch.int64, device))
        batch = cls(stages)
        if stages.sampled:
            batch.temperature, batch.seed, batch.counter = next(f), next(i), next(i)
        if stages.top_p:
            batch.top_p = next(f)
        if stages.top_k:
            batch.top_k = next(i)
        if stages.min_p:
            batch.min_p = next(f)
        if penalized:
            presence, frequency, repetition = next(f), next(f), next(f)
            batch.penalties = Penalties(next(i), next(i), presence, frequency, repetition, next(i))
        if stages.bias_slots:
            batch.bias = (next(i).view(len(rows), -1), next(f).view(len(rows), -1))
        if with_logprobs:
            batch.logprobs = (next(i), stages.logprobs, [ps[b].logprobs for b in with_logprobs])
        return batch


def _slots(n: int) -> int:
    """n rounded up to a power of two (0 stays 0): the padded size of a stage's rows or slots."""
    return 1 << (n - 1).bit_length() if n else 0


@dataclass
class Penalties:
    """[P] each: the penalized rows, padded with identity rows (presence 0, frequency 0, repetition 1)
    on the pass's scratch row that add nothing to the history."""

    rows: Tensor  # [P] batch rows (the scratch row B for padding)
    history_rows: Tensor  # [P] their TokenHistory rows (KV slots)
    presence: Tensor  # [P] float32
    frequency: Tensor
    repetition: Tensor
    counted: Tensor  # [P] int64: 1 where the row's sampled token enters its history row, 0 for padding


class TokenHistory:
    """What the penalties read, on the device: per history row (a KV slot), how often each token
    occurs in the completion and which occur in the prompt. Updated on the device after each
    sampling, so a token sampled by a step still in flight counts without a host sync.
    [rows, vocab] int32 + bool: about 5 bytes x vocab per row (165 MB for 257 rows at 128k)."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str) -> None:
        self.counts = torch.zeros((rows, vocab), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((rows, vocab), dtype=torch.bool, device=device)
        self.owner: list[object] = [None] * rows  # who each row describes now

    def reset(self, row: int, owner: object, prompt: list[int], completion: list[int]) -> None:
        """Make `row` describe a sequence that has `prompt` and, so far, `completion`."""
        device = self.counts.device
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        self.in_prompt[row, to_device(torch.tensor(prompt, dtype=torch.int64), device)] = True
        if completion:
            ids = to_device(torch.tensor(completion, dtype=torch.int64), device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.owner[row] = owner

    def forget(self, row: int) -> None:
        """`row` no longer describes its sequence: the next sampling that uses it resets it."""
        self.owner[row] = None

    def add(self, rows: Tensor, tokens: Tensor, counted: Tensor | None = None) -> None:
        """Count tokens[i] in history row rows[i] (device tensors), counted[i] times (once when None)."""
        ones = torch.ones_like(tokens, dtype=torch.int32) if counted is None else counted.to(torch.int32)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)


@dataclass
class Sampled:
    tokens: Tensor  # [B] int64
    # [L, 2 + 2k] float32 for the rows with logprobs: the sampled token's log-probability and its rank,
    # then the top k log-probabilities, then their ids (exact in float32 below 2**24): one copy to the host.
    logprobs: Tensor | None = None


def sample(logits: Tensor, batch: SamplingBatch, history: TokenHistory | None = None) -> Sampled:
    """logits: [B, V] float32 -> token ids [B] int64 on logits.device (and the log-probabilities of the
    rows that asked). The step's mask rows are padded for the pass (as its graph's inputs would be
    written), then sample_pass runs."""
    bitmask = None
    if batch.bitmask is not None:
        rows, masks = batch.bitmask
        pad = _slots(rows.numel()) - rows.numel()
        masks = masks.to(logits.device, non_blocking=True)
        bitmask = (torch.cat([rows, rows.new_full((pad,), logits.shape[0])]),  # the scratch row
                   torch.cat([masks, masks.new_full((pad, masks.shape[1]), -1)]))
    tokens, packed = sample_pass(logits, batch, bitmask, history)
    if packed is not None:
        assert batch.logprobs is not None
        packed = packed[: len(batch.logprobs[2])]
    return Sampled(tokens, packed)


def sample_pass(logits: Tensor, batch: SamplingBatch, bitmask: tuple[Tensor, Tensor] | None = None,
                history: TokenHistory | None = None) -> tuple[Tensor, Tensor | None]:
    """The whole sampling of a step in one pass over its [B, V] logits, in vLLM's order: the grammar
    masks, logit bias and bans, the penalties, then temperature, min_p, top-k, top-p and the draw;
    greedy rows take the argmax of the processed logits; then the top log-probabilities of the raw
    logits (the model's own) and the penalized rows' tokens into their history rows.

    No host sync and no shape that depends on a value: the stages run are batch.stages and their row
    lists are padded (Stages), so the pass can be captured in a graph per Stages and mask row count.
    The masks, bias and penalties work on a copy of the logits with one scratch row (row B) that
    padding rows write. bitmask: (rows [C], int32 masks [C, words]) on the device, padded, or None.
    Returns tokens [B] int64 and, when a row asks for log-probabilities, packed [L, 2 + 2k] float32
    (token_logprobs) for the logprob stage's rows, the rows that asked first.
    """
    stages = batch.stages
    raw = logits
    if bitmask is not None or stages.bias_slots or stages.penalty_rows:
        work = logits.new_empty((logits.shape[0] + 1, logits.shape[1]))  # [B + 1, V]
        work[:-1] = logits
        logits = work[:-1]
        if bitmask is not None:
            apply_bitmask(work, *bitmask)
        if stages.bias_slots:
            assert batch.bias is not None
            logits.scatter_add_(1, *batch.bias)  # -inf bans stay -inf; padding adds 0.0 to id 0
        if stages.penalty_rows:
            assert history is not None and batch.penalties is not None, "penalties need the token history"
            p = batch.penalties
            apply_penalties(work, p.rows, p.history_rows, history.counts, history.in_prompt, p.presence, p.frequency,
                            p.repetition)
    tokens = _choose(logits, batch)
    if stages.penalty_rows:
        assert history is not None and batch.penalties is not None
        p = batch.penalties
        history.add(p.history_rows, torch.cat([tokens, tokens[:1]])[p.rows], p.counted)  # the scratch row's: any
    packed = None
    if stages.logprobs is not None:
        assert batch.logprobs is not None
        rows = batch.logprobs[0]
        packed = token_logprobs(raw[rows], tokens[rows], stages.logprobs)
    return tokens, packed


def _choose(logits: Tensor, batch: SamplingBatch) -> Tensor:
    greedy_ids = logits.argmax(dim=-1)  # [B]; first index among ties
    stages = batch.stages
    if not stages.sampled:
        return greedy_ids
    assert batch.temperature is not None and batch.seed is not None and batch.counter is not None
    is_greedy = batch.temperature == 0.0  # [B]
    # Greedy rows divide by 1 so the sampled path stays finite; their result is discarded below.
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature.unsqueeze(1)  # [B, V]
    if stages.min_p:
        assert batch.min_p is not None
        # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps every token.
        floor = scaled.max(dim=-1, keepdim=True).values + batch.min_p.log().unsqueeze(1)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if stages.top_k or stages.top_p:
        scaled = _mask_top_k_top_p(scaled, batch)
    noise = gumbel_noise(batch.seed, batch.counter, logits.shape[1])  # [B, V]
    sampled_ids = (scaled + noise).argmax(dim=-1)  # [B]
    return torch.where(is_greedy, greedy_ids, sampled_ids)


def _mask_top_k_top_p(scaled: Tensor, batch: SamplingBatch) -> Tensor:
    """Set every token outside the row's top-k and then its nucleus (top-p) to -inf."""
    vocab = scaled.shape[1]
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)  # [1, V]
    remove = torch.zeros_like(sorted_vals, dtype=torch.bool)  # [B, V]
    if batch.stages.top_k:
        assert batch.top_k is not None
        # Masking by rank (not by value >= k-th value) keeps exactly k tokens even with ties.
        k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab))
        remove |= ranks >= k.unsqueeze(1)
    if batch.stages.top_p:
        assert batch.top_p is not None
        probs = sorted_vals.masked_fill(remove, float("-inf")).softmax(dim=-1)  # top-p after top-k
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of the strictly better tokens
        # A token stays while the better ones hold < top_p; rows at top_p == 1 skip the test so that
        # rounding in the cumulative sum never drops their tail.
        remove |= (mass_before >= batch.top_p.unsqueeze(1)) & (batch.top_p < 1.0).unsqueeze(1)
    remove[:, 0] = False  # always keep the top-1, whatever top_p or top_k say
    masked_sorted = sorted_vals.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_idx, masked_sorted)


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> Tensor:
    """logits [L, V] float32, tokens [L] -> packed [L, 2 + 2k]: each token's log-probability and its rank
    in the vocabulary (1 is the most likely; vLLM's: tokens at least as likely, itself included), then
    the top k log-probabilities and their token ids (unpack_logprobs reads it)."""
    # log_softmax at a few tokens only: logit - logsumexp, without a [L, V] log-probability tensor.
    lse = logits.logsumexp(dim=-1, keepdim=True)  # [L, 1]
    chosen_logit = logits.gather(1, tokens.unsqueeze(1))  # [L, 1]
    rank = (logits >= chosen_logit).sum(dim=-1, keepdim=True).to(torch.float32)  # [L, 1]
    parts = [chosen_logit - lse, rank]
    if k:
        top = logits.topk(k, dim=-1)
        parts += [top.values - lse, top.indices.to(torch.float32)]
    return torch.cat(parts, dim=1)


def unpack_logprobs(packed: list[list[float]], ks: list[int]) -> list[TokenLogprobs]:
    """The host side of Sampled.logprobs: one TokenLogprobs per row with logprobs."""
    out = []
    for row, k in zip(packed, ks, strict=True):
        width = (len(row) - 2) // 2
        top = tuple((int(row[2 + width + i]), row[2 + i]) for i in range(k))
        out.append(TokenLogprobs(row[0], top, int(row[1])))
    return out


def gumbel_noise(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """Standard Gumbel noise [B, V] float32, a pure function of (seed[b], counter[b], vocab index)."""
    seed_lo, seed_hi = _as_int32(seed), _as_int32(seed >> 32)
    key = _hash32(_hash32(_hash32(seed_hi) ^ seed_lo) ^ _as_int32(counter))  # [B]
    index = _hash32(torch.arange(vocab, device=seed.device, dtype=torch.int32))  # [V]
    # The [B, V] part is the cost: about 0.7 ms at B=64, V=128k on an H200 (a decode step is 2-6 ms),
    # so it runs in int32 and in place; a fused kernel would cut it to one pass.
    bits = key.unsqueeze(1) ^ index.unsqueeze(0)  # [B, V]
    bits = _hash32(bits, inplace=True)
    bits >>= 32 - _UNIFORM_BITS
    bits &= (1 << _UNIFORM_BITS) - 1  # the arithmetic shift copied the sign bit: keep 23 bits
    uniform = bits.to(torch.float32)
    uniform += 0.5
    uniform *= 2.0**-_UNIFORM_BITS  # in (0, 1), exact
    exponential = uniform.neg_().log1p_().neg_()  # Exp(1); log1p stays accurate for uniform near 0
    return exponential.log_().neg_()


def _hash32(x: Tensor, inplace: bool = False) -> Tensor:
    """lowbias32 (Chris Wellons) on int32 tensors read as the bits of uint32 values.

    int32 multiplication wraps modulo 2**32 (two's complement) on every torch backend, which is
    exactly uint32 multiplication on the same bits. Right shifts of int32 are arithmetic, so each
    shift is masked to the bits a logical (uint32) shift would keep.
    """
    x = x if inplace else x.clone()
    x ^= (x >> 16) & 0xFFFF
    x *= _C1
    x ^= (x >> 15) & 0x1FFFF
    x *= _C2
    x ^= (x >> 16) & 0xFFFF
    return x


def _as_int32(x: Tensor) -> Tensor:
    """The low 32 bits of an int64 tensor, as int32 (the same bits, read as signed)."""
    return (((x & _MASK32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _to_int64(value: int) -> int:
    """Map any Python int onto the int64 range, keeping its low 64 bits (seeds may be uint64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
