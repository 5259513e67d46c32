"""One MoE layer alone: our fused kernels (graphed and eager) against torch references and the dense
MLP of the same active parameters, per token count, against the bandwidth floor of the experts the
tokens touch.

For each token count T (random hidden states, router logits, expert weights of the shape):
- ours, graphed: routing, the padded sort and both grouped GEMMs captured as one CUDA graph
  (service.model.kernels.moe.fused_moe), as a decode step replays them; and eager.
- torch grouped: the pairs sorted by expert and both products through torch._grouped_mm (where
  this torch has it), eager (its offsets follow the routing);
- torch loop: transformers' way, a loop over the experts the batch picked, eager;
- torch dense path: ours on the CPU (every expert on every token), graphed;
- dense equivalent: a SwiGLU MLP of width top_k * I (the same active parameters), graphed.
The floor is the touched experts' bytes (gate, up and down of each expert any token picked) at the
measured copy rate.

    python bench/moe_bench.py --device cuda                     # Qwen3-30B-A3B's layer, bf16
    python bench/moe_bench.py --device cuda --fp8 block         # its experts in FP8, 128 x 128 scales
    python bench/moe_bench.py --device cpu --shape tiny --tokens 1,8 --iters 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, print_table, time_ms, write_result
from service.model import fp8 as fp8_weights
from service.model.kernels.activation import silu_mul_torch
from service.model.kernels.moe import ExpertWeights, fused_moe, moe_torch, route_torch

# (experts, top_k, renormalise, hidden, expert width)
SHAPES = {"qwen3-30b-a3b": (128, 8, True, 2048, 768), "mixtral-8x7b": (8, 2, True, 4096, 14336),
          "tiny": (8, 2, True, 64, 32)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,64,256,2048")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fp8", choices=["none", "channel", "block"], default="none",
                   help="experts in E4M3: one scale per output channel, or per 128 x 128 block")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--skip", default="", help="columns to leave out, comma-separated (e.g. torch_loop,torch_dense)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    args.token_list = [int(t) for t in args.tokens.split(",") if t.strip()]
    return args


def grouped_torch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
                  ) -> torch.Tensor:
    """The pairs sorted by expert, both products as torch._grouped_mm over the experts' row ranges."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0).to(torch.int32)
    xs = x[order // k]
    h = silu_mul_torch(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets) * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, y)


