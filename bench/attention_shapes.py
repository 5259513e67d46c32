"""What a prompt of a new length costs prefill attention: the first call of
`scaled_dot_product_attention(is_causal=True)` at each new (batch, length) shape, per SDPA backend set.

Each new prompt length is a new shape. A backend that builds a plan per shape (cuDNN) pays that on
the engine thread in the step that carries the prompt, while every stream waits; one that does not
(flash, memory-efficient) pays nothing. Prints first-call and repeat ms per backend set.

    python bench/attention_shapes.py --device cuda
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table, write_result

SETS = {
    "default": None,
    "flash+efficient": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", type=int, default=12, help="new (batch, length) shapes per backend set")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for offset, (name, backends) in enumerate(SETS.items()):
        rng = random.Random(offset)  # different shapes per set: every first call is a new shape
        first, again = [], []
        for _ in range(args.shapes):
            b, length = rng.randint(1, 3), rng.randint(20, 1500)
            q, k, v = (torch.randn(b, args.heads, length, args.head_dim, device=device, dtype=torch.bfloat16)
                       for _ in range(3))
            for out in (first, again):
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                try:
                    if backends is None:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    else:
                        with sdpa_kernel(backends):
                            F.scaled_dot_product_attention(q, k, v, is_causal=True)
                except RuntimeError as exc:  # a backend this build or device lacks
                    rows.append({"backends": name, "error": str(exc)[:120]})
                    break
                torch.cuda.synchronize(device)
                out.append((time.perf_counter() - started) * 1000.0)
        if first:
            rows.append({"backends": name, "shapes": len(first), "first_p50_ms": percentile(first, 50),
                         "first_max_ms": max(first), "again_p50_ms": percentile(again, 50)})
    path = write_result("attention-shapes", {"rows": rows, "heads": args.heads, "head_dim": args.head_dim},
                        device=args.device)
    print_table(rows, ["backends", "shapes", "first_p50_ms", "first_max_ms", "again_p50_ms", "error"],
                title="\nprefill attention, first call per new shape (bf16, causal)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
