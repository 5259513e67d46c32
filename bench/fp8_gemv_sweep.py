"""Batch-1 FP8 GEMV: which kernel streams E4M3 weights at the copy rate?

The served GEMV (service.model.kernels.gemv) reads an FP8 weight at 43% (1B) and 61% (8B) of the
copy rate against bf16's 65% and 90% (bench/NOTES.md, "FP8 weights"). Each FP8 element is converted
to float32 by Triton's cast (cvt instructions, a fraction of the FMA rate) and every K step ends in a
cross-warp sum. Candidates, each with the served PDL launch (first weight tile loaded before the wait):

- served: the served kernel;
- acc2d-cast: float32 products accumulated per lane, one sum at the end, Triton's cast;
- acc2d-bits: the same, the E4M3 byte turned into float32 with integer ops: sign to bit 31, exponent
  and mantissa to bits 20-26, which is the value times 2^-120 (denormals included) -- the 2^120
  goes into the row scale;
- dot-cast / dot-bits: the weight tile converted to bf16 (cast, or the same bit move into bf16's
  bits) and multiplied on the tensor cores against the row padded to 16 columns.

Times one decode step's projections at batch 1 as one dependent chain in a CUDA graph (each output
the next input), 1B (16 layers) and 8B (4 layers) shapes, us per layer and share of the copy-rate
floor; each candidate is first checked against a float32 product of the dequantized weights.

    python bench/fp8_gemv_sweep.py
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from functools import partial

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, print_table, write_result
from bench.decode_bench import copy_rate
from service.model import fp8
from service.model.kernels._triton import cdiv, pdl_launch, tl, triton
from service.model.kernels.gemv import GemvConfig, gemv_triton

SHAPES = {"1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16),
          "8b": ([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], 4)}
TWO_120 = float(2**120)
LANE = {"acc2d-cast": [(2, 2048, 4), (2, 4096, 4), (4, 2048, 4), (4, 4096, 8), (8, 1024, 4), (1, 4096, 4)],
        "dot": [(16, 256, 4), (16, 512, 4), (32, 256, 4), (16, 1024, 4), (32, 512, 4), (64, 256, 4)]}


def gemv_candidate(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kind: str, cfg: tuple[int, int, int]) -> torch.Tensor:
    n, k = q.shape
    bn, bk, warps = cfg
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    bits = kind.endswith("bits")
    w = q.view(torch.uint8) if bits else q
    kernel = _dot_kernel if kind.startswith("dot") else _lane_kernel
    kernel[(cdiv(n, bn),)](x, w, scale, y, n, k, q.stride(0), BITS=bits, BLOCK_N=bn, BLOCK_K=min(bk, k),
                           num_warps=warps, num_stages=1, **pdl_launch(True))
    return y


if triton is not None:

    @triton.jit
    def _to_f32(w, BITS: tl.constexpr):
        if BITS:
            v = w.to(tl.int32)
            return (((v & 0x80) << 24) | ((v & 0x7F) << 20)).to(tl.float32, bitcast=True)
        return w.to(tl.float32)

    @triton.jit
    def _to_bf16(w, BITS: tl.constexpr):
        if BITS:
            v = w.to(tl.int32)
            return (((v & 0x80) << 8) | ((v & 0x7F) << 4)).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return w.to(tl.bfloat16)

    @triton.jit
    def _lane_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_w, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(tl.float32)
            acc += _to_f32(w, BITS) * x[None, :]
            next_k = k0 + BLOCK_K
            w = tl.load(w_ptrs + next_k, mask=n_mask[:, None] & (offs_k[None, :] < K - next_k), other=0.0)
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        if BITS:
            s = s * 1.329227995784916e36  # 2^120: the bit move's exponent offset
        tl.store(y_ptr + offs_n, (tl.sum(acc, 1) * s).to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_w, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_c = tl.arange(0, 16)
        n_mask = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # the row as column 0 of a [BLOCK_K, 16] tile, the other columns zero
            xt = tl.load(x_ptr + k0 + offs_k[:, None] + offs_c[None, :] * 0,
                         mask=(offs_c[None, :] == 0) & (offs_k[:, None] < K - k0), other=0.0).to(tl.bfloat16)
            acc = tl.dot(_to_bf16(w, BITS), xt, acc)
            next_k = k0 + BLOCK_K
            w = tl.load(w_ptrs + next_k, mask=n_mask[:, None] & (offs_k[None, :] < K - next_k), other=0.0)
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        if BITS:
            s = s * 1.329227995784916e36
        tl.store(y_ptr + offs_n, (tl.sum(acc, 1) * s).to(y_ptr.dtype.element_ty), mask=n_mask)


def variants() -> dict[str, partial]:
    out = {"served": None}
    for kind in ("acc2d-cast", "acc2d-bits"):
        for cfg in LANE["acc2d-cast"]:
            out[f"{kind} bn{cfg[0]} bk{cfg[1]} w{cfg[2]}"] = partial(gemv_candidate, kind=kind, cfg=cfg)
    for kind in ("dot-cast", "dot-bits"):
        for cfg in LANE["dot"]:
            out[f"{kind} bn{cfg[0]} bk{cfg[1]} w{cfg[2]}"] = partial(gemv_candidate, kind=kind, cfg=cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--shapes", default="1b,8b")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("needs a CUDA GPU and triton")
    device = torch.device("cuda")
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

        def chain(project, x=x0):
            for lw in weights:
                for q, s in lw:
                    x = project(x[:, : q.shape[1]], q, s)
            return x

        served = lambda x, q, s: gemv_triton(x, q, scale=s)  # noqa: E731
        with torch.inference_mode():
            # bf16 weights through the served GEMV, 2 layers repeated to the same count: the reference speed
            def chain_bf16(x=x0):
                for i in range(layers):
                    for w in bf16[i % 2]:
                        x = gemv_triton(x[:, : w.shape[1]], w)
                return x
            ms = graph_ms([chain_bf16], stream, args.replays, warmup=2)
            rows.append({"shape": shape, "variant": "bf16 served (2 layers' weights cycled)", "us_per_layer": ms * 1000 / layers,
                         "of_floor": floor_us * 2 / (ms * 1000 / layers)})
            for name, fn in variants().items():
                project = served if fn is None else fn
                try:
                    errs = []
                    for q, s in weights[0]:
                        x = x0[:, : q.shape[1]]
                        ref = x.float() @ fp8.dequantize_rows(q, s).t()
                        errs.append(((project(x, q, s).float() - ref).norm() / ref.norm()).item())
                    ms = graph_ms([partial(chain, project)], stream, args.replays, warmup=2)
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
