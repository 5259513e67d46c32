"""Tensor-parallel decode-step benchmark: ms per decode step at TP=1 and TP=N, eager and graphed.

For each TP size it starts one process per rank (rank r on cuda:r; gloo on a CPU), builds that
rank's shards of the model with random weights on the device (--random-init: no checkpoint), fills
the KV cache to --context, and times the decode step of every batch size: eager, and captured as a
CUDA graph on every rank at once (the all-reduces inside the graph). It also times one all-reduce
of [batch, hidden] inside a graph, with NCCL and with torch's symmetric-memory one-shot kernel, and
(--all-reduce symm) the whole graphed step with the symmetric-memory all-reduce. Rank 0's numbers
are reported; `vs_tp1` is the step time over TP=1's at the same batch.

    python bench/tp_decode_bench.py --model builtin:llama-8b --tp-sizes 1,2 --batches 1,64
    python bench/tp_decode_bench.py --model builtin:tiny --device cpu --tp-sizes 1,2 --batches 1,4 --context 16
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import pathlib
import socket
import sys
import traceback
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_ms, write_result
from bench.decode_bench import _random_init, fill_kv
from service.engine.decode_step import ModelDecodeStep
from service.model import KVCache
from service.model.builtin import BUILTIN_SHAPES

_REDUCES_PER_GRAPH = 64  # all-reduces captured in one graph, to time one without launch overhead


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-8b", help="builtin:<name> (random weights on the device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=512, help="positions already in every KV slot")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--all-reduce", choices=["nccl", "symm", "both"], default="both",
                   help="the all-reduce of the graphed step (both: time the step with each)")
    args = p.parse_args(argv)
    if not args.model.startswith("builtin:"):
        raise SystemExit("--model must be builtin:<name>: weights are random, made on each rank's device")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.tp_list = [int(t) for t in args.tp_sizes.split(",") if t.strip()]
    args.batch_list = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    return args


def _reduce_us(tp: Any, batch: int, hidden: int, dtype: torch.dtype, device: torch.device,
               args: argparse.Namespace) -> float:
    """Microseconds of one all-reduce of [batch, hidden] captured in a graph (64 per replay)."""
    x = torch.ones(batch, hidden, dtype=dtype, device=device)
    for _ in range(3):
        tp.all_reduce(x.clone())
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(_REDUCES_PER_GRAPH):
            y = tp.all_reduce(y.clone())
    return time_ms(graph.replay, device, args.iters, args.warmup) * 1000.0 / _REDUCES_PER_GRAPH


def _time_step(tp: Any, args: argparse.Namespace, device: torch.device, reducer_name: str) -> list[dict]:
    from cache_manager import CudaGraphBackend

    dtype = getattr(torch, args.dtype)
    model, _ = _random_init(args.model.removeprefix("builtin:"), device, dtype, tp)
    spec = model.spec  # this rank's share
    max_batch = max(args.batch_list)
    kv = KVCache(spec, max_batch, args.context + 64, device, dtype)
    fill_kv(kv, args.context)
    step = ModelDecodeStep(model, kv, max_batch, device)
    rows = []
    for batch in args.batch_list:
        step.write_rows([7 + i for i in range(batch)], [args.context] * batch, list(range(batch)))
        row: dict[str, Any] = {"tp": tp.world_size, "all_reduce": reducer_name, "batch": batch}
        row["eager_ms"] = time_ms(lambda b=batch: step.run(b), device, args.iters, args.warmup)
        if device.type == "cuda":
            backend = CudaGraphBackend(device)
            graph = backend.capture(step, batch)  # every rank captures the same size at once
            row["graph_ms"] = time_ms(graph.replay, device, args.iters, args.warmup)
            row["graph_mib"] = graph.nbytes / 2**20
            backend.release(graph)
            if tp.world_size > 1:
                try:
                    row["reduce_us"] = _reduce_us(tp, batch, spec.hidden_size, dtype, device, args)
                except Exception as exc:  # noqa: BLE001 - recorded; the other numbers stand
                    row["reduce_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    from service.engine.ranks import join_group, rank_device
    from service.model.parallel import SymmetricMemoryAllReduce

    try:
        device = rank_device(torch.device(args.device), rank)
        tp, _ = join_group(rank, world, port, device)
        rows = _time_step(tp, args, device, "nccl" if device.type == "cuda" else "gloo")
        if world > 1 and device.type == "cuda" and args.all_reduce in ("symm", "both"):
            try:
                hidden = BUILTIN_SHAPES[args.model.removeprefix("builtin:")]["hidden_size"]
                symm = SymmetricMemoryAllReduce(max(args.batch_list), hidden, getattr(torch, args.dtype), device,
                                                tp.group)
                rows += _time_step(dataclasses.replace(tp, reducer=symm), args, device, "symm")
            except Exception as exc:  # noqa: BLE001 - e.g. no NVLink, an older torch
                rows.append({"tp": world, "all_reduce": "symm", "error": f"{type(exc).__name__}: {exc}"})
        if rank == 0:
            out.put(("ok", rows))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        out.put(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
        raise


def run_tp(world: int, args: argparse.Namespace) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    status, payload = out.get(timeout=1800)
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise SystemExit(f"TP={world} failed: {payload}")
    return payload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [row for world in args.tp_list for row in run_tp(world, args)]
    base = {r["batch"]: r for r in rows if r["tp"] == 1 and "error" not in r}
    for r in rows:
        ref = base.get(r.get("batch"))
        for key in ("eager_ms", "graph_ms"):
            if ref is not None and r.get(key) and ref.get(key):
                r[f"{key.removesuffix('_ms')}_vs_tp1"] = r[key] / ref[key]
    print_table(rows, ["tp", "all_reduce", "batch", "eager_ms", "graph_ms", "graph_vs_tp1", "eager_vs_tp1",
                       "reduce_us", "error"],
                title=f"{args.model} {args.dtype} decode step, context {args.context} ({args.device})")
    targets = {1: 0.6, 64: 0.65}  # issue 16: TP=2 graphed step over TP=1
    verdicts = [
        {"batch": r["batch"], "all_reduce": r["all_reduce"], "graph_vs_tp1": r["graph_vs_tp1"],
         "target": targets[r["batch"]], "met": r["graph_vs_tp1"] <= targets[r["batch"]]}
        for r in rows if r["tp"] == 2 and r.get("batch") in targets and r.get("graph_vs_tp1")
    ]
    if verdicts:
        print_table(verdicts, ["batch", "all_reduce", "graph_vs_tp1", "target", "met"], title="targets (TP=2)")
    path = write_result("tp-decode", {"args": {k: v for k, v in vars(args).items() if k not in ("tp_list",)},
                                      "rows": rows, "targets": verdicts}, args.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
