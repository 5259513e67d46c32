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
- gemv: a Triton CUDA-core GEMV, launched plainly;
- gemv-pdl: the same kernel launched with PDL, first weight tile loaded before the wait;
- gemv-pdl-early: as gemv-pdl, and each kernel lets the next one launch right after its wait
  (griddepcontrol.launch_dependents), so the next kernel's weight loads overlap this one's work.

Prints us per layer, TB/s and the share of the copy-rate floor; writes JSON. With --sweep, also the
served kernel (service.model.kernels.gemv, PDL as served) with one projection at a time in each of a
few other configurations: which configuration each weight shape should get.

    python bench/pdl_chain.py [--sweep]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_ms, write_result
from bench.decode_bench import copy_rate
from service.model.kernels._triton import cdiv, tl, triton
from service.model.kernels.gemv import GemvConfig, gemv_triton

# (N, K) of the 1B layer's projections in order, and the slice of the previous output each reads
LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
HEAD = (128256, 2048)
SWEEP = [GemvConfig(*c) for c in ((2, 1024, 4, 2), (2, 2048, 4, 1), (4, 512, 4, 3), (4, 1024, 4, 3),
                                   (4, 2048, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 3), (8, 1024, 4, 2),
                                   (8, 2048, 8, 1), (16, 512, 8, 2))]
CONFIGS = {"bn8-bk2048-w8": (8, 2048, 8, 1), "bn4-bk1024-w4": (4, 1024, 4, 2), "bn8-bk1024-w4": (8, 1024, 4, 2)}


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, int, int, int], pdl: bool,
         early: bool) -> None:
    """y [N] = W [N, K] x [K] (x: the first K elements of the previous output)."""
    n, k = w.shape
    block_n, block_k, warps, stages = config
    kwargs = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=min(block_k, k),
                                      PDL=pdl, EARLY=early, num_warps=warps, num_stages=stages, **kwargs)


def linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    torch.mm(x[None], w.t(), out=y[None])  # what F.linear runs for one row


def chain(weights: list[list[torch.Tensor]], bufs: list[torch.Tensor], call) -> list:  # noqa: ANN001
    """The calls of every layer: projection j reads buffer j (sliced to K) and writes buffer j + 1."""
    calls = []
    for layer in weights:
        for j, w in enumerate(layer):
            src, dst = bufs[j], bufs[(j + 1) % len(LAYER)]
            calls.append(partial(call, src[: w.shape[1]], w, dst[: w.shape[0]]))
    return calls


