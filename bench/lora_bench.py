"""LoRA benchmark: the decode step with adapters against the base step, and the engine stall of loading
an adapter while streams run.

`step`: for each batch, ms per decode step of the base step and of the LoRA step with every row on
an adapter (rows spread over the slots), for both LoRA kernels ("stacked": one GEMM against every
slot, masked; "gather": per-row gathered A/B and bmm), graphed on CUDA (eager on a CPU), and the
ratio to base (target <= 1.25 on an H200).
`load`: an in-process engine serves `--streams` greedy streams; meanwhile an adapter is read (off the
engine thread), registered (Engine.call, between steps) and used by one new stream (its slot copy
happens at admission). Reports the step gaps before and during the load (target: no gap more than
5 ms above the usual).

    python bench/lora_bench.py --model builtin:llama-1b --device cuda --random-init
    python bench/lora_bench.py --model builtin:tiny --device cpu --batches 1,4 --streams 4 --no-load
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table, time_ms, write_result
from bench.decode_bench import _random_init
from cache_manager import CudaGraphBackend
from service.engine.decode_step import LoraDecodeStep, ModelDecodeStep
from service.model import KVCache, ensure_builtin
from service.model.builtin import BUILTIN_PREFIX
from service.model.loader import default_cache_dir, load_model
from service.model.lora import FUSED, LORA_KERNELS, LoraSlots, shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:llama-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--random-init", action="store_true", help="random weights of the built-in shape (step only)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--no-load", action="store_true", help="skip the load-while-serving part")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None)
    p.add_argument("--watchdog-s", type=float, default=0.0, help="dump every thread's stack and exit after this long")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    return args


def _fill_random(lora: LoraSlots, rank: int) -> None:
    gen = torch.Generator(lora.device).manual_seed(7)
    with torch.no_grad():
        for (layer, fused), a in lora.a.items():
            b = lora.b[(layer, fused)]
            for j in range(len(FUSED[fused])):  # each sub-projection's rank block, zero-padded above `rank`
                cols = slice(j * lora.max_rank, j * lora.max_rank + rank)
                a[1:, cols].normal_(0, 0.02, generator=gen)
                b[:, 1:, cols].normal_(0, 0.02, generator=gen)


def bench_step(args: argparse.Namespace) -> list[dict]:
    if args.random_init:
        model, _ = _random_init(args.model[len(BUILTIN_PREFIX):], args.device, args.dtype)
    else:
        model = load_model(args.model, args.device, args.dtype, args.cache_dir or default_cache_dir()).model
    batch_max = max(args.batch_list)
    kv = KVCache(model.spec, batch_max, args.context + 64, args.device, args.dtype)
    base = ModelDecodeStep(model, kv, batch_max, args.device)
    lora = LoraSlots(model, args.max_loras, args.rank)
    _fill_random(lora, args.rank)
    step = LoraDecodeStep(base, lora)
    backend = CudaGraphBackend(args.device) if args.device.type == "cuda" else None
    rows = []
    with torch.inference_mode():
        for batch in args.batch_list:
            slots = [1 + i % args.max_loras for i in range(batch)]
            base.write_rows([1] * batch, [args.context] * batch, list(range(batch)), lora_slots=slots)
            row: dict = {"batch": batch}
            runs = {"base": base}
            for kernel in LORA_KERNELS:
                runs[kernel] = (kernel, step)
            for name, target in runs.items():
                if isinstance(target, tuple):
                    lora.kernel, target = target
                if backend is None:
                    row[f"{name}_ms"] = time_ms(lambda t=target, n=batch: t.run(n), args.device, args.iters, args.warmup)
                    continue
                graph = backend.capture(target, batch)
                row[f"{name}_ms"] = time_ms(graph.replay, args.device, args.iters, args.warmup)
                graph.drop()
            for kernel in LORA_KERNELS:
                row[f"{kernel}_ratio"] = row[f"{kernel}_ms"] / row["base_ms"]
            rows.append(row)
            print(row, flush=True)
    lora.kernel = "stacked"
    return rows


def write_random_adapter(path: pathlib.Path, spec: object, rank: int) -> pathlib.Path:
    """A PEFT-format adapter with random weights on all seven projections (no peft needed)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dims = shapes(spec)
    tensors = {}
    for layer in range(spec.num_layers):
        for fused, parts in FUSED.items():
            owner = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            for part in parts:
                n_in, n_out = dims[part]
                prefix = f"base_model.model.model.layers.{layer}.{owner}.{part}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank) * 0.02
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(dims), "bias": "none"}))
    return path


