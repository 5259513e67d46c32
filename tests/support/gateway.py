"""The real Shepherd Model Gateway (smg, the dev extra's pinned wheel) in front of graphserve replicas."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

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


MODEL = "builtin:tiny"
API_KEY = "k3y"  # --api-key, passed through to smg


def free_run(count: int) -> int:
    """A first port of `count` consecutive free ones."""
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no run of free ports")


class GatewayCommand:
    """`graphserve gateway` in its own process as a user runs it (round robin unless argv says otherwise),
    its stderr in a file; `client` is the official openai client on its endpoint."""

    def __init__(self, tmp_path: Path, *argv: str) -> None:
        self.http_port, self.first_port = free_port(), free_run(6)
        self.log_path = tmp_path / "gateway.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "gateway", "--http-port", str(self.http_port), "--first-port",
             str(self.first_port), "--smg-metrics-port", str(free_port()), "--policy", "round_robin", *argv],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=api_key, max_retries=0, timeout=60)

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the gateway exited with {self.proc.returncode}: {self.log()[-3000:]}"
            try:
                if [m.id for m in self.client().models.list().data] == [MODEL]:
                    return
            except openai.APIError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the gateway never served: {self.log()[-3000:]}")

    def replica_pid(self, index: int) -> int:
        lines = [line for line in self.log().splitlines() if f"replica {index} on" in line and "started, pid" in line]
        return int(lines[-1].rsplit(" ", 1)[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
