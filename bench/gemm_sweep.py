"""Decode-sized GEMMs: cuBLAS against Triton kernels that read the weight in one pass, per weight shape and M.

At decode a linear layer's M is the batch and its cost is reading the weight once; on an H200 the
1B shape's qkv and o_proj run at ~2 TB/s under cuBLAS and down_proj is split-K plus a reduce kernel
(bench/NOTES.md, "Decode kernel budget"). This sweep asks whether a kernel of ours does better:

- a GEMV on the CUDA cores for M <= 4 (each program reads BLOCK_N whole weight rows in BLOCK_K-wide
  loads and multiplies the M rows of x into them: no tensor-core tile padding M to 16);
- the tensor-core matmul of service.model.kernels.matmul (the batch-invariant mode's) with tiles
  for small M (BLOCK_M 16/32/64, narrow BLOCK_N, long BLOCK_K), no split-K.

Every configuration is checked against a float32 GEMM first, then timed as served: a CUDA graph of
calls over copies of the weight that together exceed L2 (a weight read from L2 would flatter the
small ones), replayed; microseconds per call. Prints one row per (shape, M) and writes JSON.

    python bench/gemm_sweep.py                          # the Llama-3.2-1B decode shapes, bf16
    python bench/gemm_sweep.py --shapes 3072x4096,4096x2048,14336x4096,4096x7168,64128x4096  # 8B, one rank of TP=2
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, kernel_bench_device, print_table, write_result
from service.model.kernels._triton import next_pow2, tl, triton
from service.model.kernels.matmul import MatmulConfig, matmul_triton

ONE_B_SHAPES = "3072x2048,2048x2048,16384x2048,2048x8192,128256x2048"  # qkv, o, gate_up, down, head
WEIGHT_BYTES_TIMED = 256 << 20  # copies of a weight per timed graph: several times an H200's 50 MB L2


@dataclass(frozen=True)
class GemvConfig:
    """The CUDA-core kernel: `rows` (>= M) rows of x against BLOCK_N weight rows a program."""

    rows: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


Tile = MatmulConfig | GemvConfig


def candidates(m: int) -> list[Tile]:
    """GEMV for M <= 4: narrow BLOCK_N (many programs even for a 2048-row weight), wide BLOCK_K (many
    loads in flight a thread). Tensor-core tiles: BLOCK_M covering M (16 is tl.dot's least)."""
    bm = max(16, next_pow2(m))
    gemv = []
    if m <= 4:
        gemv = [GemvConfig(next_pow2(m), bn, bk, warps, stages)
                for bn, bk, warps, stages in ((4, 1024, 4, 2), (8, 512, 4, 3), (8, 1024, 4, 2), (16, 512, 8, 2),
                                              (8, 2048, 8, 1))]
    if bm == 16:
        return gemv + [MatmulConfig(16, 16, 256, 4, 4), MatmulConfig(16, 16, 512, 4, 3),
                       MatmulConfig(16, 16, 1024, 4, 2), MatmulConfig(16, 32, 256, 4, 4),
                       MatmulConfig(16, 32, 512, 8, 3), MatmulConfig(16, 64, 128, 4, 4), MatmulConfig(16, 64, 256, 8, 3)]
    return [MatmulConfig(bm, 32, 128, 4, 4), MatmulConfig(bm, 64, 128, 4, 3), MatmulConfig(bm, 32, 256, 8, 3)]


def run_tile(x: torch.Tensor, w: torch.Tensor, tile: Tile) -> torch.Tensor:
    if isinstance(tile, MatmulConfig):
        return matmul_triton(x, w, None, tile)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        ROWS=tile.rows, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return y


def check(x: torch.Tensor, w: torch.Tensor, tile: Tile) -> None:
    ref = F.linear(x.float(), w.float())
    err = (run_tile(x, w, tile).float() - ref).abs().max().item()
    if not err <= 2e-2 * (ref.abs().max().item() + 1e-6):
        raise AssertionError(f"{tile}: max abs diff {err:.3g}")


def graph_us(calls: list, stream: torch.cuda.Stream, replays: int) -> float:
    """Microseconds per call, from CUDA-graph replays of all the calls (no launch gaps, as served)."""
    return graph_ms(calls, stream, replays) * 1000.0 / len(calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=ONE_B_SHAPES, help="weights NxK, comma-separated")
    p.add_argument("--m", default="1,2,4,8,16,32,64", help="rows of x (the decode batch)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args(argv)
    device, dtype = kernel_bench_device(), getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s.strip()]
    ms = [int(m) for m in args.m.split(",") if m.strip()]
    gen = torch.Generator(device).manual_seed(0)
    stream = torch.cuda.Stream(device)
    rows = []
    with torch.inference_mode():
        for n, k in shapes:
            copies = min(64, max(1, math.ceil(WEIGHT_BYTES_TIMED / (n * k * dtype.itemsize))))
            ws = [(torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
            for m in ms:
                x = torch.randn(m, k, device=device, generator=gen).to(dtype)
                cublas = graph_us([partial(F.linear, x, w) for w in ws], stream, args.replays)
                timed = []
                for tile in candidates(m):
                    check(x, ws[0], tile)
                    timed.append((graph_us([partial(run_tile, x, w, tile) for w in ws], stream, args.replays), tile))
                best_us, best = min(timed, key=lambda t: t[0])
                gb = n * k * dtype.itemsize / 1e9
                rows.append({"shape": f"{n}x{k}", "m": m, "cublas_us": cublas, "triton_us": best_us,
                             "triton_vs_cublas": best_us / cublas, "cublas_tb_s": gb / cublas * 1e3,
                             "triton_tb_s": gb / best_us * 1e3, "best": type(best).__name__,
                             "config": asdict(best)})
            del ws
            torch.cuda.empty_cache()
    columns = ["shape", "m", "cublas_us", "triton_us", "triton_vs_cublas", "cublas_tb_s", "triton_tb_s", "best"]
    path = write_result("gemm-sweep", {"dtype": args.dtype, "rows": rows}, device=device)
    print_table(rows, columns, title=f"decode GEMMs, {args.dtype}, us per call in CUDA graphs (weights out of L2)")
    print(f"\nwrote {path}")
    return 0


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(
        x_ptr, w_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        r_mask = offs_r < M
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_r[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y_ptrs = y_ptr + offs_r[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


if __name__ == "__main__":
    raise SystemExit(main())
