"""The residual add + RMSNorm + projection of a decode step: two kernels (ours, then cuBLAS) against one.

For each weight (N x K) and rows M: microseconds per call of (a) the add+norm kernel then F.linear,
as the model runs them unfused, (b) the fused kernel of service.model.kernels.norm_linear in the
configuration the model serves, and (c) the fastest of a few other configurations (--sweep). Timed as served: CUDA graphs of calls over
copies of the weight that together exceed L2 (bench.gemm_sweep.graph_us). The model fuses at
M <= norm_linear.MAX_ROWS; the larger M say whether that limit is right.

    python bench/norm_linear_bench.py                   # Llama-3.2-1B: qkv, gate_up, LM head
    python bench/norm_linear_bench.py --shapes 6144x4096,28672x4096,128256x4096   # Llama-3.1-8B
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

from bench.common import print_table, write_result
from bench.gemm_sweep import WEIGHT_BYTES_TIMED, graph_us
from service.model.kernels._triton import next_pow2, sm_count, triton
from service.model.kernels.norm import add_rmsnorm_triton
from service.model.kernels.norm_linear import MAX_ROWS, NormLinearConfig, add_rmsnorm_linear_triton, norm_linear_config

ONE_B_SHAPES = "3072x2048,16384x2048,128256x2048"  # qkv, gate_up, head


def candidates(m: int, default: NormLinearConfig) -> list[NormLinearConfig]:
    """The served configuration first, then others on both inner products."""
    rows = next_pow2(m)
    others = [NormLinearConfig(False, rows, bn, bk, warps, stages)
              for bn, bk, warps, stages in ((8, 2048, 8, 1), (8, 1024, 4, 2), (4, 1024, 4, 2), (16, 512, 8, 2))]
    others += [NormLinearConfig(True, 16, bn, bk, 4, 4) for bn, bk in ((64, 128), (32, 256), (16, 256))]
    return [default] + [c for c in others if c != default and (c.dot or m == 1)]


def _name(c: NormLinearConfig) -> str:
    kind = "dot" if c.dot else "cuda-core"
    return f"{kind} {c.rows}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"


def unfused(x, d, nw, w):  # noqa: ANN001, ANN201 - a timed call
    _, h = add_rmsnorm_triton(x, d, nw, 1e-5)
    return F.linear(h, w)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=ONE_B_SHAPES, help="weights NxK, comma-separated")
    p.add_argument("--m", default="1,2,4,8,16", help="rows of x (the decode batch)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="also time other tile configurations (best_us, best)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("needs a CUDA GPU and triton")
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s.strip()]
    ms = [int(m) for m in args.m.split(",") if m.strip()]
    gen = torch.Generator(device).manual_seed(0)
    stream = torch.cuda.Stream(device)
    rows = []
    with torch.inference_mode():
        for n, k in shapes:
            copies = min(64, max(1, math.ceil(WEIGHT_BYTES_TIMED / (n * k * dtype.itemsize))))
            ws = [(torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
            nw = (1 + 0.1 * torch.randn(k, device=device, generator=gen)).to(dtype)
            for m in ms:
                x, d = (torch.randn(m, k, device=device, generator=gen).to(dtype) for _ in range(2))
                ref = unfused(x, d, nw, ws[0]).float()
                err = (add_rmsnorm_linear_triton(x, d, nw, 1e-5, ws[0])[1].float() - ref).norm() / ref.norm()
                if not err < 4e-3:
                    raise AssertionError(f"{n}x{k} M={m}: fused relative error {err:.3g}")
                two = graph_us([partial(unfused, x, d, nw, w) for w in ws], stream, args.replays)
                served = norm_linear_config(n, k, m, sm_count(device))
                timed = []
                for config in candidates(m, served) if args.sweep else [served]:
                    fused = partial(add_rmsnorm_linear_triton, x, d, nw, 1e-5, config=config)
                    timed.append((graph_us([partial(fused, weight=w) for w in ws], stream, args.replays), config))
                one = timed[0][0]
                best_us, best = min(timed, key=lambda t: t[0])
                rows.append({"shape": f"{n}x{k}", "m": m, "unfused_us": two, "fused_us": one,
                             "saved_us": two - one, "fused_tb_s": n * k * dtype.itemsize / one / 1e6,
                             "kernel": "dot" if served.dot else "cuda-core", "served_fused": m <= MAX_ROWS,
                             "best_us": best_us, "best": _name(best), "config": asdict(served),
                             "best_config": asdict(best)})
            del ws
            torch.cuda.empty_cache()
    columns = ["shape", "m", "unfused_us", "fused_us", "saved_us", "fused_tb_s", "kernel", "served_fused",
               "best_us", "best"]
    path = write_result("norm-linear", {"dtype": args.dtype, "max_rows": MAX_ROWS, "rows": rows}, device=device)
    print_table(rows, columns, title=f"add + RMSNorm + projection, {args.dtype}, us per call in CUDA graphs "
                                     "(weights out of L2)")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
