"""The graph cache's line to the engine that drives it, given to the cache when it is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Driver(Protocol):
    """The engine, as the cache sees it."""

    def wake(self) -> None:
        """Run the between-steps work soon, even when idle (any thread)."""
        ...

    def busy(self) -> bool:
        """Whether the engine has work now (requests queued, running or in flight)."""
        ...


class EngineHooks:
    """What the cache tells the engine, and asks of it.

    The engine is built over the runner that holds the cache, so it attaches itself here once it
    exists (`attach`, once); until then, and for a cache no engine drives (tests, benchmarks), `wake`
    wakes nobody and `busy` is False. `capture_stall` (engine thread) receives what each capture cost
    the engine thread, in seconds, from the start (metrics).
    """

    def __init__(self, capture_stall: Callable[[float], None] | None = None) -> None:
        self._capture_stall = capture_stall
        self._driver: Driver | None = None

    def attach(self, driver: Driver) -> None:
        assert self._driver is None, "a graph cache is driven by one engine"
        self._driver = driver

    def wake(self) -> None:
        """The capture thread has a result to commit: an idle engine commits it without waiting for traffic."""
        if self._driver is not None:
            self._driver.wake()

    def busy(self) -> bool:
        return self._driver is not None and self._driver.busy()

    def capture_stall(self, seconds: float) -> None:
        if self._capture_stall is not None:
            self._capture_stall(seconds)
