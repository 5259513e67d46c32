"""Greedy text with CUDA graphs against eager, one prompt at a time: how many of N prompts give the
same tokens (bf16 by default, where rounding may differ between a captured and an eager kernel),
and the first differing position of each that does not.

    python3 bench/graph_parity.py --model builtin:llama-1b --cache-dir .cache/models --prompts 8 --tokens 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import print_table, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-1b")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    from service.llm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    common = dict(model_cache_dir=args.cache_dir, device=args.device, dtype=args.dtype)
    runs = {}
    for mode in ("full_and_piecewise", "none"):
        with LLM(args.model, cudagraph_mode=mode, **common) as llm:
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, llm.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
                       for _ in range(args.prompts)]
            llm.generate(prompts[:1], params)  # the first sizes captured before the compared runs
            runs[mode] = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    rows = []
    for i, (graphed, eager) in enumerate(zip(runs["full_and_piecewise"], runs["none"])):
        first = next((j for j, (a, b) in enumerate(zip(graphed, eager)) if a != b), None)
        rows.append({"prompt": i, "identical": graphed == eager, "first_difference": first})
    same = sum(r["identical"] for r in rows)
    print_table(rows, ["prompt", "identical", "first_difference"],
                title=f"greedy, graphs vs eager, one prompt at a time: {same} of {len(rows)} identical")
    print(write_result("graph-parity", {"rows": rows, "identical": same, "args": vars(args)}, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
