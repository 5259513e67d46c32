"""The residual add, RMSNorm and the projection after it in one kernel, for decode batches of a few rows.

At batch 1 a decode step runs 2 x layers + 1 add+norm kernels of ~1.7 us each on a 4 KB row, each
followed by a GEMM that reads megabytes of weight: the norm costs a kernel, not bandwidth
(bench/NOTES.md, "Decode kernel budget"). Here every program of the projection reads the whole rows
(a few KB, from L2) beside its weight rows, so the normed rows never go through memory and the norm
kernel is gone. The programs of the first weight columns also write x + delta, the residual stream
the next layer adds to.

Numerics: the add is rounded to the model dtype as torch's is (the residual stream is exact); the
norm is folded into the product: y = rstd * sum_k (x_k * g_k) w_k in float32, with rstd from the
same pass's sum of squares. The unfused path rounds the normed row to the model dtype twice (after
the scaling, after the weight) before the GEMM; this does not, so it is at least as close to the exact
result, and differs from the unfused path by about a rounding of the model dtype (the self-check
bounds the relative error of y at 4e-3).

Two inner products, chosen by `norm_linear_config`: for one row, CUDA-core products (BLOCK_N whole
weight rows a program: no tensor-core tile padding 1 row to 16); for more, tl.dot tiles of 16 rows.
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
    """A function of the weight's shape and the rows' count, from bench/gemm_sweep.py and
    bench/norm_linear_bench.py on an H200: one row on the CUDA cores (BLOCK_N whole weight rows a
    program); more through 16-row tensor-core tiles, 64 weight rows wide for a weight of at least 64
    rows per SM."""
    wide = cdiv(n, 64) >= num_sms
    if m == 1:
        if k <= 2048 and not wide:
            return NormLinearConfig(False, 1, 8, next_pow2(k), 8, 1)
        return NormLinearConfig(False, 1, 8 if wide else 4, min(next_pow2(k), 1024), 4, 2)
    if wide:
        return NormLinearConfig(True, 16, 64, min(next_pow2(k), 128), 4, 4)
    return NormLinearConfig(True, 16, 32, min(next_pow2(k), 256), 4, 4)


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
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]

        # One pass over K: (x + delta) * norm weight against W, and the rows' sum of squares beside it;
        # 1 / rms scales the float32 sums at the end (a per-row factor commutes with the dot products).
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        sq = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = _load_sum(x_ptrs + k0, d_ptrs + k0, r_mask[:, None] & k_mask[None, :], HAS_DELTA)
            nw = tl.load(nw_ptr + k0 + offs_k, mask=k_mask, other=0.0)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
            xs = xf * nw.to(tl.float32)[None, :]
            if DOT:
                acc = tl.dot(xs.to(x.dtype), tl.trans(w), acc)
            else:
                acc += tl.sum(xs[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        acc = acc * tl.rsqrt(sq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_r[:, None].to(tl.int64) * stride_y + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])

        if HAS_DELTA and pid_n == 0:  # the residual stream for the next layer, after the weight is read
            r_ptrs = res_ptr + offs_r[:, None].to(tl.int64) * stride_r + offs_k[None, :]
            for k0 in range(0, K, BLOCK_K):
                mask = r_mask[:, None] & (offs_k[None, :] < K - k0)
                tl.store(r_ptrs + k0, _load_sum(x_ptrs + k0, d_ptrs + k0, mask, HAS_DELTA), mask=mask)
