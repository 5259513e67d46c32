"""Decode-step benchmark: our model eager vs CUDA-graphed, against the bandwidth floor and anchors.

For each batch size: ms per decode step (eager through ModelDecodeStep.run, and the same step
captured with cache_manager's CudaGraphBackend), tokens/s, memory-bandwidth utilisation
((weights + KV read at the context) / step time / measured device copy rate) and the speed-up.
Anchors (default on for CUDA), measured in the same call, never typed in: gpt-fast's decode step on
the same shape and weights, compiled with mode="reduce-overhead" (bench/anchors/gpt_fast.py), and
transformers' generate() and StaticCache step, eager and hand-captured as a CUDA graph
(bench/anchors/transformers_anchor.py). `--buckets all` times every allowed capture size instead.

    python bench/decode_bench.py --model builtin:llama-1b --device cuda --random-init
    python bench/decode_bench.py --model builtin:tiny --device cpu --batches 1,4 --context 32
    python bench/decode_bench.py --model builtin:llama-1b --random-init --context 4096 --kv-cache-dtype fp8
    python bench/decode_bench.py --model builtin:qwen3-30b-a3b --device cuda --no-anchors

A mixture-of-experts model's rows also say which experts the step touched (`touched_experts`, per
MoE layer on average, counted in an eager run of the same inputs) and the floor of the bytes the
step must read (`floor_active_ms`: those experts, the rest of the layers, one embedding row a token
and the LM head, at the copy rate), and the step's multiple of it (`x_active_floor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import pathlib
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.anchors import gpt_fast, transformers_anchor
from bench.common import print_table, time_ms, write_result
from cache_manager import CudaGraphBackend, default_capture_sizes
from service.engine.decode_step import ModelDecodeStep
from service.model import KVCache, LlamaForCausalLM, ModelSpec, ensure_builtin
from service.model.builtin import _SEED, BUILTIN_PREFIX, BUILTIN_SHAPES, _hf_config, random_init
from service.model.kernels._triton import pdl
from service.model.kv_quant import cache_dtype
from service.model.loader import default_cache_dir, load_model
from service.model.parallel import TensorParallel


@dataclass
class Setup:
    model: LlamaForCausalLM
    hf_config: dict  # config.json contents (for the transformers anchor)
    path: pathlib.Path | None  # checkpoint directory; None with --random-init
    device: torch.device
    dtype: torch.dtype
    load_s: float
    kv_dtype: torch.dtype  # what the KV cache stores (--kv-cache-dtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-1b", help="builtin:<name> or a local HF directory")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="where built-in models are generated")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--random-init", action="store_true",
                   help="builtin only: random weights generated on the device, no files (fast on a fresh machine)")
    p.add_argument("--context", type=int, default=512, help="positions already in every KV slot")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--buckets", choices=["list", "all"], default="list",
                   help="all: every default capture size 1..--max-bucket instead of --batches")
    p.add_argument("--max-bucket", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--copy-mb", type=int, default=None, help="size of the copy-rate tensor (default 2048 cuda, 64 cpu)")
    p.add_argument("--anchors", action=argparse.BooleanOptionalAction, default=None,
                   help="gpt-fast and transformers anchors (default: on for cuda, off with --buckets all)")
    p.add_argument("--gpt-fast", action=argparse.BooleanOptionalAction, default=True,
                   help="with --anchors: gpt-fast's compiled decode step (50-60 s of compile per batch on an H200)")
    p.add_argument("--gpt-fast-batches", default=None, help="batches of the gpt-fast anchor (default: --batches)")
    p.add_argument("--gpt-fast-compile", choices=["reduce-overhead", "none"], default=None,
                   help="torch.compile mode of the gpt-fast step (default: reduce-overhead on cuda, none on cpu)")
    p.add_argument("--anchor-batches", default="1,32", help="batches for the generate() anchor")
    p.add_argument("--anchor-new-tokens", type=int, default=64)
    p.add_argument("--anchor-prompt", type=int, default=128, help="prompt tokens of the generate() anchor")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: the decoder's projections in FP8 (service.model.fp8)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="fp8: the KV cache in E4M3 (service.model.kv_quant), half the KV bytes each step reads")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the model's batch-invariant mode (invariant matmul and attention); compare with a run without")
    p.add_argument("--without", default="",
                   help="fast-path kernels to turn off after the self-check, comma-separated (an A/B of one kernel, "
                        "e.g. norm_linear); see service.model.kernels.FastPath")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    if args.anchors is None:  # anchors are about the batch list; a bucket sweep leaves them out
        args.anchors = args.device.type == "cuda" and args.buckets == "list"
    if args.buckets == "all":
        args.batch_list = list(default_capture_sizes(args.max_bucket))
    else:
        args.batch_list = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    args.anchor_batch_list = [int(b) for b in args.anchor_batches.split(",") if b.strip()]
    args.gpt_fast_batch_list = ([int(b) for b in args.gpt_fast_batches.split(",") if b.strip()]
                                if args.gpt_fast_batches else args.batch_list)
    args.gpt_fast_compile = args.gpt_fast_compile or ("reduce-overhead" if args.device.type == "cuda" else "none")
    return args


# ---- model -----------------------------------------------------------------------------------


def _random_init(name: str, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None = None,
                 batch_invariant: bool = False, kv_dtype: torch.dtype | None = None) -> tuple[LlamaForCausalLM, dict]:
    """The built-in shape with random weights made on the device (same distributions as the files,
    not the same values): seconds instead of generating and reading a 2.5 GB checkpoint. With `tp`,
    this rank's shards only."""
    shape = BUILTIN_SHAPES[name]
    num_regular = shape["vocab_size"] - shape["num_special"]
    config = _hf_config({**shape, "dtype": str(dtype).removeprefix("torch.")}, num_regular, num_regular + 1)
    spec = ModelSpec.from_hf_config(types.SimpleNamespace(**config))
    model = LlamaForCausalLM(spec, device, dtype, tp=tp, batch_invariant=batch_invariant, kv_dtype=kv_dtype)
    random_init(model, shape["layer_std"], torch.Generator(device).manual_seed(_SEED + (tp.rank if tp is not None else 0)))
    return model.eval(), config


