"""Slow engine steps are logged once, then at most once per interval with their count: a loaded CPU,
where every step is slow, gets one warning line per 10 s, not one per step."""

from __future__ import annotations

import time

import pytest
import structlog

from service.engine import slow_steps
from service.engine.engine import Engine
from service.engine.scheduler import Scheduler
from tests.unit.test_engine import Collector, LetterTokenizer, ScriptedRunner, request


class SlowRunner(ScriptedRunner):
    def launch(self, step) -> list[int]:  # noqa: ANN001
        time.sleep(0.003)
        return super().launch(step)


def slow_step_lines(threshold_s: float, steps: int = 20) -> list[dict]:
    engine = Engine(SlowRunner(), Scheduler(4, 1000), LetterTokenizer(), frozenset(), slow_step_s=threshold_s)
    out = Collector()
    with structlog.testing.capture_logs() as logs:
        engine.start()
        engine.submit(request("r", max_tokens=steps), out.sink("r"))
        out.terminal("r")
        engine.stop()
    return [line for line in logs if line["event"] == "slow_step"]


def test_every_step_slow_gives_one_line_per_interval() -> None:
    [line] = slow_step_lines(0.001)
    assert line["slow_steps"] == 1 and line["ms"] >= 1 and line["threshold_ms"] == 1.0


def test_the_lines_count_the_slow_steps_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slow_steps, "SLOW_STEP_LOG_INTERVAL_S", 0.02)
    lines = slow_step_lines(0.001, steps=40)
    assert 2 <= len(lines) < 40
    assert sum(line["slow_steps"] for line in lines) <= 41  # the prefill step and 39 decodes, some not logged yet
    assert any(line["slow_steps"] > 1 for line in lines)


def test_threshold_zero_logs_none() -> None:
    assert slow_step_lines(0.0) == []
