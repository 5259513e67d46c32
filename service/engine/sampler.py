"""Batched token sampling with per-row temperature / top-k / top-p / seed and no host syncs.

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


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, built once per step on the host. The optional
    stages are None when no row of the step uses them: such rows cost nothing."""

    # None (all five) in a batch of plain greedy rows (SamplingBatch.greedy), which never reads them
    temperature: Tensor | None  # [B] float32, 0 = greedy
    top_p: Tensor | None  # [B] float32, 1 = disabled
    top_k: Tensor | None  # [B] int64, 0 = disabled
    seed: Tensor | None  # [B] int64
    counter: Tensor | None  # [B] int64, index of the token being generated
    all_greedy: bool  # host-side flags: skip whole stages without looking at the tensors
    any_top_p: bool
    any_top_k: bool
    min_p: Tensor | None = None  # [B] float32, 0 = disabled
    additive: tuple[Tensor, Tensor, Tensor] | None = None  # (rows, ids, values): logit bias, -inf bans
    penalties: Penalties | None = None
    logprobs: tuple[Tensor, int, list[int]] | None = None  # (rows [L], largest k, k per row)
    # Structured outputs: (rows [C] on the device, their grammar masks int32 [C, words], pinned host
    # memory on CUDA) from service/engine/structured.py.
    bitmask: tuple[Tensor, Tensor] | None = None

    @classmethod
    def greedy(cls) -> SamplingBatch:
        """A step whose rows are all SamplingParams.plain_greedy: the argmax, nothing built or copied
        per row (the common case of a greedy load: 0.1-0.2 ms of host time a step at 256 rows)."""
        return cls(None, None, None, None, None, all_greedy=True, any_top_p=False, any_top_k=False)

    @classmethod
    def build(cls, rows: list[SampleRow] | list[tuple], device: torch.device | str) -> SamplingBatch:
        rows = [SampleRow(*r) for r in rows]
        ps = [r.params for r in rows]
        floats = [[p.temperature for p in ps], [p.top_p for p in ps]]
        seeds = [0 if p.greedy else _to_int64(p.seed) for p in ps]  # a greedy row draws nothing
        ints = [[p.top_k for p in ps], seeds, [_to_int64(r.counter) for r in rows]]
        any_min_p = any(not p.greedy and p.min_p > 0 for p in ps)
        if any_min_p:
            floats.append([p.min_p for p in ps])
        # Sparse per-row additions to the logits: (row, id, value) triples, one copy for all.
        add_rows, add_ids, add_values = [], [], []
        for b, r in enumerate(rows):
            for token, bias in r.params.logit_bias:
                add_rows.append(b), add_ids.append(token), add_values.append(bias)
            for token in r.banned:
                add_rows.append(b), add_ids.append(token), add_values.append(float("-inf"))
        penalized = [b for b, p in enumerate(ps) if p.penalized]
        if penalized:
            floats += [[ps[b].presence_penalty for b in penalized], [ps[b].frequency_penalty for b in penalized],
                       [ps[b].repetition_penalty for b in penalized]]
            ints += [penalized, [rows[b].history_row for b in penalized]]
        with_logprobs = [b for b, p in enumerate(ps) if p.logprobs is not None]
        if with_logprobs:
            ints.append(with_logprobs)
        if add_rows:
            ints += [add_rows, add_ids]
            floats.append(add_values)
        float_parts = iter(copy_parts(floats, torch.float32, device))
        int_parts = iter(copy_parts(ints, torch.int64, device))
        batch = cls(
            temperature=next(float_parts), top_p=next(float_parts),
            top_k=next(int_parts), seed=next(int_parts), counter=next(int_parts),
            all_greedy=all(p.greedy for p in ps),
            any_top_p=any(not p.greedy and p.top_p < 1.0 for p in ps),
            any_top_k=any(not p.greedy and p.top_k > 0 for p in ps),
        )
        if any_min_p:
            batch.min_p = next(float_parts)
        if penalized:
            presence, frequency, repetition = next(float_parts), next(float_parts), next(float_parts)
            batch.penalties = Penalties(next(int_parts), next(int_parts), presence, frequency, repetition)
        if with_logprobs:
            ks = [ps[b].logprobs for b in with_logprobs]
            batch.logprobs = (next(int_parts), max(ks), ks)
        if add_rows:
            batch.additive = (next(int_parts), next(int_parts), next(float_parts))
        return batch


