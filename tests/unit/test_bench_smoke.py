"""The benchmarks run end to end on a CPU at tiny sizes and write the JSON the README promises."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PROVENANCE = {"name", "command", "timestamp", "git_commit", "git_dirty", "source_digest", "machine", "packages"}


def _run(script: str, args: list[str], results: pathlib.Path, timeout: float = 120) -> dict:
    env = {**os.environ, "GRAPHSERVE_BENCH_RESULTS": str(results), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, f"bench/{script}", *args], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (path,) = results.glob("*.json")
    record = json.loads(path.read_text())
    assert PROVENANCE <= record.keys()
    assert record["command"].startswith(f"python bench/{script}")
    return record


def test_decode_bench(tmp_path: pathlib.Path) -> None:
    record = _run("decode_bench.py", [
        "--model", "builtin:tiny", "--device", "cpu", "--random-init", "--batches", "1,2", "--context", "16",
        "--iters", "2", "--warmup", "1", "--copy-mb", "8", "--anchors", "--anchor-batches", "1",
        "--anchor-new-tokens", "3", "--anchor-prompt", "8"], tmp_path)
    assert {"floor_ms", "copy_rate_gbps", "weight_bytes", "context"} <= record["summary"].keys()
    assert [r["batch"] for r in record["rows"]] == [1, 2]
    assert all({"eager_ms", "tokens_per_s", "bw_util"} <= r.keys() for r in record["rows"])
    anchors = record["anchors"]
    assert not anchors["errors"], anchors["errors"]
    assert anchors["generate"][0]["ms_per_token"] > 0 and anchors["static_cache"][0]["eager_ms"] > 0
    gpt_fast = anchors["gpt_fast"]  # measured in the same call (eager on a CPU), every sample kept
    assert not gpt_fast["errors"] and gpt_fast["compile"] == "none"
    assert [r["batch"] for r in gpt_fast["rows"]] == [1, 2] and all(len(r["samples_ms"]) == 2 for r in gpt_fast["rows"])
    assert "gpt_fast_reference_ms" not in record  # no figure typed in
    assert (tmp_path / record["plot"]).is_file()


def test_moe_benches(tmp_path: pathlib.Path) -> None:
    """The MoE layer alone, and a MoE model's decode step with the experts it touched and its floor."""
    layer = _run("moe_bench.py", ["--device", "cpu", "--shape", "tiny", "--tokens", "1,8", "--iters", "2",
                                  "--warmup", "1", "--dtype", "float32"], tmp_path / "layer")
    assert [r["tokens"] for r in layer["rows"]] == [1, 8]
    assert all(isinstance(r["ours_eager_ms"], float) and r["touched"] >= 2 for r in layer["rows"])
    step = _run("decode_bench.py", ["--model", "builtin:tiny-qwen3-moe", "--device", "cpu", "--random-init", "--batches",
                                    "1,4", "--context", "16", "--iters", "2", "--warmup", "1", "--copy-mb", "8",
                                    "--no-anchors", "--no-plot"], tmp_path / "step")
    assert [r["touched_experts"] for r in step["rows"]][0] == 2  # top-2 of 8 for one token
    assert all(r["floor_active_ms"] > 0 and r["active_bytes"] < step["summary"]["weight_bytes"] for r in step["rows"])


