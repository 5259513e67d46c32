"""A real `graphserve serve` process, for what only a process shows: signals, exit codes, stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.server import free_port


class ServerProcess:
    def __init__(self, argv: list[str], env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--log-format", "json", *argv]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def health_status(self, service: str = "") -> int | None:
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return None

    def wait_for_health(self, status: int, timeout: float = 120.0, service: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health_status(service) == status:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}: {self.log_text()[-2000:]}")
            time.sleep(0.05)
        raise AssertionError(f"health never reached {status}: {self.log_text()[-2000:]}")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.channel.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def kill_tree(pid: int) -> None:
    """SIGKILL a server and its engine process, as a crash, a dying node or the OOM killer would."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    for child in [*children, pid]:
        os.kill(child, signal.SIGKILL)


def kill_mid_stream(channel: grpc.Channel, pid: int) -> tuple[grpc.RpcError, float]:
    """Start a long greedy stream, SIGKILL `pid` once tokens flow, read the stream to its end; returns
    the error it ended with and the seconds from the kill to that end."""
    from service.proto import inference_pb2, inference_pb2_grpc
    from tests.support.server import greedy

    stub = inference_pb2_grpc.InferenceStub(channel)
    call = stub.Generate(inference_pb2.GenerateRequest(**greedy("Once upon a time", 2000)), timeout=60)
    next(iter(call))  # streaming
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc, time.monotonic() - started
    raise AssertionError("the stream ended normally after the kill")
