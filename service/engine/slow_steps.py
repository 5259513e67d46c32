"""Slow engine steps, for the operator: a step whose host work (schedule, launch, reading the tokens)
took longer than a threshold is logged, the first at once, then at most one line per interval with
the count and the slowest, so a loaded CPU, where every step is slow, gets one line per interval."""

from __future__ import annotations

from typing import Any

import structlog

from service.engine.scheduled_step import ScheduledStep

SLOW_STEP_LOG_INTERVAL_S = 10.0
log = structlog.get_logger("graphserve.engine")


class SlowSteps:
    def __init__(self, threshold_s: float) -> None:
        """threshold_s: --slow-step-threshold-ms in seconds; 0: never logged."""
        self.threshold_s = threshold_s
        self._count = 0  # slow steps since the last line
        self._slowest: dict[str, Any] | None = None
        self._logged_at = float("-inf")

    def step(self, scheduled: ScheduledStep, started: float, scheduled_at: float, launched_at: float,
             done: float) -> None:
        """One step's times (time.monotonic()): its start, schedule done, launch done, tokens read."""
        if not self.threshold_s or done - started <= self.threshold_s:
            return
        if self._slowest is None or done - started > self._slowest["ms"] / 1000:
            self._slowest = dict(
                ms=round((done - started) * 1000, 1), schedule_ms=round((scheduled_at - started) * 1000, 1),
                launch_ms=round((launched_at - scheduled_at) * 1000, 1), read_ms=round((done - launched_at) * 1000, 1),
                decodes=len(scheduled.decodes) + len(scheduled.verifies), prompt_chunks=len(scheduled.prefills),
                prompt_tokens=sum(c.num_tokens for c in scheduled.prefills))
        self._count += 1
        if done - self._logged_at >= SLOW_STEP_LOG_INTERVAL_S:
            log.warning("slow_step", slow_steps=self._count, threshold_ms=round(self.threshold_s * 1000, 1),
                        **self._slowest)
            self._count, self._slowest, self._logged_at = 0, None, done
