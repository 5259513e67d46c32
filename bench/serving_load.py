"""Serving load as users meet it: Poisson arrivals, mixed prompt and output lengths, a fresh server per
run, cold (no stats) and warm (the stats file of an earlier run); per rate TTFT, TPOT, per-token ITL
and message cadence, each p50 / p99 / max (bench/load_metrics.py), over `--repeat` runs with their
spread, offered against achieved output tokens/s; and, given an SLO, the highest rate holding it.

Each run starts `graphserve serve` as its own process (like a new pod), measures the seconds from
the process start to health SERVING, sends `--duration` seconds of arrivals at the rate (Poisson,
rate x duration requests unless `--requests`; prompt and output lengths log-normal around
`--prompt-median` / `--output-median` tokens, random token ids, greedy, ignore_eos), and reads from
the server's JSON log what the graph cache did: the captures before SERVING (`graph_startup`) and
after, the engine-thread stall of each, and, from its /metrics at the end, the step gaps every
running stream saw (`graphserve_step_gap_max_seconds`, with and without a capture in flight) and the
steps run eagerly (`eager_steps`; `lone_row_eager_steps`, the one-row decode steps among them, from
the stats file the server saves at shutdown). A warm start first serves `--warm-requests` at
`--warm-rate` on a server with a stats file, stops it (the stats are saved), and gives each warm run
a copy. Repeat i of a rate uses seed + i: a fresh server and a fresh draw of arrivals and lengths.

`--slo-ttft-p99-ms` / `--slo-tpot-p99-ms` search the rates between `--slo-rates LOW,HIGH` by
bisection (bench/rate_search.py) for the highest one at which every repeat keeps the limits, with
the first of `--starts`; every probed rate's runs are in the JSON. `--book FILE` keeps finished runs
across calls and `--time-budget S` stops before a run that might not finish: exit status 75 means
"run the same command again" (bench/run_book.py).

`--burst N:TOKENS` also runs, on a fresh cold server each, N prompts of TOKENS tokens sent at once
(the slowest first token is what a new pod's first users wait for). `--shared-prefix N` starts every
prompt with the same N tokens (a system prompt); `--prefix-caching on,off` runs each rate with the
server's prefix cache on and off, and the rows report the prefix hit rate and the preemptions.
`--constrained-share F` gives that share of the requests a JSON schema (bench/load_client.py's
SCHEMA; their outputs end where the schema does), and each run reports TTFT, TPOT and ITL of the
constrained and the free requests apart (`constrained_*`, `free_*`): the same seed draws the same
prompts and lengths at every share, so a run at share 0 is the free requests' baseline.

    python bench/serving_load.py --model builtin:llama-1b --device cuda --rates 20,100 --starts warm
    python bench/serving_load.py --model builtin:llama-1b --device cuda --rates "" --starts warm \
        --slo-ttft-p99-ms 200 --slo-tpot-p99-ms 10 --slo-rates 25,400 --book b.json --time-budget 540
    python bench/serving_load.py --device cpu --rates 2 --duration 5 --repeat 2 --starts cold  # smoke
"""

from __future__ import annotations

