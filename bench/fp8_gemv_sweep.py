"""Batch-1 FP8 GEMV: the served kernel in each of a few tile configurations, against bf16.

Times one decode step's projections at batch 1 as one dependent chain in a CUDA graph (each output
the next input), 1B (16 layers) and 8B (4 layers) shapes, us per layer and share of the copy-rate
floor of the FP8 bytes; each configuration is first checked against a float32 product of the
dequantized weights. The served GEMV (service.model.kernels.gemv) with bf16 weights is the
reference row. The kernels this replaced (Triton's cast to float32, a per-element bit move, the
tensor cores on the row padded to 16 columns) are in this file's history and
bench/results/h200-20261204-fp8-gemv/.

    python bench/fp8_gemv_sweep.py
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from functools import partial

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, kernel_bench_device, print_table, write_result
from bench.decode_bench import copy_rate
from service.model import fp8
from service.model.kernels._triton import triton
from service.model.kernels.gemv import GemvConfig, gemv_triton

SHAPES = {"1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16),
          "8b": ([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], 4)}
SWEEP = [GemvConfig(*c) for c in ((8, 1024, 4, 1), (4, 2048, 4, 1), (8, 2048, 8, 1), (16, 1024, 8, 1), (8, 512, 4, 1),
                                   (4, 1024, 4, 2), (8, 1024, 4, 2))]


def variants() -> dict[str, object]:
    out = {"served": lambda x, q, s: gemv_triton(x, q, scale=s)}
    for c in SWEEP:
        out[f"bn{c.block_n} bk{c.block_k} w{c.num_warps}"] = partial(
            lambda x, q, s, c: gemv_triton(x, q, scale=s, config=c), c=c)
    return out


def chain(project, x: torch.Tensor, weights: list) -> torch.Tensor:
    """Every layer's projections in order, each output the next input (its first K elements)."""
    for layer in weights:
        for w in layer:
            x = project(x[:, : w[0].shape[1]], *w) if isinstance(w, tuple) else project(x[:, : w.shape[1]], w, None)
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--shapes", default="1b,8b")
    args = p.parse_args(argv)
    device = kernel_bench_device()
    rate = copy_rate(device, 2048)
    stream = torch.cuda.Stream(device)
    rows = []
    for shape in args.shapes.split(","):
        layer, layers = SHAPES[shape]
        gen = torch.Generator(device).manual_seed(0)
        weights = []
        for _ in range(layers):
            weights.append([fp8.quantize_rows((torch.randn(n, k, device=device, generator=gen) / k**0.5).float())
                            for n, k in layer])
        bf16 = [[(q.float() * s[:, None]).to(torch.bfloat16) for q, s in lw] for lw in weights[:2]]
        x0 = torch.randn(1, max(max(n, k) for n, k in layer), device=device, generator=gen).to(torch.bfloat16)
        fp8_bytes = sum(n * k for n, k in layer)
        floor_us = fp8_bytes / rate * 1e6

        with torch.inference_mode():
            # bf16 weights through the served GEMV, 2 layers repeated to the same count: the reference speed
            ms = graph_ms([partial(chain, lambda x, w, _: gemv_triton(x, w), x0, [bf16[i % 2] for i in range(layers)])],
                          stream, args.replays, warmup=2)
            rows.append({"shape": shape, "variant": "bf16 served (2 layers' weights cycled)", "us_per_layer": ms * 1000 / layers,
                         "of_floor": floor_us * 2 / (ms * 1000 / layers)})
            for name, project in variants().items():
                try:
                    errs = []
                    for q, s in weights[0]:
                        x = x0[:, : q.shape[1]]
                        ref = x.float() @ fp8.dequantize_rows(q, s).t()
                        errs.append(((project(x, q, s).float() - ref).norm() / ref.norm()).item())
                    ms = graph_ms([partial(chain, project, x0, weights)], stream, args.replays, warmup=2)
                except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is a result too
                    rows.append({"shape": shape, "variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
                    torch.cuda.synchronize()
                    continue
                us = ms * 1000 / layers
                rows.append({"shape": shape, "variant": name, "us_per_layer": us, "of_floor": floor_us / us,
                             "max_rel_err": max(errs)})
        print(f"{shape}: floor {floor_us:.1f} us per layer ({fp8_bytes / 1e6:.1f} MB FP8) at {rate / 1e12:.2f} TB/s",
              flush=True)
    path = write_result("fp8-gemv-sweep", {"copy_rate_gbps": rate / 1e9, "triton": triton.__version__, "rows": rows},
                        device=device)
    print_table(rows, ["shape", "variant", "us_per_layer", "of_floor", "max_rel_err", "error"],
                title="FP8 weights at batch 1: a decode step's projections as one dependent chain in a CUDA graph")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
