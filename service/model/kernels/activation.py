"""The gated MLP's activation over the fused gate_up projection output [N, 2 * I] -> [N, I]:
act(gate) * up, with act SiLU (SwiGLU: Llama, Qwen, Mistral) or tanh-approximated GELU (GeGLU:
Gemma's gelu_pytorch_tanh). Rounded as torch rounds it: act(gate) to the model dtype, then the product."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.model.kernels._triton import pdl, pdl_launch, tl, triton

if triton is not None:
    from service.model.kernels._triton import pdl_wait

BLOCK = 1024
ACTIVATIONS = ("silu", "gelu_tanh")


def act_mul_torch(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    return act_mul_torch(gate_up, "silu")


def act_mul_triton(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    assert act in ACTIVATIONS, act
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), device=gate_up.device, dtype=gate_up.dtype)
    on = pdl(gate_up.device, n)
    _act_mul_kernel[(n, triton.cdiv(inter, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, GELU=act == "gelu_tanh", BLOCK=BLOCK, PDL=on,
        num_warps=4, **pdl_launch(on)
    )
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return act_mul_triton(gate_up, "silu")


if triton is not None:

    @triton.jit
    def activate(gf, GELU: tl.constexpr):
        """act(gate) in float32: SiLU, or GELU's tanh approximation (tanh(y) = 1 - 2 / (1 + e^2y))."""
        if GELU:
            y = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)  # sqrt(2 / pi)
            return 0.5 * gf * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
        return gf / (1.0 + tl.exp(-gf))

    @triton.jit
    def _act_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, GELU: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0)
        act = activate(g.to(tl.float32), GELU).to(g.dtype)  # torch rounds act(gate) to the model dtype, then * up
        tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)
