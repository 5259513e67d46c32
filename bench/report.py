"""README's benchmark tables, generated from the newest result files so that a table cannot drift
from its data (`make bench-report`; `--check` fails where README differs from what this writes).

Each table lives in README between `<!-- bench-report:KIND -->` and `<!-- /bench-report:KIND -->`
and is rewritten whole from the newest JSON (by its recorded timestamp) under bench/results/ that
fits its kind, GPU runs only (`tmp/` is left out). A column appears only where that file holds its
measurements: an anchor the run did not measure, or a figure a file from before the per-token
measures does not have, is absent, never typed in. Each table names its file, commit and machine.
bench/NOTES.md keeps the history.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
Record = tuple[Path, dict[str, Any]]


def load_results(root: Path) -> list[Record]:
    out = []
    for path in sorted(root.rglob("*.json")):
        if "tmp" in path.relative_to(root).parts[:1]:
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("name") and record.get("timestamp"):
            out.append((path, record))
    return out


def newest(records: list[Record], fits: Callable[[dict[str, Any]], bool]) -> Record | None:
    chosen = [(r["timestamp"], str(p), p, r) for p, r in records if fits(r) and (r.get("machine") or {}).get("gpu")]
    return max(chosen, key=lambda c: c[:2])[2:] if chosen else None


# ---- formatting ------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def ms_unit(value: float | None) -> str:
    return "-" if value is None else f"{ms(value)} ms"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.1f}k" if value >= 1000 else f"{value:,.0f}"


def spread_cell(point: dict[str, Any], key: str, fmt: Callable[[float | None], str] = ms) -> str:
    s = point["spread"].get(key)
    if not s:
        return "-"
    return fmt(s["median"]) if s["min"] == s["max"] else f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def table(header: list[str], rows: list[list[str]], right: int = 1) -> str:
    align = ["---"] * right + ["---:"] * (len(header) - right)
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, align, *rows])


def caption(path: Path, record: dict[str, Any], root: Path) -> str:
    commit = record.get("git_commit")
    if "source_digest" not in record:  # written before provenance was read at run time: possibly stale
        said = f"recorded commit {(commit or 'unknown').removesuffix('-dirty')[:7]} (an older file: unchecked)"
    elif commit:
        said = f"commit {commit[:7]}{' with uncommitted changes' if record.get('git_dirty') else ''}"
    else:
        said = f"commit unknown, source digest {record['source_digest']}"
    gpu = (record.get("machine") or {}).get("gpu")
    return f"From `bench/results/{path.relative_to(root).as_posix()}`: {record['timestamp'][:10]}, {gpu}, {said}."


# ---- the tables ------------------------------------------------------------------------------


def is_decode(r: dict[str, Any]) -> bool:
    s = r.get("summary") or {}
    return (r["name"] == "decode" and s.get("model") == "builtin:llama-1b" and s.get("context") == 512
            and s.get("dtype") == "bfloat16" and s.get("buckets", "list") == "list")


def render_decode(rec: Record, root: Path) -> str:
    path, r = rec
    batches = [row["batch"] for row in r["rows"]]
    lines = [["graphserve, CUDA graph", *[ms(row.get("graph_ms")) for row in r["rows"]]],
             ["graphserve, eager", *[ms(row.get("eager_ms")) for row in r["rows"]]]]
    anchors = r.get("anchors") or {}
    static = {row["batch"]: row for row in anchors.get("static_cache", [])}
    if any(row.get("graph_ms") for row in static.values()):
        lines.append(["transformers + StaticCache, graphed by hand", *[ms(static.get(b, {}).get("graph_ms")) for b in batches]])
    fast = {row["batch"]: row for row in (anchors.get("gpt_fast") or {}).get("rows", [])}
    if fast:
        mode = anchors["gpt_fast"].get("compile")
        lines.append([f"gpt-fast, torch.compile {mode}", *[ms(fast.get(b, {}).get("ms")) for b in batches]])
    floor = (r.get("summary") or {}).get("floor_ms")
    if floor:
        lines.append(["bandwidth floor (weights / measured copy rate)", f"{floor:.3f}", *[""] * (len(batches) - 1)])
    measured = "; anchors measured in the same call" if fast or static else "; no anchor was measured in this run"
    return (f"{caption(path, r, root)} Context 512{measured}.\n\n"
            + table(["ms per decode step", *[f"batch {b}" for b in batches]], lines))


def closed_loop_fits(prompt: int, output: int) -> Callable[[dict[str, Any]], bool]:
    def fits(r: dict[str, Any]) -> bool:
        w = r.get("workload") or {}
        paths = {row.get("path") for row in r.get("results", [])}
        return (r["name"] == "serve" and w.get("model") == "builtin:llama-1b" and w.get("prompt_tokens") == prompt
                and w.get("output_tokens") == output and w.get("rate") is None and {"grpc", "engine"} <= paths
                and not w.get("target"))
    return fits


def render_closed_loop(rec: Record, root: Path) -> str:
    path, r = rec
    w = r["workload"]
    by = {(row.get("streams", w.get("concurrency")), row["path"]): row for row in r["results"]}
    levels = sorted({s for s, _ in by})
    with_step = any("vs_graphed_step" in row for row in r["results"])
    header = ["streams", "through gRPC, tokens/s", "engine alone", "gRPC / engine", "TTFT p50 / p99 (gRPC)",
              "TPOT p50 (gRPC)"] + (["share of the graphed step (same call)"] if with_step else [])
    rows = []
    for s in levels:
        g, e = by.get((s, "grpc"), {}), by.get((s, "engine"), {})
        ratio = f"{g['tok_per_s'] / e['tok_per_s']:.2f}" if g.get("tok_per_s") and e.get("tok_per_s") else "-"
        row = [str(s), rate(g.get("tok_per_s")), rate(e.get("tok_per_s")), ratio,
               f"{ms(g.get('ttft_p50_ms'))} / {ms(g.get('ttft_p99_ms'))} ms", ms_unit(g.get("tpot_p50_ms"))]
        if with_step:
            row.append(f"{g['vs_graphed_step']:.2f}" if g.get("vs_graphed_step") else "-")
        rows.append(row)
    server = f", server `{w['server_args']}`" if w.get("server_args") else ""
    note = "" if with_step else " No decode step was timed in this call, so no share of it is given."
    return (f"{caption(path, r, root)} {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, "
            f"{w.get('client_procs', 1)} client processes{server}.{note}\n\n" + table(header, rows, right=0))


def is_chat_load(r: dict[str, Any]) -> bool:
    w = r.get("workload") or {}
    return (r["name"] == "serving-load" and w.get("model") == "builtin:llama-1b" and w.get("prompt_median") == 270
            and w.get("output_median") == 135 and not w.get("shared_prefix") and "--quantization" not in w.get("server_args", "")
            and any(row.get("rate") for row in r.get("results", [])))


def render_chat_load(rec: Record, root: Path) -> str:
    path, r = rec
    w = r["workload"]
    if "curve" not in r:  # before per-token measures: one run per rate, ITL per message
        rows = [[row["run"], f"{ms(row['ttft_p50_ms'])} / {ms(row['ttft_p99_ms'])}",
                 f"{ms(row['itl_p50_ms'])} / {ms(row['itl_p99_ms'])} / {ms(row['itl_max_ms'])}",
                 rate(row.get("out_tok_per_s")), f"{row.get('running_peak', 0):.0f}"]
                for row in r["results"] if row.get("rate")]
        return (f"{caption(path, r, root)} One run per rate of {w['requests']} requests (a few seconds of arrivals); "
                "this file predates TPOT, per-token ITL and repeats: its gaps are per message, and with paced writes "
                "a message carries several tokens. The H200 campaign's serving-load run replaces it.\n\n"
                + table(["run", "TTFT p50 / p99 ms", "message gap p50 / p99 / max ms", "output tokens/s", "running peak"],
                        rows))
    rows = [[p["run"], spread_cell(p, "ttft_p50_ms"), spread_cell(p, "ttft_p99_ms"), spread_cell(p, "tpot_p50_ms"),
             spread_cell(p, "tpot_p99_ms"), spread_cell(p, "itl_p99_ms"), spread_cell(p, "msg_gap_p99_ms"),
             spread_cell(p, "offered_tok_per_s", rate), spread_cell(p, "achieved_tok_per_s", rate)] for p in r["curve"]]
    return (f"{caption(path, r, root)} {w['repeat']} runs per rate on fresh servers, {w['duration']:g} s of arrivals "
            "each: the median of the runs, their range in brackets. ITL is per token; message gap is the cadence of "
            "the server's writes.\n\n"
            + table(["run", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms",
                     "message gap p99 ms", "offered tokens/s", "achieved tokens/s"], rows))


def is_slo_search(r: dict[str, Any]) -> bool:
    return r["name"] == "serving-load" and bool(r.get("search")) and (r.get("workload") or {}).get("model") == "builtin:llama-1b"


def render_slo(rec: Record | None, root: Path) -> str:
    if rec is None:
        return ("Not measured yet: no result file holds an SLO search (`bash bench/h200_session.sh gen-1b slo`, "
                "bench/README.md).")
    path, r = rec
    s = r["search"]
    held, failed = s["highest_rate_held"], s["lowest_rate_failed"]
    answer = (f"none: the low bound {failed:g} requests/s missed it" if held is None
              else f"at least {held:g} requests/s (the high bound)" if failed is None
              else f"{held:g} requests/s ({failed:g}/s missed it)")
    rows = [[f"{p['rate']:g}", "held" if p["slo_held"] else "missed", spread_cell(p, "ttft_p99_ms"),
             spread_cell(p, "tpot_p99_ms"), spread_cell(p, "achieved_tok_per_s", rate)]
            for p in sorted(s["probes"], key=lambda p: p["rate"])]
    return (f"{caption(path, r, root)} SLO: {s['slo']}; {s['start']} starts. Highest rate holding it: "
            f"**{answer}**.\n\n" + table(["requests/s", "SLO", "TTFT p99 ms", "TPOT p99 ms", "achieved tokens/s"], rows, 0))


KINDS: dict[str, tuple[Callable[[dict[str, Any]], bool], Callable[[Record, Path], str], bool]] = {
    # kind: (which files fit, the table, whether "no file" is said instead of failing)
    "decode": (is_decode, render_decode, False),
    "closed-loop-128": (closed_loop_fits(128, 128), render_closed_loop, False),
    "closed-loop-32": (closed_loop_fits(32, 256), render_closed_loop, False),
    "chat-load": (is_chat_load, render_chat_load, False),
    "slo": (is_slo_search, render_slo, True),
}


def regions(results: Path) -> dict[str, str]:
    records = load_results(results)
    out = {}
    for kind, (fits, render, optional) in KINDS.items():
        rec = newest(records, fits)
        if rec is None and not optional:
            raise SystemExit(f"no result file under {results} fits the {kind} table")
        out[kind] = render(rec, results)
    return out


def rewrite(text: str, bodies: dict[str, str]) -> str:
    for kind, body in bodies.items():
        pattern = re.compile(rf"(<!-- bench-report:{kind} -->\n).*?(<!-- /bench-report:{kind} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README has no <!-- bench-report:{kind} --> ... <!-- /bench-report:{kind} --> region")
        text = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
    p.add_argument("--check", action="store_true", help="exit 1 where README's tables differ from the results")
    args = p.parse_args(argv)
    before = args.readme.read_text()
    after = rewrite(before, regions(args.results))
    if args.check:
        if before != after:
            sys.stdout.writelines(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "README.md",
                                                       "generated"))
            print("README's benchmark tables differ from bench/results: run `make bench-report`")
            return 1
        return 0
    args.readme.write_text(after)
    print(f"rewrote {len(KINDS)} tables in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
