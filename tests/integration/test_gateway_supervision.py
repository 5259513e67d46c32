"""`graphserve gateway` as a user runs it: one command, the real smg in front, the official openai
client. A replica killed under load comes back by itself; requests that start after the kill all
succeed; Ctrl-C drains everything."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from tests.support.gateway import API_KEY, MODEL, GatewayCommand, find_smg, kill_replica_under_load

pytestmark = pytest.mark.skipif(find_smg() is None, reason="smg is not installed (the dev extra has it)")

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
        run = kill_replica_under_load(gateway, limit_s=limit)
        log = gateway.log()
        assert len(run.after) >= 6 and all(o == "ok" for o in run.after), [o for o in run.after if o != "ok"]
        assert "SERVING again" in log and run.back_after is not None, f"not back within {limit:.0f} s: {log[-3000:]}"
        assert f"replica 0 on 127.0.0.1:{gateway.first_port}: exited with -9" in log
        assert gateway.replica_pid(0) != run.victim
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
