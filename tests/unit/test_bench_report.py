"""README's benchmark tables come from the newest result files: what a reader sees is what the files
hold, an anchor without measurements has no row, and the committed README matches bench/results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report

H200 = {"gpu": "NVIDIA H200"}
MARKED = "".join(f"intro\n<!-- bench-report:{kind} -->\nold text\n<!-- /bench-report:{kind} -->\n" for kind in report.KINDS)


def write(root: Path, name: str, record: dict) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": H200, "git_commit": "a" * 40, "git_dirty": False, "source_digest": "d",
                                **record}))


def decode(timestamp: str, graph_1: float, anchors: dict | None) -> dict:
    return {"name": "decode", "timestamp": timestamp, "anchors": anchors,
            "summary": {"model": "builtin:llama-1b", "context": 512, "dtype": "bfloat16", "floor_ms": 0.58},
            "rows": [{"batch": 1, "graph_ms": graph_1, "eager_ms": 7.0}, {"batch": 64, "graph_ms": 1.5, "eager_ms": 6.0}]}


def serve(timestamp: str, prompt: int, output: int, step: bool) -> dict:
    rows = [{"streams": 64, "path": p, "tok_per_s": t, "ttft_p50_ms": 40.0, "ttft_p99_ms": 60.0, "tpot_p50_ms": 1.5,
             **({"vs_graphed_step": t / 45000.0} if step else {})} for p, t in (("grpc", 41000.0), ("engine", 44000.0))]
    return {"name": "serve", "timestamp": timestamp, "results": rows,
            "workload": {"model": "builtin:llama-1b", "prompt_tokens": prompt, "output_tokens": output, "rate": None,
                         "client_procs": 8, "server_args": ""}}


def point(rate: float, ttft: tuple, tpot: tuple, held: bool) -> dict:
    spread = {k: dict(zip(("min", "median", "max"), v)) for k, v in (
        ("ttft_p50_ms", (10.0, 11.0, 12.0)), ("ttft_p99_ms", ttft), ("tpot_p50_ms", (1.4, 1.5, 1.6)), ("tpot_p99_ms", tpot),
        ("itl_p99_ms", (3.0, 3.0, 3.0)), ("msg_gap_p99_ms", (20.0, 25.0, 30.0)),
        ("offered_tok_per_s", (2600.0, 2700.0, 2800.0)), ("achieved_tok_per_s", (2500.0, 2650.0, 2750.0)))}
    return {"run": f"warm {rate:g}/s", "rate": rate, "start": "warm", "repeats": 3, "spread": spread, "slo_held": held}


def chat(timestamp: str) -> dict:
    curve = [point(20.0, (30.0, 35.0, 40.0), (2.0, 2.2, 2.5), True), point(150.0, (50.0, 70.0, 250.0), (8.0, 9.0, 12.0), False)]
    return {"name": "serving-load", "timestamp": timestamp, "curve": curve, "results": [{"run": "warm 20/s #1", "rate": 20.0}],
            "workload": {"model": "builtin:llama-1b", "prompt_median": 270, "output_median": 135, "shared_prefix": 0,
                         "server_args": "", "repeat": 3, "duration": 30.0},
            "search": {"slo": "TTFT p99 <= 200 ms and TPOT p99 <= 10 ms, every repeat, no errors", "start": "warm",
                       "highest_rate_held": 100.0, "lowest_rate_failed": 150.0,
                       "probes": [point(150.0, (50.0, 70.0, 250.0), (8.0, 9.0, 12.0), False),
                                  point(100.0, (40.0, 45.0, 50.0), (5.0, 6.0, 7.0), True)]}}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    old_anchors = {"static_cache": [{"batch": 1, "graph_ms": 2.5}, {"batch": 64, "graph_ms": 9.4}]}
    write(root, "old/decode-a.json", decode("2026-12-01T00:00:00+00:00", 1.00, old_anchors))
    gpt_fast = {"compile": "reduce-overhead", "rows": [{"batch": 1, "ms": 1.17, "samples_ms": [1.1, 1.17, 1.2]},
                                                       {"batch": 64, "ms": 2.71, "samples_ms": [2.7, 2.71, 2.8]}]}
    write(root, "new/decode-b.json", decode("2026-12-06T00:00:00+00:00", 0.87, {"static_cache": [], "gpt_fast": gpt_fast}))
    write(root, "tmp/decode-c.json", decode("2026-12-07T00:00:00+00:00", 0.10, None))  # a smoke run: never reported
    write(root, "new/serve-128.json", serve("2026-12-06T00:00:00+00:00", 128, 128, step=False))
    write(root, "new/serve-32.json", serve("2026-12-06T00:00:00+00:00", 32, 256, step=True))
    write(root, "new/load.json", chat("2026-12-06T01:00:00+00:00"))
    return root


def test_each_table_comes_from_the_newest_fitting_file_with_only_measured_columns(results: Path) -> None:
    bodies = report.regions(results)
    decode_table = bodies["decode"]
    assert "`bench/results/new/decode-b.json`: 2026-12-06, NVIDIA H200, commit aaaaaaa" in decode_table
    assert "| graphserve, CUDA graph | 0.87 | 1.50 |" in decode_table
    assert "| gpt-fast, torch.compile reduce-overhead | 1.17 | 2.71 |" in decode_table
    assert "StaticCache" not in decode_table  # the newest run measured none: the older run's figures stay out
    assert "1.00" not in decode_table and "0.10" not in decode_table
    assert "| 64 | 41.0k | 44.0k | 0.93 | 40.0 / 60.0 ms | 1.50 ms | 0.91 |" in bodies["closed-loop-32"]
    assert "share of the graphed step" not in bodies["closed-loop-128"]  # not timed in that call
    chat_table = bodies["chat-load"]
    assert "| warm 150/s | 11.0 (10.0-12.0) | 70.0 (50.0-250) | 1.50 (1.40-1.60) | 9.00 (8.00-12.0) | 3.00 |" in chat_table
    assert "| 2.7k (2.6k-2.8k) | 2.6k (2.5k-2.8k) |" in chat_table
    assert "**100 requests/s (150/s missed it)**" in bodies["slo"]
    assert bodies["slo"].index("| 100 | held") < bodies["slo"].index("| 150 | missed")


def test_check_fails_on_a_hand_edited_table_until_the_report_is_written(results: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(MARKED)
    args = ["--results", str(results), "--readme", str(readme)]
    assert report.main([*args, "--check"]) == 1
    assert report.main(args) == 0
    assert report.main([*args, "--check"]) == 0 and readme.read_text().count("intro\n") == len(report.KINDS)
    readme.write_text(readme.read_text().replace("| 0.87 |", "| 0.80 |"))
    assert report.main([*args, "--check"]) == 1


def test_without_an_slo_search_the_readme_says_it_was_not_measured(results: Path) -> None:
    (results / "new/load.json").write_text(json.dumps({**json.loads((results / "new/load.json").read_text()), "search": None}))
    assert report.regions(results)["slo"].startswith("Not measured yet")


def test_the_readme_tables_match_the_committed_results() -> None:
    assert report.main(["--check"]) == 0, "run `make bench-report`"
