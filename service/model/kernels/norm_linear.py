"""The residual add, RMSNorm and the projection after it in one kernel, for decode batches of a few rows.

At batch 1 a decode step runs 2 x layers + 1 add+norm kernels of ~1.7 us each on a 4 KB row, each
followed by a GEMM that reads megabytes of weight: the norm costs a kernel, not bandwidth
(bench/NOTES.md, "Decode kernel budget"). Here every program of the projection recomputes the row's
sum of squares (the rows are a few KB, read from L2) and normalises its K chunks on the fly, so the
normed rows never go through memory and the norm kernel is gone. Program 0 also writes x + delta,
the residual stream the next layer adds to.

Numerics are the add_rmsnorm kernel's (service.model.kernels.norm): the add rounded to the model
dtype, normalised in float32, cast, times the weight in float32, cast; then float32 accumulation
over K. Only the sum of squares is reduced in another order (chunks of BLOCK_K), so h may differ
from the unfused path by an ulp now and then.

Two inner products, chosen per weight shape by `norm_linear_config`: CUDA-core (one row of x,
BLOCK_N whole weight rows a program: no tensor-core tile padding 1 row to 16) for a narrow weight,
and tl.dot tiles of 16 rows for a wide one (gate_up, the LM head), as measured in bench/gemm_sweep.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.model.kernels._triton import cdiv, next_pow2, sm_count, tl, triton

MAX_ROWS = 4  # larger batches keep the separate norm kernel and cuBLAS (bench/norm_linear_bench.py)


@dataclass(frozen=True)
class NormLinearConfig:
    dot: bool  # tensor-core tiles of 16 rows, else CUDA-core products of `rows` rows
    rows: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def norm_linear_config(n: int, k: int, m: int, num_sms: int) -> NormLinearConfig:
    """A function of the weight's shape and the rows' count, measured on an H200 (bench/gemm_sweep.py):
    a weight of at least 64 rows per SM streams best through 16 x 64 tensor-core tiles; a narrower one
    through the CUDA-core kernel at one row, 16 x 32 tiles at more."""
    block_k = min(next_pow2(k), 2048)
    if cdiv(n, 64) >= num_sms:
        return NormLinearConfig(True, 16, 64, min(block_k, 128), 4, 4)
    if m == 1:
        if k <= 2048:
            return NormLinearConfig(False, 1, 8, block_k, 8, 1)
        return NormLinearConfig(False, 1, 4, 1024, 4, 2)
    return NormLinearConfig(True, 16, 32, min(block_k, 256), 4, 4)


def add_rmsnorm_linear_torch(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta) W^T + b): the unfused reference."""
    from service.model.kernels.norm import add_rmsnorm_torch

    res, h = add_rmsnorm_torch(x, delta, norm_weight, eps)
    return res, torch.nn.functional.linear(h, weight, bias)


def add_rmsnorm_linear_triton(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, config: NormLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [M, K] (M <= MAX_ROWS), weight [N, K] -> (x + delta [M, K], y [M, N]); delta None: no add."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1 and norm_weight.is_contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.dtype == weight.dtype, (x.shape, weight.shape, x.dtype, weight.dtype)
    c = config or norm_linear_config(n, k, m, sm_count(x.device))
    assert c.dot or m <= c.rows, (m, c)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if delta is not None:
        assert delta.shape == x.shape and delta.stride(1) == 1
        res = torch.empty_like(x)
    else:
        delta, res = x, x  # neither read nor written: HAS_DELTA is False
    grid = (cdiv(m, c.rows) * cdiv(n, c.block_n),)
    _add_rmsnorm_linear_kernel[grid](
        x, delta, norm_weight, weight, bias if bias is not None else weight, res, y,
        m, n, k, x.stride(0), delta.stride(0), weight.stride(0), res.stride(0), y.stride(0), eps,
        HAS_DELTA=res is not x, HAS_BIAS=bias is not None, DOT=c.dot,
        ROWS=c.rows, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return res, y


if triton is not None:

    @triton.jit
    def _load_sum(x_ptrs, d_ptrs, mask, HAS_DELTA: tl.constexpr):
        """A [ROWS, BLOCK_K] chunk of x + delta, rounded to the model dtype as torch's add does."""
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit(do_not_specialize=["M"])
    def _add_rmsnorm_linear_kernel(
        x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, y_ptr,
        M, N, K,
        stride_x, stride_d, stride_w, stride_r, stride_y, eps,
        HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, ROWS)
        pid_m = pid % num_m
        pid_n = pid // num_m
        offs_r = pid_m * ROWS + tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        r_mask = offs_r < M
        n_mask = offs_n < N
        x_ptrs = x_ptr + offs_r[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        d_ptrs = d_ptr + offs_r[:, None].to(tl.int64) * stride_d + offs_k[None, :]

        # The rows' mean of squares: each program reads the whole rows (a few KB, from L2).
        sq = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = r_mask[:, None] & (offs_k[None, :] < K - k0)
            xf = _load_sum(x_ptrs + k0, d_ptrs + k0, mask, HAS_DELTA).to(tl.float32)
            sq += tl.sum(xf * xf, 1)
        rstd = tl.rsqrt(sq / K + eps)

        write_res = HAS_DELTA & (pid_n == 0)
        r_ptrs = res_ptr + offs_r[:, None].to(tl.int64) * stride_r + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            mask = r_mask[:, None] & k_mask[None, :]
            x = _load_sum(x_ptrs + k0, d_ptrs + k0, mask, HAS_DELTA)
            if write_res:
                tl.store(r_ptrs + k0, x, mask=mask)
            h = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            nw = tl.load(nw_ptr + k0 + offs_k, mask=k_mask, other=0.0)
            h = (nw.to(tl.float32)[None, :] * h.to(tl.float32)).to(x.dtype)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if DOT:
                acc = tl.dot(h, tl.trans(w), acc)
            else:
                acc += tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_r[:, None].to(tl.int64) * stride_y + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])
