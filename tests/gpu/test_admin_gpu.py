"""graphctl against a real server on a GPU: operator capture, eviction that gives memory back, budget.

The graphs live in the server's engine process, so memory is read here as the device's free
memory (cudaMemGetInfo), which sees every process on the device; this process allocates nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog
import torch

from service import graphctl
from service.server.admin_server import start_admin_server
from tests.support.server import ServerThread, generate, greedy, running_server

pytestmark = pytest.mark.gpu

TOKEN = "gpu-admin-test-token"


class Ctl:
    def __init__(self, target: str, token_file: str, capsys: pytest.CaptureFixture) -> None:
        self.target, self.token_file, self.capsys = target, token_file, capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = graphctl.main(["--target", self.target, "--token-file", self.token_file, *argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str) -> dict:
        code, out, err = self("--json", *argv)
        assert code == 0, err
        return json.loads(out)

    def bucket(self, size: int) -> dict:
        return next(b for b in self.json("state")["buckets"] if b["size"] == size)


@pytest.fixture
def gpu_server(model_cache_dir, tmp_path) -> Iterator[tuple[ServerThread, str, str]]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "bfloat16",
            "--model", "builtin:tiny", "--cudagraph-mode", "full", "--max-running-seqs", "16",
            "--max-seq-len", "256", "--no-warm-start"]
    with structlog.testing.capture_logs(), running_server(argv, environ={"GRAPHSERVE_ADMIN_TOKEN": TOKEN}) as server:
        port = getattr(server.app, "admin_port", None)
        own = None
        if port is None:  # until app.py starts the admin server itself
            own, port = server._run(start_admin_server(server.config, server.app.engine))
        try:
            yield server, f"127.0.0.1:{port}", str(token_file)
        finally:
            if own is not None:
                server._run(own.stop(1.0))


def device_free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_capture_then_evict_gives_the_memory_back(gpu_server, capsys) -> None:
    server, target, token_file = gpu_server
    ctl = Ctl(target, token_file, capsys)
    # The first capture of the process also creates the capture stream's cuBLAS workspace (32 MiB
    # on Hopper), which outlives every graph: pay it with another bucket before measuring.
    assert ctl("capture", "2")[0] == 0 and ctl("evict", "2")[0] == 0
    free0 = device_free_bytes()

    code, out, err = ctl("capture", "8")
    assert code == 0, err
    assert "captured" in out
    entry = ctl.bucket(8)
    assert entry["state"] == "BUCKET_STATE_CAPTURED"
    nbytes = int(entry["bytes"])
    assert nbytes > 0 and float(entry["capture_ms"]) > 0
    state = ctl.json("state")
    assert state["mode"] == "full" and state["device"].startswith("cuda")
    captured = [int(b["bytes"]) for b in state["buckets"] if b["state"] == "BUCKET_STATE_CAPTURED"]
    assert int(state["used_bytes"]) >= sum(captured) >= nbytes  # start-up traffic may have captured size 1
    free_captured = device_free_bytes()
    grown = free0 - free_captured
    assert grown > 0
    # bytes = max(pool, driver free-memory drop at capture). The driver takes one more 2 MiB block
    # for the instantiated graph at its first launch, which a capture beside serving cannot see
    # (it may not launch the graph: that would run it on the live inputs).
    assert nbytes >= 0.9 * grown - 2 * 2**20, (nbytes, grown)

    response = ctl.json("evict", "8")
    assert [r["outcome"] for r in response["results"]] == ["evicted"]
    assert int(response["results"][0]["bytes"]) > 0
    assert ctl.bucket(8)["state"] == "BUCKET_STATE_EVICTED"
    returned = device_free_bytes() - free_captured
    assert returned >= 0.9 * nbytes, (returned, grown, nbytes)

    # Traffic still runs correctly after the operator's capture and eviction.
    _, finished = generate(server.stub(), **greedy("Once upon a time", 8))
    assert finished.usage.completion_tokens == 8


def test_budget_below_current_use_evicts_until_under_it(gpu_server, capsys) -> None:
    _, target, token_file = gpu_server
    ctl = Ctl(target, token_file, capsys)
    response = ctl.json("capture", "4", "8", "16")
    assert {r["outcome"] for r in response["results"]} == {"captured"}, response
    used = int(ctl.json("state")["used_bytes"])
    assert used > 0
    budget = used - 1
    response = ctl.json("budget", str(budget))
    assert int(response["budget_bytes"]) == budget
    assert int(response["used_bytes"]) <= budget
    evicted = [r["size"] for r in response["results"] if r["outcome"] == "evicted"]
    assert evicted
    state = ctl.json("state")
    assert int(state["used_bytes"]) <= budget
    for b in state["buckets"]:
        if b["size"] in evicted:
            assert b["state"] == "BUCKET_STATE_EVICTED"

    # A capture that cannot fit even after evicting is refused per size, not as an RPC error.
    code, out, err = ctl("budget", "1")
    assert code == 0, err
    code, out, err = ctl("capture", "16")
    assert code == graphctl.EXIT_REFUSED and "over_budget" in out
    assert err.startswith("graphctl: ") and len(err.strip().splitlines()) == 1
