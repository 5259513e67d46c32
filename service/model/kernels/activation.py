"""SiLU(gate) * up over the fused gate_up projection output [N, 2 * I] -> [N, I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.model.kernels._triton import pdl, pdl_launch, tl, triton

if triton is not None:
    from service.model.kernels._triton import pdl_wait

BLOCK = 1024


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), device=gate_up.device, dtype=gate_up.dtype)
    on = pdl(gate_up.device, n)
    _silu_mul_kernel[(n, triton.cdiv(inter, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=BLOCK, PDL=on, num_warps=4, **pdl_launch(on)
    )
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the model dtype, then * up rounds again
        tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)
