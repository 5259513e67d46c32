"""Library log records and warnings reach the structured log, never as plain-text lines."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
import warnings

import pytest
from transformers.utils import logging as hf_logging

from service.telemetry.log import LogThrottle, configure_logging, route_library_logs


@pytest.fixture
def json_logging():  # noqa: ANN201
    """What configure_logging and route_library_logs change beyond structlog and the root logger
    (tests/conftest.py restores those after every test)."""
    yield
    logging.captureWarnings(False)
    hf_logging.disable_propagation()
    hf_logging.enable_default_handler()


def test_transformers_warnings_and_python_warnings_are_json_events(json_logging, capsys) -> None:  # noqa: ANN001
    configure_logging("json", "info")
    route_library_logs()
    hf_logging.get_logger("transformers.tokenization_utils_base").warning(
        "Token indices sequence length is longer than the specified maximum sequence length")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a deprecated thing", DeprecationWarning, stacklevel=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line parses: no plain text
    assert [e["logger"] for e in events] == ["transformers.tokenization_utils_base", "py.warnings"]
    assert events[0]["event"] == "library_log" and events[0]["level"] == "warning"
    assert "Token indices" in events[0]["message"] and "a deprecated thing" in events[1]["message"]


def test_throttle_logs_once_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    throttle = LogThrottle(10.0, clock=lambda: now[0])
    assert throttle.due() == 0
    assert [throttle.due() for _ in range(5)] == [None] * 5
    now[0] = 10.5
    assert throttle.due() == 5


_WRITER = """
import pathlib
import sys
import time
import structlog
from service.telemetry.log import configure_logging
configure_logging("json", "info")
log = structlog.get_logger()
lines, name, size, barrier = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), pathlib.Path(sys.argv[4])
(barrier / f"ready-{name}").touch()
while not (barrier / "go").exists():  # both write at once
    time.sleep(0.001)
for i in range(lines):
    log.info("graph_captured", writer=name, i=i, padding="x" * size)
"""


@pytest.mark.parametrize("stream, size", [("file", 120), ("pipe", 20_000)])
def test_processes_sharing_stderr_write_whole_json_lines(tmp_path, stream, size) -> None:  # noqa: ANN001
    """The gRPC process and its engine process log to one inherited stderr: a file, or a pipe as under
    Kubernetes, which keeps writes apart only up to 4 KiB (a traceback's line is often longer);
    unbuffered, as in the container image. Every line must parse on its own."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(repo)}
    lines = 20_000 if stream == "file" else 400
    read_fd, write_fd = os.pipe() if stream == "pipe" else (None, os.open(tmp_path / "server.log", os.O_WRONLY | os.O_CREAT))
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_fd, 1 << 16), b""))) \
        if read_fd is not None else None
    if reader is not None:
        reader.start()
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(lines), name, str(size), str(tmp_path)],
                                stderr=write_fd, env=env) for name in ("server", "engine")]
    os.close(write_fd)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{n}").exists() for n in ("server", "engine")) and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    if reader is not None:
        reader.join(timeout=60)
        text = b"".join(chunks).decode()
    else:
        text = (tmp_path / "server.log").read_text()
    events = [json.loads(line) for line in text.splitlines()]
    assert sorted(e["writer"] for e in events) == ["engine"] * lines + ["server"] * lines
