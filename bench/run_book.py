"""Runs of a long benchmark kept by key in a JSON file, so that one command can span several calls.

A lent GPU machine runs one command for at most ~10 minutes, while a serving-load campaign (a fresh
server per run, 30 s of arrivals, three repeats per rate, a rate search) takes longer. With a book
file the benchmark records each finished run, stops starting runs when the next might not finish
within `--time-budget`, and exits with OUT_OF_TIME; the same command again skips what is recorded
and goes on. The book refuses to mix runs of another workload (its signature differs).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT_OF_TIME = 75  # the exit status (EX_TEMPFAIL): not failed, not finished; run the same command again


class OutOfTime(Exception):
    pass


class RunBook:
    def __init__(self, path: Path | None, signature: dict[str, Any], budget_s: float | None = None) -> None:
        self.path, self.signature, self.budget_s = path, signature, budget_s
        self.started = time.monotonic()
        self.runs: dict[str, dict[str, Any]] = {}
        self.longest_s = 0.0  # the longest run so far, this call or an earlier one: what the next may take
        if path is not None and path.exists():
            saved = json.loads(path.read_text())
            if saved["signature"] != json.loads(json.dumps(signature)):
                raise SystemExit(f"{path} holds runs of another workload; remove it or pass another --book")
            self.runs, self.longest_s = saved["runs"], saved.get("longest_s", 0.0)

    @property
    def work_dir(self) -> Path | None:
        """Where files that later calls need (a warm start's stats) are kept: beside the book."""
        return None if self.path is None else self.path.with_name(self.path.stem + "-work")

    def run(self, key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The recorded result of `key`, or fn()'s, recorded; OutOfTime where the budget would not
        hold one more run as long as the longest."""
        if key in self.runs:
            return self.runs[key]
        if self.budget_s is not None and time.monotonic() - self.started + self.longest_s > self.budget_s:
            raise OutOfTime(key)
        t0 = time.monotonic()
        result = fn()
        self.longest_s = max(self.longest_s, time.monotonic() - t0)
        self.runs[key] = result
        self._save()
        return result

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"signature": self.signature, "runs": self.runs, "longest_s": self.longest_s},
                                  default=str))
        os.replace(tmp, self.path)
