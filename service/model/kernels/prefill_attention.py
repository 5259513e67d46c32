"""Prompt-chunk attention over the paged KV cache: every chunk of a step in one call.

A chunk is rows [row, row + length) of the step holding a prompt's tokens at positions
[start, start + length) of its slot; the slot's KV already holds [0, start) from earlier steps (a
prefix-cache hit, or the prompt's earlier chunks) and this step's rows were written before
attention runs. Query i of the chunk attends to positions [0, start + i]. A chunk that starts its
prompt is the case start = 0.

`prefill_attention_torch` gathers each chunk's positions through its table row and runs SDPA with
a lower-right causal mask, one call per chunk (the CPU path and the reference).
`prefill_attention_triton` is one flash-attention launch for the whole step: a grid over (tile of
BLOCK_M queries of one chunk, query head); each program walks the keys [0, the tile's last
position] in BLOCK_N steps, each key read in place through the block table, the softmax online in
float32. Its per-chunk and per-tile tables are device tensors of the step's one host-to-device copy
(service.model.step_batch), so it needs no host sync and compiles once per model shape: no
argument that follows the step's lengths is a compile-time constant. An FP8 cache is read with the
layer's (k, v) scales, as the decode kernel reads it (service/model/kv_quant.py).

A sliding-window layer passes `window` w: the query at position p sees keys (p - w, p] only, and
the kernel's key loop starts at the tile's first visible key. `scale` replaces head_dim ** -0.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from service.model.kernels._triton import LOG2E, cdiv, interpreting, next_pow2, tl, triton
from service.model.kernels.decode_attention import check_kv_dtypes
from service.model.kv_quant import load_kv

if triton is not None:
    from service.model.kernels._triton import kv_scales, online_softmax

BLOCK_M = 64  # queries per program (one chunk's, one head's)
BLOCK_N = 64  # keys per inner step

# Never cuDNN's SDPA (PyTorch's first choice on Hopper): it builds a plan per new shape, and every
# prompt length is one, 73 ms per new length (960 ms the first) on an H200, on the engine thread
# while every stream waited (bench/attention_shapes.py). The math kernel is the fallback.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# (row, length, start, slot) of each chunk: the columns of the chunk table
CHUNK_FIELDS = 4


def chunk_tiles(lengths: Sequence[int]) -> list[int]:
    """(chunk index, first query) of every BLOCK_M-query tile of chunks of these lengths, flat."""
    return [x for c, n in enumerate(lengths) for first in range(0, n, BLOCK_M) for x in (c, first)]


def prefill_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    chunks: Sequence[tuple[int, int, int, int]], out: torch.Tensor, kv_scale: torch.Tensor | None = None,
    window: int = 0, scale: float | None = None,
) -> None:
    """q: [S, H, D] rows of the step; k_cache, v_cache: [num_blocks, KVH, block_size, D];
    block_table [rows, MB] int32; chunks: (row, length, start, slot) each (host ints); kv_scale: the
    layer's (k, v) float32 [2], read for an FP8 cache; window: the layer's sliding window (0: none);
    scale: the scores' (None: D ** -0.5). Writes each chunk's rows of out [S, H * D]."""
    heads, kvh, bs = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    for row, length, start, slot in chunks:
        end = start + length
        table = block_table[slot, : cdiv(end, bs)].long()
        k, v = (c.index_select(0, table).transpose(0, 1).reshape(kvh, -1, c.shape[3])[:, :end]
                for c in (k_cache, v_cache))  # [KVH, end, D]
        k, v = load_kv(k, v, kv_scale, q.dtype)
        k, v = (x.repeat_interleave(heads // kvh, dim=0)[None] for x in (k, v))
        mask = causal_lower_right(length, end) if not window else _window_mask(start, length, window, q.device)
        with sdpa_kernel(_SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(q[row: row + length].transpose(0, 1)[None], k, v,
                                               attn_mask=mask, scale=scale)  # [1, H, L, D]
        out[row: row + length] = o[0].transpose(0, 1).reshape(length, -1)


def _window_mask(start: int, length: int, window: int, device: torch.device) -> torch.Tensor:
    """[L, start + L] bool: query i (position start + i) sees keys (start + i - window, start + i]."""
    keys = torch.arange(start + length, device=device)[None, :]
    query = start + torch.arange(length, device=device)[:, None]
    return (keys <= query) & (keys > query - window)


def prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    chunk_table: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor, kv_scale: torch.Tensor | None = None,
    window: int = 0, scale: float | None = None,
) -> None:
    """As prefill_attention_torch, the chunks given as device tensors: chunk_table [C, 4] and tiles
    [T, 2] long (chunk_tiles)."""
    s, h, d = q.shape
    kvh, block_size = k_cache.shape[1], k_cache.shape[2]
    fp8_kv = check_kv_dtypes(q, k_cache, v_cache, kv_scale)
    assert h % kvh == 0 and q.dtype == out.dtype
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert chunk_table.is_contiguous() and tiles.is_contiguous() and out.shape[1] == h * d and out.stride(1) == 1
    if tiles.shape[0] == 0:
        return
    q = q.contiguous()
    max_keys = block_table.shape[1] * block_size
    _prefill_attn_kernel[(tiles.shape[0], h)](
        q, k_cache, v_cache, k_cache if kv_scale is None else kv_scale, block_table, chunk_table, tiles, out,
        (d**-0.5 if scale is None else scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0),
        GROUPS=h // kvh, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        KV_BLOCK=block_size, DYNAMIC_LOOP=not interpreting(), MAX_KEYS=cdiv(max_keys, BLOCK_N) * BLOCK_N,
        FP8_KV=fp8_kv, WINDOW=window, num_warps=4, num_stages=2,
    )


if triton is not None:

    @triton.jit
    def _prefill_attn_kernel(
        q_ptr, k_ptr, v_ptr, scale_ptr, table_ptr, chunks_ptr, tiles_ptr, out_ptr,
        qk_scale,
        stride_qs, stride_qh,
        stride_kb, stride_kh, stride_kt,
        stride_tb, stride_os,
        GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, MAX_KEYS: tl.constexpr,
        FP8_KV: tl.constexpr, WINDOW: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        chunk = tl.load(tiles_ptr + 2 * tile)
        first = tl.load(tiles_ptr + 2 * tile + 1)
        row0 = tl.load(chunks_ptr + chunk * 4)
        length = tl.load(chunks_ptr + chunk * 4 + 1)
        start = tl.load(chunks_ptr + chunk * 4 + 2)
        slot = tl.load(chunks_ptr + chunk * 4 + 3)

        offs_m = first + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < length
        d_mask = offs_d < HEAD_DIM
        rows = (row0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qs + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = start + offs_m  # [BLOCK_M] each query's position: it sees keys [0, q_pos]
        end = start + tl.minimum(first + BLOCK_M, length)  # keys [0, end) are all the tile can see
        table = table_ptr + slot * stride_tb
        kv_off = (head // GROUPS) * stride_kh
        k_scale, v_scale = kv_scales(scale_ptr, FP8_KV)
        if FP8_KV:  # as the decode kernel: fp16 products on the unscaled E4M3 tiles (exact in fp16)
            q = (q.to(tl.float32) * qk_scale).to(tl.float16)
            qk_scale = k_scale

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if DYNAMIC_LOOP:
            first_key = 0  # with a sliding window: the tile's first query's first visible key, tile-aligned
            if WINDOW > 0:
                first_key = tl.maximum(start + first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            for n0 in range(first_key, end, BLOCK_N):
                m_i, l_i, acc = _attend_keys(q, k_ptr, v_ptr, table, kv_off, n0 + tl.arange(0, BLOCK_N), end,
                                             q_pos, offs_d, d_mask, stride_kb, stride_kt, KV_BLOCK, WINDOW, qk_scale,
                                             m_i, l_i, acc)
        else:  # the interpreter cannot loop over runtime bounds: every key tile of the table, masked
            for n0 in range(0, MAX_KEYS, BLOCK_N):
                m_i, l_i, acc = _attend_keys(q, k_ptr, v_ptr, table, kv_off, n0 + tl.arange(0, BLOCK_N), end,
                                             q_pos, offs_d, d_mask, stride_kb, stride_kt, KV_BLOCK, WINDOW, qk_scale,
                                             m_i, l_i, acc)
        o = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # v_scale: 1.0 but for an FP8 cache
        tl.store(out_ptr + rows[:, None] * stride_os + head * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _attend_keys(q, k_ptr, v_ptr, table, kv_off, offs_n, end, q_pos, offs_d, d_mask, stride_kb, stride_kt,
                     KV_BLOCK: tl.constexpr, WINDOW: tl.constexpr, qk_scale, m_i, l_i, acc):
        # BLOCK_N keys, each read through the chunk's block table: causal scores, the online-softmax
        # rescale (base 2), accumulate p @ v.
        n_mask = offs_n < end
        blocks = tl.load(table + offs_n // KV_BLOCK, mask=n_mask, other=0).to(tl.int64)
        kv_rows = kv_off + blocks * stride_kb + (offs_n % KV_BLOCK) * stride_kt
        tile = kv_rows[:, None] + offs_d[None, :]
        tile_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + tile, mask=tile_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]; E4M3 -> fp16
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] float32
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_ptr + tile, mask=tile_mask, other=0.0).to(q.dtype)
        return online_softmax(s, v, m_i, l_i, acc)