import argparse
import pathlib
import random
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result
from bench.load_client import Item, drive, workload
from bench.load_figure import curve_figure
from bench.load_metrics import SPREAD_KEYS, Slo, cell, spread, summarize
from bench.load_server import RunningPeak, Server, lone_row_eager_steps
from bench.rate_search import highest_rate
from bench.run_book import OUT_OF_TIME, OutOfTime, RunBook
from bench.serve_bench import Trace, arrival_offsets, vocab_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="where built-in models are generated")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--rates", default="5,10,20", help="requests/s of the curve, one point per rate and start")
    p.add_argument("--starts", default="cold,warm", help="cold (no stats file), warm (an earlier run's), or both")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument("--requests", type=int, default=None, help="per run (default: rate x --duration)")
    p.add_argument("--repeat", type=int, default=3, help="runs per rate, a fresh server each")
    p.add_argument("--prompt-median", type=int, default=270)
    p.add_argument("--output-median", type=int, default=135)
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of both lengths")
    p.add_argument("--max-prompt", type=int, default=2000)
    p.add_argument("--max-output", type=int, default=1000)
    p.add_argument("--max-running-seqs", type=int, default=128)
    p.add_argument("--warm-requests", type=int, default=80)
    p.add_argument("--warm-rate", type=float, default=20.0)
    p.add_argument("--slo-ttft-p99-ms", type=float, default=None, help="SLO: TTFT p99 limit (starts the search)")
    p.add_argument("--slo-tpot-p99-ms", type=float, default=None, help="SLO: TPOT p99 limit (starts the search)")
    p.add_argument("--slo-rates", default=None, help="LOW,HIGH: the search's bounds (default: the lowest and highest of --rates)")
    p.add_argument("--slo-tolerance", type=float, default=0.1, help="stop when high / low <= 1 + this")
    p.add_argument("--book", type=pathlib.Path, default=None, help="keep finished runs here; the same command goes on")
    p.add_argument("--time-budget", type=float, default=None, help="seconds: start no run that might end later")
    p.add_argument("--burst", default="", help="N:TOKENS[,N:TOKENS]: N prompts at once on a fresh server")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (a system prompt)")
    p.add_argument("--prefix-caching", default="on", help="on, off or on,off: the server's prefix cache per run")
    p.add_argument("--server-args", default="", help="more flags for every started server")
    p.add_argument("--constrained-share", type=float, default=0.0, help="share of requests with a JSON schema")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=pathlib.Path, default=None, help="where the servers' logs go (default: a temp dir)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.starts = [s for s in args.starts.split(",") if s]
    args.bursts = [tuple(int(x) for x in b.split(":")) for b in args.burst.split(",") if b]
    args.prefix_modes = [m for m in args.prefix_caching.split(",") if m]
    assert all(m in ("on", "off") for m in args.prefix_modes), "--prefix-caching takes on, off or on,off"
    args.slo = None
    if args.slo_ttft_p99_ms is not None or args.slo_tpot_p99_ms is not None:
        args.slo = Slo(args.slo_ttft_p99_ms, args.slo_tpot_p99_ms)
        bounds = ([float(r) for r in args.slo_rates.split(",")] if args.slo_rates
                  else [min(args.rates, default=0.0), max(args.rates, default=0.0)])
        if len(bounds) != 2 or not 0 < bounds[0] < bounds[1]:
            p.error("an SLO search needs --slo-rates LOW,HIGH (or two --rates) with 0 < LOW < HIGH")
        args.slo_bounds = bounds
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if not 0.0 <= args.constrained_share <= 1.0:
        p.error("--constrained-share must be between 0 and 1")
    if args.time_budget is not None and args.book is None:
        p.error("--time-budget needs --book: the runs done would be lost")
    return args


# ---- one run ---------------------------------------------------------------------------------


def measure(label: str, server: Server, traces: list[Trace], wall_s: float, items: list[Item],
            offsets: list[float], **extra: Any) -> dict[str, Any]:
    metrics = server.scrape()
    startup = (server.events("graph_startup") or [{}])[0]
    captured = server.events("graph_captured")
    gap = {flag: metrics.get(("graphserve_step_gap_max_seconds", (("capturing", flag),)), 0.0) * 1000.0
           for flag in ("false", "true")}
    stalls = [float(e.get("stall_ms", 0.0)) for e in captured]
    queried = metrics.get(("graphserve_prefix_cache_queries_total", ()), 0.0)
    figures = summarize(traces, sum(i.output_tokens for i in items), max(offsets, default=0.0))
    return {
        "run": label, **extra, **figures, **by_class(traces, items),
        "start_to_serving_s": server.start_to_serving_s,
        "graphs_before_serving": len(startup.get("captured", [])),
        "startup_graph_s": startup.get("seconds"),
        "captures_while_serving": len(captured) - len(startup.get("captured", [])),
        "capture_stall_max_ms": max(stalls, default=None),
        "prefix_hit_rate": metrics.get(("graphserve_prefix_cache_hits_total", ()), 0.0) / queried if queried else 0.0,
        "preemptions": metrics.get(("graphserve_preemptions_total", ()), 0.0),
        "eager_steps": sum(v for (name, _), v in metrics.items() if name == "graphserve_graph_eager_fallbacks_total"),
        "step_gap_max_ms": gap["false"], "step_gap_max_capturing_ms": gap["true"],
        "wall_s": wall_s, "out_tok_per_s": figures["tokens"] / wall_s,
    }


