"""structlog configuration: JSON lines when not on a terminal, readable console output on one."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable

import structlog


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """Called once by the entry point; library code only calls structlog.get_logger()."""
    json_output = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # One write per line (message and newline together): the engine process shares this stderr,
        # and print()'s two writes let its lines land inside ours, unparseable.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries log through the standard library (and `warnings`): into the same structured stream.
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.handlers = [_ToStructlog()]
    root.setLevel(logging.WARNING)


class _ToStructlog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            structlog.get_logger("graphserve.library").log(record.levelno, "library_log", logger=record.name,
                                                           message=record.getMessage())
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def route_library_logs() -> None:
    """transformers writes to stderr through a handler of its own (plain text inside a JSON log):
    after it is imported, send its records to the standard library, hence to structlog."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


class LogThrottle:
    """At most one log line per interval for an event a remote peer can trigger at will (failed
    logins, undecodable requests): `due()` says whether to log now and how many were skipped."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -math.inf
        self._skipped = 0

    def due(self) -> int | None:
        """None: skip this one (counted); otherwise the number skipped since the last line."""
        now = self._clock()
        if now - self._last < self.interval_s:
            self._skipped += 1
            return None
        skipped, self._last, self._skipped = self._skipped, now, 0
        return skipped