@dataclass
class Penalties:
    rows: Tensor  # [P] the step's rows with a penalty
    history_rows: Tensor  # [P] their TokenHistory rows
    presence: Tensor  # [P] float32
    frequency: Tensor
    repetition: Tensor


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

    def add(self, rows: Tensor, tokens: Tensor) -> None:
        """Count tokens[i] in history row rows[i] (device tensors)."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


@dataclass
class Sampled:
    tokens: Tensor  # [B] int64
    # [L, 2 + 2k] float32 for the rows with logprobs: the sampled token's log-probability and its rank,
    # then the top k log-probabilities, then their ids (exact in float32 below 2**24): one copy to the host.
    logprobs: Tensor | None = None


def sample(logits: Tensor, batch: SamplingBatch, history: TokenHistory | None = None) -> Sampled:
    """logits: [B, V] float32 -> token ids [B] int64 on logits.device (and log-probabilities)."""
    raw = logits
    if batch.additive is not None or batch.penalties is not None or batch.bitmask is not None:
        logits = logits.clone()
        if batch.bitmask is not None:
            apply_bitmask(logits, *batch.bitmask)
        if batch.additive is not None:
            rows, ids, values = batch.additive
            logits.index_put_((rows, ids), values, accumulate=True)  # -inf bans stay -inf
        if batch.penalties is not None:
            assert history is not None, "penalties need the token history"
            p = batch.penalties
            apply_penalties(logits, p.rows, p.history_rows, history.counts, history.in_prompt, p.presence, p.frequency,
                            p.repetition)
    tokens = _choose(logits, batch)
    if batch.penalties is not None:
        assert history is not None
        history.add(batch.penalties.history_rows, tokens[batch.penalties.rows])
    return Sampled(tokens, None if batch.logprobs is None else _logprobs(raw, tokens, batch.logprobs))


def _choose(logits: Tensor, batch: SamplingBatch) -> Tensor:
    greedy_ids = logits.argmax(dim=-1)  # [B]; first index among ties
    if batch.all_greedy:
        return greedy_ids
    assert batch.temperature is not None and batch.seed is not None and batch.counter is not None
    is_greedy = batch.temperature == 0.0  # [B]
    # Greedy rows divide by 1 so the sampled path stays finite; their result is discarded below.
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature.unsqueeze(1)  # [B, V]
    if batch.min_p is not None:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps every token.
        floor = scaled.max(dim=-1, keepdim=True).values + batch.min_p.log().unsqueeze(1)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if batch.any_top_k or batch.any_top_p:
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
    if batch.any_top_k:
        # Masking by rank (not by value >= k-th value) keeps exactly k tokens even with ties.
        k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab))
        remove |= ranks >= k.unsqueeze(1)
    if batch.any_top_p:
        probs = sorted_vals.masked_fill(remove, float("-inf")).softmax(dim=-1)  # top-p after top-k
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of the strictly better tokens
        # A token stays while the better ones hold < top_p; rows at top_p == 1 skip the test so that
        # rounding in the cumulative sum never drops their tail.
        remove |= (mass_before >= batch.top_p.unsqueeze(1)) & (batch.top_p < 1.0).unsqueeze(1)
    remove[:, 0] = False  # always keep the top-1, whatever top_p or top_k say
    masked_sorted = sorted_vals.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_idx, masked_sorted)


def _logprobs(raw: Tensor, tokens: Tensor, spec: tuple[Tensor, int, list[int]]) -> Tensor:
    rows, k, _ = spec
    logits = raw[rows] if rows.numel() != raw.shape[0] else raw  # [L, V]
    return token_logprobs(logits, tokens[rows], k)


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
