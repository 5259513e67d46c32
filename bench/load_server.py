"""A fresh `graphserve serve` process per run of the serving load, and what it says of itself: seconds
to SERVING, its /metrics, its JSON log's events, the most requests it ran at once, and the one-row
decode steps it ran eagerly (from the stats file it saves at shutdown)."""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shlex
import threading
import time
import urllib.request


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
        return log_events(self.log_path, name)


def log_events(log_path: pathlib.Path, name: str) -> list[dict]:
    """The events called `name` in a server's JSON log, in order."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                out.append(event)
    return out


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
