"""Decode attention: one query token per row against the filled part of its sequence's paged KV.

Caches are [num_blocks, KVH, block_size, D]; row i reads position p of its sequence at
(block_table[slot_ids[i], p // block_size], :, p % block_size) (service/model/kv_cache.py).
`decode_attention_torch` gathers each row's blocks and masks (the CPU path and the reference): the
positions past a row's own are selected away (zeroed) before any product, never only given a -inf
bias, so a stale NaN or inf that an earlier sequence left in the slot cannot reach the row (0 x NaN
and NaN - inf are NaN). `decode_attention_triton` is flash-decoding: a grid over (row, kv head,
split of the sequence) loads only positions [0, positions[i]] of row i (the others as 0), each
through the block table, the
query heads of one kv head share its loads (GQA), and the softmax runs online in float32. Lengths
come from the `positions` tensor, so both are graph-safe (fixed grid, no host syncs). The number
of splits follows the batch by default; the batch-invariant mode fixes the split's length by the
cache length (`fixed_split_len`). An FP8 cache (service/model/kv_quant.py) is read with the
layer's (k, v) scales `kv_scale`: the torch path upcasts what it gathers; the kernel (a compile-time
switch of the same kernel, from the cache's dtype) converts each tile to fp16, which holds every E4M3
value exactly, and applies the k scale to the scores and the v scale to the output.

A sliding-window layer (Gemma 3, Mistral) passes `window` w: row i then sees positions
(positions[i] - w, positions[i]] only (the paged cache keeps every position; the window is a mask,
and the kernel's loop starts at the window). `scale` replaces head_dim ** -0.5 as the scores' scale
(Gemma 3's query_pre_attn_scalar ** -0.5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.model.fp8 import FP8
from service.model.kernels._triton import LOG2E, cdiv, interpreting, next_pow2, pdl, pdl_launch, sm_count, tl, triton
from service.model.kv_quant import load_kv

if triton is not None:
    from service.model.kernels._triton import kv_scales, online_softmax, pdl_wait

BLOCK_N = 64  # KV positions per inner step: the unit of the batch-invariant mode's splits


def served_tile(head_dim: int, fp8_kv: bool) -> tuple[int, int, int]:
    """(KV positions a step, warps, pipeline stages) of the kernel, from bench/decode_attention_sweep.py
    on an H200 (batch 64, contexts 512 and 4,096, bench/results/h200-20261204-attention/): an FP8
    cache 128 positions and two stages (25-30% faster than 64 and three); bf16 128 positions at head
    dim 64 (10-17% faster), 64 at head dim 128 (128 was up to 6% slower there)."""
    if fp8_kv:
        return 128, 4, 2
    return (128, 4, 3) if head_dim <= 64 else (64, 4, 3)


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Each row's whole table as positions: [B, KVH, blocks_per_seq * block_size, D] (a copy)."""
    blocks = block_table.index_select(0, slot_ids).long()  # [B, MB]
    out = cache[blocks]  # [B, MB, KVH, bs, D]
    b, mb, kvh, bs, d = out.shape
    return out.permute(0, 2, 1, 3, 4).reshape(b, kvh, mb * bs, d)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [num_blocks, KVH, block_size, D]; block_table [rows, MB] int32;
    slot_ids, positions: [B] long; kv_scale: the layer's (k, v) float32 [2], read for an FP8 cache;
    window: the layer's sliding window (0: none); scale: the scores' (None: D ** -0.5) -> [B, H * D]."""
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    t = block_table.shape[1] * k_cache.shape[2]
    keys = torch.arange(t, device=q.device)[None, :]
    visible = keys <= positions[:, None]  # [B, T]
    if window:
        visible &= keys > positions[:, None] - window
    hidden = ~visible[:, None, :, None]  # [B, 1, T, 1]
    k, v = load_kv(gather_rows(k_cache, block_table, slot_ids), gather_rows(v_cache, block_table, slot_ids),
                   kv_scale, q.dtype)
    k, v = k.masked_fill_(hidden, 0), v.masked_fill_(hidden, 0)  # stale positions zeroed
    qg = q.view(b, kvh, h // kvh, d)  # GQA: the query heads of one kv head share its keys
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :], scale=scale)  # [B, KVH, G, D]
    return out.reshape(b, h * d)


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                   block_n: int = BLOCK_N) -> tuple[int, int]:
    """(num_splits, split_len): enough programs to fill the GPU twice over; split_len a multiple of
    block_n (the kernel's positions a step).

    The split follows the batch rounded up to a power of two. The split is a compile-time constant
    of the kernel, so each distinct one is a Triton compile: per exact batch, every new count of
    decode rows in a mixed step compiled one on the engine thread (hundreds of ms while every
    stream waited); per power of two there are a handful, all compiled by the start-up warm-up. It
    also gives an eager step of b rows the split of the graph it pads into (the default capture sizes
    hold every power of two up to their largest), so both reduce each row in the same pieces."""
    batch = 1 << max(0, batch - 1).bit_length()
    blocks = cdiv(max_seq_len, block_n)
    want = max(1, min(blocks, cdiv(2 * num_sms, batch * num_kv_heads)))
    split_len = cdiv(blocks, want) * block_n
    return cdiv(max_seq_len, split_len), split_len


def fixed_split_len(max_seq_len: int) -> int:
    """A split length that depends only on the cache length, never on the batch: the batch-invariant
    mode's split (each row's positions are reduced in the same pieces whatever the batch). At least
    256 positions per split and at most 16 splits, a multiple of BLOCK_N."""
    return max(256, cdiv(cdiv(max_seq_len, 16), BLOCK_N) * BLOCK_N)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_len: int | None = None,
    tile: tuple[int, int, int] | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as decode_attention_torch. `num_splits` overrides the heuristic (tests), which
    picks the split by the batch; `split_len` fixes the split's length instead (fixed_split_len).
    Splits are over the table's span (blocks_per_seq * block_size positions). `tile` (positions a
    step, warps, pipeline stages) overrides `served_tile` (bench/decode_attention_sweep.py)."""
    b, h, d = q.shape
    kvh, block_size = k_cache.shape[1], k_cache.shape[2]
    t = block_table.shape[1] * block_size
    fp8_kv = check_kv_dtypes(q, k_cache, v_cache, kv_scale)
    assert h % kvh == 0
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    q = q.contiguous()
    groups = h // kvh
    block_n, warps, stages = tile or served_tile(d, fp8_kv)
    if split_len is not None:
        assert num_splits is None and split_len % BLOCK_N == 0
        num_splits = cdiv(t, split_len)
    elif num_splits is None:
        num_splits, split_len = num_splits_for(b, kvh, t, sm_count(q.device), block_n)
    else:
        split_len = cdiv(cdiv(t, num_splits), block_n) * block_n
        num_splits = cdiv(t, split_len)
    out = torch.empty((b, h, d), device=q.device, dtype=q.dtype)
    if num_splits > 1:
        part = torch.empty((b, h, num_splits, d), device=q.device, dtype=torch.float32)
        lse = torch.empty((b, h, num_splits), device=q.device, dtype=torch.float32)
    else:  # unused: the kernel writes `out` directly
        part, lse = out, out
    block_d = max(16, next_pow2(d))
    block_g = max(16, next_pow2(groups))  # tl.dot needs M >= 16
    on = pdl(q.device, b)
    _decode_attn_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, k_cache if kv_scale is None else kv_scale, block_table, slot_ids, positions, out,
        part, lse,
        (d**-0.5 if scale is None else scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUPS=groups, HEAD_DIM=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, KV_BLOCK=block_size,
        SPLIT_LEN=split_len, NUM_SPLITS=num_splits, DYNAMIC_LOOP=not interpreting(), FP8_KV=fp8_kv, WINDOW=window,
        PDL=on,
        num_warps=warps, num_stages=stages, **pdl_launch(on),
    )
    if num_splits > 1:
        _combine_kernel[(b, h)](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)), PDL=on,
            num_warps=1, **pdl_launch(on),
        )
    return out.view(b, h * d)


