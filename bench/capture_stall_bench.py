"""Capture-stall benchmark: what graph captures, evictions and the old capture path cost serving steps.

A serving loop decodes `--batch` rows step after step through the GraphCache (write the inputs,
run, sample greedily, read the tokens back: one host sync per step, as the engine does). Each
scenario reports the wall time of every step; the *stall* is a step's time minus the median step
of the quiet baseline. Scenarios:

- baseline: the batch's graph captured, nothing else happening.
- operator: every other allowed size is captured by the capture thread while the loop runs.
- lazy: the loop's batch size moves through every allowed size on a cold cache, so each new size
  asks for its own capture (served padded or eager meanwhile).
- churn: as lazy, under a budget of about three graphs: captures and evictions all the time.
- old_path: the capture as it was before it moved beside serving, on the serving thread: warm-up,
  gc.collect(), torch.cuda.empty_cache(), torch.cuda.graph(). Its parts are timed one by one.

Also the engine-thread time per capture (the `graphserve_graph_capture_stall_seconds` samples).

    python bench/capture_stall_bench.py --model builtin:llama-1b --device cuda --random-init
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import add_model_arguments, percentile, print_table, write_result
from bench.decode_bench import load, make_step
from cache_manager import EngineHooks, Fingerprint, GraphCache, GraphCacheConfig, default_capture_sizes
from service.engine_client.gil import shorten_switch_interval


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="rows of the steady loop (baseline, operator)")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--baseline-steps", type=int, default=300)
    p.add_argument("--steps-per-size", type=int, default=20, help="lazy and churn: steps at each size")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    args.anchors = False
    return args


class Loop:
    """The serving loop: one decode step per call, with the engine's one host sync."""

    def __init__(self, cache: GraphCache, step: Any, vocab: int, context: int) -> None:
        self.cache, self.step, self.vocab, self.context = cache, step, vocab, context
        self.tokens: dict[int, list[int]] = {}
        # As the runner reads tokens back: a pinned copy and an event wait, which releases the GIL
        # (a blocking .tolist() would hold it and starve the capture thread).
        self.host = torch.zeros(step.max_batch, dtype=torch.long, pin_memory=True)
        self.ready = torch.cuda.Event()

    def __call__(self, n: int) -> float:
        t0 = time.perf_counter()
        self.cache.poll()
        tokens = self.tokens.get(n) or [1] * n
        self.step.write_rows(tokens, [self.context] * n, list(range(n)))
        self.host[:n].copy_(self.cache.run(n).argmax(dim=-1), non_blocking=True)
        self.ready.record()
        self.ready.synchronize()
        self.tokens[n] = self.host[:n].tolist()
        return (time.perf_counter() - t0) * 1000.0


def summarize(name: str, samples: list[float], base_ms: float, stalls: list[float], **extra: Any) -> dict:
    over = [max(0.0, s - base_ms) for s in samples]
    return {
        "scenario": name, "steps": len(samples), "step_p50_ms": statistics.median(samples),
        "step_p99_ms": percentile(samples, 99), "step_max_ms": max(samples),
        "stall_p99_ms": percentile(over, 99), "stall_max_ms": max(over),
        "engine_thread_max_ms": max(stalls) * 1000.0 if stalls else None,
        "engine_thread_p99_ms": percentile([s * 1000.0 for s in stalls], 99) if stalls else None,
        **extra,
    }


