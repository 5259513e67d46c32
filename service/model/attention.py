"""Attention over one step's packed rows, reading keys and values from the paged KV cache.

The step's K/V are already in the cache when this runs (the piece before it writes them, at the
rows' (block, offset) write index), so attention is a function of the rotated queries, the cache
and the step's AttentionMetadata:
decode rows through the decode kernel (Triton on CUDA, torch otherwise), chunks that start a
prompt through batched causal attention by length bucket, chunks that continue a prompt against
their sequence's earlier KV (gathered through its block table) plus causally within the chunk. It runs eagerly, between the pieces that
CUDA graphs may capture, on the real lengths; padding rows of the output stay zero.

`rowwise_step_attention` is the batch-invariant mode's: every row, prompt token or decode, goes
through the decode kernel (a token attends to its slot's positions up to its own), so a token's
result is the same whether its prompt arrives whole, in chunks, or beside other requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from service.model.kv_cache import KVCache
from service.model.step_batch import StepBatch

# Prompt attention never uses cuDNN's SDPA (PyTorch's first choice on Hopper): it builds a plan per
# new shape, and every prompt length is one, 73 ms per new length (960 ms the first) on an H200,
# on the engine thread while every stream waited; flash / memory-efficient take 0.16 ms
# (bench/attention_shapes.py). The math kernel is the fallback (the CPU, odd shapes).
_PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# (q [B, H, D], k_cache, v_cache, block_table, slot_ids [B], positions [B]) -> [B, H * D]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                           torch.Tensor]
# The step's rows' KV entries: (block [S], offset [S]), KVCache.write_index
WriteIndex = tuple[torch.Tensor, torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [L, H, D], k, v: [L, KVH, D] -> [L, H * D]
    return batched_causal_attention(q[None], k[None], v[None])[0]


def batched_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [B, L, H, D], k, v: [B, L, KVH, D] -> [B, L, H * D]; each of the B sequences on its own
    batch, length, heads, _ = q.shape
    groups = heads // k.shape[2]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    with sdpa_kernel(_PROMPT_BACKENDS):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [B, H, L, D]
    return out.transpose(1, 2).reshape(batch, length, -1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [L, H, D], the last L of the E positions whose keys and values are k, v: [KVH, E, D]
    -> [L, H * D]: query i attends to positions [0, E - L + i]."""
    length, heads, _ = q.shape
    groups = heads // k.shape[0]
    kh, vh = k.repeat_interleave(groups, dim=0)[None], v.repeat_interleave(groups, dim=0)[None]
    with sdpa_kernel(_PROMPT_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kh, vh, attn_mask=causal_lower_right(length, k.shape[1])
        )  # [1, H, L, D]
    return out[0].transpose(0, 1).reshape(length, -1)


def _output(q: torch.Tensor, out: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """The [S, H * D] output: `out` with its padding rows (from num_tokens) zeroed, or a new zero one."""
    if out is None:
        return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    if num_tokens < out.shape[0]:
        out[num_tokens:].zero_()
    return out


def step_attention(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    batch: StepBatch,
    index: WriteIndex,
    decode_attention: DecodeAttention,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [S, H, D] rotated queries of every row; the layer's cache already holding this step's K/V
    at `index` -> [S, H * D] (written into `out` when given, e.g. a buffer a captured piece reads)."""
    meta = batch.attention
    out = _output(q, out, meta.num_tokens)
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    blocks, offsets = index
    d = meta.num_decodes
    if d:
        out[:d] = decode_attention(q[:d], k_cache, v_cache, kv.block_table, batch.slot_ids[:d], batch.positions[:d])
    for g in meta.prompts:
        if g.rows is None:
            rows = slice(g.first_row, g.first_row + g.batch * g.length)
            qg, bg, off = q[rows], blocks[rows], offsets[rows]
        else:
            qg, bg, off = (x.index_select(0, g.rows) for x in (q, blocks, offsets))
        kg, vg = k_cache[bg, :, off], v_cache[bg, :, off]  # [batch * length, KVH, D]
        shaped = (x.view(g.batch, g.length, *x.shape[1:]) for x in (qg, kg, vg))
        og = batched_causal_attention(*shaped).view(g.batch * g.length, -1)
        if g.rows is None:
            out[rows] = og
        else:
            assert g.real is not None and g.dest is not None
            out.index_copy_(0, g.dest, og.index_select(0, g.real))
    for c in meta.contexts:
        end = c.start + c.length
        out[c.row: c.row + c.length] = context_attention(
            q[c.row: c.row + c.length], kv.gather(k_cache, c.slot, end), kv.gather(v_cache, c.slot, end)
        )
    return out


def rowwise_step_attention(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    batch: StepBatch,
    decode_attention: DecodeAttention,
    out: torch.Tensor | None = None,
    rows_per_call: int = 64,
) -> torch.Tensor:
    """As step_attention, with every real row as a decode row: [0, num_tokens) in calls of at most
    rows_per_call rows (bounding the kernel's buffers on long prompts). The decode kernel computes
    each row on its own, so neither the calls' boundaries nor the other rows change a row's result."""
    n = batch.attention.num_tokens
    out = _output(q, out, n)
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    for start in range(0, n, rows_per_call):
        rows = slice(start, min(n, start + rows_per_call))
        out[rows] = decode_attention(q[rows], k_cache, v_cache, kv.block_table, batch.slot_ids[rows],
                                     batch.positions[rows])
    return out
