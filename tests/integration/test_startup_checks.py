"""`graphserve serve` refuses a bad start before anything starts: one line per problem, exit code 2,
no traceback, no port opened, no model loaded, no process left (the engine process, started early to
import torch beside the checks, is gone when the command returns)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from service.model_dirs import MISSING_MODEL
from tests.support.server import free_port


def test_a_port_in_use_and_a_missing_model_directory_are_one_line_each(tmp_path) -> None:  # noqa: ANN001
    metrics_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--metrics-port", str(metrics_port), str(tmp_path / "no-model")],
                              capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"graphserve: --port: 127.0.0.1:{port} is in use (another graphserve?); pick another port with --port",
        f"graphserve: --model {tmp_path / 'no-model'}: {MISSING_MODEL}"]
    assert done.stdout == ""
    assert seconds < 60, "no model load or engine start before the checks"


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds marker (children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_check_that_imports_the_model_package_fails_at_once_and_leaves_no_process(tmp_path) -> None:  # noqa: ANN001
    """The architecture check reads config.json through transformers (seconds of imports), by which
    time the early engine process ignores SIGTERM and waits for a spec that never comes: it must not
    hold the exit up."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    marker = f"GRAPHSERVE_TEST_RUN={uuid.uuid4().hex}"
    name, value = marker.split("=")
    done = subprocess.run([sys.executable, "-m", "service", "serve", "--port", "0", "--metrics-port", "0", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, name: value})
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"graphserve: --model {tmp_path}: unsupported architecture 'GPT2LMHeadModel'"), line
    assert processes_with(marker) == []