def graph_ms(calls: list, stream: torch.cuda.Stream, replays: int) -> float:
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    return time_ms(graph.replay, stream.device, iters=replays, warmup=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="the served kernel, one projection at a time in other configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("needs a CUDA GPU and triton")
    device, dtype = torch.device("cuda"), torch.bfloat16
    rate = copy_rate(device, 2048)
    gen = torch.Generator(device).manual_seed(0)
    weights = [[(torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype) for n, k in LAYER]
               for _ in range(args.layers)]
    layer_bytes = sum(n * k for n, k in LAYER) * dtype.itemsize
    # buffer j is projection j's input: the previous projection's output (K <= its N)
    bufs = [torch.randn(max(n for n, _ in LAYER), device=device, generator=gen).to(dtype) for _ in LAYER]
    stream = torch.cuda.Stream(device)

    # every variant against cuBLAS on one layer's inputs first
    for j, w in enumerate(weights[0]):
        ref = F.linear(bufs[j][: w.shape[1]].float(), w.float())
        for config in CONFIGS.values():
            for pdl, early in ((False, False), (True, False), (True, True)):
                out = torch.empty(w.shape[0], device=device, dtype=dtype)
                gemv(bufs[j][: w.shape[1]], w, out, config, pdl, early)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise AssertionError(f"gemv {w.shape} {config} pdl={pdl} early={early}: relative error {err:.3g}")

    variants = {"cublas": linear}
    for name, config in CONFIGS.items():
        variants[f"gemv {name}"] = partial(_call, config=config, pdl=False, early=False)
        variants[f"gemv-pdl {name}"] = partial(_call, config=config, pdl=True, early=False)
        variants[f"gemv-pdl-early {name}"] = partial(_call, config=config, pdl=True, early=True)
    rows = []
    with torch.inference_mode():
        for name, call in variants.items():
            try:
                ms = graph_ms(chain(weights, bufs, call), stream, args.replays)
            except Exception as e:  # noqa: BLE001 - a variant that cannot be captured is a result too
                rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
                torch.cuda.synchronize()
                continue
            us = ms * 1000 / args.layers
            rows.append({"variant": name, "us_per_layer": us, "tb_s": layer_bytes / us / 1e6,
                         "of_floor": layer_bytes / rate * 1e6 / us})
        if args.sweep:
            rows += sweep(weights, bufs, stream, args.replays, layer_bytes, rate)
    floor_us = layer_bytes / rate * 1e6
    path = write_result("pdl-chain", {"layers": args.layers, "layer_bytes": layer_bytes, "copy_rate_gbps": rate / 1e9,
                                      "floor_us_per_layer": floor_us, "triton": triton.__version__, "rows": rows},
                        device=device)
    print_table(rows, ["variant", "projection", "config", "us_per_layer", "tb_s", "of_floor", "error"],
                title=f"1B decode projections at batch 1, {args.layers} layers in one CUDA graph; floor "
                      f"{floor_us:.1f} us per layer at the copy rate {rate / 1e12:.2f} TB/s")
    print(f"\nwrote {path}")
    return 0


def sweep(weights: list[list[torch.Tensor]], bufs: list[torch.Tensor], stream: torch.cuda.Stream, replays: int,
          layer_bytes: int, rate: float) -> list[dict]:
    """The served kernel; then each projection alone in each SWEEP configuration, the others as served."""

    def served(override: dict) -> torch.Tensor:  # the chain, each output the next input (as the model runs)
        x = bufs[0][None, : LAYER[0][1]]
        for layer in weights:
            for w in layer:
                x = gemv_triton(x[:, : w.shape[1]], w, None, override.get(tuple(w.shape)))
        return x

    def row(name: str, projection: str, config: str, ms: float) -> dict:
        us = ms * 1000 / len(weights)
        return {"variant": name, "projection": projection, "config": config, "us_per_layer": us,
                "tb_s": layer_bytes / us / 1e6, "of_floor": layer_bytes / rate * 1e6 / us}

    rows = [row("served", "all", "default", graph_ms([partial(served, {})], stream, replays))]
    for n, k in LAYER:
        for c in SWEEP:
            rows.append(row("served, one swept", f"{n}x{k}", f"bn{c.block_n} bk{c.block_k} w{c.num_warps} "
                            f"s{c.num_stages}", graph_ms([partial(served, {(n, k): c})], stream, replays)))
    # The LM head alone (525 MB: one kernel a step), 4 copies a graph
    head = [(torch.randn(HEAD[0], HEAD[1], device=bufs[0].device) / HEAD[1] ** 0.5).to(bufs[0].dtype) for _ in range(4)]
    x = bufs[0][None, : HEAD[1]]
    head_bytes = HEAD[0] * HEAD[1] * bufs[0].element_size()
    for c in [None, *SWEEP]:
        calls = [partial(gemv_triton, x, w, None, c) for w in head]
        us = graph_ms(calls, stream, replays) * 1000 / len(head)
        cublas = c is None and graph_ms([partial(torch.nn.functional.linear, x, w) for w in head], stream, replays)
        rows.append({"variant": "head", "projection": f"{HEAD[0]}x{HEAD[1]}",
                     "config": "default" if c is None else f"bn{c.block_n} bk{c.block_k} w{c.num_warps} s{c.num_stages}",
                     "us_per_layer": us, "tb_s": head_bytes / us / 1e6, "of_floor": head_bytes / rate * 1e6 / us})
        if cublas:
            us = cublas * 1000 / len(head)
            rows.append({"variant": "head", "projection": f"{HEAD[0]}x{HEAD[1]}", "config": "cublas",
                         "us_per_layer": us, "tb_s": head_bytes / us / 1e6, "of_floor": head_bytes / rate * 1e6 / us})
    return rows


def _call(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple, pdl: bool, early: bool) -> None:
    gemv(x, w, y, config, pdl, early)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, y_ptr, N, K, stride_w,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)  # independent of x
        if PDL:
            tl.extra.cuda.gdc_wait()  # the previous kernel's output (x) is complete and visible
            if EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
            w = tl.load(w_ptrs + k0 + BLOCK_K, mask=n_mask[:, None] & (offs_k[None, :] < K - k0 - BLOCK_K), other=0.0)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


if __name__ == "__main__":
    raise SystemExit(main())
