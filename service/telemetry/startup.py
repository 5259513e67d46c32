"""The start-up timeline: when each phase of a start ended, in seconds since the process started.

Every phase is a `time.monotonic()` stamp. That clock is the same in every process of the machine,
so the engine process's phases (its own start, imports, weights, KV pool, self-checks, warm-up)
travel to the gRPC process as plain stamps (EngineFacts.startup) and merge into its timeline, which
is logged once, as `startup_timeline`, when health turns SERVING. The origin is the process's own
start (read from /proc on Linux), so the interpreter's start and the imports before any of our code
ran are counted too.

One timeline per process: start-up is a process-wide thing, and the phases are marked deep in the
loader and the builder, which need not know who reads them. It records only once an entry point
(`graphserve serve`, the engine process) called `record()`: an in-process `LLM` built many times in
one process marks nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


def process_start() -> float:
    """This process's start on the time.monotonic() clock: its age from /proc (to the clock tick,
    10 ms) subtracted from now; now itself where /proc is not there."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command's parentheses
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - max(0.0, age)


@dataclass
class Timeline:
    """Named phases in the order they ended: (name, time.monotonic() when it ended)."""

    origin: float = field(default_factory=process_start)
    phases: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        self.phases.append((phase, time.monotonic()))

    def merge(self, phases: tuple[tuple[str, float], ...] | list[tuple[str, float]], prefix: str = "") -> None:
        """Another process's phases (stamps of the same clock), kept in time order."""
        self.phases = sorted([*self.phases, *((prefix + name, t) for name, t in phases)], key=lambda p: p[1])

    def _ordered(self) -> list[tuple[str, float]]:
        """The phases in time order; a phase marked twice counts where it ended last."""
        last = dict(self.phases)
        return sorted(last.items(), key=lambda p: p[1])

    def seconds(self) -> dict[str, float]:
        """{phase: seconds since the process started}, in time order (a dict keeps it in JSON)."""
        return {name: round(t - self.origin, 3) for name, t in self._ordered()}

    def durations(self) -> dict[str, float]:
        """{phase: seconds since the phase before it ended (the first: since the process started)}."""
        out, last = {}, self.origin
        for name, t in self._ordered():
            out[name] = round(t - last, 3)
            last = t
        return out


_TIMELINE: Timeline | None = None


def record() -> Timeline:
    """This process's timeline, recording from now on (the entry points call it first)."""
    global _TIMELINE
    if _TIMELINE is None:
        _TIMELINE = Timeline()
    return _TIMELINE


_PREFIX = ""


def mark(phase: str) -> None:
    """Marks the end of a start-up phase on this process's timeline, if it records one."""
    if _TIMELINE is not None:
        _TIMELINE.mark(_PREFIX + phase)


@contextlib.contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """The phases marked inside carry `prefix` (a draft model's load marks draft_weights_read, not a
    second weights_read that would move the target's)."""
    global _PREFIX
    before, _PREFIX = _PREFIX, _PREFIX + prefix
    try:
        yield
    finally:
        _PREFIX = before


def phases() -> tuple[tuple[str, float], ...]:
    """What this process marked so far (nothing when it records no timeline)."""
    return () if _TIMELINE is None else tuple(_TIMELINE.phases)
