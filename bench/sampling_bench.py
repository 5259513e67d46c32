"""What the sampling fields cost a decode step: the sampler alone per configuration (64 rows of a
128k vocabulary: logprobs, penalties, grammar masks), and closed-loop tokens/s through the LLM API
with CUDA graphs (plain, every row with top-5 logprobs and the three penalties, every row under a
10-field JSON schema).

    python3 bench/sampling_bench.py --device cuda                    # the sampler alone
    python3 bench/sampling_bench.py --device cuda --e2e --cache-dir .cache/models   # and the closed loop
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import HostTimers, print_table, time_ms, write_result  # noqa: E402
from service.engine.request import Constraint  # noqa: E402
from service.engine.request import SamplingParams as EngineParams  # noqa: E402
from service.engine.sampler import SampleRow, SamplingBatch, TokenHistory, sample  # noqa: E402

# Ten fields of the kinds OpenAI users constrain to: strings, numbers, booleans, an enum, an array.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"}, "active": {"type": "boolean"},
        "role": {"enum": ["reader", "writer", "admin"]}, "city": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "city", "tags", "verified"],
    "additionalProperties": False,
}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def sampler_rows(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    b, vocab = args.batch, args.vocab
    logits = torch.randn(b, vocab, device=device)
    history = TokenHistory(b, vocab, device)
    gen = torch.Generator().manual_seed(0)
    for r in range(b):  # 300 prompt and 100 completion tokens per row
        ids = torch.randint(0, vocab, (400,), generator=gen).tolist()
        history.reset(r, r, ids[:300], ids[300:])
    configs = {
        "greedy": EngineParams(temperature=0.0),
        "sampled (T 0.8, top-p 0.95)": EngineParams(temperature=0.8, top_p=0.95, seed=1),
        "greedy + top-5 logprobs": EngineParams(temperature=0.0, logprobs=5),
        "greedy + 3 penalties": EngineParams(temperature=0.0, **PENALTIES),
        "greedy + logprobs + penalties": EngineParams(temperature=0.0, logprobs=5, **PENALTIES),
        "sampled + logprobs + penalties": EngineParams(temperature=0.8, top_p=0.95, seed=1, logprobs=5, **PENALTIES),
        "greedy + min_p + logit_bias": EngineParams(temperature=0.0, min_p=0.05, logit_bias=((5, 1.0), (6, -1.0))),
    }
    rows = []
    for name, p in configs.items():
        step_rows = [SampleRow(p, 100, r) for r in range(b)]

        def run(step_rows: list[SampleRow] = step_rows) -> None:
            sample(logits, SamplingBatch.build(step_rows, device), history)

        rows.append({"config": name, "rows": b, "vocab": vocab, "ms": round(time_ms(run, device, iters=50), 3),
                     "busy_ms": busy_ms(run, device)})
    rows += grammar_rows(args, device, logits)
    base = rows[0]["ms"]
    for row in rows:
        row["x_greedy"] = round(row["ms"] / base, 2)
    return rows


def busy_ms(fn, device: torch.device, iters: int = 20) -> float | None:  # noqa: ANN001
    """Device milliseconds of fn when its kernels queue behind a busy GPU, as in a step (the sampling
    is launched while the forward pass runs): a 3 ms sleep kernel, then fn, minus the sleep alone.
    Without the sleep the launch gaps of an idle GPU would count."""
    if device.type != "cuda":
        return None

    def timed(with_fn: bool) -> float:
        out = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(3_000_000)  # ~1.5-3 ms of cycles
            if with_fn:
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        return sorted(out)[len(out) // 2]

    fn()
    return round(timed(True) - timed(False), 3)


def grammar_rows(args: argparse.Namespace, device: torch.device, logits: torch.Tensor) -> list[dict]:
    """Filling 64 rows' JSON-schema masks on the host (in a step they are filled while the engine
    prepares it), and applying them on the device."""
    from transformers import AutoTokenizer

    from service.engine.constraints import mask_workers
    from service.engine.mask_fill import MaskFiller
    from service.engine.structured import GrammarCompiler, allocate_bitmask
    from service.model.builtin import BUILTIN_SHAPES, write_tokenizer
    from service.model.kernels.sampling import apply_bitmask

    tok_dir = Path(args.tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        tok_dir.mkdir(parents=True, exist_ok=True)
        write_tokenizer(tok_dir, BUILTIN_SHAPES["llama-1b"])
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    compiler = GrammarCompiler(tokenizer, args.vocab, [tokenizer.eos_token_id])
    matchers = [compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA))) for _ in range(args.batch)]
    for m in matchers[1::2]:  # half the rows inside a string value, half at the start
        for token in tokenizer.encode('{"id": 12, "name": "ab', add_special_tokens=False):
            m.accept(token)
    masks = allocate_bitmask(args.batch, args.vocab, pin=device.type == "cuda")
    rows_t = torch.arange(args.batch, device=device)
    workers = mask_workers()
    filler = MaskFiller(args.vocab, workers=workers, budget_ms=1000)

    def fill_ms(pooled: bool) -> float:
        fills = []
        for _ in range(30):
            t0 = time.perf_counter()
            if pooled:
                assert filler.fill(matchers, masks) == ({}, [])
            else:
                for i, m in enumerate(matchers):
                    m.fill_bitmask(masks, i)
            fills.append((time.perf_counter() - t0) * 1000)
        return round(sorted(fills)[len(fills) // 2], 3)

    def apply() -> None:
        apply_bitmask(logits, rows_t, masks)

    rows = [{"config": f"JSON schema: fill {args.batch} masks, row by row (host)", "rows": args.batch,
             "vocab": args.vocab, "ms": fill_ms(False)},
            {"config": f"JSON schema: fill {args.batch} masks, the engine's {workers} mask workers (host)",
             "rows": args.batch, "vocab": args.vocab, "ms": fill_ms(True)},
            {"config": f"JSON schema: apply {args.batch} masks (device)", "rows": args.batch, "vocab": args.vocab,
             "ms": round(time_ms(apply, device, iters=50), 3), "busy_ms": busy_ms(apply, device)}]
    filler.close()
    return rows


def e2e_rows(args: argparse.Namespace) -> list[dict]:
    from service.llm import LLM, SamplingParams

    configs = {
        "plain (greedy)": SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True),
        "top-5 logprobs + 3 penalties": SamplingParams(temperature=0.0, max_tokens=args.output_tokens,
                                                       ignore_eos=True, logprobs=5, **PENALTIES),
        "10-field JSON schema (greedy)": SamplingParams(temperature=0.0, max_tokens=args.output_tokens,
                                                        constraint=Constraint("json_schema", json.dumps(SCHEMA))),
        "sampled (T 1.0)": SamplingParams(temperature=1.0, seed=3, max_tokens=args.output_tokens, ignore_eos=True),
        "10-field JSON schema (T 1.0)": SamplingParams(temperature=1.0, seed=3, max_tokens=args.output_tokens,
                                                       constraint=Constraint("json_schema", json.dumps(SCHEMA))),
    }
    rows = []
    with LLM(model=args.model, model_cache_dir=args.cache_dir, device=args.device, dtype=args.dtype) as llm:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, llm.vocab_size, (32,), generator=gen).tolist() for _ in range(args.streams)]
        llm.generate(prompts, configs["plain (greedy)"])  # captures and warms every size
        timers = _host_timers(llm)
        for name, params in configs.items():
            best = None
            for _ in range(args.rounds):
                timers.reset()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, [params] * len(prompts))
                seconds = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                if best is None or tokens / seconds > best[0]:
                    best = (tokens / seconds, tokens, seconds, outs, timers.snapshot())
            tps, tokens, seconds, outs, spent = best
            row = {"config": name, "streams": args.streams, "tokens": tokens, "seconds": round(seconds, 3),
                   "tokens_per_s": round(tps), "steps": spent["launch"][1],
                   "step_ms": round(seconds * 1000 / max(1, spent["launch"][1]), 2)}
            for key, (total, _) in spent.items():  # host milliseconds per step, by part
                row[f"{key}_ms"] = round(total * 1000 / max(1, spent["launch"][1]), 3)
            if params.constraint is not None:
                row["valid_json"] = sum(_valid(o.outputs[0].text) for o in outs)
            rows.append(row)
    for row in rows:
        row["x_plain"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    return rows


def _host_timers(llm) -> HostTimers:  # noqa: ANN001
    """Host seconds and calls of a step's parts (the engine thread's): launch (forward, sampling and
    what runs between), the grammar masks' fill, reading and postprocessing the tokens (the
    matchers' accept included), waiting for the tokens."""
    engine, runner = llm._engine, llm._engine.runner
    timers = HostTimers()
    timers.wrap(runner, "launch", "launch")
    timers.wrap(runner, "_masks", "masks")
    timers.wrap(runner, "collect", "collect")
    timers.wrap(engine, "_read_tokens", "read_tokens")
    return timers


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tokenizer-dir", default=".cache/llama-1b-tokenizer")
    p.add_argument("--e2e", action="store_true", help="also the closed loop through the LLM API")
    p.add_argument("--model", default="builtin:llama-1b")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    sampler = sampler_rows(args)
    print_table(sampler, ["config", "rows", "vocab", "ms", "busy_ms", "x_greedy"],
                title="the sampler alone, one step (ms: an idle GPU, launch gaps included; busy_ms: queued behind work)")
    payload = {"sampler": sampler}
    if args.e2e:
        payload["closed_loop"] = e2e_rows(args)
        print_table(payload["closed_loop"], ["config", "tokens", "tokens_per_s", "x_plain", "steps", "step_ms", "launch_ms",
                                             "masks_ms", "collect_ms", "read_tokens_ms", "valid_json"],
                    title=f"closed loop through the LLM API, graphs on, {args.streams} streams (host ms per step)")
    print(write_result("sampling", payload, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
