"""A replica killed under load behind `graphserve gateway`: how long until it serves again, and
whether any request that started after the kill failed.

For each of --repeat runs, starts `graphserve gateway --replicas R` afresh (round robin, so the
killed replica had its share of the load), keeps --clients clients sending 16-token completions
through the OpenAI endpoint (official `openai` client), kills replica 0's process tree with SIGKILL
after --warm-s seconds, and records the seconds from the kill until the gateway logs the replica
"SERVING again", the first start's seconds (gateway start to the endpoint listing the model), and
the requests that started after the kill with their outcomes. The supervision test
(tests/integration/test_gateway_supervision.py) asserts the same on one run; this reports repeats.

    python bench/replica_restart.py                       # CPU: builtin:tiny, 2 replicas, 3 runs
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="fresh gateways, one after the other")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=3, help="closed-loop clients sending completions")
    p.add_argument("--warm-s", type=float, default=3.0, help="seconds of load before the kill")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="where built-in models are generated")
    p.add_argument("--results-dir", type=pathlib.Path, default=None, help="default: bench/results/")
    return p.parse_args(argv)


def one_run(args: argparse.Namespace, work: pathlib.Path) -> dict:
    from tests.support.gateway import API_KEY, MODEL, GatewayCommand, kill_replica_under_load

    cache = args.cache_dir or work / "models"
    gateway = GatewayCommand(work, MODEL, "--replicas", str(args.replicas), "--api-key", API_KEY,
                             "--model-cache-dir", str(cache), "--max-num-seqs", "8", "--max-model-len", "512")
    try:
        started = time.monotonic()
        gateway.wait_ready()
        first_start = time.monotonic() - started
        run = kill_replica_under_load(gateway, args.clients, args.warm_s, settle_s=args.warm_s)
        back, after = run.back_after, run.after
        return {"first_start_s": round(first_start, 2), "back_after_kill_s": round(back, 2) if back else None,
                "requests_after_kill": len(after), "failed_after_kill": [o for o in after if o != "ok"]}
    finally:
        gateway.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="graphserve-restart-") as work:
            run = {"run": i + 1, **one_run(args, pathlib.Path(work))}
        print(f"run {run['run']}: first start {run['first_start_s']} s, back {run['back_after_kill_s']} s after the "
              f"kill, {run['requests_after_kill']} requests after it, {len(run['failed_after_kill'])} failed", flush=True)
        runs.append(run)
    backs = [r["back_after_kill_s"] for r in runs if r["back_after_kill_s"] is not None]
    summary = {"back_after_kill_s_median": statistics.median(backs) if backs else None,
               "back_after_kill_s_range": [min(backs), max(backs)] if backs else None,
               "never_back": sum(r["back_after_kill_s"] is None for r in runs),
               "failed_after_kill": sum(len(r["failed_after_kill"]) for r in runs)}
    print_table([r | {"failed": len(r["failed_after_kill"])} for r in runs],
                ["run", "first_start_s", "back_after_kill_s", "requests_after_kill", "failed"])
    path = write_result("replica_restart", {"command": " ".join(sys.argv), "config": vars(args) | {
        "cache_dir": str(args.cache_dir), "results_dir": str(args.results_dir)}, "runs": runs, "summary": summary},
        device="cpu", results_dir=args.results_dir)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
