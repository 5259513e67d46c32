"""Library log records and warnings reach the structured log, never as plain-text lines."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import structlog
from transformers.utils import logging as hf_logging

from service.telemetry.log import LogThrottle, configure_logging, route_library_logs


@pytest.fixture
def json_logging():  # noqa: ANN201
    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
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


_TWO_WRITERS = """
import sys
import time
import structlog
from service.telemetry.log import configure_logging
configure_logging("json", "info")
log = structlog.get_logger()
time.sleep(max(0.0, float(sys.argv[3]) - time.time()))  # both write at once
for i in range(int(sys.argv[1])):
    log.info("graph_captured", writer=sys.argv[2], i=i, padding="x" * 120)
"""


def test_two_processes_sharing_stderr_write_whole_json_lines(tmp_path) -> None:  # noqa: ANN001
    """The gRPC process and its engine process log to one inherited stderr (a file or a pipe, as
    under Kubernetes); unbuffered, as in the container image. Every line must parse on its own."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()}
    lines, start_at = 20000, time.time() + 3.0
    with open(tmp_path / "server.log", "w") as log_file:
        writers = [subprocess.Popen([sys.executable, "-c", _TWO_WRITERS, str(lines), name, str(start_at)],
                                    stderr=log_file, env=env) for name in ("server", "engine")]
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
    events = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines()]
    assert sorted(e["writer"] for e in events) == ["engine"] * lines + ["server"] * lines
