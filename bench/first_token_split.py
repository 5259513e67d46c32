"""Where a first token's time goes on the server, from a server log (JSON, `--log-level info`).

Each `request_finished` line carries the engine's queue and time to first token (`queue_s`, `ttft_s`,
from the stream's arrival in the gRPC process), when that token's event reached the gRPC process
(`first_token_in_s`: plus the pipe) and when its message was written (`first_written_s`: plus that
process's queue and the write). A client's TTFT beyond `first_written_s` is outside these: the
request's way in before its handler ran, the message's way out, and the client itself.

Requests are split into levels in log order (serve_bench.py runs `--requests` per level, 4 x the
streams by default); lines of fewer than --min-tokens completion tokens (warm-up) are skipped.

    python bench/first_token_split.py SERVER_LOG --levels 128,256
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table

FIELDS = ("queue_s", "ttft_s", "first_token_in_s", "first_written_s")


def read_lines(path: pathlib.Path, min_tokens: int) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if '"request_finished"' not in line or '"first_written_s"' not in line:
            continue
        try:
            event = json.loads(line[line.index("{"):])
        except ValueError:
            continue  # a line another process's output cut into
        if event.get("completion_tokens", 0) >= min_tokens:
            out.append(event)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=pathlib.Path)
    p.add_argument("--levels", default="", help="streams per level, in order (default: all lines as one)")
    p.add_argument("--per-stream", type=int, default=4, help="requests per stream at each level")
    p.add_argument("--min-tokens", type=int, default=16)
    args = p.parse_args(argv)
    lines = read_lines(args.log, args.min_tokens)
    levels = [int(x) for x in args.levels.split(",") if x] or [len(lines) // args.per_stream]
    rows, start = [], 0
    for level in levels:
        group = lines[start:start + level * args.per_stream]
        start += level * args.per_stream
        rows.append({"streams": level, "requests": len(group),
                     **{f"{f[:-2]}_p50_ms": percentile([e[f] * 1000.0 for e in group], 50) for f in FIELDS}})
    print_table(rows, ["streams", "requests", *(f"{f[:-2]}_p50_ms" for f in FIELDS)],
                title=f"{args.log}: a first token's time on the server, from the stream's arrival")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
