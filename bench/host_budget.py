"""Where the engine thread's time goes per step, at 64 / 128 / 256 closed-loop streams: the host
milliseconds of scheduling, input preparation, the forward's launch, sampling, the wait for the
tokens, output processing and publishing, beside the step's wall time.

The engine runs as the server's engine process runs it (the same builder, its metrics observer,
tokens streamed one at a time), with a publisher that pickles each step's events as the engine
process does before its pipe write; the gRPC process is not in it (bench/serve_bench.py measures
the whole path). A step whose `wait_ms` is near 0 is host-bound: the device idles for the rest.

    python3 bench/host_budget.py --model builtin:llama-1b --device cuda --cache-dir .cache/models --streams 64,128,256
    python3 bench/host_budget.py --device cpu --streams 4 --output-tokens 16    # a smoke run
    python3 bench/host_budget.py ... --token-ids-only    # streams as the vLLM protocol's: token ids, no text
    python3 bench/host_budget.py ... --profile 40   # plus cProfile of the engine thread's steps: the top 40
                                                    # functions by own time (the timings above include its cost)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import pickle
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import HostTimers, print_table, write_result  # noqa: E402

# Parts in the order a step runs them; nested ones are shown as their own share, the rest derived.
PARTS = ["schedule", "inputs", "forward", "sample", "wait", "read", "outputs", "publish", "other"]


class _TimedEvent:
    """A step's ready event whose synchronize() (the host waiting for the device) is timed."""

    def __init__(self, event: torch.cuda.Event, spent: list) -> None:
        self.event, self.spent = event, spent

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.event.synchronize()
        self.spent[0] += time.perf_counter() - t0
        self.spent[1] += 1


def _pickling_publisher() -> tuple[Any, list]:
    """engine_client.worker.publish's work before its pipe write: the events encoded, pickled."""
    from service.engine.request import Finish
    from service.engine_client.worker import encode_events

    sent = [0]

    def publish(pairs: list[tuple[Any, Any]]) -> None:
        sent[0] += sum(isinstance(event, Finish) for _, event in pairs)
        pickle.dumps(encode_events(pairs), protocol=pickle.HIGHEST_PROTOCOL)

    return publish, sent


class _Sink:
    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _instrument(engine: Any) -> HostTimers:
    from service.engine import output

    runner = engine.runner
    timers = HostTimers()
    timers.wrap(engine, "step", "step")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "launch", "launch")
    timers.wrap(runner, "forward", "forward")
    timers.wrap(runner, "_sample_rows", "sample_rows")
    timers.wrap(runner, "_sample", "sample")
    timers.wrap(runner, "collect", "read")
    timers.wrap(engine, "_read_tokens", "read_tokens")
    timers.wrap(engine, "publish", "publish")
    timers.wrap(output.RequestOutput, "on_token", "on_token")
    wait = timers.spent.setdefault("wait", [0.0, 0])
    launch = runner.launch

    def launch_timed_wait(*a: Any, **kw: Any) -> Any:
        step = launch(*a, **kw)
        return step if step.ready is None else dataclasses.replace(step, ready=_TimedEvent(step.ready, wait))

    runner.launch = launch_timed_wait
    _time_collections(timers.spent.setdefault("gc", [0.0, 0]))
    return timers


def _time_collections(spent: list) -> None:
    """The garbage collector's time inside the engine thread's steps (part of the other parts' time)."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if threading.current_thread().name != "graphserve-engine":
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            spent[1] += 1

    gc.callbacks.append(callback)


# The project's host code (the model's modules aside): what the cumulative view lists.
_HOST_CODE = r"service/engine/|service/telemetry/|service/server/|cache_manager/|device_copy|step_batch|kv_cache"


class _StepProfiler:
    """cProfile of the engine thread's steps while `on`: a fresh profile per reported pass."""

    def __init__(self, engine: Any) -> None:
        self.on = False
        self.profile = cProfile.Profile()
        step = engine.step

        def profiled() -> None:
            if not self.on:
                return step()
            self.profile.enable()
            try:
                step()
            finally:
                self.profile.disable()

        engine.step = profiled

    def start(self) -> None:
        self.profile, self.on = cProfile.Profile(), True

    def top(self, n: int, steps: int) -> str:
        """The n functions of most own time, and the project's n of most time with their callees."""
        self.on = False
        out = io.StringIO()
        out.write(f"engine-thread profile over {steps} steps (seconds summed over them)\n")
        stats = pstats.Stats(self.profile, stream=out)
        stats.sort_stats("tottime").print_stats(n)
        stats.sort_stats("cumtime").print_stats(_HOST_CODE, n)
        return out.getvalue()


