"""RoPE on q and k plus the decode KV-cache write, in one kernel.

Input is the fused qkv projection [B, (H + 2 * KVH) * D]. Writes rotated k and v into
(slot_ids[i], :, positions[i]) of the layer's cache and returns rotated q [B, H, D]. cos/sin are
computed once per step by the caller (float32, cast to the model dtype, like transformers); the
kernel repeats the torch op order: x * cos and rotate_half(x) * sin each rounded, then summed, and
is compiled without FP fusion (`NO_FP_FUSION`: a fused multiply-add would skip one product's rounding),
so q, k and v are torch's bit for bit. An FP8 cache gets k / k_scale and v / v_scale, clamped and
rounded to E4M3 (service/model/kv_quant.py).

Qwen3 and Gemma 3 normalise each query and key head (RMSNorm over head_dim, their q_norm and k_norm)
before RoPE: `QkNorm` asks for it, and the kernel does it on the head it already holds, so the
norm costs no launch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.model.fp8 import FP8, FP8_MAX
from service.model.kernels._triton import NO_FP_FUSION, pdl, pdl_launch, tl, triton
from service.model.kernels.norm import rmsnorm_torch
from service.model.kv_quant import store_kv

if triton is not None:
    from service.model.kernels._triton import kv_quantize, pdl_wait


@dataclass(frozen=True)
class QkNorm:
    """RMSNorm of every query head by weight[0] and every key head by weight[1] (weight [2, head_dim]),
    before RoPE; `gemma`: Gemma's (1 + w) scaling (service.model.kernels.norm)."""

    weight: torch.Tensor
    eps: float
    gemma: bool = False


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # qkv: [N, (H + 2 KVH) * D] -> views q [N, H, D], k, v [N, KVH, D]
    n = qkv.shape[0]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    return q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)


def rope_kv_write_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_scale: torch.Tensor | None = None,
    qk_norm: QkNorm | None = None,
) -> torch.Tensor:
    """cos, sin: [B, 1, D]; caches [num_slots + 1, KVH, T, D]; slot_ids, positions [B]; kv_scale: the
    layer's (k, v) float32 [2] (an FP8 cache's); qk_norm: the heads' norm before RoPE -> q [B, H, D]."""
    head_dim = k_cache.shape[-1]
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q, k = norm_heads(q, k, qk_norm)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = store_kv(k, v, kv_scale, k_cache.dtype)
    k_cache[slot_ids, :, positions] = k  # [B, KVH, D] into (slot, :, position)
    v_cache[slot_ids, :, positions] = v
    return q


def norm_heads(q: torch.Tensor, k: torch.Tensor, qk_norm: QkNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D], k [N, KVH, D] with each head normalised (qk_norm), or as they are (None)."""
    if qk_norm is None:
        return q, k
    w, eps, gemma = qk_norm.weight, qk_norm.eps, qk_norm.gemma
    return rmsnorm_torch(q, w[0], eps, gemma), rmsnorm_torch(k, w[1], eps, gemma)


def rope_kv_write_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_scale: torch.Tensor | None = None,
    qk_norm: QkNorm | None = None,
) -> torch.Tensor:
    b = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert head_dim % 2 == 0 and qkv.stride(-1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
    fp8_kv = k_cache.dtype == FP8
    assert not fp8_kv or (kv_scale is not None and kv_scale.dtype == torch.float32), "an FP8 cache needs its scales"
    cos2, sin2 = cos.reshape(b, head_dim), sin.reshape(b, head_dim)
    assert cos2.stride(-1) == 1 and sin2.stride() == cos2.stride()
    q = torch.empty((b, num_heads, head_dim), device=qkv.device, dtype=qkv.dtype)
    half = head_dim // 2
    on = pdl(qkv.device, b)
    if qk_norm is not None:
        assert qk_norm.weight.shape == (2, head_dim) and qk_norm.weight.is_contiguous()
    _rope_kv_kernel[(b, num_heads + num_kv_heads)](
        qkv, cos2, sin2, slot_ids, positions, q, k_cache, v_cache, k_cache if kv_scale is None else kv_scale,
        qkv if qk_norm is None else qk_norm.weight, 0.0 if qk_norm is None else qk_norm.eps,
        qkv.stride(0), cos2.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK=triton.next_power_of_2(half), FP8_KV=fp8_kv, FP8_MAX=FP8_MAX,
        QK_NORM=qk_norm is not None, GEMMA=qk_norm is not None and qk_norm.gemma, PDL=on,
        num_warps=1, **NO_FP_FUSION, **pdl_launch(on),
    )
    return q


if triton is not None:

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, scale_ptr, norm_ptr, eps,
        stride_qkv, stride_cs, stride_qb, stride_qh,
        stride_ks, stride_kh, stride_kt,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        BLOCK: tl.constexpr, FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr, QK_NORM: tl.constexpr,
        GEMMA: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # [0, H) query heads, then [H, H + KVH) key heads
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        src = qkv_ptr + row * stride_qkv + head * HEAD_DIM
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
        dt = x1.dtype
        c1 = tl.load(cos_ptr + row * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + row * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + row * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + row * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if QK_NORM:  # the head's RMSNorm (q_norm for query heads, k_norm for key heads), as norm.rmsnorm_torch
            r = tl.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / HEAD_DIM + eps)
            w_row = norm_ptr + (head >= NUM_HEADS).to(tl.int32) * HEAD_DIM
            w1 = tl.load(w_row + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
            if GEMMA:
                f1 = (f1 * r * (1.0 + w1)).to(dt).to(tl.float32)
                f2 = (f2 * r * (1.0 + w2)).to(dt).to(tl.float32)
            else:
                f1 = (w1 * (f1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                f2 = (w2 * (f2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # torch: x * cos + cat(-x2, x1) * sin, each product rounded to the model dtype, then the sum (no
        # FMA may fuse a product into the sum: the launch turns FP fusion off)
        o1 = ((f1 * c1).to(dt).to(tl.float32) + ((-f2) * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
        if head < NUM_HEADS:
            dst = q_ptr + row * stride_qb + head * stride_qh
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + HALF + offs, o2, mask=mask)
        else:
            kh = head - NUM_HEADS
            slot = tl.load(slot_ptr + row).to(tl.int64)
            pos = tl.load(pos_ptr + row).to(tl.int64)
            cache_off = slot * stride_ks + kh * stride_kh + pos * stride_kt
            vsrc = qkv_ptr + row * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kh) * HEAD_DIM
            # New names, not o1 / o2: a value live into this branch must keep its type through it
            k1, k2 = o1, o2
            v1 = tl.load(vsrc + offs, mask=mask, other=0.0)
            v2 = tl.load(vsrc + HALF + offs, mask=mask, other=0.0)
            if FP8_KV:  # x / scale, clamped to +-FP8_MAX, rounded to E4M3 by the store's cast
                k_scale = tl.load(scale_ptr)
                v_scale = tl.load(scale_ptr + 1)
                k1, k2 = kv_quantize(k1, k_scale, FP8_MAX), kv_quantize(k2, k_scale, FP8_MAX)
                v1, v2 = kv_quantize(v1, v_scale, FP8_MAX), kv_quantize(v2, v_scale, FP8_MAX)
            ty = k_ptr.dtype.element_ty
            tl.store(k_ptr + cache_off + offs, k1.to(ty), mask=mask)
            tl.store(k_ptr + cache_off + HALF + offs, k2.to(ty), mask=mask)
            tl.store(v_ptr + cache_off + offs, v1.to(ty), mask=mask)
            tl.store(v_ptr + cache_off + HALF + offs, v2.to(ty), mask=mask)