def run_once(args: argparse.Namespace, label: str, stats: pathlib.Path, log_dir: pathlib.Path,
             items: list[Item], offsets: list[float], prefix_caching: bool = True, **extra: Any) -> dict[str, Any]:
    lone_before = lone_row_eager_steps(stats)
    server = Server(args, stats, log_dir / (label.replace(" ", "-").replace("/", "per").replace("#", "") + ".log"),
                    prefix_caching)
    try:
        with RunningPeak(server) as peak:
            traces, wall = drive(server.proc.address, items, offsets)
        row = measure(label, server, traces, wall, items, offsets, running_peak=peak.value, **extra)
    finally:
        server.stop()
    row["lone_row_eager_steps"] = lone_row_eager_steps(stats) - lone_before  # saved at shutdown
    return row


def by_class(traces: list[Trace], items: list[Item]) -> dict[str, Any]:
    """The constrained and the free requests' figures apart (nothing when none is constrained)."""
    if not any(i.constrained for i in items):
        return {}
    out: dict[str, Any] = {}
    for name, want in (("constrained", True), ("free", False)):
        picked = [t for t, i in zip(traces, items) if i.constrained == want]
        figures = summarize(picked, sum(i.output_tokens for i in items if i.constrained == want), 0.0)
        out[f"{name}_requests"] = len(picked)
        out.update({f"{name}_{k}": figures[k] for k in CLASS_KEYS + ("errors", "tokens")})
    return out


CLASS_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "itl_max_ms")


