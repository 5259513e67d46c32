"""The graphed decode step at a closed loop's own contexts, measured in the same invocation as the loop:
what the engine could reach if every step were one decode step of all its streams.

A closed loop of S streams with P prompt and O output tokens decodes, at steady state, rows whose
contexts spread over P .. P + O - 2 (the first token comes from the prefill). The step's time grows
with the context its attention reads, so the step of S rows (captured as a CUDA graph on a GPU, eager
on a CPU) is timed with every row at the lowest, middle and highest of those contexts, and averaged
over the request's life (trapezoid rule). serve_bench reports efficiency = the loop's tokens/s /
(S / that step time). The weights are random (the step's time does not depend on their values), in
the server's dtype, quantization and KV cache dtype (read from --server-args).
"""

from __future__ import annotations

import argparse
import gc
import shlex
from typing import Any

import torch

from bench.common import time_ms
from bench.decode_bench import load, make_step
from cache_manager import CudaGraphBackend
from service.model.builtin import BUILTIN_PREFIX


def contexts(prompt_tokens: int, output_tokens: int) -> list[int]:
    """The lowest, middle and highest context a decode row of this workload has."""
    low, high = prompt_tokens, prompt_tokens + max(output_tokens - 2, 0)
    return sorted({low, (low + high) // 2, high})


def life_mean(ms_by_context: dict[int, float]) -> float:
    """The step's mean over contexts evenly spaced through the request's life (trapezoid rule)."""
    values = [ms_by_context[c] for c in sorted(ms_by_context)]
    if len(values) == 1:
        return values[0]
    inner = sum(values[1:-1])
    return (values[0] / 2 + inner + values[-1] / 2) / (len(values) - 1)


def server_model_args(args: argparse.Namespace) -> argparse.Namespace:
    """decode_bench's model flags for what the server ran."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--quantization", default="none")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch-invariant", action="store_true")
    served, _ = p.parse_known_args(shlex.split(args.server_args))
    return argparse.Namespace(model=args.model, cache_dir=args.cache_dir, device=torch.device(args.device),
                              dtype=getattr(torch, args.dtype), random_init=args.model.startswith(BUILTIN_PREFIX),
                              quantization=served.quantization, kv_cache_dtype=served.kv_cache_dtype,
                              batch_invariant=served.batch_invariant, without="")


def measure(args: argparse.Namespace, batches: list[int], iters: int = 30, warmup: int = 5) -> dict[str, Any]:
    """Per batch: the step's ms at each context, its life mean and the tokens/s it allows."""
    model_args = server_model_args(args)
    setup = load(model_args)
    points = contexts(args.prompt_tokens, args.output_tokens)
    step = make_step(setup, max(batches), max(points))
    graphed = setup.device.type == "cuda"
    rows = []
    for batch in batches:
        tokens = torch.randint(0, setup.model.spec.vocab_size, (batch,)).tolist()
        step.write_rows(tokens, [points[0]] * batch, list(range(batch)))
        step.set_padding_rows(batch, step.max_batch)
        backend = CudaGraphBackend(setup.device) if graphed else None
        graph = backend.capture(step, batch) if backend else None
        run = graph.replay if graph else (lambda b=batch: step.run(b))
        by_context = {}
        for context in points:
            step.write_rows(tokens, [context] * batch, list(range(batch)))
            by_context[context] = time_ms(run, setup.device, iters, warmup)
        if graph:
            backend.release(graph)
        mean = life_mean(by_context)
        rows.append({"batch": batch, "step_ms_by_context": {str(c): ms for c, ms in by_context.items()},
                     "step_ms": mean, "allows_tok_per_s": batch / mean * 1000.0})
    step = setup = None  # the model and its KV cache go before the device cache is emptied
    gc.collect()
    if graphed:
        torch.cuda.empty_cache()
    return {"mode": "cuda graph" if graphed else "eager", "contexts": points,
            "model": {k: str(v) for k, v in vars(model_args).items()}, "rows": rows}
