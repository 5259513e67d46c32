"""Batch-invariant matmul: y = x W^T (+ b) where each output row depends only on its input row and W.

cuBLAS (and CPU BLAS) choose kernels, tile shapes and split-K by M, the number of rows in the
call, so a row's rounding changes with what else is batched with it. These two never look at M:

- `matmul_triton` (CUDA): one Triton kernel whose tile configuration is fixed per weight shape
  (N, K) and GPU (`matmul_config`), no split-K, float32 accumulation, K reduced in the same
  BLOCK_K steps for every row. M is a runtime argument the kernel is never specialised on.
- `matmul_blocked_torch` (CPU): the rows padded to a multiple of ROW_BLOCK and run as GEMMs of one
  identical shape [ROW_BLOCK, K] x [K, N], which a deterministic BLAS computes the same way each time.

The weight is [N, K] row-major, as nn.Linear stores it. Decode (M of 1 to 256) is bandwidth-bound,
so the configuration is chosen for reading W once per BLOCK_M rows with enough programs to keep
every SM streaming; long prompts pay for the small tiles (the mode's documented cost).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.model.kernels._triton import cdiv, interpreting, next_pow2, sm_count, tl, triton

ROW_BLOCK = 16  # rows per GEMM of the CPU fallback


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def matmul_config(n: int, k: int, num_sms: int) -> MatmulConfig:
    """The tile configuration of a weight [n, k] on a GPU of num_sms SMs: a function of the weight's
    shape only, never of the rows. BLOCK_M 64 covers a decode batch of 64 in one pass over W; the
    widest BLOCK_N that still gives every SM a program (split-K would change the reduction order)."""
    block_n = 16
    for width in (128, 64, 32):
        if cdiv(n, width) >= num_sms:
            block_n = width
            break
    block_k = 128 if k >= 128 else max(16, next_pow2(k))
    stages = 4 if block_n <= 64 else 3  # 3 x (64 + 128) x 128 bf16 tiles: within the SM's shared memory
    return MatmulConfig(block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)


def matmul_blocked_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] as GEMMs of ROW_BLOCK rows each (the last one zero-padded)."""
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, weight.shape[0]))
    pad = -m % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
    out = torch.cat([F.linear(x[i: i + ROW_BLOCK], weight, bias) for i in range(0, m + pad, ROW_BLOCK)])
    return out[:m] if pad else out


def matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> [M, N] in x's dtype. `config` overrides the weight's own (self-check)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    c = config or matmul_config(n, k, sm_count(x.device))
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 and not interpreting(),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return y


if triton is not None:
    from service.model.kernels._triton import gemm_tile

    # M is never specialised (Triton would compile M == 1 and M % 16 == 0 apart): one program for all M.
    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_m, offs_n, m_mask, n_mask = gemm_tile(M, N, BLOCK_M, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # the same K steps, in the same order, for every row
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if IEEE:  # float32 weights: no TF32 rounding of the inputs
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
