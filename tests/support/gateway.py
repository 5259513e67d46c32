"""The real Shepherd Model Gateway (smg, the dev extra's pinned wheel) in front of graphserve replicas."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai

from tests.support.process import kill_tree
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


@dataclass
class KilledUnderLoad:
    victim: int  # the killed replica's pid
    killed_at: float
    back_after: float | None  # seconds from the kill to the gateway's "SERVING again"; None: not within the limit
    outcomes: list[tuple[float, str]]  # (sent at, "ok" / "short" / the error) of every request

    @property
    def after(self) -> list[str]:
        """The outcomes of the requests sent after the kill."""
        return [o for sent, o in self.outcomes if sent > self.killed_at]


def kill_replica_under_load(gateway: GatewayCommand, clients: int = 3, warm_s: float = 3.0, limit_s: float = 300.0,
                            settle_s: float = 5.0) -> KilledUnderLoad:
    """`clients` closed-loop clients send 16-token completions (ignore_eos) through the gateway; after
    warm_s seconds replica 0's process tree is SIGKILLed; the load goes on until the gateway logs the
    replica "SERVING again" (at most limit_s) and settle_s more, while smg takes it back."""
    oa = gateway.client()
    outcomes: list[tuple[float, str]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                answer = oa.completions.create(model=MODEL, prompt="keep going", max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
                outcomes.append((sent, "ok" if answer.usage.completion_tokens == 16 else "short"))
            except openai.APIError as exc:
                outcomes.append((sent, f"{type(exc).__name__}: {exc}"))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(warm_s)
    victim = gateway.replica_pid(0)
    kill_tree(victim)
    killed_at = time.monotonic()
    while "SERVING again" not in gateway.log() and time.monotonic() < killed_at + limit_s:
        time.sleep(0.2)
    back_after = time.monotonic() - killed_at if "SERVING again" in gateway.log() else None
    time.sleep(settle_s)
    stop.set()
    for thread in threads:
        thread.join(90)
    return KilledUnderLoad(victim, killed_at, back_after, outcomes)