def old_path_parts(step: Any, size: int, device: torch.device) -> dict[str, float]:
    """The capture as it ran on the serving thread before: each part's wall milliseconds."""
    parts: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(device)
        parts[name] = (time.perf_counter() - t0) * 1000.0
        return out

    stream = torch.cuda.Stream(device)
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        def warm() -> None:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step.run(size)
        timed("warmup_ms", warm)
        timed("gc_collect_ms", gc.collect)
        timed("empty_cache_ms", torch.cuda.empty_cache)

        def record() -> None:
            with torch.cuda.graph(graph, pool=pool, stream=stream):  # itself collects and empties again
                step.run(size)
        timed("torch_cuda_graph_ms", record)
        timed("measure_ms", lambda: (torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)))
    parts["total_ms"] = sum(parts.values())
    graph.reset()
    return parts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shorten_switch_interval()  # as the engine process does: a waiting thread gets the GIL within 0.5 ms
    s = load(args)
    step = make_step(s, args.max_batch, args.context)
    # The serving process freezes its long-lived objects after load (ModelRunner.warmup); so do we.
    gc.collect()
    gc.freeze()
    sizes = default_capture_sizes(args.max_batch)
    fp = Fingerprint(args.model, str(args.dtype), torch.cuda.get_device_name(args.device), torch.__version__,
                     sizes, args.max_batch)
    vocab = s.model.spec.vocab_size

    def new_cache(budget: Any = "20GiB") -> tuple[GraphCache, list[float]]:
        stalls: list[float] = []
        cfg = GraphCacheConfig("full", sizes, args.max_batch, memory_budget=budget, warm_start=False)
        return GraphCache(step, cfg, args.device, fp, hooks=EngineHooks(capture_stall=stalls.append)), stalls

    rows: list[dict] = []
    # baseline and operator: the steady batch, quiet and then with every other size captured beside it
    cache, stalls = new_cache()
    cache.capture([cache.descriptor(args.batch).padded_size])
    loop = Loop(cache, step, vocab, args.context)
    for _ in range(20):
        loop(args.batch)
    base = [loop(args.batch) for _ in range(args.baseline_steps)]
    base_ms = statistics.median(base)
    rows.append(summarize("baseline", base, base_ms, []))
    stalls.clear()
    pending = cache.capture_async([x for x in sizes if x != cache.descriptor(args.batch).padded_size])
    during: list[float] = []
    t0 = time.perf_counter()
    while not pending.done():
        during.append(loop(args.batch))
    capture_s = time.perf_counter() - t0
    rows.append(summarize("operator", during, base_ms, stalls, captures=len(sizes) - 1,
                          capture_wall_s=round(capture_s, 2)))
    bytes_by_size = {b.size: b.bytes for b in cache.snapshot().buckets}
    cache.close()

    # lazy: cold cache, the batch moves through every size (smallest first, as a ramp does)
    cache, stalls = new_cache()
    loop = Loop(cache, step, vocab, args.context)
    lazy = [loop(n) for n in sizes for _ in range(args.steps_per_size)]
    cache.wait_idle()
    snap = cache.snapshot()
    rows.append(summarize("lazy", lazy, base_ms, stalls, captures=sum(b.since_start.captures for b in snap.buckets)))
    cache.close()

    # churn: three graphs' worth of budget while the size moves back and forth
    big = sorted(bytes_by_size.values())[-3:]
    cache, stalls = new_cache(budget=sum(big))
    loop = Loop(cache, step, vocab, args.context)
    order = [n for n in sizes if n >= 8]
    churn = [loop(n) for _ in range(3) for n in order + order[::-1] for _ in range(args.steps_per_size // 2)]
    cache.wait_idle()
    snap = cache.snapshot()
    rows.append(summarize("churn", churn, base_ms, stalls, budget_bytes=sum(big),
                          captures=sum(b.since_start.captures for b in snap.buckets),
                          evictions=sum(b.since_start.evictions for b in snap.buckets)))
    cache.close()

    # the old path, on the serving thread, for the batch's bucket
    parts = old_path_parts(step, cache.descriptor(args.batch).padded_size, args.device)
    rows.append({"scenario": "old_path", "stall_max_ms": parts["total_ms"], **parts})

    print_table(rows, ["scenario", "steps", "step_p50_ms", "step_p99_ms", "step_max_ms", "stall_p99_ms",
                       "stall_max_ms", "engine_thread_p99_ms", "engine_thread_max_ms", "captures", "evictions"],
                title=f"capture stalls, batch {args.batch}, {args.model} {args.dtype}")
    print_table([parts], list(parts), title="old capture path on the serving thread (ms)")
    path = write_result("capture-stall", {"batch": args.batch, "context": args.context, "rows": rows,
                                          "graph_bytes": bytes_by_size}, args.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
