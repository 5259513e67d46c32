"""Serving load as users meet it: Poisson arrivals, mixed prompt and output lengths, a fresh server per
run, cold (no stats) and warm (the stats file of an earlier run), TTFT and ITL percentiles per rate.

Each run starts `graphserve serve` as its own process (like a new pod), measures the seconds from
the process start to health SERVING, sends `--requests` requests at `--rate` requests/s (Poisson;
prompt and output lengths log-normal around `--prompt-median` / `--output-median` tokens, random
token ids, greedy, ignore_eos), and reads from the server's JSON log what the graph cache did: the
captures before SERVING (`graph_startup`) and after, the engine-thread stall of each, and, from its
/metrics at the end, the step gaps every running stream saw (`graphserve_step_gap_max_seconds`, with
and without a capture in flight) and the steps run eagerly (`eager_steps`; `lone_row_eager_steps`,
the one-row decode steps among them, from the stats file the server saves at shutdown). A warm
start first serves `--warm-requests` at `--warm-rate` on a server with a stats file, stops it (the
stats are saved), and gives each warm run a copy.

`--burst N:TOKENS` also runs, on a fresh cold server each, N prompts of TOKENS tokens sent at once
(the slowest first token is what a new pod's first users wait for).

`--shared-prefix N` starts every prompt with the same N tokens (a system prompt) before its own;
`--prefix-caching on,off` runs each rate with the server's prefix cache on and off, and the rows
report the prefix hit rate and the preemptions from the server's /metrics.

    python bench/serving_load.py --model builtin:llama-1b --device cuda --rates 5,10,20 --requests 200
    python bench/serving_load.py --device cpu --rates 2 --requests 8 --starts cold --burst 4:64  # smoke
    python bench/serving_load.py --model builtin:llama-1b --device cuda --rates 20 --starts warm \
        --shared-prefix 1024 --prefix-caching on,off
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import pathlib
import random
import shlex
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table, write_result
from bench.serve_bench import Trace, arrival_offsets, closed_loop, vocab_size
from service.telemetry.gc_pauses import freeze_startup_heap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="where built-in models are generated")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--rates", default="5,10,20", help="requests/s, one run per rate and start")
    p.add_argument("--starts", default="cold,warm", help="cold (no stats file), warm (an earlier run's), or both")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt-median", type=int, default=270)
    p.add_argument("--output-median", type=int, default=135)
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of both lengths")
    p.add_argument("--max-prompt", type=int, default=2000)
    p.add_argument("--max-output", type=int, default=1000)
    p.add_argument("--max-running-seqs", type=int, default=128)
    p.add_argument("--warm-requests", type=int, default=80)
    p.add_argument("--warm-rate", type=float, default=20.0)
    p.add_argument("--burst", default="", help="N:TOKENS[,N:TOKENS]: N prompts at once on a fresh server")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (a system prompt)")
    p.add_argument("--prefix-caching", default="on", help="on, off or on,off: the server's prefix cache per run")
    p.add_argument("--server-args", default="", help="more flags for every started server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=pathlib.Path, default=None, help="where the servers' logs go (default: a temp dir)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.starts = [s for s in args.starts.split(",") if s]
    args.bursts = [tuple(int(x) for x in b.split(":")) for b in args.burst.split(",") if b]
    args.prefix_modes = [m for m in args.prefix_caching.split(",") if m]
    assert all(m in ("on", "off") for m in args.prefix_modes), "--prefix-caching takes on, off or on,off"
    return args


def lengths(n: int, median: int, sigma: float, cap: int, rng: random.Random) -> list[int]:
    return [max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def workload(args: argparse.Namespace, n: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output tokens) pairs."""
    rng = random.Random(seed)
    vocab = vocab_size(args)
    prompts = lengths(n, args.prompt_median, args.sigma, args.max_prompt, rng)
    outputs = lengths(n, args.output_median, args.sigma, args.max_output, rng)
    shared = [random.Random(args.seed + 99).randrange(3, vocab - 300) for _ in range(args.shared_prefix)]
    return [(shared + [rng.randrange(3, vocab - 300) for _ in range(p)], o) for p, o in zip(prompts, outputs)]


# ---- the server ------------------------------------------------------------------------------


class Server:
    """A fresh `graphserve serve` process, with the seconds from its start to SERVING."""

    def __init__(self, args: argparse.Namespace, stats_file: pathlib.Path, log_path: pathlib.Path,
                 prefix_caching: bool = True) -> None:
        from tests.support.process import ServerProcess

        argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
                "--max-running-seqs", str(args.max_running_seqs),
                "--max-seq-len", str(args.shared_prefix + args.max_prompt + args.max_output + 8),
                "--admin-port", "0", "--log-level", "info", "--stats-file", str(stats_file)]
        if args.cache_dir is not None:
            argv += ["--model-cache-dir", str(args.cache_dir)]
        argv += shlex.split(args.server_args)
        if not prefix_caching:
            argv.append("--no-prefix-caching")
        self.log_path = log_path
        started = time.monotonic()
        self.proc = ServerProcess(argv, log_path=log_path)
        try:
            self.proc.wait_for_health(1, timeout=600)  # SERVING
        except BaseException:
            self.proc.close()
            raise
        self.start_to_serving_s = time.monotonic() - started

    def scrape(self) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.proc.metrics_port}/metrics", timeout=30).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        finally:
            self.proc.close()

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{name}"' in line:
                event = json.loads(line)
                if event.get("event") == name:
                    out.append(event)
        return out