def _budget(spent: dict[str, list], seconds: float) -> dict[str, float]:
    """Host ms per step by part: nested timers subtracted from their parents."""
    steps = max(1, spent["launch"][1])
    ms = {k: v[0] * 1000 / steps for k, v in spent.items()}
    part = {
        "schedule": ms["schedule"],
        "inputs": ms["launch"] - ms["forward"] - ms["sample"] - ms["sample_rows"],
        "forward": ms["forward"],
        "sample": ms["sample"] + ms["sample_rows"],
        "wait": ms["wait"],
        "read": ms["read"] - ms["wait"],
        "outputs": ms["read_tokens"] - ms["read"],
        "publish": ms["publish"],
    }
    part["other"] = ms["step"] - ms["schedule"] - ms["launch"] - ms["read_tokens"] - ms["publish"]
    row = {k: round(v, 3) for k, v in part.items()}
    row["gc_ms"] = round(ms["gc"], 3)  # inside the parts above, not beside them
    row["on_token_us"] = round(spent["on_token"][0] * 1e6 / max(1, spent["on_token"][1]), 2)
    row["step_ms"] = round(seconds * 1000 / steps, 3)
    row["host_ms"] = round(sum(v for k, v in part.items() if k != "wait"), 3)
    row["steps"] = steps
    return row


def run(args: argparse.Namespace) -> list[dict]:
    from service.config import load_config
    from service.engine.builder import load_runner, new_engine
    from service.engine.request import GenerationRequest, SamplingParams
    from service.telemetry.engine_metrics import EngineMetrics

    argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
            "--max-running-seqs", str(max(*args.streams, 8)), "--max-seq-len", str(args.prompt_tokens + args.output_tokens + 16)]
    if args.cache_dir:
        argv += ["--model-cache-dir", args.cache_dir]
    config = load_config(argv + args.server_args.split(), {})
    lr = load_runner(config)
    publish, finished = _pickling_publisher()
    engine = new_engine(config, lr, publish=publish, observer=EngineMetrics(model_name=config.model_name))
    engine.start()
    vocab = lr.loaded.spec.vocab_size
    gen = torch.Generator().manual_seed(1)
    profiler = _StepProfiler(engine) if args.profile else None
    timers = _instrument(engine)
    rows = []
    try:
        for n, streams in enumerate(s for s in args.streams for _ in range(2)):  # each first pass captures: not reported
            prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(streams)]
            timers.reset()
            if profiler is not None and n % 2:
                profiler.start()
            finished[0] = 0
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                request = GenerationRequest(f"s{n}-{i}", prompt,
                                            SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True, seed=0),
                                            arrival_time=time.monotonic(), stream_text=not args.token_ids_only)
                engine.submit(request, _Sink(request.request_id))
            while finished[0] < streams:
                time.sleep(0.002)
                if not engine.thread_alive:
                    raise RuntimeError(f"the engine stopped: {engine.error!r}")
            seconds = time.perf_counter() - t0
            if n % 2:
                rows.append({"streams": streams, "tokens_per_s": round(streams * args.output_tokens / seconds),
                             **_budget(timers.snapshot(), seconds)})
                if profiler is not None:
                    rows[-1]["profile"] = profiler.top(args.profile, rows[-1]["steps"])
    finally:
        engine.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-1b")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--server-args", default="", help="more server flags, e.g. '--no-overlap-steps'")
    p.add_argument("--token-ids-only", action="store_true",
                   help="requests whose client reads token ids only, as the vLLM protocol's do: no text is decoded")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also cProfile the engine thread's steps and print the N functions of most own time")
    args = p.parse_args(argv)
    rows = run(args)
    for row in rows:
        if "profile" in row:
            print(f"-- {row['streams']} streams\n{row['profile']}")
    print_table(rows, ["streams", "tokens_per_s", "step_ms", "host_ms", *PARTS, "gc_ms", "on_token_us"],
                title="host ms per engine step, by part (wait: the host waiting for the device)")
    print(write_result("host-budget", {"rows": rows, "args": vars(args)}, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