class Campaign:
    """The runs of one invocation: a point of the curve or a probe of the search is `--repeat` runs at
    one rate, each on a fresh server, recorded in the book by its label."""

    def __init__(self, args: argparse.Namespace, book: RunBook) -> None:
        self.args, self.book = args, book
        self.work = book.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="serving-load-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_dir = args.log_dir or self.work
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.warm_stats = self.work / "warm-stats.json"

    def warm_up(self) -> dict[str, Any]:
        """The earlier run whose stats the warm starts read."""
        args = self.args
        items = workload(args, args.warm_requests, args.seed + 1000)
        server = Server(args, self.warm_stats, self.log_dir / "warming.log")
        try:
            drive(server.proc.address, items, arrival_offsets(len(items), args.warm_rate, args.seed + 1000))
        finally:
            server.stop()
        return {"warm_requests": len(items)}

    def point(self, start: str, rate: float, mode: str) -> dict[str, Any]:
        args = self.args
        if start == "warm":
            if not self.warm_stats.exists():  # a book carried without its work folder: warm up again
                self.book.runs.pop("warming", None)
            self.book.run("warming", self.warm_up)
        name = f"{start} {rate:g}/s" + (f" prefix-cache {mode}" if len(args.prefix_modes) > 1 else "")
        rows = [self.book.run(f"{name} #{i + 1}", lambda i=i: self._repeat(f"{name} #{i + 1}", start, rate, mode, i))
                for i in range(args.repeat)]
        point = {"run": name, "start": start, "rate": rate, "prefix_cache": mode, "repeats": len(rows),
                 "ok": sum(r["ok"] for r in rows), "errors": sum(r["errors"] for r in rows),
                 "spread": spread(rows, SPREAD_KEYS + tuple(f"{c}_{k}" for c in ("constrained", "free") for k in CLASS_KEYS))}
        if args.slo is not None:
            point["slo_held"] = args.slo.held(rows)
        return point

    def _repeat(self, label: str, start: str, rate: float, mode: str, i: int) -> dict[str, Any]:
        """Repeat i of a rate: seed + i, a fresh server (and a copy of the warm stats for a warm start)."""
        args, seed = self.args, self.args.seed + i
        n = args.requests or max(1, round(rate * args.duration))
        stats = self.work / f"{label.replace(' ', '-').replace('/', 'per').replace('#', '')}.json"
        stats.unlink(missing_ok=True)
        if start == "warm":
            shutil.copy(self.warm_stats, stats)
        return run_once(args, label, stats, self.log_dir, workload(args, n, seed), arrival_offsets(n, rate, seed),
                        prefix_caching=mode == "on", start=start, rate=rate, prefix_cache=mode, repeat=i + 1, seed=seed)

    def burst(self, n: int, tokens: int) -> dict[str, Any]:
        rng = random.Random(self.args.seed + 7)
        vocab = vocab_size(self.args)
        items = [Item([rng.randrange(3, vocab - 300) for _ in range(tokens)], 8) for _ in range(n)]
        label = f"burst {n}x{tokens}"
        return self.book.run(label, lambda: run_once(self.args, label, self.work / f"burst-{n}-{tokens}.json",
                                                      self.log_dir, items, [0.0] * n, start="cold", rate=None))

    def search(self) -> dict[str, Any]:
        args = self.args
        probes: dict[float, dict[str, Any]] = {}

        def holds(rate: float) -> bool:
            probes[rate] = self.point(args.starts[0], rate, args.prefix_modes[0])
            return probes[rate]["slo_held"]

        found = highest_rate(holds, *args.slo_bounds, tolerance=args.slo_tolerance)
        return {"slo": args.slo.describe(), "ttft_p99_ms": args.slo.ttft_p99_ms, "tpot_p99_ms": args.slo.tpot_p99_ms,
                "start": args.starts[0], "prefix_cache": args.prefix_modes[0], "bounds": args.slo_bounds,
                "tolerance": args.slo_tolerance, "highest_rate_held": found.held, "lowest_rate_failed": found.failed,
                "probes": [probes[rate] for rate, _ in found.probes]}


# ---- output ----------------------------------------------------------------------------------

# The curve's columns: the median of the repeats and their range.
POINT_COLUMNS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "msg_gap_p99_ms",
                 "offered_tok_per_s", "achieved_tok_per_s", "running_peak")
RUN_COLUMNS = ["run", "ok", "errors", "start_to_serving_s", "graphs_before_serving", "captures_while_serving",
               "ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "itl_max_ms", "msg_gap_p99_ms", "msg_gap_max_ms",
               "step_gap_max_ms", "step_gap_max_capturing_ms", "achieved_tok_per_s", "prefix_hit_rate", "preemptions",
               "running_peak", "eager_steps", "lone_row_eager_steps"]
NOTES = ("a fresh server process per run; TTFT from the client's send to its first token; TPOT per request (last - "
         "first token) / (tokens - 1); itl_* per token (a message of m tokens counts as m gaps of its interval / m); "
         "msg_gap_* per message (the cadence of the server's writes); achieved_tok_per_s over the arrivals' span "
         "without its first fifth, offered_tok_per_s the output tokens asked for over that span; curve and search "
         "points give min / median / max over the repeats; step_gap_max from the server's /metrics, capture counts "
         "and stalls from its log")


