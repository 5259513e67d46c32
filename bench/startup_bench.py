"""Scale from zero: from a new `graphserve serve` process to its first token, and where the time goes.

Each run starts a fresh server process (as a new pod would), polls gRPC health until SERVING, sends
one greedy Generate (a short prompt, one token) and records, from the moment the process was
started: SERVING and the first token (the client's clock), then stops it and reads the server's
`startup_timeline` log event: the end of each phase of its start (this process's and the engine
process's) in seconds since the process started, and `startup_first_token`: when it wrote that
token. Runs share one `--compile-cache-dir`, empty before the first run unless given: run 1 starts
with an empty compile cache, the next ones with the one it left (`compile_cache` says which, from
the server's log). `--stats-file` gives every run the same graph statistics file (a warm start on a
GPU).

    python bench/startup_bench.py                                        # the built-in model on the CPU
    python bench/startup_bench.py --model /models/Llama-3.2-1B-Instruct --device cuda --repeat 5
    python bench/startup_bench.py --model builtin:llama-1b --device cuda --stats-file /tmp/s.json

The table and JSON go to bench/results/ (`--out-dir`), with bench/provenance.py's record.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result  # noqa: E402

PROMPT = "Once upon a time"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeat", type=int, default=3, help="fresh server processes, one after the other")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="where built-in models are generated")
    p.add_argument("--compile-cache-dir", type=pathlib.Path, default=None,
                   help="shared by the runs (default: a new empty directory, so run 1 starts without one)")
    p.add_argument("--stats-file", type=pathlib.Path, default=None, help="graph statistics for every run")
    p.add_argument("--server-args", default="", help="more flags for every started server")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to reach SERVING")
    p.add_argument("--out-dir", type=pathlib.Path, default=None, help="default: bench/results/")
    return p.parse_args(argv)


def one_start(args: argparse.Namespace, compile_cache: pathlib.Path, log_path: pathlib.Path) -> dict:
    """One fresh server: seconds from its process start to SERVING and to the first token, and its timeline."""
    from grpc_health.v1 import health_pb2

    from bench.load_server import log_events
    from service.proto import inference_pb2, inference_pb2_grpc
    from tests.support.process import ServerProcess

    argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--admin-port", "0",
            "--log-level", "info", "--compile-cache-dir", str(compile_cache)]
    if args.cache_dir is not None:
        argv += ["--model-cache-dir", str(args.cache_dir)]
    if args.stats_file is not None:
        argv += ["--stats-file", str(args.stats_file)]
    argv += shlex.split(args.server_args)
    started = time.monotonic()
    proc = ServerProcess(argv, log_path=log_path)
    try:
        proc.wait_for_health(health_pb2.HealthCheckResponse.SERVING, timeout=args.timeout)
        serving = time.monotonic() - started
        request = inference_pb2.GenerateRequest(
            text=PROMPT, sampling=inference_pb2.SamplingParams(temperature=0.0),
            stopping=inference_pb2.StoppingCriteria(max_tokens=1, ignore_eos=True))
        first_token = None
        for response in inference_pb2_grpc.InferenceStub(proc.channel).Generate(request, timeout=120):
            if first_token is None and response.WhichOneof("kind") == "chunk":
                first_token = time.monotonic() - started
        proc.terminate()
        proc.wait(120)
        command = shlex.join(proc.proc.args)
    finally:
        proc.close()
    [timeline] = log_events(log_path, "startup_timeline")
    first_written = log_events(log_path, "startup_first_token")
    hits, misses = log_events(log_path, "compile_cache_hit"), log_events(log_path, "compile_cache_miss")
    return {"start_to_serving_s": round(serving, 3),
            "start_to_first_token_s": None if first_token is None else round(first_token, 3),
            "server_serving_s": timeline["serving_s"],
            "server_first_token_s": first_written[0]["seconds"] if first_written else None,
            "compile_cache": "hit" if hits and not misses else "miss" if misses else "none",
            "phases_s": timeline["seconds"], "durations_s": timeline["durations"], "server_command": command}


def phase_rows(runs: list[dict]) -> list[dict]:
    """Per phase, in the order of the first run: its length (median and range over the runs)."""
    rows = []
    for phase in runs[0]["durations_s"]:
        values = [r["durations_s"][phase] for r in runs if phase in r["durations_s"]]
        ends = [r["phases_s"][phase] for r in runs if phase in r["phases_s"]]
        rows.append({"phase": phase, "median_s": statistics.median(values), "min_s": min(values),
                     "max_s": max(values), "ends_at_median_s": statistics.median(ends)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="graphserve-startup-") as tmp:
        compile_cache = args.compile_cache_dir or pathlib.Path(tmp) / "compile"
        runs = []
        for i in range(args.repeat):
            run = {"run": i + 1, **one_start(args, compile_cache, pathlib.Path(tmp) / f"server-{i}.log")}
            runs.append(run)
            print(f"run {run['run']}: SERVING {run['start_to_serving_s']} s, first token "
                  f"{run['start_to_first_token_s']} s (compile cache {run['compile_cache']})", flush=True)
    phases = phase_rows(runs)
    summary = {k: statistics.median(r[k] for r in runs)
               for k in ("start_to_serving_s", "start_to_first_token_s", "server_serving_s", "server_first_token_s")}
    path = write_result("startup", {
        "workload": {"model": args.model, "device": args.device, "dtype": args.dtype, "repeat": args.repeat,
                     "prompt": PROMPT, "max_tokens": 1, "stats_file": args.stats_file is not None,
                     "server_args": args.server_args},
        "summary_median": summary, "runs": runs, "phases": phases,
    }, device=args.device, results_dir=args.out_dir)
    print_table(runs, ["run", "compile_cache", "start_to_serving_s", "start_to_first_token_s", "server_serving_s",
                       "server_first_token_s"],
                title=f"\n{args.model} on {args.device}: a fresh process per run (seconds from its start)")
    print_table(phases, ["phase", "median_s", "min_s", "max_s", "ends_at_median_s"],
                title="\nwhere the time goes: each phase's length, median [min, max] over the runs")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
