"""y = x W^T (+ b) for one row of x: the projections of a batch-1 decode step, with PDL.

A batch-1 step is ~100 kernels that each read one weight once. Under cuBLAS each starts cold when the
previous one has finished; a small weight (8-34 MB) never reaches full bandwidth in one kernel
(bench/NOTES.md, "Decode GEMMs of our own against cuBLAS"). This GEMV is launched with programmatic
dependent launch where the GPU has it (service.model.kernels._triton.pdl): its programs load their
first weight tile (weights no kernel writes), then wait for the previous kernel, and let the next
kernel launch as soon as they may. The next weight's reads so overlap this kernel's tail
(bench/pdl_chain.py: the 1B layer's four projections 42.9 -> 39.5 us on an H200).

CUDA cores, float32 accumulation: BLOCK_N whole weight rows a program, BLOCK_K-wide loads.

An FP8 (E4M3) weight has a kernel of its own. At FP8's rate a GEMV is bound by the instructions that
turn weight bytes into float32, not by the bytes: Triton's cast (cvt, a fraction of the FMA rate)
streamed the 8B shape's projections at 0.56 of the copy rate, an integer bit move per element at
0.66 (bench/fp8_gemv_sweep.py). This one reads four E4M3 values as one 32-bit word and moves them
into two bf16 pairs with a few integer ops a pair (sign to bit 15 / 31, exponent and mantissa under
it), then each bf16 into float32 with one op: E4M3's exponent bias is 7 and bf16's 127, so the result
is the value times 2^-120, denormals included, and the 2^120 goes into the row scale. The pairs hold
elements 0 and 2, 1 and 3 of the word: the row is read in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.model.kernels._triton import cdiv, next_pow2, pdl, pdl_launch, tl, triton


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows a program
    block_k: int  # K elements a load
    num_warps: int
    num_stages: int


HEAD = GemvConfig(4, 1024, 4, 2)  # the LM head's: 4.4 TB/s on the 1B head (bench/pdl_chain.py --sweep)
LAYER = GemvConfig(2, 2048, 4, 1)  # a layer's projections: 40.2 -> 36-39 us a 1B layer, swept one at a time
HEAD_ROWS = 65536  # a weight of more rows is a (vocabulary) head
# An FP8 weight's (block_k counts E4M3 elements): best of 7 on the 8B shape, within 3% of the best on 1B's
FP8_LAYER = GemvConfig(8, 1024, 4, 1)


def gemv_config(n: int, k: int) -> GemvConfig:
    """The configuration of a bf16 / float32 weight [n, k], from the H200 sweep (bench/pdl_chain.py
    --sweep): a layer's projection streams best as two whole weight rows a program read in 2048-wide
    loads, a vocabulary head (one kernel of hundreds of MB) as four rows in 1024-wide loads."""
    return HEAD if n >= HEAD_ROWS else LAYER


# How a GEMV launches: plainly, with PDL letting the next kernel launch only when this one exits, or
# with PDL letting it launch right after this one's wait (served wherever PDL is on).
LAUNCHES = ("plain", "pdl-wait", "pdl-early")


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None,
    launch: str | None = None, scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K], weight [N, K] (rows contiguous) -> [1, N] in x's dtype. `config` overrides the
    weight's own, `launch` (one of LAUNCHES) the served launch (bench/pdl_chain.py compares them).
    `scale` [N] float32: the weight is FP8 and row n's products are scaled by scale[n] (service.model.fp8)."""
    assert x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert weight.stride(1) == 1, weight.stride()
    assert x.dtype == weight.dtype if scale is None else scale.dtype == torch.float32, (x.dtype, weight.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    n, k = weight.shape
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    launch = launch or ("pdl-early" if pdl(x.device) else "plain")
    assert launch in LAUNCHES, launch
    on = launch != "plain"
    flags = dict(HAS_BIAS=bias is not None, PDL=on, EARLY=launch == "pdl-early")
    if scale is not None:  # E4M3, four to a 32-bit word
        assert weight.dtype == torch.float8_e4m3fn and k % 4 == 0 and weight.stride(0) % 4 == 0, (weight.dtype, k)
        c = config or FP8_LAYER
        _gemv_fp8_kernel[(cdiv(n, c.block_n),)](
            x, weight.view(torch.int32), bias if bias is not None else scale, scale, y, n, k // 4, weight.stride(0) // 4,
            **flags, BLOCK_N=c.block_n, BLOCK_W=min(c.block_k // 4, next_pow2(k // 4)),
            num_warps=c.num_warps, num_stages=c.num_stages, **pdl_launch(on),
        )
        return y
    c = config or gemv_config(n, k)
    _gemv_kernel[(cdiv(n, c.block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), **flags,
        BLOCK_N=c.block_n, BLOCK_K=min(c.block_k, max(16, next_pow2(k))),
        num_warps=c.num_warps, num_stages=c.num_stages, **pdl_launch(on),
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, one row through gemv_triton: the fast path's matmul for every linear layer."""
    if x.dim() == 2 and x.shape[0] == 1:
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        # The first weight tile before the wait: it does not depend on the previous kernel.
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
            next_k = k0 + BLOCK_K  # the next tile (none past K: the mask loads nothing)
            w = tl.load(w_ptrs + next_k, mask=n_mask[:, None] & (offs_k[None, :] < K - next_k), other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _gemv_fp8_kernel(
        x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, N, K4, stride_w,
        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        # w_ptr: the E4M3 weight as 32-bit words [N, K4], word j of a row holding elements 4j .. 4j + 3
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_W)
        n_mask = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_w[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_w[None, :] < K4), other=0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)  # summed across lanes once, at the end
        for w0 in range(0, K4, BLOCK_W):
            x_mask = offs_w < K4 - w0
            x_ptrs = x_ptr + (w0 + offs_w) * 4
            # bytes 0 and 2 -> the low and high bf16 of `even`, bytes 1 and 3 -> of `odd`
            even = ((w & 0x00800080) << 8) | ((w & 0x007F007F) << 4)
            odd = (w & -2147450880) | ((w >> 4) & 0x07F007F0)  # -2147450880: the sign bits 0x80008000
            # the row in the same order, as four strided loads (one contiguous load split in registers
            # measured 3-15% slower: bench/results/h200-20261204-fp8-gemv/)
            x0 = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptrs + 1, mask=x_mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptrs + 2, mask=x_mask, other=0.0).to(tl.float32)
            x3 = tl.load(x_ptrs + 3, mask=x_mask, other=0.0).to(tl.float32)
            acc += (even << 16).to(tl.float32, bitcast=True) * x0[None, :]
            acc += (even & -65536).to(tl.float32, bitcast=True) * x2[None, :]  # -65536: 0xFFFF0000
            acc += (odd << 16).to(tl.float32, bitcast=True) * x1[None, :]
            acc += (odd & -65536).to(tl.float32, bitcast=True) * x3[None, :]
            next_w = w0 + BLOCK_W  # the next tile (none past K4: the mask loads nothing)
            w = tl.load(w_ptrs + next_w, mask=n_mask[:, None] & (offs_w[None, :] < K4 - next_w), other=0)
        # the row scales, times 2^120: the bit move's exponent offset
        out = tl.sum(acc, 1) * (tl.load(s_ptr + offs_n, mask=n_mask, other=0.0) * 1.329227995784916e36)
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)
