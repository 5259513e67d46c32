"""`graphserve gateway` as a user runs it: one command, the real smg in front, the official openai
client. A replica killed under load comes back by itself; requests that start after the kill all
succeed; Ctrl-C drains everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.support.gateway import find_smg
from tests.support.process import kill_tree
from tests.support.server import free_port

pytestmark = pytest.mark.skipif(find_smg() is None, reason="smg is not installed (the dev extra has it)")

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
    """`graphserve gateway` in its own process, its stderr in a file."""

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


def test_a_killed_replica_comes_back_and_requests_after_the_kill_all_succeed(model_cache_dir, tmp_path) -> None:  # noqa: ANN001
    gateway = GatewayCommand(tmp_path, MODEL, "--replicas", "2", "--api-key", API_KEY, "--model-cache-dir",
                             str(model_cache_dir), "--max-num-seqs", "8", "--max-model-len", "512")
    try:
        started = time.monotonic()
        gateway.wait_ready()
        # The 30 s target assumes a replica starts in under 20 s, as on an idle 2-core machine; where the
        # first start took longer (a loaded machine), the bound grows with it.
        limit = max(30.0, 1.5 * (time.monotonic() - started))
        with pytest.raises(openai.AuthenticationError):
            gateway.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        oa = gateway.client()
        outcomes: list[tuple[float, str]] = []  # (start, "ok" or the error)
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    answer = oa.completions.create(model=MODEL, prompt="keep going", max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": True})
                    outcomes.append((started, "ok" if answer.usage.completion_tokens == 16 else "short"))
                except openai.APIError as exc:
                    outcomes.append((started, f"{type(exc).__name__}: {exc}"))

        threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(3)
        victim = gateway.replica_pid(0)
        kill_tree(victim)
        killed_at = time.monotonic()
        while "SERVING again" not in gateway.log() and time.monotonic() < killed_at + limit:
            time.sleep(0.2)
        back_after = time.monotonic() - killed_at
        time.sleep(5)  # the load goes on while smg takes the replica back
        stop.set()
        for t in threads:
            t.join(90)
        log = gateway.log()
        after = [o for started, o in outcomes if started > killed_at]
        assert len(after) >= 6 and all(o == "ok" for o in after), [o for o in after if o != "ok"]
        assert "SERVING again" in log and back_after < limit, f"not back within {limit:.0f} s: {log[-3000:]}"
        assert f"replica 0 on 127.0.0.1:{gateway.first_port}: exited with -9" in log
        assert gateway.replica_pid(0) != victim
    finally:
        gateway.close()
    assert gateway.proc.returncode == 0, gateway.log()[-3000:]


def test_bad_replica_flags_and_ports_in_use_stop_the_gateway_before_anything_starts(tmp_path) -> None:  # noqa: ANN001
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gateway = GatewayCommand(tmp_path, MODEL, "--smg-metrics-port", str(taken.getsockname()[1]))
        assert gateway.proc.wait(120) == 2
    log = gateway.log()
    assert "is in use" in log and "--smg-metrics-port" in log and "started, pid" not in log, log
    gateway = GatewayCommand(tmp_path, str(tmp_path / "no-model"), "--max-num-seqs", "0")
    assert gateway.proc.wait(120) == 2
    assert "--max-running-seqs must be >= 1" in gateway.log()