# ---- the client ------------------------------------------------------------------------------

_STREAMS_PER_CONNECTION = 32


async def _one(stub: Any, pb: Any, item: tuple[list[int], int], trace: Trace) -> None:
    prompt, output_tokens = item
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0.0),
                                 stopping=pb.StoppingCriteria(max_tokens=output_tokens, ignore_eos=True))
    try:
        async for response in stub.Generate(request, timeout=600):
            if response.WhichOneof("kind") == "chunk" and response.chunk.token_ids:
                trace.chunks.append((time.perf_counter(), len(response.chunk.token_ids)))
    except Exception as exc:  # noqa: BLE001 - recorded per request
        trace.error = f"{type(exc).__name__}: {exc}"
    trace.done = time.perf_counter()


async def _drive(address: str, items: list[tuple[list[int], int]], offsets: list[float],
                 concurrency: int) -> tuple[list[Trace], float]:
    import grpc

    from service.proto import inference_pb2 as pb
    from service.proto import inference_pb2_grpc

    # Connections of at most _STREAMS_PER_CONNECTION streams each, as a gateway opens them (one
    # connection may hold at most half of the server's --max-concurrent-streams, and 100 by default).
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, math.ceil(concurrency / _STREAMS_PER_CONNECTION)))]
    stubs = itertools.cycle([inference_pb2_grpc.InferenceStub(c) for c in channels])
    try:
        return await closed_loop(items, offsets, argparse.Namespace(concurrency=concurrency),
                                 lambda item, trace: _one(next(stubs), pb, item, trace))
    finally:
        for channel in channels:
            await channel.close()


def drive(address: str, items: list[tuple[list[int], int]], offsets: list[float]) -> tuple[list[Trace], float]:
    freeze_startup_heap()  # a full collection here would delay the receive times it records
    return asyncio.run(_drive(address, items, offsets, concurrency=len(items)))


# ---- one run ---------------------------------------------------------------------------------


def measure(label: str, server: Server, traces: list[Trace], wall_s: float, **extra: Any) -> dict[str, Any]:
    ok = [t for t in traces if t.error is None and t.chunks]
    ttft = [(t.chunks[0][0] - t.sent) * 1000.0 for t in ok]
    itl = [(b[0] - a[0]) * 1000.0 for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    metrics = server.scrape()
    startup = (server.events("graph_startup") or [{}])[0]
    captured = server.events("graph_captured")
    gap = {flag: metrics.get(("graphserve_step_gap_max_seconds", (("capturing", flag),)), 0.0) * 1000.0
           for flag in ("false", "true")}
    stalls = [float(e.get("stall_ms", 0.0)) for e in captured]
    queried = metrics.get(("graphserve_prefix_cache_queries_total", ()), 0.0)
    return {
        "run": label, **extra,
        "ok": len(ok), "errors": len(traces) - len(ok),
        "first_error": next((t.error for t in traces if t.error), None),
        "start_to_serving_s": server.start_to_serving_s,
        "graphs_before_serving": len(startup.get("captured", [])),
        "startup_graph_s": startup.get("seconds"),
        "captures_while_serving": len(captured) - len(startup.get("captured", [])),
        "capture_stall_max_ms": max(stalls, default=None),
        "prefix_hit_rate": metrics.get(("graphserve_prefix_cache_hits_total", ()), 0.0) / queried if queried else 0.0,
        "preemptions": metrics.get(("graphserve_preemptions_total", ()), 0.0),
        "eager_steps": sum(v for (name, _), v in metrics.items() if name == "graphserve_graph_eager_fallbacks_total"),
        "step_gap_max_ms": gap["false"], "step_gap_max_capturing_ms": gap["true"],
        "out_tok_per_s": sum(k for t in ok for _, k in t.chunks) / wall_s,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99), "ttft_max_ms": max(ttft, default=None),
        "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99), "itl_max_ms": max(itl, default=None),
    }


def run_once(args: argparse.Namespace, label: str, stats: pathlib.Path, log_dir: pathlib.Path,
             items: list[tuple[list[int], int]], offsets: list[float], prefix_caching: bool = True,
             **extra: Any) -> dict[str, Any]:
    lone_before = lone_row_eager_steps(stats)
    server = Server(args, stats, log_dir / (label.replace(" ", "-").replace("/", "per") + ".log"), prefix_caching)
    try:
        with RunningPeak(server) as peak:
            traces, wall = drive(server.proc.address, items, offsets)
        row = measure(label, server, traces, wall, running_peak=peak.value, **extra)
    finally:
        server.stop()
    row["lone_row_eager_steps"] = lone_row_eager_steps(stats) - lone_before  # saved at shutdown
    return row


