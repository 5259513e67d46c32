"""A long benchmark spans several calls: finished runs are kept and skipped, the budget stops it
before a run that might not finish, and runs of another workload are never mixed in."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.run_book import OutOfTime, RunBook


def test_recorded_runs_are_not_run_again_by_the_next_call(tmp_path: Path) -> None:
    path = tmp_path / "book.json"
    first = RunBook(path, {"rates": [20.0]})
    assert first.run("warm 20/s #1", lambda: {"ttft_p99_ms": 40.0}) == {"ttft_p99_ms": 40.0}
    again = RunBook(path, {"rates": [20.0]})
    assert again.run("warm 20/s #1", lambda: pytest.fail("ran again")) == {"ttft_p99_ms": 40.0}
    assert again.work_dir == tmp_path / "book-work"
    with pytest.raises(SystemExit, match="another workload"):
        RunBook(path, {"rates": [30.0]})


def test_the_budget_stops_before_a_run_as_long_as_the_longest(tmp_path: Path) -> None:
    book = RunBook(tmp_path / "book.json", {}, budget_s=0.15)

    def slow() -> dict:
        time.sleep(0.1)
        return {"ok": 1}
    book.run("a", slow)  # 0.1 s done; another 0.1 s would pass 0.15 s
    with pytest.raises(OutOfTime):
        book.run("b", lambda: pytest.fail("started past the budget"))
    later = RunBook(tmp_path / "book.json", {}, budget_s=0.15)  # the next call knows runs take 0.1 s
    assert later.run("b", lambda: {"ok": 2}) == {"ok": 2}
    assert list(RunBook(tmp_path / "book.json", {}).runs) == ["a", "b"]
