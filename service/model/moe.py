"""The mixture-of-experts MLP of a decoder layer (Qwen3-MoE, Mixtral): a router and stacked experts.

The experts' weights are two stacked tensors per layer (`w13` [E, 2I, H]: each expert's gate rows,
then its up rows; `w2` [E, H, I]), the layout the fused kernels read (service.model.kernels.moe).
Checkpoints name every expert's matrices on their own, as Hugging Face writes them:
`mlp.experts.<e>.{gate,up,down}_proj.weight` (Qwen3-MoE; Mixtral's `block_sparse_moe.experts.<e>.
{w1,w3,w2}.weight` are renamed to these at load, `checkpoint_name`), so each is registered as a
parameter that is a view of its rows of the stacked storage: load_weights, random initialisation and
anything that fills named_parameters() write the stacked tensors. The router is `mlp.gate`.

With tensor parallelism every rank holds every expert's 1/N of the inner dimension I (gate and up
rows column-parallel, down columns row-parallel, the router whole), and the layer's output is summed
over the ranks once; expert parallelism (whole experts per rank) is not served yet.

`use_fp8` turns the experts to E4M3 with one scale per output channel, or per block of a
block-quantized checkpoint (e.g. 128 x 128); the router stays in the model's dtype.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from service.model import fp8
from service.model.kernels import FastPath
from service.model.kernels.moe import ExpertWeights, fused_moe
from service.model.parallel import TensorParallel
from service.model.spec import ModelSpec

# Mixtral's checkpoint names -> ours (the Qwen3-MoE / Hugging Face v5 naming)
_MIXTRAL = [(re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
            (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."), (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj.")]


def checkpoint_name(architecture: str, name: str) -> str:
    """A checkpoint tensor's name as our modules name it."""
    if architecture == "MixtralForCausalLM" and (".block_sparse_moe." in name):
        for pattern, repl in _MIXTRAL:
            name = pattern.sub(repl, name)
    return name


def hf_name(architecture: str, name: str) -> str:
    """Ours -> the family's checkpoint name (the inverse of checkpoint_name), for writing checkpoints."""
    if architecture != "MixtralForCausalLM" or ".mlp.gate." not in name and ".mlp.experts." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


class _Expert(nn.Module):
    """One expert's gate_proj, up_proj and down_proj weights: views of its rows of the stacked tensors."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        from service.model.llama import WeightView  # llama imports this module

        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = WeightView(gate), WeightView(up), WeightView(down)

    def repoint(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        for view, t in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
            view.weight = nn.Parameter(t, requires_grad=False)


class SparseMoe(nn.Module):
    """Top-k routed experts; `forward(x [N, hidden], fast)` -> [N, hidden] like the dense MLP."""

    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        from service.model.llama import Linear  # the model's Linear (its matmul hook); llama imports this module

        e, inter, hidden = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
        self.tp, self.top_k, self.renormalize, self.act = tp, spec.num_experts_per_tok, spec.norm_topk_prob, spec.hidden_act
        self.gate = Linear(hidden, e, False, device, dtype)  # the router, [E, hidden]
        self.gate.keep_dtype = True  # never FP8 (use_fp8 skips it): routing decides which experts run
        self.register_buffer("w13", torch.empty(e, 2 * inter, hidden, device=device, dtype=dtype), persistent=False)
        self.register_buffer("w2", torch.empty(e, hidden, inter, device=device, dtype=dtype), persistent=False)
        self.experts = nn.ModuleList(_Expert(self.w13[i, :inter], self.w13[i, inter:], self.w2[i]) for i in range(e))
        self.weights = ExpertWeights(self.w13, self.w2)

    def forward(self, x: torch.Tensor, fast: FastPath) -> torch.Tensor:
        out = fused_moe(x, self.gate(x), self.weights, self.top_k, self.renormalize, self.act, fast.moe)
        return self.tp.all_reduce(out)

    def use_fp8(self, block: tuple[int, int] | None) -> int:
        """The experts to E4M3 (scales per channel, or per `block`); returns the bytes saved."""
        inter = self.w2.shape[2]
        before = self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()
        (q13, s13), (q2, s2) = fp8.quantize_experts(self.w13, block), fp8.quantize_experts(self.w2, block)
        self.w13, self.w2 = q13, q2  # buffers: the old storage goes once the views move
        for i, expert in enumerate(self.experts):
            expert.repoint(q13[i, :inter], q13[i, inter:], q2[i])
        self.weights = ExpertWeights(q13, q2, s13, s2, block)
        after = q13.numel() + q2.numel() + 4 * (s13.numel() + s2.numel())
        return before - after
