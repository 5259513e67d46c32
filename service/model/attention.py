"""Attention over one step's packed rows, reading keys and values from the paged KV cache.

The step's K/V are already in the cache when this runs (the piece before it writes them, at the
rows' (block, offset) write index), so attention is a function of the rotated queries, the cache
and the step's AttentionMetadata: decode rows through the decode kernel, prompt chunks (whether
they start a prompt or continue one against the KV its earlier chunks or a prefix-cache hit left)
through the chunk kernel, all chunks of the step in one call (service.model.kernels: Triton on
CUDA, torch otherwise). It runs eagerly, between the pieces that CUDA graphs may capture, on the
real lengths; padding rows of the output stay zero.

A sliding-window layer's attention gets its `window` and every call the model's score `scale`
(None: head_dim ** -0.5), passed through to the kernels.

`rowwise_step_attention` is the batch-invariant mode's: every row, prompt token or decode, goes
through the decode kernel (a token attends to its slot's positions up to its own), so a token's
result is the same whether its prompt arrives whole, in chunks, or beside other requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from service.model.kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
from service.model.kv_cache import KVCache
from service.model.step_batch import AttentionMetadata, StepBatch

# (q [B, H, D], k_cache, v_cache, block_table, slot_ids [B], positions [B], the layer's (k, v) scales
# [2], window=, scale=) -> [B, H * D]
DecodeAttention = Callable[..., torch.Tensor]
# (q [S, H, D], k_cache, v_cache, block_table, the step's metadata, out [S, H * D], the layer's (k, v)
# scales [2], window=, scale=): writes the chunks' rows of out
ChunkAttention = Callable[..., None]


def chunk_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          meta: AttentionMetadata, out: torch.Tensor, kv_scale: torch.Tensor | None = None,
                          window: int = 0, scale: float | None = None) -> None:
    prefill_attention_torch(q, k_cache, v_cache, block_table,
                            [(c.row, c.length, c.start, c.slot) for c in meta.chunks], out, kv_scale, window, scale)


def chunk_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           meta: AttentionMetadata, out: torch.Tensor, kv_scale: torch.Tensor | None = None,
                           window: int = 0, scale: float | None = None) -> None:
    assert meta.chunk_table is not None and meta.chunk_tiles is not None
    prefill_attention_triton(q, k_cache, v_cache, block_table, meta.chunk_table, meta.chunk_tiles, out, kv_scale,
                             window, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                     scale: float | None = None) -> torch.Tensor:
    """q: [L, H, D], k, v: [M, KVH, D] (M >= L: the queries are the last L of the M positions) ->
    [L, H * D], causal (the cache-free reference forward; a draft's later passes), within a sliding
    window when `window` > 0."""
    length, heads, _ = q.shape
    groups = heads // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    mask = None
    offset = k.shape[0] - length
    if window or offset:
        q_pos = torch.arange(offset, offset + length, device=q.device)[:, None]
        k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                             scale=scale)  # [1, H, L, D]
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
    decode_attention: DecodeAttention,
    chunk_attention: ChunkAttention,
    out: torch.Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [S, H, D] rotated queries of every row; the layer's cache already holding this step's K/V
    -> [S, H * D] (written into `out` when given, e.g. a buffer a captured piece reads)."""
    meta = batch.attention
    out = _output(q, out, meta.num_tokens)
    k_cache, v_cache, kv_scale = kv.k[layer], kv.v[layer], kv.scales[layer]
    d = meta.num_decodes
    if d:
        out[:d] = decode_attention(q[:d], k_cache, v_cache, kv.block_table, batch.slot_ids[:d], batch.positions[:d],
                                   kv_scale, window=window, scale=scale)
    if meta.chunks:
        chunk_attention(q, k_cache, v_cache, kv.block_table, meta, out, kv_scale, window=window, scale=scale)
    return out


def rowwise_step_attention(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    batch: StepBatch,
    decode_attention: DecodeAttention,
    out: torch.Tensor | None = None,
    rows_per_call: int = 64,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """As step_attention, with every real row as a decode row: [0, num_tokens) in calls of at most
    rows_per_call rows (bounding the kernel's buffers on long prompts). The decode kernel computes
    each row on its own, so neither the calls' boundaries nor the other rows change a row's result."""
    n = batch.attention.num_tokens
    out = _output(q, out, n)
    k_cache, v_cache, kv_scale = kv.k[layer], kv.v[layer], kv.scales[layer]
    for start in range(0, n, rows_per_call):
        rows = slice(start, min(n, start + rows_per_call))
        out[rows] = decode_attention(q[rows], k_cache, v_cache, kv.block_table, batch.slot_ids[rows],
                                     batch.positions[rows], kv_scale, window=window, scale=scale)
    return out
