"""Decode-sized FP8 GEMMs: cuBLAS (`torch._scaled_mm`) against service.model.kernels.fp8_gemm, per
weight shape and rows of x, with the bf16 GEMM for reference.

Each configuration is checked against a float32 product of the dequantized operands, then timed as
served: a CUDA graph of calls over copies of the weight that together exceed L2, replayed; us per
call and TB/s of the FP8 weight. The activation's per-token quantization is a kernel of its own in
both FP8 paths and is timed apart. The summary adds up a layer's projections (q/k/v, o, gate/up,
down) per model and rows: bf16, cuBLAS FP8, the served configuration of ours, and the best
configuration of ours per shape ("served" is cuBLAS's time where the served rule picks cuBLAS).

    python bench/fp8_gemm_sweep.py                 # the 1B and 8B shapes at 16, 64, 256 rows
    python bench/fp8_gemm_sweep.py --m 64 --models 8b
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from dataclasses import asdict
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, kernel_bench_device, print_table, write_result
from service.model import fp8
from service.model.kernels._triton import cdiv, next_pow2, sm_count, triton
from service.model.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton

MODELS = {"1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
          "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}
WEIGHT_BYTES_TIMED = 256 << 20  # copies of a weight per timed graph: several times an H200's 50 MB L2


def candidates(m: int, n: int, k: int, sms: int) -> list[Fp8GemmConfig]:
    out = []
    for swap in (True, False):
        for bn in ((64, 128) if swap else (32, 64, 128)):
            bm = min(64, max(16, next_pow2(m))) if swap else 64
            for bk in (128, 256):
                programs = cdiv(m, bm) * cdiv(n, bn)
                for split in (1, 2, 4):
                    if k % (bk * split) or (split > 1 and programs * split > 2 * sms):
                        continue
                    out.append(Fp8GemmConfig(swap, bm, bn, bk, split, 4, 4 if bk == 128 else 3))
    served = fp8_gemm_config(m, n, k, sms)
    if served is not None and served not in out:
        out.append(served)
    return out


def us_per_call(calls: list, stream: torch.cuda.Stream, replays: int) -> float:
    return graph_ms(calls, stream, replays) * 1000.0 / len(calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b,8b")
    p.add_argument("--m", default="16,64,256", help="rows of x (the decode batch)")
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args(argv)
    device = kernel_bench_device()
    sms = sm_count(device)
    stream = torch.cuda.Stream(device)
    gen = torch.Generator(device).manual_seed(0)
    ms = [int(v) for v in args.m.split(",") if v.strip()]
    rows, summary = [], []
    with torch.inference_mode():
        for model in args.models.split(","):
            totals = {m: {"bf16": 0.0, "cublas_fp8": 0.0, "served": 0.0, "best": 0.0, "quant": 0.0} for m in ms}
            for n, k in MODELS[model]:
                copies = min(64, max(1, math.ceil(WEIGHT_BYTES_TIMED / (n * k))))
                w = torch.randn(n, k, device=device, generator=gen) / k**0.5
                qs = [fp8.quantize_rows(w) for _ in range(copies)]
                bf16 = [w.to(torch.bfloat16) for _ in range(max(1, copies // 2))]
                del w
                for m in ms:
                    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
                    xq, xs = fp8._quantize_tokens(x)
                    ref = (xq.float() * xs) @ fp8.dequantize_rows(*qs[0]).t()
                    row = {"model": model, "shape": f"{n}x{k}", "m": m,
                           "bf16_us": us_per_call([partial(F.linear, x, b) for b in bf16], stream, args.replays),
                           "quant_us": us_per_call([partial(fp8._quantize_tokens, x)] * 16, stream, args.replays),
                           "cublas_fp8_us": us_per_call(
                               [partial(torch._scaled_mm, xq, q.t(), scale_a=xs, scale_b=s.view(1, -1),
                                        out_dtype=torch.bfloat16) for q, s in qs], stream, args.replays)}
                    timed = []
                    for c in candidates(m, n, k, sms):
                        try:
                            y = fp8_gemm_triton(xq, xs, *qs[0], None, torch.bfloat16, c)
                            err = ((y.float() - ref).norm() / ref.norm()).item()
                            if not err < 5e-3:
                                raise AssertionError(f"relative error {err:.3g}")
                            us = us_per_call([partial(fp8_gemm_triton, xq, xs, q, s, None, torch.bfloat16, c)
                                              for q, s in qs], stream, args.replays)
                        except Exception as e:  # noqa: BLE001 - a configuration that fails is a result too
                            print(f"{model} {n}x{k} m={m} {c}: {type(e).__name__}: {e}"[:300], flush=True)
                            torch.cuda.synchronize()
                            continue
                        timed.append((us, c))
                    best_us, best = min(timed, key=lambda t: t[0])
                    served = fp8_gemm_config(m, n, k, sms)  # None: cuBLAS serves this shape and rows
                    served_us = next((us for us, c in timed if c == served), float("nan")) if served \
                        else row["cublas_fp8_us"]
                    gb = n * k / 1e9
                    row.update({"served_us": served_us, "best_us": best_us, "best_tb_s": gb / best_us * 1e3,
                                "cublas_tb_s": gb / row["cublas_fp8_us"] * 1e3, "best": asdict(best),
                                "served": asdict(served) if served else None,
                                "all": [(us, asdict(c)) for us, c in sorted(timed, key=lambda t: t[0])]})
                    rows.append(row)
                    t = totals[m]
                    for key, value in (("bf16", row["bf16_us"]), ("cublas_fp8", row["cublas_fp8_us"]),
                                       ("served", served_us), ("best", best_us), ("quant", row["quant_us"])):
                        t[key] += value
                    print(f"{model} {n}x{k} m={m}: bf16 {row['bf16_us']:.1f} cuBLAS FP8 {row['cublas_fp8_us']:.1f} "
                          f"served {served_us:.1f} best {best_us:.1f} us {best}", flush=True)
                del qs, bf16
                torch.cuda.empty_cache()
            for m, t in totals.items():
                summary.append({"model": model, "m": m, "bf16_us": t["bf16"],
                                "cublas_fp8_plus_quant_us": t["cublas_fp8"] + t["quant"],
                                "served_plus_quant_us": t["served"] + t["quant"], "best_plus_quant_us": t["best"] + t["quant"],
                                "bf16_over_served": t["bf16"] / (t["served"] + t["quant"])})
    path = write_result("fp8-gemm-sweep", {"rows": rows, "summary": summary, "triton": triton.__version__}, device=device)
    print_table(rows, ["model", "shape", "m", "bf16_us", "cublas_fp8_us", "served_us", "best_us", "quant_us",
                       "best_tb_s", "cublas_tb_s"], title="decode GEMMs, us per call in CUDA graphs (weights out of L2)")
    print_table(summary, ["model", "m", "bf16_us", "cublas_fp8_plus_quant_us", "served_plus_quant_us",
                          "best_plus_quant_us", "bf16_over_served"], title="a layer's four projections, us")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
