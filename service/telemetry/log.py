"""structlog configuration: JSON lines when not on a terminal, readable console output on one."""

from __future__ import annotations

import fcntl
import io
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

import structlog


class LineWriter:
    """Writes each log line whole into a stream that other processes write too (the engine process and
    the ranks inherit the server's stderr, under Kubernetes a pipe): one write per line, under an
    advisory lock on the stream's own file or pipe, which every writer opens anew. A pipe keeps
    writes apart only up to 4 KiB (a traceback is often longer), and print() wrote the newline
    apart; either put one process's line inside another's, unparseable."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self._threads = threading.Lock()
        self._lock_fd = _stream_lock(file)
        self._pid = os.getpid()  # a forked child shares the descriptor, hence the lock: it opens its own

    def close(self) -> None:
        with self._threads:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def msg(self, message: str) -> None:
        with self._threads:
            if self._pid != os.getpid():
                self._lock_fd, self._pid = _stream_lock(self.file), os.getpid()
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            # A stream closed under us (a test's captured stderr, gone with its test) is no reason
            # for a log call to raise into the caller: the process's stderr of now takes the line.
            file = sys.stderr if self.file.closed else self.file
            try:
                file.write(message + "\n")
                file.flush()
            finally:
                if self._lock_fd is not None:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


def _stream_lock(file: TextIO) -> int | None:
    """A descriptor of the stream's own file or pipe, opened anew (a descriptor of its own, so that
    its flock excludes the other processes'), or None where there is none to take: no descriptor
    behind the stream (pytest's capture), no /proc (macOS), a socket. O_NONBLOCK: opening a named
    FIFO for writing never waits for a reader."""
    try:
        return os.open(f"/proc/self/fd/{file.fileno()}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


_LINE_WRITER: LineWriter | None = None


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """Called once by the entry point; library code only calls structlog.get_logger()."""
    global _LINE_WRITER
    if _LINE_WRITER is None or _LINE_WRITER.file is not sys.stderr:
        if _LINE_WRITER is not None:
            _LINE_WRITER.close()
        _LINE_WRITER = LineWriter(sys.stderr)
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
        logger_factory=lambda *_: _LINE_WRITER,
        # Not cached: configure_logging runs again where a process makes another LLM (and in tests), and
        # a cached logger would keep the stream and processors of its first use. Costs ~µs a log call.
        cache_logger_on_first_use=False,
    )
    # Libraries log through the standard library (and `warnings`): into the same structured stream.
    logging.captureWarnings(False)  # re-hook: warnings.showwarning may have been replaced since (a test harness
    logging.captureWarnings(True)  # restores its own after each test while logging thinks it still holds it)
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
