"""Prefill benchmark: a step of prompts as piecewise CUDA graphs vs our eager forward vs transformers.

For each case (prompts x tokens), one engine step that prefills the prompts from position 0:
- eager: `forward_step` (the pieces run eagerly, attention between them), as steps ran before;
- piecewise: the pieces of that token count captured with cache_manager's CudaGraphBackend and
  replayed with eager attention between them, plus the LM head on the sampled rows;
- transformers: its LlamaForCausalLM forward over the same prompts (no cache), for reference.
Milliseconds per step (device time, CUDA events, median), the speed-up, capture time and bytes.

    python bench/prefill_bench.py --model builtin:llama-1b --device cuda --random-init
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import add_model_arguments, print_table, time_ms, write_result
from bench.decode_bench import hf_model, load
from cache_manager import CudaGraphBackend
from service.engine.piecewise_step import PiecewiseStep
from service.model import KVCache
from service.model.pieces import PiecewiseForward
from service.model.step_batch import ChunkSpec, build_step_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--cases", default="1x128,16x128,1x2048,1x16,4x512", help="PROMPTSxTOKENS,...")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-transformers", dest="transformers", action="store_false")
    p.add_argument("--batch-invariant", action="store_true", help="the model's batch-invariant mode")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    args.case_list = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    s = load(args)
    model, device = s.model, args.device
    max_prompts = max(b for b, _ in args.case_list)
    max_tokens = max(b * n for b, n in args.case_list)
    kv = KVCache(model.spec, max_prompts, max(n for _, n in args.case_list) + 8, device, args.dtype)
    step = PiecewiseStep(PiecewiseForward(model, kv), kv, max_tokens, device)
    backend = CudaGraphBackend(device)
    hf = hf_model(s) if args.transformers else None
    vocab = model.spec.vocab_size
    def case(prompts: int, tokens: int) -> dict[str, Any]:
        total = prompts * tokens
        ids = torch.randint(0, vocab, (total,)).tolist()
        batch = build_step_batch([], [], [ChunkSpec(i, 0, tokens) for i in range(prompts)], ids, kv.max_seq_len,
                                 kv.scratch_slot, device)
        row: dict[str, Any] = {"prompts": prompts, "tokens": tokens}
        with torch.inference_mode():
            row["eager_ms"] = time_ms(lambda: model.forward_step(batch, kv), device, args.iters, 3)
            step.write(batch)
            graph = backend.capture(step, total)
            row["capture_ms"], row["graph_mib"] = graph.capture_ms, graph.nbytes / 2**20

            def replay() -> torch.Tensor:
                step.write(batch)
                return model.logits(graph.replay()[batch.sample_rows])

            got, want = replay(), model.forward_step(batch, kv)
            row["max_rel_err"] = float((got.float() - want.float()).norm() / want.float().norm())
            row["piecewise_ms"] = time_ms(replay, device, args.iters, 3)
            backend.release(graph)
            if hf is not None:
                hf_ids = torch.tensor(ids, device=device).view(prompts, tokens)
                row["transformers_ms"] = time_ms(lambda: hf(hf_ids, use_cache=False), device, args.iters, 3)
        row["speedup"] = row["eager_ms"] / row["piecewise_ms"]
        print_table([row], list(row))
        return row

    rows = [case(prompts, tokens) for prompts, tokens in args.case_list]
    columns = ["prompts", "tokens", "eager_ms", "piecewise_ms", "speedup", "transformers_ms", "capture_ms",
               "graph_mib", "max_rel_err"]
    print_table(rows, columns, title=f"prefill step, {args.model} {args.dtype}")
    path = write_result("prefill-invariant" if args.batch_invariant else "prefill",
                        {"batch_invariant": args.batch_invariant, "rows": rows}, device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
