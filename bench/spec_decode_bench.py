"""Speculative decoding on workloads users meet: time per output token and acceptance with
speculation off, n-gram (prompt lookup), suffix decoding, (with --draft-layers N) self-speculation
with the target's first N layers and (with --draft-model M) a separate draft checkpoint M, batch 1,
greedy, through the Python API.

Workloads: code editing that repeats the input, summarise-with-quotes, a multi-turn chat whose answer
reuses the question, and open chat. Each runs twice per method (round 2 is the same traffic again:
what the suffix corpus of recent outputs is for). Greedy outputs of every method are compared with
speculation off (float32: they must be equal).

    python3 bench/spec_decode_bench.py --model /tmp/smol/hf --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import print_table, write_result  # noqa: E402
from service.engine.spec.stats import SpecDecodeStats  # noqa: E402
from service.llm import LLM, SamplingParams  # noqa: E402

CODE = '''def load_rows(path):
    count = 0
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rows.append(line.split(","))
            count += 1
    print("loaded", count, "rows")
    return rows, count
'''
TEXT = ("The river rose three feet overnight. Farmers moved their animals to higher ground. "
        "The mayor said the bridge would stay closed until Friday. Schools opened late on Tuesday. "
        "The mayor said volunteers had filled two thousand sandbags. Rain is expected to stop on Thursday.")
WORKLOADS = {
    "code_edit": [{"role": "user", "content": "Rename the variable count to total in this code. Output only the "
                   "full code.\n\n" + CODE}],
    "summarise_quotes": [{"role": "user", "content": "Quote, word for word, every sentence of this text that "
                          "mentions the mayor, then summarise it in one line.\n\n" + TEXT}],
    "multi_turn": [{"role": "user", "content": "My shopping list: apples, bread, milk, eggs, rice, coffee."},
                   {"role": "assistant", "content": "Got it: apples, bread, milk, eggs, rice, coffee."},
                   {"role": "user", "content": "Repeat my list as a numbered list, one item a line, and add "
                    "butter at the end."}],
    "open_chat": [{"role": "user", "content": "What should I know before adopting a cat?"}],
}
METHODS = {"off": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
           "suffix": {"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/smol/hf")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=0,
                   help="also method draft_layers with the target's first N layers drafting (0: not run)")
    p.add_argument("--draft-model", default="",
                   help="also method draft_model with this draft checkpoint (sharing the target's tokenizer; "
                        "the target itself bounds the machinery's overhead)")
    p.add_argument("--methods", default="", help="comma-separated methods to run (default: all; off is always run)")
    args = p.parse_args()
    methods = dict(METHODS)
    if args.draft_layers:
        methods["draft_layers"] = {"method": "draft_layers", "num_speculative_tokens": 4,
                                   "num_draft_layers": args.draft_layers}
    if args.draft_model:
        methods["draft_model"] = {"method": "draft_model", "num_speculative_tokens": 4, "model": args.draft_model}
    if args.methods:
        methods = {m: spec for m, spec in methods.items() if m == "off" or m in args.methods.split(",")}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows, outputs = [], {}
    for method, spec in methods.items():
        with LLM(model=args.model, device=args.device, dtype=args.dtype, max_running_seqs=1, max_seq_len=2048,
                 speculative_config=spec) as llm:
            llm.chat(WORKLOADS["open_chat"], SamplingParams(temperature=0, max_tokens=4))  # warm-up
            engine = llm._engine.engine
            for round_ in range(1, args.rounds + 1):
                for name, messages in WORKLOADS.items():
                    before = dataclasses.replace(engine.spec_stats)
                    started = time.perf_counter()
                    out = llm.chat(messages, params)[0].outputs[0]
                    seconds = time.perf_counter() - started
                    after = engine.spec_stats
                    counts = SpecDecodeStats(after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                                             after.accepted - before.accepted)
                    n = len(out.token_ids)
                    reference = outputs.setdefault((name, round_), out.token_ids)
                    rows.append({
                        "workload": name, "round": round_, "method": method, "tokens": n,
                        "ms_per_token": round(1000 * seconds / max(n, 1), 2),
                        "tokens_per_s": round(n / seconds, 1),
                        "drafts": counts.drafts, "draft_tokens": counts.draft_tokens, "accepted": counts.accepted,
                        "acceptance_rate": _round(counts.acceptance_rate, 3),
                        "mean_acceptance_length": _round(counts.mean_acceptance_length, 2),
                        "equal_to_off": out.token_ids == reference,
                    })
                    print(rows[-1], flush=True)
    base = {(r["workload"], r["round"]): r["ms_per_token"] for r in rows if r["method"] == "off"}
    for r in rows:
        r["time_vs_off"] = round(r["ms_per_token"] / base[(r["workload"], r["round"])], 2)
    print_table(rows, ["workload", "round", "method", "tokens", "ms_per_token", "time_vs_off", "acceptance_rate",
                       "mean_acceptance_length", "equal_to_off"], title="speculative decoding, batch 1, greedy")
    path = write_result("spec_decode", {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
                                        "methods": methods, "rows": rows}, device=args.device)
    print(path)


if __name__ == "__main__":
    main()