def check_kv_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_scale: torch.Tensor | None) -> bool:
    """Whether the caches are FP8 (read with kv_scale), asserting they hold q's dtype otherwise."""
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    if k_cache.dtype != FP8:
        assert k_cache.dtype == q.dtype, (q.dtype, k_cache.dtype)
        return False
    assert kv_scale is not None and kv_scale.dtype == torch.float32 and kv_scale.numel() == 2, "FP8 KV needs (k, v) scales"
    return True


if triton is not None:

    @triton.jit
    def _attend_tile(q, k_ptr, v_ptr, table_ptr, kv_off, offs_n, lo, end, offs_d, d_mask, stride_kb, stride_kt,
                     KV_BLOCK: tl.constexpr, WINDOW: tl.constexpr, sm_scale, m_i, l_i, acc):
        # One tile of BLOCK_N positions, each read through the row's block table: scores,
        # online-softmax rescale, accumulate p @ v. With a sliding window only positions >= lo count.
        n_mask = offs_n < end
        if WINDOW > 0:
            n_mask = n_mask & (offs_n >= lo)
        blocks = tl.load(table_ptr + offs_n // KV_BLOCK, mask=n_mask, other=0).to(tl.int64)
        rows = blocks * stride_kb + (offs_n % KV_BLOCK) * stride_kt
        tile = kv_off + rows[:, None] + offs_d[None, :]
        tile_mask = n_mask[:, None] & d_mask[None, :]
        # E4M3 tiles become q's fp16 as they are (one packed conversion per two values; the scales are
        # applied to the scores and the output), bf16 tiles are used as loaded
        k = tl.load(k_ptr + tile, mask=tile_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_G, BLOCK_N] float32, times LOG2E
        s = tl.where(n_mask[None, :], s, float("-inf"))
        v = tl.load(v_ptr + tile, mask=tile_mask, other=0.0).to(q.dtype)
        return online_softmax(s, v, m_i, l_i, acc)

    @triton.jit
    def _decode_attn_kernel(
        q_ptr, k_ptr, v_ptr, scale_ptr, table_ptr, slot_ptr, pos_ptr, out_ptr, part_ptr, lse_ptr,
        sm_scale,
        stride_qb, stride_qh,
        stride_kb, stride_kh, stride_kt,
        stride_tb,
        stride_ob, stride_oh,
        GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr, SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
        FP8_KV: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        length = tl.load(pos_ptr + row).to(tl.int32) + 1
        start = split * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, length)
        lo = 0  # the first visible position: length - WINDOW with a sliding window
        if WINDOW > 0:
            lo = tl.maximum(length - WINDOW, 0)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_mask = offs_g < GROUPS
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUPS + offs_g
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        kv_off = kvh * stride_kh
        table = table_ptr + slot * stride_tb
        k_scale, v_scale = kv_scales(scale_ptr, FP8_KV)
        if FP8_KV:
            # E4M3 is a subset of fp16: the products run in fp16 on the unscaled tiles, q carrying the
            # softmax scale (well inside fp16's range), the scores the k scale, the output the v scale
            q = (q.to(tl.float32) * sm_scale).to(tl.float16)
            sm_scale = k_scale

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        if DYNAMIC_LOOP:  # only the filled tiles of this split (from the window's first one)
            first = start
            if WINDOW > 0:
                first = tl.maximum(start, lo // BLOCK_N * BLOCK_N)
            for n0 in range(first, end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, k_ptr, v_ptr, table, kv_off, n0 + tl.arange(0, BLOCK_N), lo, end, offs_d, d_mask, stride_kb,
                    stride_kt, KV_BLOCK, WINDOW, sm_scale, m_i, l_i, acc,
                )
        else:  # the interpreter cannot loop over runtime bounds: every tile of the split, masked
            for i in range(0, SPLIT_LEN, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, k_ptr, v_ptr, table, kv_off, start + i + tl.arange(0, BLOCK_N), lo, end, offs_d, d_mask,
                    stride_kb, stride_kt, KV_BLOCK, WINDOW, sm_scale, m_i, l_i, acc,
                )

        l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split (start >= length) has l = 0
        o = acc * (v_scale / l_safe)[:, None]  # v_scale: 1.0 but for an FP8 cache
        o_mask = g_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=o_mask,
            )
        else:
            # part: [B, H, NUM_SPLITS, HEAD_DIM] float32, lse: [B, H, NUM_SPLITS], both contiguous
            part_row = (row * (GROUPS * tl.num_programs(1)) + heads) * NUM_SPLITS + split
            tl.store(part_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=o_mask)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # base 2, as the scores
            tl.store(lse_ptr + part_row, lse, mask=g_mask)

    @triton.jit
    def _combine_kernel(
        part_ptr, lse_ptr, out_ptr,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        d_mask = offs_d < HEAD_DIM
        lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)  # finite: the split of the row's own position holds a visible key
        w = tl.exp2(lse - m)  # [BLOCK_S], 0 for empty splits
        parts = tl.load(
            part_ptr + row * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)
