"""The real Shepherd Model Gateway (smg, the dev extra's pinned wheel) in front of graphserve replicas."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.server import free_port


def find_smg() -> str | None:
    beside_python = Path(sys.executable).parent / "smg"
    return str(beside_python) if beside_python.exists() else shutil.which("smg")


class Gateway:
    """`smg launch` routing to `workers` (HOST:PORT) over vLLM's engine protocol; OpenAI HTTP on `port`."""

    def __init__(self, workers: list[str], log_path: Path, policy: str = "round_robin", *extra: str) -> None:
        smg = find_smg()
        assert smg is not None, "smg is not installed: it is in the dev extra (make setup)"
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--backend", "vllm",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port), "--policy", policy,
               "--worker-urls", *[f"grpc://{w}" for w in workers], *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def models(self) -> list[str]:
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as response:
            return [m["id"] for m in json.load(response)["data"]]

    def wait_ready(self, model: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"smg exited with {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if model in self.models():
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"smg never listed {model!r}: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