def bench_load(args: argparse.Namespace) -> list[dict]:
    """Two loads while --streams base streams decode: the first adapter ever (its stream is the first
    to run the LoRA path) and a second one (a LoRA stream already running). Each reports the read
    (off the engine thread), the register call (on it), the step gaps in the window from the
    register until 0.5 s after the new stream's first token, and the largest gaps with what ran."""
    from service.config import ServeConfig
    from service.engine.builder import close_engine, load_runner, new_engine
    from service.engine.request import Finish, GenerationRequest, SamplingParams, TokenDelta

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="lora-bench-"))
    if args.model.startswith(BUILTIN_PREFIX):
        ensure_builtin(args.model[len(BUILTIN_PREFIX):], args.cache_dir or default_cache_dir())
    # Production defaults: warm start on (a cold start captures the largest size of each kind, base
    # and LoRA graphs alike), so the measured window sees what a fresh server sees.
    config = ServeConfig(model=args.model, model_cache_dir=args.cache_dir, device=args.device.type,
                         dtype=str(args.dtype).removeprefix("torch."), max_running_seqs=args.streams + 2,
                         max_num_batched_tokens=max(2048, args.streams + 2), max_seq_len=2048,
                         max_loras=args.max_loras, max_lora_rank=args.rank)
    config.validate()
    lr = load_runner(config)
    steps: list[tuple[float, int, int]] = []  # (time, decode rows, prompt chunks)

    class Observer:
        def on_step(self, _running: int, _waiting: int, num_decode: int, num_prefill: int) -> None:
            steps.append((time.perf_counter(), num_decode, num_prefill))

        def on_tokens(self, *_: object) -> None: ...
        def on_finish(self, *_: object) -> None: ...
        def on_step_gap(self, *_: object) -> None: ...

    engine = new_engine(config, lr, observer=Observer())
    engine.start()
    done = threading.Semaphore(0)

    def sink(event: object) -> None:
        if isinstance(event, Finish):
            done.release()

    def request(i: int, adapter: str = "", tokens: int = 1200) -> GenerationRequest:
        return GenerationRequest(f"r{i}", [1 + i % 50] * 16,
                                 SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, seed=0),
                                 adapter=adapter, arrival_time=time.monotonic())

    for i in range(args.streams):
        engine.submit(request(i), sink)
    deadline = time.monotonic() + 60
    while len(steps) < 300:  # every stream decoding, the warm captures committed
        if engine.error is not None or time.monotonic() > deadline:
            import faulthandler

            faulthandler.dump_traceback(all_threads=True)  # where the engine stopped
            raise SystemExit(f"the engine ran {len(steps)} steps; error: {engine.error!r}")
        time.sleep(0.01)

    def load_one(name: str, index: int) -> dict:
        adapter_dir = write_random_adapter(tmp / name, lr.loaded.spec, args.rank)
        t_read = time.perf_counter()
        adapter = lr.read_adapter(name, adapter_dir)  # off the engine thread
        t_register = time.perf_counter()
        engine.call(lambda: lr.adapters.register(adapter)).result()
        t_registered = time.perf_counter()
        first = threading.Event()
        first_at: list[float] = []

        def adapter_sink(event: object) -> None:
            if isinstance(event, TokenDelta) and not first.is_set():
                first_at.append(time.perf_counter())
                first.set()
            sink(event)

        engine.submit(request(index, name, 600), adapter_sink)
        first.wait(30)
        time.sleep(0.5)
        t_end = time.perf_counter()
        before = [(b[0] - a[0]) * 1000.0 for a, b in zip(steps, steps[1:]) if b[0] < t_read][-200:]
        during = [((b[0] - a[0]) * 1000.0, b[0] - t_register, b[1], b[2])
                  for a, b in zip(steps, steps[1:]) if b[0] > t_register and a[0] < t_end]
        usual = statistics.median(before) if before else 0.0
        worst = max((g for g, *_ in during), default=0.0)
        top = sorted(during, reverse=True)[:5]
        return {"load": name, "streams": args.streams, "read_ms": (t_register - t_read) * 1000.0,
                "register_call_ms": (t_registered - t_register) * 1000.0,
                "usable_ms": ((first_at[0] if first_at else t_end) - t_register) * 1000.0,
                "step_gap_p50_before_ms": usual, "step_gap_p99_before_ms": percentile(before, 99),
                "step_gap_p99_during_ms": percentile([g for g, *_ in during], 99),
                "step_gap_max_during_ms": worst, "stall_ms": worst - usual,
                "largest_gaps": [{"gap_ms": round(g, 2), "at_ms": round(at * 1000.0, 1), "decodes": d, "chunks": c}
                                 for g, at, d, c in top]}

    results = [load_one("first", args.streams), load_one("second", args.streams + 1)]
    for r in results:
        print(r, flush=True)
    close_engine(engine, lr.graphs)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.watchdog_s:  # a hung run prints every thread's stack instead of dying silently
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    rows = bench_step(args)
    load = None if args.no_load else bench_load(args)
    summary = {"model": args.model, "dtype": str(args.dtype).removeprefix("torch."), "max_loras": args.max_loras,
               "rank": args.rank, "context": args.context, "graphs": args.device.type == "cuda",
               "target": "LoRA step <= 1.25x base; no engine stall > 5 ms while loading; usable <= 200 ms"}
    path = write_result("lora", {"summary": summary, "rows": rows, "load": load}, device=args.device)
    print_table(rows, ["batch", "base_ms", "stacked_ms", "gather_ms", "stacked_ratio", "gather_ratio"],
                title="decode step, every row on an adapter")
    if load is not None:
        print_table(load, [k for k in load[0] if k != "largest_gaps"], title="loading an adapter while streams run")
        for r in load:
            print(f"{r['load']}: largest step gaps {r['largest_gaps']}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
