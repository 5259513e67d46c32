"""Does programmatic dependent launch (PDL) hide the per-kernel fixed cost of decode GEMVs?

At batch 1 each of a decode layer's four projections is one kernel that reads its weight once, and a
small weight cannot reach full bandwidth in one kernel: ramp-up, tail and the gap to the next kernel
(bench/NOTES.md, "Decode GEMMs of our own against cuBLAS"). With PDL (Hopper), a kernel launched with
the programmatic-serialization attribute may start while the previous one finishes: it loads its
first weight tile (which does not depend on the previous kernel), then waits (griddepcontrol.wait)
for the previous kernel's results before reading its input row.

This times the projections of a Llama-3.2-1B decode step at batch 1 as one dependent chain in a CUDA
graph (each kernel's input is the previous one's output: qkv -> o -> gate_up -> down -> next layer),
16 layers of distinct weights (1.9 GB, far beyond L2), as:

- cublas: F.linear;
- gemv: the served GEMV (service.model.kernels.gemv) in a few tile configurations, launched plainly;
- gemv-pdl: the same kernel launched with PDL, first weight tile loaded before the wait;
- gemv-pdl-early: as gemv-pdl, and each kernel lets the next one launch right after its wait
  (griddepcontrol.launch_dependents), so the next kernel's weight loads overlap this one's work
  (what the model runs).

Prints us per layer, TB/s and the share of the copy-rate floor; writes JSON. With --sweep, also the
served kernel (service.model.kernels.gemv, PDL as served) with one projection at a time in each of a
few other configurations: which configuration each weight shape should get.

    python bench/pdl_chain.py [--sweep]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, kernel_bench_device, print_table, write_result
from bench.decode_bench import copy_rate
from service.model.kernels._triton import triton
from service.model.kernels.gemv import GemvConfig, gemv_triton

# (N, K) of the 1B layer's projections in order; each reads the first K elements of the previous output
LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
HEAD = (128256, 2048)
SWEEP = [GemvConfig(*c) for c in ((2, 1024, 4, 2), (2, 2048, 4, 1), (4, 512, 4, 3), (4, 1024, 4, 3),
                                   (4, 2048, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 3), (8, 1024, 4, 2),
                                   (8, 2048, 8, 1), (16, 512, 8, 2))]
CONFIGS = {"bn8-bk2048-w8": GemvConfig(8, 2048, 8, 1), "bn4-bk1024-w4": GemvConfig(4, 1024, 4, 2),
           "bn8-bk1024-w4": GemvConfig(8, 1024, 4, 2)}
LAUNCHES = {"gemv": "plain", "gemv-pdl": "pdl-wait", "gemv-pdl-early": "pdl-early"}

Project = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [1, K], weight [N, K]) -> [1, N]


def run_chain(x: torch.Tensor, weights: list[list[torch.Tensor]], project: Project,
              override: dict | None = None) -> torch.Tensor:
    """Every layer's projections in order, each output the next input (as a decode step runs them);
    `override` gives a weight shape its own projection."""
    for layer in weights:
        for w in layer:
            x = (override or {}).get(tuple(w.shape), project)(x[:, : w.shape[1]], w)
    return x


def _name(c: GemvConfig) -> str:
    return f"bn{c.block_n} bk{c.block_k} w{c.num_warps} s{c.num_stages}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="the served kernel, one projection at a time in other configurations")
    args = p.parse_args(argv)
    device, dtype = kernel_bench_device(), torch.bfloat16
    rate = copy_rate(device, 2048)
    gen = torch.Generator(device).manual_seed(0)
    weights = [[(torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype) for n, k in LAYER]
               for _ in range(args.layers)]
    layer_bytes = sum(n * k for n, k in LAYER) * dtype.itemsize
    x0 = torch.randn(1, max(n for n, _ in LAYER), device=device, generator=gen).to(dtype)
    stream = torch.cuda.Stream(device)

    def row(variant: str, projection: str, config: str, ms: float, nbytes: int, per: int) -> dict:
        us = ms * 1000 / per
        return {"variant": variant, "projection": projection, "config": config, "us_per_layer": us,
                "tb_s": nbytes / us / 1e6, "of_floor": nbytes / rate * 1e6 / us}

    variants: dict[str, Project] = {"cublas": F.linear}
    for name, config in CONFIGS.items():
        for label, launch in LAUNCHES.items():
            variants[f"{label} {name}"] = partial(gemv_triton, bias=None, config=config, launch=launch)
    for name, project in variants.items():  # every variant against a float32 GEMM on one layer first
        for w in weights[0]:
            x = x0[:, : w.shape[1]]
            ref = F.linear(x.float(), w.float())
            err = ((project(x, w).float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"{name} {tuple(w.shape)}: relative error {err:.3g}")

    rows = []
    with torch.inference_mode():
        for name, project in variants.items():
            try:
                ms = graph_ms([partial(run_chain, x0, weights, project)], stream, args.replays, warmup=2)
            except Exception as e:  # noqa: BLE001 - a variant that cannot be captured is a result too
                rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
                torch.cuda.synchronize()
                continue
            rows.append(row(name, "-", "-", ms, layer_bytes, args.layers))
        if args.sweep:
            # The served kernel; then each projection alone in each SWEEP configuration, the others as served.
            def chain_ms(override: dict) -> float:
                return graph_ms([partial(run_chain, x0, weights, gemv_triton, override)], stream, args.replays, warmup=2)

            rows.append(row("served", "all", "default", chain_ms({}), layer_bytes, args.layers))
            for n, k in LAYER:
                for c in SWEEP:
                    rows.append(row("served, one swept", f"{n}x{k}", _name(c),
                                    chain_ms({(n, k): partial(gemv_triton, bias=None, config=c)}),
                                    layer_bytes, args.layers))
            # The LM head alone (525 MB: one kernel a step), 4 copies a graph
            head = [(torch.randn(*HEAD, device=device) / HEAD[1] ** 0.5).to(dtype) for _ in range(4)]
            x, head_bytes, shape = x0[:, : HEAD[1]], HEAD[0] * HEAD[1] * dtype.itemsize, f"{HEAD[0]}x{HEAD[1]}"
            for label, project in [("cublas", F.linear), ("default", gemv_triton)] + [
                    (_name(c), partial(gemv_triton, bias=None, config=c)) for c in SWEEP]:
                ms = graph_ms([partial(project, x, w) for w in head], stream, args.replays)
                rows.append(row("head", shape, label, ms, head_bytes, len(head)))
    floor_us = layer_bytes / rate * 1e6
    path = write_result("pdl-chain", {"layers": args.layers, "layer_bytes": layer_bytes, "copy_rate_gbps": rate / 1e9,
                                      "floor_us_per_layer": floor_us, "triton": triton.__version__, "rows": rows},
                        device=device)
    print_table(rows, ["variant", "projection", "config", "us_per_layer", "tb_s", "of_floor", "error"],
                title=f"1B decode projections at batch 1, {args.layers} layers in one CUDA graph; floor "
                      f"{floor_us:.1f} us per layer at the copy rate {rate / 1e12:.2f} TB/s")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
