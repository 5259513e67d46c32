"""RMSNorm, optionally fused with the residual add before it: x = x + delta; h = rmsnorm(x).

Numerics follow transformers (and the torch path): normalise in float32 (x.float(), mean of
squares, rsqrt), cast to the model dtype, then multiply by the weight in the model dtype. Gemma's
norm (`gemma=True`) scales by (1 + weight) in float32 and casts once, as Gemma3RMSNorm does.
"""

from __future__ import annotations

import torch

from service.model.kernels._triton import pdl, pdl_launch, tl, triton

if triton is not None:
    from service.model.kernels._triton import pdl_wait


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rmsnorm_torch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [N, hidden] -> (x + delta, rmsnorm(x + delta)); delta None means no add."""
    if delta is not None:
        x = x + delta
    return x, rmsnorm_torch(x, weight, eps, gemma)


def add_rmsnorm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    n, hidden = x.shape
    out = torch.empty_like(x)
    if delta is not None:
        assert delta.shape == x.shape and delta.stride(-1) == 1
        res = torch.empty_like(x)
    else:
        delta, res = x, x  # not read / written: HAS_DELTA is False
    block = triton.next_power_of_2(hidden)
    on = pdl(x.device, n)
    _add_rmsnorm_kernel[(n,)](
        x, delta, weight, out, res,
        x.stride(0), delta.stride(0), out.stride(0), res.stride(0),
        hidden, eps,
        HAS_DELTA=res is not x, GEMMA=gemma, BLOCK=block, PDL=on,
        num_warps=max(1, min(16, block // 256)), **pdl_launch(on),
    )
    return res, out


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(
        x_ptr, d_ptr, w_ptr, out_ptr, res_ptr,
        stride_x, stride_d, stride_o, stride_r,
        hidden, eps,
        HAS_DELTA: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # rounded once, like torch's add
            tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
        xf = x.to(tl.float32)
        mean_sq = tl.sum(xf * xf, 0) / hidden
        hf = xf * tl.rsqrt(mean_sq + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:  # (1 + w) in float32, one rounding
            out = (hf * (1.0 + w)).to(x.dtype)
        else:  # rounded to the model dtype, then scaled
            out = (w * hf.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
