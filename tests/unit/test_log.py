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
