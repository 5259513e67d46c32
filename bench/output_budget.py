"""The engine thread's output processing alone, per step at 64 / 128 / 256 streams: the engine's
reading of one step's tokens (stop checks, incremental detokenization, the deltas, the metrics
observer) and the publisher's encoding and pickling of its events, with no model and no device.

host_budget.py measures the same part ("outputs") inside a running engine, but its tokens are
what the random-weight model samples, and on a CPU the forward pass just before it evicts the
caches. Here the tokens are chosen: `text` (the tokens of real text, as a trained model writes
them), `random` (uniform ids, as a random-weight model samples them: over a byte-level vocabulary
many end inside a character), and `ids` (text tokens for requests that stream token ids only, as
the vLLM protocol's do). Times are the engine thread's CPU time (thread_time), best of --repeats,
so other work on a shared CPU does not count.

    python3 bench/output_budget.py --model builtin:llama-1b --streams 64,128,256
"""

from __future__ import annotations

import argparse
import functools
import pickle
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import print_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOKENS = ("text", "random", "ids")


class _Runner:
    def collect(self, launched: Any) -> Any:  # the launch handle is the step's StepTokens
        return launched

    def take_failed_constraints(self) -> list:
        return []

    def take_sat_out(self) -> list:
        return []


class _Sink:
    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _tokenizer(model: str, cache_dir: Path | None) -> Any:
    """The model's tokenizer; a built-in one is written alone (no weights are generated)."""
    import tempfile

    from service.model.builtin import BUILTIN_PREFIX, BUILTIN_SHAPES, write_tokenizer
    from service.model.loader import _model_dir, read_tokenizer

    if model.startswith(BUILTIN_PREFIX):
        path = Path(tempfile.mkdtemp(prefix="output-budget-"))
        write_tokenizer(path, BUILTIN_SHAPES[model[len(BUILTIN_PREFIX):]])
        return read_tokenizer(path)
    return read_tokenizer(_model_dir(model, cache_dir))


@functools.cache
def _text_ids(tokenizer: Any) -> list[int]:
    """The tokens of this repository's text: its Markdown files and the service's Python."""
    text = "\n".join(p.read_text() for p in sorted(REPO.glob("*.md")) + sorted((REPO / "service").rglob("*.py")))
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def _step_tokens(tokenizer: Any, kind: str, streams: int, steps: int, rng: random.Random) -> list[list[int]]:
    """steps x streams token ids: each stream reads its own place in the text, or draws at random."""
    if kind == "random":
        specials = set(tokenizer.all_special_ids)
        pool = [i for i in range(len(tokenizer)) if i not in specials]
        return [[rng.choice(pool) for _ in range(streams)] for _ in range(steps)]
    ids = _text_ids(tokenizer)
    starts = [rng.randrange(len(ids) - steps) for _ in range(streams)]
    return [[ids[s + k] for s in starts] for k in range(steps)]


def _measure(tokenizer: Any, eos: frozenset[int], kind: str, streams: int, steps: int, seed: int) -> tuple[float, float]:
    """One pass: (ms per step reading the tokens, ms per step encoding and pickling the events)."""
    from service.engine.engine import Engine, _InFlight
    from service.engine.output import RequestOutput
    from service.engine.request import GenerationRequest, SamplingParams, StepTokens
    from service.engine.scheduler import Scheduler
    from service.engine.sequence import Sequence, SequenceStatus
    from service.engine_client.worker import encode_events
    from service.telemetry.engine_metrics import EngineMetrics

    rng = random.Random(seed)
    size = len(tokenizer)
    engine = Engine(_Runner(), Scheduler(streams, 1 << 20), tokenizer, eos, observer=EngineMetrics())
    seqs = []
    for i in range(streams):
        prompt = [rng.randrange(256, size - 300) for _ in range(32)]
        request = GenerationRequest(f"s{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True, seed=0),
                                    arrival_time=time.monotonic(), stream_text=kind != "ids")
        seq = Sequence(request)
        seq.status = SequenceStatus.RUNNING
        engine._outputs[seq.key] = (RequestOutput(seq, tokenizer, eos), _Sink(seq.key))
        seqs.append(seq)
    tokens = _step_tokens(tokenizer, kind, streams, steps, rng)
    read = publish = 0.0
    for step in tokens:
        for seq in seqs:
            seq.num_pending = 1
        events: list = []
        t0 = time.thread_time()
        engine._read_tokens(_InFlight(seqs, StepTokens(step)), events)
        t1 = time.thread_time()
        pickle.dumps(encode_events(events), protocol=pickle.HIGHEST_PROTOCOL)
        publish += time.thread_time() - t1
        read += t1 - t0
    return read * 1000 / steps, publish * 1000 / steps


def run(args: argparse.Namespace) -> list[dict]:
    tokenizer = _tokenizer(args.model, args.cache_dir)
    eos = frozenset({tokenizer.eos_token_id} - {None})
    rows = []
    for kind in args.tokens:
        for streams in args.streams:
            passes = [_measure(tokenizer, eos, kind, streams, args.steps, seed) for seed in range(args.repeats)]
            outputs, publish = min(p[0] for p in passes), min(p[1] for p in passes)
            rows.append({"tokens": kind, "streams": streams, "outputs_ms": round(outputs, 3),
                         "us_per_token": round(outputs * 1000 / streams, 2), "publish_ms": round(publish, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-1b", help="its tokenizer is used (a built-in one alone)")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256])
    p.add_argument("--tokens", type=lambda s: s.split(","), default=list(TOKENS), help=",".join(TOKENS))
    p.add_argument("--steps", type=int, default=200, help="steps per pass (one token per stream each)")
    p.add_argument("--repeats", type=int, default=7, help="passes; the best is reported")
    args = p.parse_args(argv)
    assert set(args.tokens) <= set(TOKENS), args.tokens
    rows = run(args)
    print_table(rows, ["tokens", "streams", "outputs_ms", "us_per_token", "publish_ms"],
                title="engine-thread CPU ms per step: reading one step's tokens, and encoding its events for the pipe")
    print(write_result("output-budget", {"rows": rows, "args": {**vars(args), "cache_dir": str(args.cache_dir)}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
