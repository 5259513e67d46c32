"""A/B of the plain closed loop (greedy, no sampling fields) between two source trees, alternating,
so that host noise hits both: `python3 bench/ab_plain_loop.py TREE_A TREE_B` (each a directory
holding service/ and cache_manager/, e.g. `git archive <commit> service cache_manager`)."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from service.llm import LLM, SamplingParams
with LLM(model="builtin:llama-1b", model_cache_dir=".cache/models", device="cuda", dtype="bfloat16") as llm:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, llm.vocab_size, (32,), generator=gen).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts, params)
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        print(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0), flush=True)
"""


def main() -> int:
    trees, results = sys.argv[1:3], {}
    for _ in range(2):  # A B A B
        for tree in trees:
            out = subprocess.run([sys.executable, "-c", CHILD, tree, "3"], capture_output=True, text=True, timeout=200)
            results.setdefault(tree, []).extend(float(x) for x in out.stdout.split())
            if out.returncode:
                print(out.stderr[-2000:])
    print(json.dumps({t: {"tokens_per_s": [round(v) for v in vs], "best": round(max(vs)) if vs else None}
                      for t, vs in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
