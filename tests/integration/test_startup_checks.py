"""`graphserve serve` refuses a bad start before anything starts: one line per problem, exit code 2,
no traceback, no port opened, no engine process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

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
