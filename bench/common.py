"""Shared helpers of the benchmarks: result files with provenance, a fixed-width table, timing.

Every benchmark writes `bench/results/<name>-<device-tag>-<UTC timestamp>.json` (plus its PNG
beside it) starting with bench/provenance.py's record, read while it runs: the command line, the
commit and a dirty flag, a digest of the source files, the machine and the library versions, so a
number in a PR or issue can be traced back to how it was produced.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.provenance import provenance

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---- result files ----------------------------------------------------------------------------


def device_tag(device: torch.device | str | None = None) -> str:
    """"cpu", or the GPU's name as a slug (e.g. "nvidia-h200")."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def write_result(name: str, payload: dict, device: torch.device | str | None = None,
                 figure: Any | None = None, results_dir: Path | None = None) -> Path:
    """Writes payload plus provenance as JSON (and `figure`, a matplotlib Figure, as a PNG beside
    it); returns the JSON path. $GRAPHSERVE_BENCH_RESULTS overrides the directory (tests use it)."""
    out_dir = Path(results_dir or os.environ.get("GRAPHSERVE_BENCH_RESULTS") or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    path = out_dir / f"{name}-{device_tag(device)}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    record = {"name": name, "timestamp": now.isoformat(timespec="seconds"), **provenance(), **payload}
    if figure is not None:
        png = path.with_suffix(".png")
        figure.savefig(png, dpi=120, bbox_inches="tight")
        record["plot"] = png.name
    path.write_text(json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")
    return path


# ---- output ----------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) >= 1000 or abs(value) < 0.01 and value != 0 else f"{value:.2f}"
    return str(value)


def print_table(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    """A fixed-width table of `columns` (missing values print as "-")."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    sys.stdout.flush()


# ---- timing ----------------------------------------------------------------------------------


def time_samples_ms(fn: Callable[[], Any], device: torch.device, iters: int = 20, warmup: int = 3) -> list[float]:
    """Milliseconds of each of `iters` calls of fn() after `warmup` calls: CUDA events around each call
    on a GPU (device time, queue drained between calls), time.perf_counter on a CPU."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1000.0)
    return samples


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() (time_samples_ms)."""
    return statistics.median(time_samples_ms(fn, device, iters, warmup))


def kernel_bench_device() -> torch.device:
    """The CUDA device a kernel benchmark runs on; exits saying what is missing where there is none."""
    from service.model.kernels._triton import triton

    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("needs a CUDA GPU and triton")
    return torch.device("cuda")


def graph_ms(calls: list[Callable[[], Any]], stream: torch.cuda.Stream, replays: int, warmup: int = 1) -> float:
    """Median milliseconds of one replay of a CUDA graph of all the calls, in order (no launch gaps,
    as served). The calls run once on `stream` first: compiles, and lets cuBLAS allocate its
    workspace outside the capture."""
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    return time_ms(graph.replay, stream.device, iters=replays, warmup=warmup)


def wall_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall milliseconds of one call, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1000.0


def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100], linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def add_model_arguments(p: Any, device: str = "cuda") -> None:
    """--model, --cache-dir, --device, --dtype and --random-init, as the GPU benchmarks take them."""
    p.add_argument("--model", default="builtin:llama-1b", help="builtin:<name> or a local HF directory")
    p.add_argument("--cache-dir", type=Path, default=None, help="where built-in models are generated")
    p.add_argument("--device", default=device, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--random-init", action="store_true", help="built-in shape, random weights made on the device")


class HostTimers:
    """Host seconds and calls of named callables, wrapped in place (an attribute of an object, or a
    method of a class): what a bench reads about where the engine thread's time goes."""

    def __init__(self) -> None:
        self.spent: dict[str, list] = {}

    def wrap(self, owner: Any, attr: str, key: str) -> None:
        inner = getattr(owner, attr)
        spent = self.spent.setdefault(key, [0.0, 0])

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
                spent[1] += 1
        setattr(owner, attr, timed)

    def reset(self) -> None:
        for t in self.spent.values():
            t[:] = [0.0, 0]

    def snapshot(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.spent.items()}

