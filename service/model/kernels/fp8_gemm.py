"""Decode-sized FP8 GEMM: y = (xq * xs) (wq * ws)^T for a few to a few hundred rows of x.

At decode the product's cost is reading the weight once. cuBLAS's FP8 GEMM (`torch._scaled_mm`)
takes a 128 x 128 tile for 64 rows, so a weight of 4,096 rows runs on 32 of an H200's 132 SMs and
the 8B step's projections stream at 0.55 of the copy rate (bench/NOTES.md, "FP8 weights"). Here the
weight is the wide operand: a program owns BLOCK_N weight rows and every row of x (BLOCK_M at a
time, the x tile reread from L2), so narrow BLOCK_N gives every SM a program; SPLIT_K > 1 splits K
among programs too, for the weights too short in N for that, their float32 partial sums added
atomically into a zeroed buffer.

With SWAP the weight tile is the dot's left operand (the tensor core's 64-row side) and the x rows
its right one, as small as 16; without it x is the left operand. Both read E4M3 from shared memory
into the FP8 tensor cores (wgmma on Hopper), accumulate in float32 (promoted from the tensor cores'
own accumulator every IMPRECISE_ACC elements of K) and scale by the weight row's and the token's
scales at the end, as `torch._scaled_mm` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from service.model.kernels._triton import cdiv, next_pow2, tl, triton

MAX_ROWS = 256  # more rows (prompt chunks) go to cuBLAS, whose large tiles are made for them
# Hopper's FP8 tensor cores accumulate in less than float32 (about 14 mantissa bits kept), and Triton
# lets them run a whole K loop so unless told otherwise: the partial sums move into the float32
# accumulator every IMPRECISE_ACC elements of K instead, as DeepSeek-V3's FP8 GEMMs do (128), closer
# to cuBLAS without fast accumulation (torch._scaled_mm's default).
IMPRECISE_ACC = 128


@dataclass(frozen=True)
class Fp8GemmConfig:
    swap: bool  # the weight tile as the dot's left operand
    block_m: int  # rows of x a tile
    block_n: int  # weight rows a program
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache  # asked per projection of every eager step: a handful of shapes and row counts
def fp8_gemm_config(m: int, n: int, k: int, num_sms: int) -> Fp8GemmConfig | None:
    """The served configuration for x [m, k] times a weight [n, k], None where cuBLAS serves it.
    Chosen from bench/fp8_gemm_sweep.py on an H200 (bench/results/h200-20261204-fp8-gemm/), the 1B
    and 8B shapes at 16 / 64 / 256 rows, within ~5% of the best configuration of each:
    - up to 32 rows: the weight tile as the left operand (64 rows, 128 for a wide gate/up), x as 16
      or 32 rows; more rows: x as the left operand (64 rows), narrow weight tiles (32 rows up to
      64 rows of x) so that a 4,096-row weight still gives every SM a program;
    - K split in two only for long K (8,192+: the down projection), while the programs stay within
      one wave; a split costs a zeroed float32 buffer and a cast, more than it saves on shorter K.
      Never in more than two: the halves are added atomically, 0 + a + b is the same in either order,
      three or more partial sums are not (the sweep's four-way split of the 1B down projection was
      ~2 us faster at 16 rows, not worth a result that changes from run to run);
    - past 64 rows, weights of 6,144+ rows go to cuBLAS: its 128-row tiles fill the SMs there and
      were 5-20% faster at 256 rows."""
    if m > MAX_ROWS or k % 128 or (m > 64 and n >= 6144):
        return None
    wide = n >= 16384
    if m <= 32:
        swap, block_m, block_n, block_k = True, max(16, next_pow2(m)), 128 if wide else 64, 256
    else:
        swap, block_m, block_n = False, 64, 128 if wide else (32 if m <= 64 else 64)
        block_k = 128 if wide else 256
    if k % block_k:
        block_k = 128
    programs = cdiv(m, block_m) * cdiv(n, block_n)
    split = 1
    if k >= 8192 and programs * 2 <= num_sms and k % (block_k * 2) == 0:
        split = 2
    return Fp8GemmConfig(swap, block_m, block_n, block_k, split, 4, 3 if block_k == 256 else 4)


def fp8_gemm_triton(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, config: Fp8GemmConfig) -> torch.Tensor:
    """xq [M, K] E4M3 (rows contiguous), xs [M, 1] float32, wq [N, K] E4M3, ws [N] float32 -> [M, N]
    in out_dtype. K must be a multiple of config.block_k * config.split_k."""
    m, k = xq.shape
    n = wq.shape[0]
    c = config
    assert wq.shape[1] == k and xq.stride(1) == 1 and wq.stride(1) == 1, (xq.shape, wq.shape)
    assert k % (c.block_k * c.split_k) == 0, (k, c)
    split = c.split_k > 1
    y = torch.zeros((m, n), device=xq.device, dtype=torch.float32) if split else \
        torch.empty((m, n), device=xq.device, dtype=out_dtype)
    if m == 0:
        return y.to(out_dtype)
    grid = (cdiv(m, c.block_m) * cdiv(n, c.block_n), c.split_k)
    _fp8_gemm_kernel[grid](
        xq, xs, wq, ws, bias if bias is not None else ws, y,
        m, n, k, xq.stride(0), wq.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SWAP=c.swap, SPLIT_K=c.split_k, IMPRECISE_ACC=IMPRECISE_ACC,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return y.to(out_dtype) if split else y


if triton is not None:
    from service.model.kernels._triton import gemm_tile

    @triton.jit(do_not_specialize=["M"])
    def _fp8_gemm_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
        M, N, K, stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, SWAP: tl.constexpr, SPLIT_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_m, offs_n, m_mask, n_mask = gemm_tile(M, N, BLOCK_M, BLOCK_N)
        pid_k = tl.program_id(1)
        k_len = K // SPLIT_K
        offs_k = pid_k * k_len + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_ACC)
            else:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=IMPRECISE_ACC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP:
            acc = tl.trans(acc)
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K > 1:
            tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
