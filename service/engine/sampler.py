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

import torch
from torch import Tensor

from service.engine.request import SamplingParams

_MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32's multipliers, the second as the int32 with the same bits
_C2 = 0x846CA68B - (1 << 32)
_UNIFORM_BITS = 23  # (k + 0.5) * 2**-23 for k < 2**23 is exact in float32 and strictly inside (0, 1)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, built once per step on the host."""

    temperature: Tensor  # [B] float32, 0 = greedy
    top_p: Tensor  # [B] float32, 1 = disabled
    top_k: Tensor  # [B] int64, 0 = disabled
    seed: Tensor  # [B] int64
    counter: Tensor  # [B] int64, index of the token being generated
    all_greedy: bool  # host-side flags: skip whole stages without looking at the tensors
    any_top_p: bool
    any_top_k: bool

    @classmethod
    def build(cls, params: list[tuple[SamplingParams, int]], device: torch.device | str) -> SamplingBatch:
        """params: (sampling parameters, counter) per row."""
        floats = torch.tensor([[p.temperature for p, _ in params], [p.top_p for p, _ in params]],
                              dtype=torch.float32)  # [2, B]
        ints = torch.tensor([[p.top_k for p, _ in params], [_to_int64(p.seed) for p, _ in params],
                             [_to_int64(c) for _, c in params]], dtype=torch.int64)  # [3, B]
        if torch.device(device).type == "cuda":
            # Two copies from pinned memory, queued on the stream: the host does not wait for them.
            floats = floats.pin_memory().to(device, non_blocking=True)
            ints = ints.pin_memory().to(device, non_blocking=True)
        else:
            floats, ints = floats.to(device), ints.to(device)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            seed=ints[1],
            counter=ints[2],
            all_greedy=all(p.greedy for p, _ in params),
            any_top_p=any(not p.greedy and p.top_p < 1.0 for p, _ in params),
            any_top_k=any(not p.greedy and p.top_k > 0 for p, _ in params),
        )


def sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits: [B, V] float32 -> token ids [B] int64 on logits.device."""
    greedy_ids = logits.argmax(dim=-1)  # [B]; first index among ties
    if batch.all_greedy:
        return greedy_ids
    is_greedy = batch.temperature == 0.0  # [B]
    # Greedy rows divide by 1 so the sampled path stays finite; their result is discarded below.
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature.unsqueeze(1)  # [B, V]
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
