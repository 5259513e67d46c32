"""A bad stats file never stops the service from starting, and a crash while saving never leaves a
file that fails to load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from cache_manager import Fingerprint, StatsStore
from service.proto import admin_pb2, admin_pb2_grpc
from tests.support.server import generate, greedy, running_server

BAD_CONTENTS = {
    "truncated": b'{"format_version": 1, "fingerprint": {"model": "builtin:ti',
    "random bytes": os.urandom(4096),
    "foreign": json.dumps({"format_version": 1, "fingerprint": {"model": "another-model"}, "stats": {}}).encode(),
}


@pytest.mark.parametrize("kind", list(BAD_CONTENTS))
def test_server_starts_and_serves_with_a_bad_stats_file(model_cache_dir, tmp_path, kind: str) -> None:  # noqa: ANN001
    stats = tmp_path / "stats.json"
    stats.write_bytes(BAD_CONTENTS[kind])
    with running_server(["--model-cache-dir", str(model_cache_dir), "--stats-file", str(stats)]) as server:
        _, finished = generate(server.stub(), **greedy("after a bad stats file", 4))
        assert finished.usage.completion_tokens == 4
    set_aside = [p for p in tmp_path.iterdir() if p.name.startswith("stats.json.")]
    assert len(set_aside) == 1 and set_aside[0].read_bytes() == BAD_CONTENTS[kind]
    assert json.loads(stats.read_text())["fingerprint"]["model"] == "builtin:tiny"  # saved anew at shutdown


def test_server_starts_and_serves_when_the_stats_directory_cannot_exist(model_cache_dir, tmp_path) -> None:  # noqa: ANN001
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with running_server(["--model-cache-dir", str(model_cache_dir),
                         "--stats-file", str(blocker / "stats.json")]) as server:
        _, finished = generate(server.stub(), **greedy("stats cannot be saved", 4))
        assert finished.usage.completion_tokens == 4


SAVE_LOOP = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cache_manager import Fingerprint, StatsStore
    from cache_manager.stats import StatsTables
    store = StatsStore(Path(sys.argv[1]), Fingerprint("m", "float32", "cpu", "t", (1, 2, 4), 4))
    tables = StatsTables()
    i = 0
    print("saving", flush=True)
    while True:
        i += 1
        for n in range(1, 200):
            tables.req(n).requests = i * n
        store.save(tables)
""")


def test_sigkill_while_saving_in_a_loop_never_leaves_an_unloadable_file(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    fingerprint = Fingerprint("m", "float32", "cpu", "t", (1, 2, 4), 4)
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(path)], stdout=subprocess.PIPE,
                                cwd=Path(__file__).resolve().parents[2])
        assert proc.stdout.readline() == b"saving\n"
        time.sleep(0.2 + 0.13 * attempt)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        tables = StatsStore(path, fingerprint).load()
        assert tables.requested, "the file must load with the saved counters"
        assert not [p for p in tmp_path.iterdir() if ".bad-" in p.name or ".foreign-" in p.name]


def test_stats_of_another_kv_cache_dtype_are_set_aside_and_the_same_dtype_keeps_them(model_cache_dir, tmp_path) -> None:  # noqa: ANN001
    """FP8 KV makes other graphs (other sizes in bytes): a warm start must not read a bf16 cache's
    statistics as its own. A server of the same KV dtype keeps the file. The admin state names the
    cache's dtype."""
    stats = tmp_path / "stats.json"
    base = ["--model-cache-dir", str(model_cache_dir), "--stats-file", str(stats)]
    for argv in ([], []):  # auto, then auto again: the file is read, not set aside
        with running_server(base + argv) as server:
            generate(server.stub(), **greedy("the same cache dtype", 4))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("stats.json.")]
    assert json.loads(stats.read_text())["fingerprint"]["dtype"] == "float32"
    with running_server(base + ["--kv-cache-dtype", "fp8"], environ={"GRAPHSERVE_ADMIN_TOKEN": "t"}) as server:
        generate(server.stub(), **greedy("an FP8 KV cache", 4))
        admin = admin_pb2_grpc.GraphCacheAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.app.admin_port}"))
        state = admin.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=[("authorization", "Bearer t")])
        assert state.kv_cache.dtype == "float8_e4m3fn"
    set_aside = [p for p in tmp_path.iterdir() if p.name.startswith("stats.json.foreign-")]
    assert len(set_aside) == 1 and json.loads(set_aside[0].read_text())["fingerprint"]["dtype"] == "float32"
    assert json.loads(stats.read_text())["fingerprint"]["dtype"] == "float32+kv-float8_e4m3fn"