def loop_torch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
               ) -> torch.Tensor:
    """transformers' way: for each expert some token picked, its tokens through it."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tokens, slot = torch.where(ids == e)
        h = silu_mul_torch(x[tokens] @ w13[e].T) @ w2[e].T
        out.index_add_(0, tokens, (h * weights[tokens, slot, None]).to(x.dtype))
    return out


def copy_rate(device: torch.device) -> float:
    n = (2048 if device.type == "cuda" else 64) * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (time_ms(lambda: dst.copy_(src), device, iters=10, warmup=2) / 1000.0)


def timed(fn: Callable[[], Any], args: argparse.Namespace, graphed: bool) -> float | str:
    try:
        if graphed and args.device.type == "cuda":
            return graph_ms([fn], torch.cuda.Stream(args.device), args.iters, args.warmup)
        return time_ms(fn, args.device, args.iters, args.warmup)
    except Exception as exc:  # noqa: BLE001 - a column that cannot run says why, the others go on
        return f"{type(exc).__name__}: {exc}"[:120]


@dataclass
class Layer:
    experts: ExpertWeights  # what ours runs (bf16, or FP8)
    w13: torch.Tensor  # the bf16 experts, for the torch references
    w2: torch.Tensor
    dense_gu: torch.Tensor  # the dense equivalent's gate/up and down
    dense_down: torch.Tensor
    top_k: int
    renorm: bool
    expert_bytes: int
    rate: float


def measure(layer: Layer, t: int, gen: torch.Generator, skip: set[str], args: argparse.Namespace) -> dict[str, Any]:
    """One row: T tokens' hidden states and router logits through every column."""
    num_experts, hidden = layer.w13.shape[0], layer.w13.shape[2]
    x = torch.randn(t, hidden, device=args.device, generator=gen).to(args.dtype)
    logits = torch.randn(t, num_experts, device=args.device, generator=gen).to(args.dtype)
    weights, ids = route_torch(logits, layer.top_k, layer.renorm)
    touched = int(ids.unique().numel())
    row: dict[str, Any] = {"tokens": t, "touched": touched, "floor_ms": touched * layer.expert_bytes / layer.rate * 1e3}

    def ours() -> torch.Tensor:
        return fused_moe(x, logits, layer.experts, layer.top_k, layer.renorm, "silu", args.device.type == "cuda")

    row["ours_graph_ms"] = timed(ours, args, graphed=True)
    row["ours_eager_ms"] = timed(ours, args, graphed=False)
    bf16 = args.fp8 == "none"
    if "torch_grouped" not in skip and bf16 and hasattr(torch, "_grouped_mm"):
        row["torch_grouped_ms"] = timed(lambda: grouped_torch(x, weights, ids, layer.w13, layer.w2), args, False)
    if "torch_loop" not in skip and bf16:
        row["torch_loop_ms"] = timed(lambda: loop_torch(x, weights, ids, layer.w13, layer.w2), args, False)
    if "torch_dense" not in skip:
        row["torch_dense_ms"] = timed(lambda: moe_torch(x, weights, ids, layer.experts), args, graphed=True)
    row["dense_equiv_ms"] = timed(lambda: F.linear(silu_mul_torch(F.linear(x, layer.dense_gu)), layer.dense_down),
                                  args, graphed=True)
    if isinstance(row["ours_graph_ms"], float):
        row["x_floor"] = row["ours_graph_ms"] / row["floor_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_experts, top_k, renorm, hidden, inter = SHAPES[args.shape]
    dev, dt = args.device, args.dtype
    gen = torch.Generator(dev).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=dev, generator=gen) * 0.02).to(dt)
    w2 = (torch.randn(num_experts, hidden, inter, device=dev, generator=gen) * 0.02).to(dt)
    block = (128, 128) if args.fp8 == "block" else None
    experts = ExpertWeights(w13, w2)
    if args.fp8 != "none":
        (q13, s13), (q2, s2) = fp8_weights.quantize_experts(w13, block), fp8_weights.quantize_experts(w2, block)
        experts = ExpertWeights(q13, q2, s13, s2, block)
    expert_bytes = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
    dense_gu = (torch.randn(2 * top_k * inter, hidden, device=dev, generator=gen) * 0.02).to(dt)
    dense_down = (torch.randn(hidden, top_k * inter, device=dev, generator=gen) * 0.02).to(dt)
    skip = {c for c in args.skip.split(",") if c}
    fast = dev.type == "cuda"
    rate = copy_rate(dev)
    layer = Layer(experts, w13, w2, dense_gu, dense_down, top_k, renorm, expert_bytes, rate)
    rows = [measure(layer, t, torch.Generator(dev).manual_seed(t), skip, args) for t in args.token_list]
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    summary = {"shape": args.shape, "experts": num_experts, "top_k": top_k, "hidden": hidden, "inter": inter,
               "dtype": str(dt).removeprefix("torch."), "fp8": args.fp8, "device_name": device_name,
               "copy_rate_gbps": rate / 1e9, "expert_bytes": expert_bytes, "fast": fast,
               "floor_note": "the touched experts' gate, up and down bytes at the device copy rate (read + write)"}
    path = write_result(f"moe-{args.shape}" + ("" if args.fp8 == "none" else f"-fp8{args.fp8}"),
                        {"summary": summary, "rows": rows}, device=dev)
    print(f"{args.shape} MoE layer ({num_experts} experts of {inter}, top {top_k}) {summary['dtype']} fp8={args.fp8} "
          f"on {device_name}: copy rate {rate / 1e9:.0f} GB/s, {expert_bytes / 2**20:.1f} MiB an expert")
    print_table(rows, ["tokens", "touched", "floor_ms", "ours_graph_ms", "x_floor", "ours_eager_ms", "torch_grouped_ms",
                       "torch_loop_ms", "torch_dense_ms", "dense_equiv_ms"], title="ms per MoE layer")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
