"""Kernel budget of the decode step: which kernels one step launches and where its time goes.

Profiles the eager decode step (torch.profiler, CUDA activities) of the built-in shape with random
weights and a KV cache filled to --context, for each batch: kernels per step, GPU time per step by
kernel, grouped (GEMM, attention, norm, elementwise, ...), against the bandwidth floor (weights +
KV read at the device's copy rate). The graphed step runs the same kernels without launch gaps, so
the sum of kernel times is what the graph can at best reach.

    python bench/profile_decode.py --model builtin:llama-1b --device cuda --random-init --batches 1,64
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result
from bench.decode_bench import bench_ours, copy_rate, kv_bytes_read, load, make_step, weight_bytes

# Kernel-name patterns, first match wins: the groups of the budget.
_GROUPS = [
    ("gemm", r"gemm|gemv|sm90_xmma|cutlass|matmul|splitK|nvjet"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("norm", r"rms|norm|pow_|rsqrt|mean|reduce"),
    ("copy/index", r"copy|index|gather|scatter|cat|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def group_of(name: str) -> str:
    for group, pattern in _GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def profile_step(step: Any, batch: int, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step.run(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step.run(batch)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            per_kernel[ev.name].append(ev.device_time)
    kernels = [{"kernel": name[:90], "group": group_of(name), "calls_per_step": len(t) / steps,
                "us_per_step": sum(t) / steps} for name, t in per_kernel.items()]
    kernels.sort(key=lambda k: -k["us_per_step"])
    groups: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"kernels": 0.0, "us": 0.0})
    for k in kernels:
        groups[k["group"]]["kernels"] += k["calls_per_step"]
        groups[k["group"]]["us"] += k["us_per_step"]
    return {"kernels_per_step": sum(k["calls_per_step"] for k in kernels),
            "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
            "groups": dict(groups), "top": kernels[:25]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-1b")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None)
    p.add_argument("--device", default="cuda", choices=["cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--without", default="", help="fast-path kernels to turn off, as decode_bench.py's")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none", help="as decode_bench.py's")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    s = load(args)
    step = make_step(s, max(batches), args.context)
    rate = copy_rate(s.device, 2048)
    rows, details = [], {}
    for batch in batches:
        timed = bench_ours(s, step, batch, args)
        prof = profile_step(step, batch, args.steps)
        floor_ms = (weight_bytes(s.model) + kv_bytes_read(s.model.spec, batch, args.context, s.dtype)) / rate * 1000
        row = {"batch": batch, "kernels": prof["kernels_per_step"], "kernel_ms": prof["kernel_us_per_step"] / 1000,
               "graph_ms": timed.get("graph_ms"), "eager_ms": timed["eager_ms"], "floor_ms": floor_ms}
        for group, g in prof["groups"].items():
            row[f"{group}_ms"] = g["us"] / 1000
        rows.append(row)
        details[batch] = prof
        print_table(prof["top"][:15], ["kernel", "group", "calls_per_step", "us_per_step"],
                    title=f"batch {batch}: top kernels")
        print_table([{"group": k, **v} for k, v in sorted(prof["groups"].items(), key=lambda kv: -kv[1]["us"])],
                    ["group", "kernels", "us"], title=f"batch {batch}: by group")
    cols = ["batch", "kernels", "kernel_ms", "graph_ms", "eager_ms", "floor_ms",
            *sorted({k for r in rows for k in r if k.endswith("_ms") and k not in
                     ("kernel_ms", "graph_ms", "eager_ms", "floor_ms")})]
    print_table(rows, cols, title=f"{args.model} decode step, context {args.context}: kernel budget")
    path = write_result("decode-profile", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                           "kernels": details, "copy_rate_gbps": rate / 1e9}, s.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