def workload_info(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("model", "device", "dtype", "rates", "starts", "duration", "requests", "repeat", "prompt_median",
            "output_median", "sigma", "max_prompt", "max_output", "max_running_seqs", "warm_requests", "warm_rate",
            "bursts", "server_args", "seed", "shared_prefix", "prefix_modes", "slo_ttft_p99_ms", "slo_tpot_p99_ms",
            "slo_rates", "slo_tolerance", "constrained_share")
    return {k: getattr(args, k) for k in keys}


def point_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"run": p["run"], "repeats": p["repeats"], "errors": p["errors"],
             **{k: cell(p["spread"].get(k)) for k in POINT_COLUMNS},
             **({"slo": "held" if p["slo_held"] else "missed"} if "slo_held" in p else {})} for p in points]


def print_search(search: dict[str, Any]) -> None:
    print(f"\nSLO: {search['slo']}; {search['start']} starts, rates searched in {search['bounds']}")
    for p in search["probes"]:
        print(f"  {p['rate']:g}/s: {'held' if p['slo_held'] else 'missed'}  TTFT p99 {cell(p['spread'].get('ttft_p99_ms'))}"
              f"  TPOT p99 {cell(p['spread'].get('tpot_p99_ms'))}  ({p['repeats']} repeats, {p['errors']} errors)")
    held, failed = search["highest_rate_held"], search["lowest_rate_failed"]
    if held is None:
        print(f"highest rate holding the SLO: none; the low bound {failed:g}/s missed it")
    elif failed is None:
        print(f"highest rate holding the SLO: at least the high bound, {held:g}/s")
    else:
        print(f"highest rate holding the SLO: {held:g} requests/s ({failed:g}/s missed it)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    book = RunBook(args.book, workload_info(args), args.time_budget)
    campaign = Campaign(args, book)
    try:
        curve = [campaign.point(start, rate, mode) for start in args.starts for rate in args.rates
                 for mode in args.prefix_modes]
        search = campaign.search() if args.slo is not None else None
        for n, tokens in args.bursts:
            campaign.burst(n, tokens)
    except OutOfTime as stop:
        print(f"--time-budget reached before run {stop}: {len(book.runs)} runs recorded in {args.book}; "
              "run the same command again to go on")
        return OUT_OF_TIME
    rows = [row for key, row in book.runs.items() if key != "warming"]
    plotted = {p["run"]: p for p in curve + (search["probes"] if search else [])}
    slo_lines = {k: v for k, v in (("ttft_p99_ms", args.slo_ttft_p99_ms), ("tpot_p99_ms", args.slo_tpot_p99_ms))
                 if v is not None}
    path = write_result("serving-load", {
        "workload": workload_info(args), "results": rows, "curve": curve, "search": search, "notes": NOTES,
    }, device=args.device, figure=curve_figure(list(plotted.values()), slo_lines))
    title = (f"\n{args.model} {args.dtype} on {args.device}: Poisson, {args.duration:g} s of arrivals per run, "
             f"{f'a shared prefix of {args.shared_prefix} + ' if args.shared_prefix else ''}prompts ~{args.prompt_median} "
             f"and outputs ~{args.output_median} tokens (log-normal, sigma {args.sigma})")
    print_table(rows, RUN_COLUMNS, title=title + ", each run")
    if plotted:
        columns = ["run", "repeats", "errors", *POINT_COLUMNS] + (["slo"] if args.slo is not None else [])
        print_table(point_rows(list(plotted.values())), columns,
                    title="\nper rate: median [min-max] of the repeats (itl per token, msg_gap per message)")
    if args.constrained_share > 0:
        print_table(rows, ["run"] + [f"{c}_{k}" for c in ("constrained", "free") for k in ("requests", "tokens", *CLASS_KEYS)],
                    title=f"\nconstrained ({args.constrained_share:g} of the requests, a JSON schema) and free requests, each run")
    if search is not None:
        print_search(search)
    for row in rows:
        if row["errors"]:
            print(f"{row['run']}: first error: {row['first_error']}")
    print(f"wrote {path}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