def test_serve_bench(tmp_path: pathlib.Path) -> None:
    record = _run("serve_bench.py", [
        "--device", "cpu", "--cache-dir", str(tmp_path / "models"), "--concurrency", "1,4",
        "--prompt-tokens", "16", "--output-tokens", "8", "--warmup-requests", "0",
        "--server-log", str(tmp_path / "server.log"), "--server-args", "--log-level info", "--step-baseline"], tmp_path)
    rows = record["results"]
    assert [(r["streams"], r["path"]) for r in rows] == [(1, "grpc"), (1, "engine"), (4, "grpc"), (4, "engine")]
    for row in rows:  # 4 requests per stream at each level, on one server and one engine process
        assert row["ok"] == 4 * row["streams"] and row["tokens"] == 8 * row["ok"] and row["short_requests"] == 0
        assert {"ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "req_per_s", "tok_per_s"} <= row.keys()
        # the engine's own times, through gRPC (the Finished message) and on the engine alone (Finish)
        assert 0 <= row["server_queue_p50_ms"] <= row["server_ttft_p50_ms"] <= row["ttft_p50_ms"], row
    # the step at this workload's contexts (16 prompt + 8 output tokens), timed in the same invocation
    step = record["graphed_step"]
    assert step["mode"] == "eager" and step["contexts"] == [16, 19, 22] and [r["batch"] for r in step["rows"]] == [1, 4]
    for row in rows:
        allows = next(r["allows_tok_per_s"] for r in step["rows"] if r["batch"] == row["streams"])
        assert row["vs_graphed_step"] == pytest.approx(row["tok_per_s"] / allows)
    assert set(record["grpc_over_engine_token_throughput"]) == {"1", "4"}
    assert all(v > 0 for v in record["grpc_over_engine_token_throughput"].values())
    # the server's log splits its first tokens by level
    split = subprocess.run([sys.executable, "bench/first_token_split.py", str(tmp_path / "server.log"), "--levels", "1,4",
                            "--min-tokens", "8"], check=True, cwd=REPO, capture_output=True, text=True, timeout=60)
    levels = [line.split() for line in split.stdout.splitlines() if line.split()[:1] in (["1"], ["4"])]
    assert [(cells[0], cells[1]) for cells in levels] == [("1", "4"), ("4", "16")], split.stdout


def test_serving_load(tmp_path: pathlib.Path) -> None:
    record = _run("serving_load.py", [
        "--device", "cpu", "--cache-dir", str(tmp_path / "models"), "--rates", "8", "--requests", "6", "--repeat", "2",
        "--starts", "warm", "--warm-requests", "3", "--prompt-median", "16", "--output-median", "6",
        "--max-prompt", "64", "--max-output", "16", "--max-running-seqs", "8", "--burst", "3:32",
        "--slo-ttft-p99-ms", "100000", "--slo-rates", "8,16"], tmp_path, timeout=180)
    runs = {r["run"]: r for r in record["results"]}
    # the search's probe at 8/s is the curve's point, not run again
    assert list(runs) == ["warm 8/s #1", "warm 8/s #2", "warm 16/s #1", "warm 16/s #2", "burst 3x32"]
    assert [runs["warm 8/s #1"]["seed"], runs["warm 8/s #2"]["seed"]] == [0, 1]  # each repeat a fresh draw
    assert (tmp_path / record["plot"]).is_file()  # the rate curve
    for row in runs.values():
        n = 3 if row["rate"] is None else 6
        assert row["ok"] == n and row["errors"] == 0
        assert row["start_to_serving_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
        assert row["itl_max_ms"] >= row["itl_p99_ms"] > 0 and row["msg_gap_max_ms"] >= row["msg_gap_p99_ms"] > 0
        assert row["tpot_p99_ms"] >= row["tpot_p50_ms"] > 0 and row["step_gap_max_ms"] > 0  # from the server's /metrics
        # on a CPU every step is eager (mode none); the lone rows' share from this run's stats, not the last run's
        assert row["eager_steps"] > 0 and 0 <= row["lone_row_eager_steps"] <= row["eager_steps"]
    assert [(p["run"], p["repeats"], p["slo_held"]) for p in record["curve"]] == [("warm 8/s", 2, True)]
    ttft = record["curve"][0]["spread"]["ttft_p99_ms"]
    assert sorted([runs["warm 8/s #1"]["ttft_p99_ms"], runs["warm 8/s #2"]["ttft_p99_ms"]]) == [ttft["min"], ttft["max"]]
    assert ttft["median"] == pytest.approx((ttft["min"] + ttft["max"]) / 2)
    search = record["search"]  # a limit every rate keeps: the high bound holds
    assert (search["highest_rate_held"], search["lowest_rate_failed"]) == (16.0, None)
    assert [p["rate"] for p in search["probes"]] == [8.0, 16.0]


def test_serving_load_reports_constrained_and_free_requests_apart(tmp_path: pathlib.Path) -> None:
    from bench.load_client import workload
    from bench.serving_load import parse_args

    args = parse_args(["--device", "cpu", "--cache-dir", str(tmp_path / "models"), "--constrained-share", "0.5"])
    mixed, free = workload(args, 40, 3), workload(parse_args(["--device", "cpu"]), 40, 3)
    assert [(i.prompt, i.output_tokens) for i in mixed] == [(i.prompt, i.output_tokens) for i in free]
    assert 0 < sum(i.constrained for i in mixed) < 40 and not any(i.constrained for i in free)
    record = _run("serving_load.py", [
        "--device", "cpu", "--cache-dir", str(tmp_path / "models"), "--rates", "8", "--requests", "8", "--repeat", "1",
        "--starts", "cold", "--prompt-median", "16", "--output-median", "12", "--max-prompt", "64",
        "--max-output", "24", "--max-running-seqs", "8", "--constrained-share", "0.5"], tmp_path, timeout=180)
    row, = record["results"]
    constrained = sum(i.constrained for i in workload(parse_args(["--device", "cpu", "--rates", "8", "--requests", "8",
                      "--prompt-median", "16", "--output-median", "12", "--max-prompt", "64", "--max-output", "24",
                      "--constrained-share", "0.5"]), 8, 0))
    assert (row["constrained_requests"], row["free_requests"]) == (constrained, 8 - constrained)
    assert row["constrained_errors"] == row["free_errors"] == 0
    assert row["constrained_tokens"] + row["free_tokens"] == row["tokens"]
    for cls in ("constrained", "free"):
        assert row[f"{cls}_tpot_p99_ms"] >= row[f"{cls}_tpot_p50_ms"] > 0
        assert row[f"{cls}_itl_max_ms"] >= row[f"{cls}_itl_p99_ms"] > 0


def test_hostile_constraints_flood_splits_first_token_time_at_the_server(tmp_path: pathlib.Path) -> None:
    record = _run("hostile_constraints.py", [
        "--scenarios", "flood", "--repeat", "0", "--flood", "2", "--ttft-samples", "4",
        "--cache-dir", str(tmp_path / "models")], tmp_path, timeout=180)
    flood = record["flood"]
    inside = flood["server_ms"]
    for side in ("alone", "flood"):
        client = flood[f"ttft_{side}_ms"]
        server, queue = inside[f"first_token_{side}_ms"], inside[f"queue_{side}_ms"]
        assert len(client) == len(server) == len(queue) == 4
        # The server's span (arrival to first token) lies inside the client's (send to first chunk),
        # and its queueing inside that; all three in ms (0.1 ms rounding each).
        for c, s, q in zip(client, server, queue, strict=True):
            assert 0 <= q <= s + 0.1 and 0 < s <= c + 0.1, (c, s, q)
    assert flood["hostile_in_flight_while_measured"] > 0


def test_host_budget(tmp_path: pathlib.Path) -> None:
    record = _run("host_budget.py", [
        "--device", "cpu", "--dtype", "float32", "--model", "builtin:tiny", "--cache-dir", str(tmp_path / "models"),
        "--streams", "2,4", "--output-tokens", "6"], tmp_path)
    assert [r["streams"] for r in record["rows"]] == [2, 4]
    for row in record["rows"]:
        assert row["steps"] >= 6 and row["tokens_per_s"] > 0 and row["forward"] > 0
        parts = ("schedule", "inputs", "forward", "sample", "read", "outputs", "publish", "other")
        assert row["host_ms"] == pytest.approx(sum(row[p] for p in parts), abs=0.01)


def test_output_budget(tmp_path: pathlib.Path) -> None:
    record = _run("output_budget.py", ["--model", "builtin:tiny", "--streams", "2,3", "--steps", "4", "--repeats", "1"],
                  tmp_path)
    rows = record["rows"]
    assert [(r["tokens"], r["streams"]) for r in rows] == [(k, n) for k in ("text", "random", "ids") for n in (2, 3)]
    assert all(r["outputs_ms"] > 0 and r["us_per_token"] > 0 and r["publish_ms"] >= 0 for r in rows)


def test_graph_parity(tmp_path: pathlib.Path) -> None:
    record = _run("graph_parity.py", [
        "--model", "builtin:tiny", "--device", "cpu", "--dtype", "float32", "--cache-dir", str(tmp_path / "models"),
        "--prompts", "2", "--prompt-tokens", "8", "--tokens", "4"], tmp_path)
    assert [r["prompt"] for r in record["rows"]] == [0, 1]
    assert record["identical"] == 2  # on the CPU both modes run the same eager kernels


def test_gateway_bench(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("smg")
    record = _run("gateway_bench.py", [
        "--device", "cpu", "--cache-dir", str(tmp_path / "models"), "--concurrency", "4", "--requests", "8",
        "--prompt-tokens", "32", "--output-tokens", "8", "--warmup-requests", "0"], tmp_path)
    rows = {row["path"]: row for row in record["results"]}
    assert set(rows) == {"grpc", "grpc text", "smg"}
    for row in rows.values():  # smg forwarded ignore_eos and counted the same prompt length
        assert row["ok"] == 8 and row["tokens"] == 64 and row["short_requests"] == 0
        assert row["itl_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
    assert rows["smg"]["smg_cpu_s"] is not None  # read from /proc (a few clock ticks at this size)
    assert record["smg_over_direct_median"]["tok_per_s"] > 0


def test_lora_bench(tmp_path: pathlib.Path) -> None:
    record = _run("lora_bench.py", [
        "--model", "builtin:tiny", "--device", "cpu", "--batches", "1,2", "--iters", "2", "--warmup", "1",
        "--streams", "2", "--context", "16", "--cache-dir", str(tmp_path / "cache")], tmp_path)
    assert [r["batch"] for r in record["rows"]] == [1, 2]
    assert all({"base_ms", "stacked_ms", "gather_ms", "stacked_ratio", "gather_ratio"} <= r.keys() for r in record["rows"])
    loads = record["load"]
    assert [r["load"] for r in loads] == ["first", "second"]
    assert all(r["streams"] == 2 and r["step_gap_max_during_ms"] > 0 and r["usable_ms"] > 0 for r in loads)


def test_tp_decode_bench(tmp_path: pathlib.Path) -> None:
    record = _run("tp_decode_bench.py", [
        "--model", "builtin:tiny", "--device", "cpu", "--tp-sizes", "1,2", "--batches", "1,2", "--context", "8",
        "--iters", "2", "--warmup", "1"], tmp_path)
    rows = record["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["eager_ms"] > 0 for r in rows)
    assert rows[2]["eager_vs_tp1"] > 0


def test_startup_bench(tmp_path: pathlib.Path) -> None:
    record = _run("startup_bench.py", ["--cache-dir", str(tmp_path / "models"), "--repeat", "2"], tmp_path,
                  timeout=300)
    runs = record["runs"]
    # run 1 starts with an empty compile cache and leaves it to run 2
    assert [(r["run"], r["compile_cache"]) for r in runs] == [(1, "miss"), (2, "hit")]
    for r in runs:
        assert 0 < r["server_serving_s"] and 0 < r["start_to_serving_s"] <= r["start_to_first_token_s"]
        assert r["server_serving_s"] <= r["server_first_token_s"]
        assert list(r["phases_s"])[-1] == "serving" and "engine.weights_loaded" in r["phases_s"]
    assert [p["phase"] for p in record["phases"]] == list(runs[0]["durations_s"])
    assert record["summary_median"]["start_to_first_token_s"] > 0
