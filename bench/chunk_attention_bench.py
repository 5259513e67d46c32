"""Prompt-chunk attention of one layer over the paged KV cache, per step shape.

The shapes a serving step carries: fresh prompts (start 0) of one or mixed lengths, and prefix-cache
hits (a chunk of the prompt's own tokens after a cached prefix). For each: the Triton chunk kernel
(every chunk of the step in one launch, keys read through the block table), the torch path (one
SDPA call per chunk over keys gathered through the table: the CPU path, and on the GPU what hits
ran before the kernel), and for fresh prompts a padded batch through flash SDPA (what fresh
prompts ran before). Device ms per call (CUDA events, median), the 1B shape's heads by default.

    python bench/chunk_attention_bench.py --device cuda
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_ms, write_result
from service.model.kernels.prefill_attention import chunk_tiles, prefill_attention_torch, prefill_attention_triton

# name -> chunks (start, length)
CASES = {
    "1 x 2048 fresh": [(0, 2048)],
    "4 x 512 fresh": [(0, 512)] * 4,
    "16 x 128 fresh": [(0, 128)] * 16,
    "7 fresh, 90-400": [(0, n) for n in (90, 130, 170, 220, 270, 330, 400)],
    "1 hit: 1024 + 270": [(1024, 270)],
    "7 hits: 1024 + 90-400": [(1024, n) for n in (90, 130, 170, 220, 270, 330, 400)],
    "1 chunk: 3584 + 512": [(3584, 512)],
}


def case(name: str, chunks: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, bs: int,
         device: torch.device, iters: int) -> dict:
    dtype = torch.bfloat16
    per_seq = -(-max(s + n for s, n in chunks) // bs)
    num_blocks = 1 + len(chunks) * per_seq
    k = torch.randn(num_blocks, kv_heads, bs, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    table = (1 + torch.randperm(num_blocks - 1, device=device)).view(len(chunks), per_seq).to(torch.int32)
    first = list(itertools.accumulate((n for _, n in chunks), initial=0))
    spec = [(row, n, start, slot) for slot, (row, (start, n)) in enumerate(zip(first, chunks))]
    q = torch.randn(first[-1], heads, head_dim, device=device, dtype=dtype)
    out = torch.zeros(first[-1], heads * head_dim, device=device, dtype=dtype)
    chunk_t = torch.tensor([x for c in spec for x in c], device=device).view(-1, 4)
    tiles = torch.tensor(chunk_tiles([n for _, n in chunks]), device=device).view(-1, 2)
    row = {
        "case": name, "tokens": first[-1],
        "triton_ms": time_ms(lambda: prefill_attention_triton(q, k, v, table, chunk_t, tiles, out), device, iters),
        "torch_ms": time_ms(lambda: prefill_attention_torch(q, k, v, table, spec, out), device, iters),
    }
    if all(s == 0 for s, _ in chunks):  # fresh prompts: a padded batch through flash SDPA
        longest = max(n for _, n in chunks)
        qb = torch.randn(len(chunks), heads, longest, head_dim, device=device, dtype=dtype)
        kb = torch.randn(len(chunks), heads, longest, head_dim, device=device, dtype=dtype)

        def flash() -> None:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                F.scaled_dot_product_attention(qb, kb, kb, is_causal=True)

        row["flash_batched_ms"] = time_ms(flash, device, iters)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--heads", default="32,8,64", help="query heads, kv heads, head dim")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    device = torch.device(args.device)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    rows = [case(name, chunks, heads, kv_heads, head_dim, args.block_size, device, args.iters)
            for name, chunks in CASES.items()]
    print_table(rows, ["case", "tokens", "triton_ms", "torch_ms", "flash_batched_ms"],
                title=f"chunk attention, one layer, heads {args.heads}, block {args.block_size} (device ms)")
    path = write_result("chunk-attention", {"heads": args.heads, "block_size": args.block_size, "rows": rows}, device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
