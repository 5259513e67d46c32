"""What graph captures cost a running server's serving steps, read from its JSON log.

Every capture logs `graph_captured` with `stall_ms`: the engine-thread time it cost the steps (with
tensor parallelism captures run inline on every rank's engine thread, so this is the whole
capture). Prints the count, p50, p99 and max of stall_ms, and p50 and max of the recording's own `ms`;
and, with tensor parallelism, what each follower rank's memory report (`rank_memory_published`, after
a graph operation) cost its engine thread.

    python bench/capture_stalls.py server.log
    python bench/serve_bench.py ... --server-log s.log --server-args "--log-level info --log-format json"
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table


def events_named(lines: list[str], name: str) -> list[dict]:
    events = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == name:
            events.append(event)
    return events


def summarize(events: list[dict]) -> dict:
    stalls = sorted(float(e["stall_ms"]) for e in events)
    records = sorted(float(e["ms"]) for e in events)
    if not stalls:
        return {"captures": 0}
    return {"captures": len(stalls), "stall_ms_p50": percentile(stalls, 50), "stall_ms_p99": percentile(stalls, 99),
            "stall_ms_max": stalls[-1], "record_ms_p50": percentile(records, 50), "record_ms_max": records[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=pathlib.Path)
    args = p.parse_args(argv)
    lines = args.log.read_text(errors="replace").splitlines()
    summary = summarize(events_named(lines, "graph_captured"))
    print_table([{"log": args.log.name, **summary}], ["log", *summary])
    published = sorted(float(e["ms"]) for e in events_named(lines, "rank_memory_published"))
    if published:
        print_table([{"publishes": len(published), "ms_p50": percentile(published, 50),
                      "ms_p99": percentile(published, 99), "ms_max": published[-1]}],
                    ["publishes", "ms_p50", "ms_p99", "ms_max"], title="rank memory reports")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