def lone_row_eager_steps(stats: pathlib.Path) -> int:
    """One-row decode steps run eagerly, summed over the runs a stats file has seen (0 without one)."""
    try:
        requested = json.loads(stats.read_text())["stats"]["requested"]
    except FileNotFoundError:
        return 0
    return sum(requested.get("full:1", {}).get("eager", {}).values())


class RunningPeak:
    """The most requests the server ran at once during a run: its `vllm:num_requests_running`
    gauge, scraped every 0.2 s on a thread of its own."""

    def __init__(self, server: Server) -> None:
        self.server, self.value = server, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> RunningPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            with contextlib.suppress(OSError):
                running = sum(v for (name, _), v in self.server.scrape().items() if name == "vllm:num_requests_running")
                self.value = max(self.value, running)


def curve_figure(rows: list[dict[str, Any]]) -> Any | None:
    """Rate -> output tokens/s, TTFT and ITL p50 / p99, one line per start (and prefix mode): the curve
    the load is read by. None with fewer than two rates."""
    series: dict[str, list[dict[str, Any]]] = {}
    both_modes = len({r.get("prefix_cache") for r in rows}) > 1
    for row in rows:
        if row.get("rate") is not None:
            name = row["start"] + (f", prefix cache {row['prefix_cache']}" if both_modes else "")
            series.setdefault(name, []).append(row)
    if not any(len(points) > 1 for points in series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, points in series.items():
        rates = [r["rate"] for r in points]
        tput.plot(rates, [r["out_tok_per_s"] for r in points], "o-", label=name)
        for ax, key in ((ttft, "ttft"), (itl, "itl")):
            ax.plot(rates, [r[f"{key}_p50_ms"] for r in points], "o-", label=f"{name} p50")
            ax.plot(rates, [r[f"{key}_p99_ms"] for r in points], "s--", label=f"{name} p99")
    for ax, title in ((tput, "output tokens/s"), (ttft, "TTFT (ms)"), (itl, "ITL, per message (ms)")):
        ax.set_xlabel("requests/s (Poisson)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in (ttft, itl):
        ax.set_yscale("log")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="serving-load-"))
    log_dir = args.log_dir or work
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    warm_stats = work / "warm-stats.json"
    if "warm" in args.starts:  # the earlier run whose stats the warm starts read
        items = workload(args, args.warm_requests, args.seed + 1000)
        server = Server(args, warm_stats, log_dir / "warming.log")
        try:
            drive(server.proc.address, items, arrival_offsets(len(items), args.warm_rate, args.seed + 1000))
        finally:
            server.stop()
    for start in args.starts:
        for rate in args.rates:
            for mode in args.prefix_modes:
                stats = work / f"{start}-{rate:g}-{mode}.json"
                if start == "warm":
                    shutil.copy(warm_stats, stats)
                items = workload(args, args.requests, args.seed)
                label = f"{start} {rate:g}/s" + (f" prefix-cache {mode}" if len(args.prefix_modes) > 1 else "")
                rows.append(run_once(args, label, stats, log_dir, items, arrival_offsets(len(items), rate, args.seed),
                                     prefix_caching=mode == "on", start=start, rate=rate, prefix_cache=mode))
    for n, tokens in args.bursts:
        rng = random.Random(args.seed + 7)
        vocab = vocab_size(args)
        items = [([rng.randrange(3, vocab - 300) for _ in range(tokens)], 8) for _ in range(n)]
        rows.append(run_once(args, f"burst {n}x{tokens}", work / f"burst-{n}-{tokens}.json", log_dir, items,
                             [0.0] * n, start="cold", rate=None))
    path = write_result("serving-load", {
        "workload": {k: getattr(args, k) for k in ("model", "device", "dtype", "rates", "starts", "requests",
                                                   "prompt_median", "output_median", "sigma", "max_prompt",
                                                   "max_output", "max_running_seqs", "warm_requests", "warm_rate",
                                                   "bursts", "server_args", "seed", "shared_prefix",
                                                   "prefix_modes")},
        "results": rows,
        "notes": "a fresh server process per run; TTFT from the client's send to its first token; ITL one sample "
                 "per chunk; step_gap_max from the server's /metrics (every running stream's gap), capture "
                 "counts and stalls from its log",
    }, device=args.device, figure=curve_figure(rows))
    print_table(rows, ["run", "ok", "errors", "start_to_serving_s", "graphs_before_serving", "captures_while_serving",
                       "ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
                       "step_gap_max_ms", "step_gap_max_capturing_ms", "out_tok_per_s", "prefix_hit_rate",
                       "preemptions", "running_peak", "eager_steps", "lone_row_eager_steps"],
                title=f"\n{args.model} {args.dtype} on {args.device}: Poisson, "
                      f"{f'a shared prefix of {args.shared_prefix} + ' if args.shared_prefix else ''}prompts ~{args.prompt_median} "
                      f"and outputs ~{args.output_median} tokens (log-normal, sigma {args.sigma})")
    for row in rows:
        if row["errors"]:
            print(f"{row['run']}: first error: {row['first_error']}")
    print(f"wrote {path}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