def load(args: argparse.Namespace) -> Setup:
    """The model of args (its --batch-invariant when the bench has the flag)."""
    t0 = time.perf_counter()
    invariant = getattr(args, "batch_invariant", False)
    kv_dtype = cache_dtype(getattr(args, "kv_cache_dtype", "auto"), args.dtype)
    if args.random_init:
        if not args.model.startswith(BUILTIN_PREFIX):
            raise SystemExit("--random-init needs a builtin:<name> model")
        model, config = _random_init(args.model[len(BUILTIN_PREFIX):], args.device, args.dtype,
                                     batch_invariant=invariant, kv_dtype=kv_dtype)
        if getattr(args, "quantization", "none") == "fp8":
            model.use_fp8()
        path = None
    else:
        loaded = load_model(args.model, args.device, args.dtype, args.cache_dir or default_cache_dir(),
                            batch_invariant=invariant, quantization=getattr(args, "quantization", "none"),
                            kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
        model, path = loaded.model, loaded.path
        import json

        config = json.loads((path / "config.json").read_text())
    without = [k for k in getattr(args, "without", "").split(",") if k.strip()]
    unknown = set(without) - set(vars(model.fast))
    if unknown:
        raise SystemExit(f"--without: no fast-path kernel {sorted(unknown)}; there are {sorted(vars(model.fast))}")
    model.set_fast(dataclasses.replace(model.fast, **dict.fromkeys(without, False)))
    return Setup(model, config, path, args.device, args.dtype, time.perf_counter() - t0, kv_dtype)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_read(spec: ModelSpec, batch: int, context: int, dtype: torch.dtype) -> int:
    """K and V of positions [0, context] (context old ones plus the new one) for every row."""
    return batch * (context + 1) * KVCache.bytes_per_block(spec, 1, dtype)  # a block of one token: one position


def copy_rate(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting read + write."""
    n = megabytes * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=10, warmup=2)
    return 2 * n / (ms / 1000.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- our model -------------------------------------------------------------------------------


def fill_kv(kv: KVCache, context: int) -> None:
    """Random K and V at positions [0, context) of every sequence row (whole blocks, through the block
    table), drawn in the model's dtype and stored as the cache stores them (E4M3 at scale 1.0: randn fits)."""
    blocks = kv.block_table[: kv.num_slots, : -(-context // kv.block_size)].flatten().long()
    for t in (*kv.k, *kv.v):
        t[blocks] = torch.randn((len(blocks), *t.shape[1:]), device=t.device, dtype=kv.dtype).to(t.dtype)


def make_step(s: Setup, max_batch: int, context: int) -> ModelDecodeStep:
    """KV slots filled with random values to `context` positions; every row decodes at `context`."""
    kv = KVCache(s.model.spec, max_batch, context + 64, s.device, s.dtype, cache_dtype=s.kv_dtype)
    fill_kv(kv, context)
    return ModelDecodeStep(s.model, kv, max_batch, s.device)


def touched_experts(s: Setup, step: ModelDecodeStep, batch: int) -> list[int] | None:
    """Per MoE layer, the experts the step's rows pick (one eager run with router hooks); None: dense."""
    from service.model.moe import SparseMoe

    moes = [layer.mlp for layer in s.model.model.layers if isinstance(layer.mlp, SparseMoe)]
    if not moes:
        return None
    picked: list[int] = []
    hooks = [m.gate.register_forward_hook(lambda mod, args, out, k=m.top_k: picked.append(
        torch.topk(out.float(), k, dim=-1).indices.unique().numel())) for m in moes]
    try:
        step.run(batch)
    finally:
        for h in hooks:
            h.remove()
    return picked


def active_bytes(model: LlamaForCausalLM, batch: int, touched: list[int]) -> int:
    """The bytes a decode step of a MoE model must read: every weight but the experts and the embedding
    table, the experts it touched, one embedding row a token (the LM head whole, tied or not)."""
    from service.model.moe import SparseMoe

    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]
    expert_params = {id(p) for m in moes for p in m.experts.parameters()}
    embed = model.model.embed_tokens.weight
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params and p is not embed)
    if model.lm_head is None:  # tied: the head reads the table
        rest += embed.numel() * embed.element_size()
    rest += batch * embed.shape[1] * embed.element_size()
    per_expert = [(m.weights.w13[0].numel() + m.weights.w2[0].numel()) * m.weights.w13.element_size() for m in moes]
    return rest + sum(n * b for n, b in zip(touched, per_expert))


def bench_ours(s: Setup, step: ModelDecodeStep, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    vocab = s.model.spec.vocab_size
    step.write_rows(torch.randint(0, vocab, (batch,)).tolist(), [args.context] * batch, list(range(batch)))
    step.set_padding_rows(batch, step.max_batch)
    row: dict[str, Any] = {"batch": batch}
    touched = touched_experts(s, step, batch)
    if touched is not None:
        row["touched_experts"] = sum(touched) / len(touched)
        row["active_bytes"] = active_bytes(s.model, batch, touched)
    row["eager_ms"] = time_ms(lambda: step.run(batch), s.device, args.iters, args.warmup)
    if s.device.type != "cuda":
        return row
    backend = CudaGraphBackend(s.device)
    try:
        graph = backend.capture(step, batch)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        row["graph_error"] = f"{type(exc).__name__}: {exc}"
        backend.cleanup_after_failure()
        return row
    row["graph_ms"] = time_ms(graph.replay, s.device, args.iters, args.warmup)
    row["capture_ms"] = graph.capture_ms
    row["graph_bytes"] = graph.nbytes
    row["graph_mib"] = graph.nbytes / 2**20
    row["released_bytes"] = backend.release(graph)
    return row


def add_derived(row: dict[str, Any], s: Setup, context: int, rate: float | None) -> None:
    best = row.get("graph_ms") or row["eager_ms"]
    row["tokens_per_s"] = row["batch"] / (best / 1000.0)
    if row.get("graph_ms"):
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
    if rate:
        kv = kv_bytes_read(s.model.spec, row["batch"], context, s.kv_dtype)
        moved = row.get("active_bytes", weight_bytes(s.model)) + kv
        row["bw_util"] = moved / (best / 1000.0) / rate
        if "active_bytes" in row:
            row["floor_active_ms"] = (row["active_bytes"] + kv) / rate * 1000.0
            row["x_active_floor"] = best / row["floor_active_ms"]


# ---- output ----------------------------------------------------------------------------------


def plot(rows: list[dict], anchors: dict | None, floor_ms: float | None, title: str) -> Any:
    """Measured points only: ours, and the anchors this call ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5))

    def line(points: list[tuple[int, float]], label: str, **kw: Any) -> None:
        if points:
            ax.plot(*zip(*points), label=label, **kw)

    line([(r["batch"], r["eager_ms"]) for r in rows], "ours, eager", marker="o")
    line([(r["batch"], r["graph_ms"]) for r in rows if r.get("graph_ms")], "ours, CUDA graph", marker="o")
    if anchors:
        sc = anchors.get("static_cache", [])
        line([(r["batch"], r["graph_ms"]) for r in sc if r.get("graph_ms")], "transformers StaticCache, CUDA graph",
             marker="s", linestyle="--")
        line([(r["batch"], r["eager_ms"]) for r in sc if r.get("eager_ms")], "transformers StaticCache, eager",
             marker="s", linestyle=":")
        gf = anchors.get("gpt_fast") or {}
        line([(r["batch"], r["ms"]) for r in gf.get("rows", [])], f"gpt-fast, torch.compile {gf.get('compile')}",
             marker="*", linestyle="-", color="black")
    if floor_ms:
        ax.axhline(floor_ms, color="gray", linestyle="-.", label=f"bandwidth floor {floor_ms:.3f} ms")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def print_tables(rows: list[dict], anchors: dict | None, summary: dict) -> None:
    if anchors:
        if anchors["generate"]:
            print_table(anchors["generate"], ["batch", "prompt_tokens", "new_tokens", "total_ms", "prefill_ms",
                                              "ms_per_token"], title="\ntransformers generate() (eager)")
        if anchors["static_cache"]:
            print_table(anchors["static_cache"], ["batch", "eager_ms", "graph_ms", "capture_ms", "speedup"],
                        title="\ntransformers + StaticCache, one decode step")
        gf = anchors.get("gpt_fast")
        if gf and gf["rows"]:
            print_table(gf["rows"], ["batch", "ms", "compile_s"],
                        title=f"\ngpt-fast, one decode step (torch.compile {gf['compile']}, same weights)")
        for e in anchors["errors"] + (gf["errors"] if gf else []):
            print("anchor error:", e)
    print(f"\n{summary['model']} {summary['dtype']} on {summary['device_name']}, context {summary['context']}: "
          f"weights {summary['weight_bytes'] / 1e9:.3f} GB, copy rate {summary['copy_rate_gbps']:.0f} GB/s, "
          f"floor {summary['floor_ms']:.3f} ms")
    moe = ["touched_experts", "floor_active_ms", "x_active_floor"] if any("active_bytes" in r for r in rows) else []
    print_table(rows, ["batch", "eager_ms", "graph_ms", "speedup", "capture_ms", "graph_mib", "tokens_per_s",
                       "bw_util", *moe], title="ours: ms per decode step")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    checkpoint_s = None
    if args.model.startswith(BUILTIN_PREFIX) and not args.random_init:
        t0 = time.perf_counter()  # generation (first run on a machine) is timed apart from loading
        ensure_builtin(args.model[len(BUILTIN_PREFIX):], args.cache_dir or default_cache_dir())
        checkpoint_s = time.perf_counter() - t0
        print(f"checkpoint ready in {checkpoint_s:.1f} s", flush=True)
    rate = copy_rate(args.device, args.copy_mb or (2048 if args.device.type == "cuda" else 64))
    s = load(args)
    wbytes = weight_bytes(s.model)
    device_name = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else "cpu"
    print(f"model ready in {s.load_s:.1f} s; copy rate {rate / 1e9:.0f} GB/s", flush=True)

    step = make_step(s, max(args.batch_list), args.context)
    rows = []
    for b in args.batch_list:
        row = bench_ours(s, step, b, args)
        add_derived(row, s, args.context, rate)
        rows.append(row)
    del step
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    anchors = None
    if args.anchors:
        anchors = transformers_anchor.run(s, args)
        if args.gpt_fast and args.quantization == "none" and args.kv_cache_dtype == "auto":
            anchors["gpt_fast"] = gpt_fast.run(s.model, args.gpt_fast_batch_list, args.context, args.gpt_fast_compile,
                                               args.iters, args.warmup)

    summary = {
        "model": args.model, "random_init": args.random_init, "dtype": str(s.dtype).removeprefix("torch."),
        "batch_invariant": args.batch_invariant, "quantization": args.quantization, "fast_path": vars(s.model.fast),
        "kv_cache_dtype": str(s.kv_dtype).removeprefix("torch."),
        "pdl": pdl(s.device),
        "device_name": device_name, "context": args.context, "max_seq_len": args.context + 64,
        "buckets": args.buckets, "weight_bytes": wbytes, "copy_rate_gbps": rate / 1e9,
        "copy_rate_note": "device-to-device copy, read + write bytes", "floor_ms": wbytes / rate * 1000.0,
        "checkpoint_s": checkpoint_s, "load_s": s.load_s, "iters": args.iters, "timing": "median of CUDA events per call" if
        s.device.type == "cuda" else "median of perf_counter per call",
        "kv_note": "bw_util counts KV of positions [0, context]; decode_attention gathers whole slots "
                   "(max_seq_len positions), so it actually reads more",
    }
    fig = None if args.no_plot else plot(rows, anchors, summary["floor_ms"],
                                         f"{args.model} {summary['dtype']}{' batch-invariant' if args.batch_invariant else ''}"
                                         f"{' fp8 KV' if args.kv_cache_dtype == 'fp8' else ''}"
                                         f" decode, context {args.context}, {device_name}")
    name = "decode" if args.buckets == "list" else "decode-buckets"
    name += "-invariant" if args.batch_invariant else ""
    name += "-fp8" if args.quantization == "fp8" else ""
    name += "-fp8kv" if args.kv_cache_dtype == "fp8" else ""
    name += "".join(f"-without-{k}" for k in args.without.split(",") if k.strip())
    name += "" if pdl(s.device) or s.device.type != "cuda" else "-nopdl"
    path = write_result(name,
                        {"summary": summary, "rows": rows, "anchors": anchors}, device=s.device, figure=fig)
    print_tables(rows, anchors, summary)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
