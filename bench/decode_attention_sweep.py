"""Decode attention tiles: the served kernel (service.model.kernels.decode_attention) at each
(positions a step, warps, pipeline stages), bf16 and FP8 KV, the 1B and 8B head shapes.

Caches are paged as served (blocks of 16 positions, each row's table a random draw of the pool), every
row at the same context; each configuration is checked against the torch reference, then timed as a
CUDA graph of calls over several layers' caches (together beyond L2); us per layer call and the share
of the copy rate its KV bytes would allow.

    python bench/decode_attention_sweep.py
    python bench/decode_attention_sweep.py --batches 64 --contexts 4096 --models 8b
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from functools import partial

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, kernel_bench_device, print_table, write_result
from bench.decode_bench import copy_rate
from service.model.fp8 import FP8
from service.model.kernels.decode_attention import decode_attention_torch, decode_attention_triton, served_tile

HEADS = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # query heads, kv heads, head dim
TILES = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
KV_BYTES_TIMED = 512 << 20
BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b,8b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--kv", default="bf16,fp8")
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args(argv)
    device = kernel_bench_device()
    rate = copy_rate(device, 2048)
    stream = torch.cuda.Stream(device)
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    with torch.inference_mode():
        for model in args.models.split(","):
            h, kvh, d = HEADS[model]
            for batch in (int(v) for v in args.batches.split(",")):
                for ctx in (int(v) for v in args.contexts.split(",")):
                    per_seq = -(-(ctx + 64) // BLOCK)
                    blocks = batch * per_seq + 1
                    table = (torch.randperm(blocks - 1, device=device, generator=gen)[: batch * per_seq] + 1)
                    table = table.view(batch, per_seq).to(torch.int32)
                    slots = torch.arange(batch, device=device)
                    positions = torch.full((batch,), ctx - 1, device=device, dtype=torch.long)
                    q = torch.randn(batch, h, d, device=device, generator=gen).to(torch.bfloat16)
                    for kv in args.kv.split(","):
                        dtype = FP8 if kv == "fp8" else torch.bfloat16
                        layer_bytes = 2 * batch * ctx * kvh * d * dtype.itemsize
                        layers = max(1, min(16, math.ceil(KV_BYTES_TIMED / layer_bytes)))
                        caches = [tuple(torch.randn(blocks, kvh, BLOCK, d, device=device, generator=gen).to(dtype)
                                        for _ in range(2)) for _ in range(layers)]
                        scale = torch.tensor([0.5, 2.0], device=device) if kv == "fp8" else None
                        ref = decode_attention_torch(q, *caches[0], table, slots, positions, scale).float()
                        floor_us = layer_bytes / rate * 1e6
                        for tile in [None, *TILES]:
                            name = "served" if tile is None else f"n{tile[0]} w{tile[1]} s{tile[2]}"
                            try:
                                out = decode_attention_triton(q, *caches[0], table, slots, positions, scale, tile=tile)
                                err = ((out.float() - ref).norm() / ref.norm()).item()
                                if not err < 2e-2:
                                    raise AssertionError(f"relative error {err:.3g}")
                                ms = graph_ms([partial(decode_attention_triton, q, kc, vc, table, slots, positions, scale,
                                                       tile=tile) for kc, vc in caches], stream, args.replays)
                            except Exception as e:  # noqa: BLE001 - a tile that fails is a result too
                                print(f"{model} b{batch} ctx{ctx} {kv} {name}: {type(e).__name__}: {e}"[:300], flush=True)
                                torch.cuda.synchronize()
                                continue
                            us = ms * 1000 / layers
                            rows.append({"model": model, "batch": batch, "context": ctx, "kv": kv, "tile": name,
                                         "us": us, "of_floor": floor_us / us, "rel_err": err})
                        del caches
                        torch.cuda.empty_cache()
                        these = [r for r in rows if (r["model"], r["batch"], r["context"], r["kv"]) == (model, batch, ctx, kv)]
                        if these:
                            served = next((r for r in these if r["tile"] == "served"), None)
                            best = min(these, key=lambda r: r["us"])
                            print(f"{model} b{batch} ctx{ctx} {kv}: served {served['us'] if served else float('nan'):.1f} us, "
                                  f"best {best['tile']} {best['us']:.1f} us ({best['of_floor']:.2f} of the copy rate)", flush=True)
    best_rows = []
    for key in sorted({(r["model"], r["batch"], r["context"], r["kv"]) for r in rows}):
        these = [r for r in rows if (r["model"], r["batch"], r["context"], r["kv"]) == key]
        served = next((r for r in these if r["tile"] == "served"), {"us": float("nan")})
        best = min(these, key=lambda r: r["us"])
        best_rows.append({"model": key[0], "batch": key[1], "context": key[2], "kv": key[3], "served_us": served["us"],
                          "best": best["tile"], "best_us": best["us"], "best_of_floor": best["of_floor"]})
    served = {m: {kv: served_tile(HEADS[m][2], kv == "fp8") for kv in args.kv.split(",")} for m in args.models.split(",")}
    path = write_result("decode-attention-sweep", {"copy_rate_gbps": rate / 1e9, "served_tiles": served, "rows": rows},
                        device=device)
    print_table(best_rows, ["model", "batch", "context", "kv", "served_us", "best", "best_us", "best_of_floor"],
                title="decode attention per layer call, us (CUDA graphs, caches beyond L2)")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
