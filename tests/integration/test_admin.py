"""The admin port and graphctl against a real server on loopback. On CPU graphs are off (mode none);
with GRAPHSERVE_TEST_ARGS="--device cuda ..." they are on (mode full): the tests assert what holds on
either, and the one that needs a server without graphs says so."""

from __future__ import annotations

import asyncio
import json
import threading
import types
from collections.abc import Iterator

import grpc
import pytest
import structlog
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_manager import Fingerprint, GraphCache, GraphCacheConfig, GraphFamily
from cache_manager.sizes import FULL
from cache_manager.testing import CountingStep, FakeGraphBackend
from service import graphctl
from service.config import ConfigError, ServeConfig, load_config
from service.engine.engine import Engine
from service.engine.scheduler import Scheduler
from service.engine_client.client import EngineFacts
from service.engine_client.in_process import InProcessEngine
from service.proto import admin_pb2, admin_pb2_grpc
from service.server.admin_server import start_admin_server
from tests.support.server import ServerThread, free_port, generate, greedy, running_server

TOKEN = "s3cret-admin-token-for-tests"
SIZES = [1, 2, 4, 8, 16]


class Admin:
    """The admin side of a running server: its address, a raw stub and graphctl in-process."""

    def __init__(self, server: ServerThread, port: int, token_file: str, logs: list[dict]) -> None:
        self.server = server
        self.logs = logs  # the server's log events while this module runs
        self.target = f"127.0.0.1:{port}"
        self.token_file = token_file
        self.stub = admin_pb2_grpc.GraphCacheAdminStub(grpc.insecure_channel(self.target))

    def auth(self, token: str = TOKEN) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),)

    def ctl(self, capsys: pytest.CaptureFixture, *argv: str, token_file: str | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        code = graphctl.main(["--target", self.target, "--token-file", token_file or self.token_file, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    def ctl_json(self, capsys: pytest.CaptureFixture, *argv: str) -> dict:
        code, out, err = self.ctl(capsys, "--json", *argv)
        assert code == 0, err
        return json.loads(out)


@pytest.fixture(scope="module")
def admin(model_cache_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("admin")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "16", "--max-seq-len", "256",
            "--stats-file", str(tmp / "stats.json")]
    # Capturing the server's logs keeps them out of graphctl's stdout (same process) and lets a test
    # check that the token never reaches them.
    with structlog.testing.capture_logs() as logs, \
            running_server(argv, environ={"GRAPHSERVE_ADMIN_TOKEN": TOKEN + "\n"}) as server:
        yield Admin(server, server.app.admin_port, str(token_file), logs)


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphctl: "), err
    assert "Traceback" not in err
    return lines[0]


def requested(stats: dict, view: str = "since_start") -> dict[int, int]:
    return {int(c["size"]): int(c["count"]) for c in stats[view]["requested_sizes"]}


def device_of(admin: Admin) -> str:
    """cpu here; cuda when GRAPHSERVE_TEST_ARGS runs these tests on a GPU."""
    return admin.server.app.model.device


def mode_of(admin: Admin) -> str:
    """none on CPU; full on a GPU unless --cudagraph-mode none."""
    return admin.server.app.model.graph_mode


def test_state_json_shows_the_mode_and_every_bucket(admin: Admin, capsys) -> None:
    state = admin.ctl_json(capsys, "state")
    assert state["mode"] == mode_of(admin)
    assert state["device"] == device_of(admin)
    assert state["capture_sizes"] == SIZES
    assert [b["size"] for b in state["buckets"]] == SIZES
    if mode_of(admin) == "none":  # nothing is ever captured
        assert {b["state"] for b in state["buckets"]} == {"BUCKET_STATE_NOT_CAPTURED"}
        assert int(state.get("used_bytes", 0)) == 0


def test_requested_size_histogram_grows_with_generate_calls(admin: Admin, capsys) -> None:
    before = requested(admin.ctl_json(capsys, "stats"))
    for prompt in ("Once upon a time", "hello", "graphs"):
        generate(admin.server.stub(), **greedy(prompt, 6))
    stats = admin.ctl_json(capsys, "stats")
    after = requested(stats)
    assert after.get(1, 0) >= before.get(1, 0) + 3 * 5  # 6 tokens: one prefill, then 5 decode steps of 1 row
    assert requested(stats, "persisted").get(1, 0) >= after[1]
    eager = {r["reason"]: int(r["count"]) for r in stats["since_start"]["eager_fallbacks"]}
    if mode_of(admin) == "none":
        assert eager["mode_none"] >= 15
    assert stats["stats_file"].endswith("stats.json")


def test_table_names_every_bucket(admin: Admin, capsys) -> None:
    code, out, err = admin.ctl(capsys, "state")
    assert code == 0, err
    assert out.startswith(f"graph cache: mode {mode_of(admin)} on {device_of(admin)}")
    lines = out.splitlines()
    ready = admin.server.app.model
    assert lines[0].endswith(f", model {ready.spec.architecture}")  # the served model's architecture
    assert lines[1].startswith(f"KV cache ({ready.kv_cache_dtype or ready.dtype}): 0 of ") and "prefix hits" in lines[1]
    rows = [line.split() for line in lines[3:]]  # after the two head lines and the table's header
    full = [r for r in rows if r[0] == "full"]
    assert [int(r[1]) for r in full] == SIZES
    if mode_of(admin) == "none":
        assert all(r[2] == "not_captured" for r in rows)
    code, out, err = admin.ctl(capsys, "stats")
    assert code == 0, err
    assert "requested sizes" in out
    if mode_of(admin) == "none":
        assert "mode_none" in out


def test_global_flags_go_before_or_after_the_command(admin: Admin, capsys) -> None:
    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = graphctl.main(list(argv))
        return code, capsys.readouterr().out

    target, token = ("--target", admin.target), ("--token-file", admin.token_file)
    before = run(*target, *token, "--json", "state")
    after = run("state", "--json", *target, *token)
    mixed = run(*target, "state", *token, "--json")
    assert before[0] == after[0] == mixed[0] == 0
    assert json.loads(before[1])["capture_sizes"] == json.loads(after[1])["capture_sizes"] == SIZES
    assert json.loads(mixed[1])["mode"] == mode_of(admin)
    code, out = run("stats", *target, *token)  # after the command, without --json: the table
    assert code == 0 and out.startswith("stats file: ")


def test_missing_or_wrong_token_is_unauthenticated(admin: Admin, capsys, tmp_path, monkeypatch) -> None:
    for metadata in ((), admin.auth("wrong-token"), (("authorization", TOKEN),), admin.auth(TOKEN + "x")):
        with pytest.raises(grpc.RpcError) as info:
            admin.stub.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN not in info.value.details() and "wrong-token" not in info.value.details()
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-token")
    code, out, err = admin.ctl(capsys, "state", token_file=str(wrong))
    assert code == graphctl.EXIT_UNAUTHENTICATED and out == ""
    assert "rejected the admin token" in one_line_error(err)
    monkeypatch.delenv("GRAPHSERVE_ADMIN_TOKEN", raising=False)
    capsys.readouterr()
    code = graphctl.main(["--target", admin.target, "state"])
    assert code == graphctl.EXIT_UNAUTHENTICATED
    assert "no admin token" in one_line_error(capsys.readouterr().err)
    assert any(e["event"] == "admin_unauthenticated" for e in admin.logs)
    assert TOKEN not in repr(admin.logs)


def test_token_from_environment(admin: Admin, capsys, monkeypatch) -> None:
    monkeypatch.setenv("GRAPHSERVE_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("GRAPHSERVE_ADMIN_TARGET", admin.target)
    capsys.readouterr()
    assert graphctl.main(["--json", "state"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == mode_of(admin)


def test_token_variable_with_a_trailing_newline_is_trimmed(admin: Admin) -> None:
    # The fixture's server got GRAPHSERVE_ADMIN_TOKEN with a newline, as a Kubernetes Secret gives it.
    state = admin.stub.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=admin.auth(), timeout=10)
    assert state.capture_sizes == SIZES


@pytest.mark.parametrize("token", ["two words", "caf\u00e9", "tab\there"])
def test_a_token_that_cannot_be_sent_as_metadata_is_refused_at_start(token: str) -> None:
    with pytest.raises(ConfigError, match="GRAPHSERVE_ADMIN_TOKEN: the admin token must be visible ASCII"):
        load_config([], {"GRAPHSERVE_ADMIN_TOKEN": token})


def test_failed_logins_are_counted_and_their_log_lines_throttled(admin: Admin) -> None:
    def failures() -> float:
        return admin.server.app.metrics.registry.get_sample_value("graphserve_admin_auth_failures_total") or 0.0

    before, logged_before = failures(), sum(e["event"] == "admin_unauthenticated" for e in admin.logs)
    for _ in range(50):
        with pytest.raises(grpc.RpcError) as info:
            admin.stub.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=admin.auth("guess"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert failures() == before + 50
    logged = sum(e["event"] == "admin_unauthenticated" for e in admin.logs) - logged_before
    assert logged <= 2, f"{logged} log lines for 50 failed logins"


def test_reflection_needs_the_token_too(admin: Admin) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(admin.target))
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
    replies = list(stub.ServerReflectionInfo(iter(ask), metadata=admin.auth(), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "graphserve.v1.GraphCacheAdmin" in names
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ServerReflectionInfo(iter(ask), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_capture_and_evict_without_graphs_are_failed_precondition(admin: Admin, capsys) -> None:
    if mode_of(admin) != "none":
        pytest.skip("needs a server without CUDA graphs (mode none: CPU, or --cudagraph-mode none)")
    for method in (admin.stub.Capture, admin.stub.Evict):
        with pytest.raises(grpc.RpcError) as info:
            method(admin_pb2.SizesRequest(sizes=[8]), metadata=admin.auth(), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "mode none" in info.value.details() and device_of(admin) in info.value.details()
    code, out, err = admin.ctl(capsys, "capture", "8")
    assert code == graphctl.EXIT_REFUSED and out == ""
    assert "FAILED_PRECONDITION" in one_line_error(err)


def test_size_outside_the_allowed_list_is_invalid_argument(admin: Admin, capsys) -> None:
    for method in (admin.stub.Capture, admin.stub.Evict):
        with pytest.raises(grpc.RpcError) as info:
            method(admin_pb2.SizesRequest(sizes=[3, 8]), metadata=admin.auth(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "[3]" in info.value.details() and str(SIZES) in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        admin.stub.Capture(admin_pb2.SizesRequest(), metadata=admin.auth(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    code, _, err = admin.ctl(capsys, "evict", "3")
    assert code == graphctl.EXIT_REFUSED
    assert "allowed: [1, 2, 4, 8, 16]" in one_line_error(err)
    code, _, err = admin.ctl(capsys, "capture", "0")
    assert code == graphctl.EXIT_USAGE and "Traceback" not in err


def test_lora_kinds_without_adapter_slots_are_invalid_argument(admin: Admin, capsys) -> None:
    for method in (admin.stub.Capture, admin.stub.Evict):
        for kind in ("full+lora", "piecewise+lora"):
            with pytest.raises(grpc.RpcError) as info:
                method(admin_pb2.SizesRequest(sizes=[8], kind=kind), metadata=admin.auth(), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no adapter slots" in info.value.details() and "--max-loras" in info.value.details()
    code, out, err = admin.ctl(capsys, "capture", "--kind", "full+lora", "8")
    assert code == graphctl.EXIT_REFUSED and out == ""
    assert "INVALID_ARGUMENT" in one_line_error(err) and "no adapter slots" in err
    with pytest.raises(grpc.RpcError) as info:
        admin.stub.Capture(admin_pb2.SizesRequest(sizes=[8], kind="lora"), metadata=admin.auth(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "full+lora" in info.value.details()


def test_adapter_calls_without_adapter_slots_say_how_to_turn_adapters_on(admin: Admin, capsys) -> None:
    for method, request in ((admin.stub.LoadAdapter, admin_pb2.LoadAdapterRequest(name="a", path="/tmp/a")),
                            (admin.stub.UnloadAdapter, admin_pb2.UnloadAdapterRequest(name="a"))):
        with pytest.raises(grpc.RpcError) as info:
            method(request, metadata=admin.auth(), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "serves no adapters" in info.value.details() and "--max-loras" in info.value.details()
    listed = admin.stub.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=admin.auth(), timeout=30)
    assert list(listed.adapters) == [] and listed.max_loras == 0
    code, out, err = admin.ctl(capsys, "load-adapter", "a", "/tmp/a")
    assert code == graphctl.EXIT_REFUSED and out == ""
    assert "FAILED_PRECONDITION" in one_line_error(err)


def test_thousands_of_bad_sizes_are_listed_capped(admin: Admin) -> None:
    bad = list(range(1000, 6000))
    for method in (admin.stub.Capture, admin.stub.Evict):
        with pytest.raises(grpc.RpcError) as info:
            method(admin_pb2.SizesRequest(sizes=bad), metadata=admin.auth(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert "[1000, 1001, 1002" in details and "and 4992 more" in details and len(details) < 300


def test_budget_zero_or_absurd_is_invalid_argument(admin: Admin, capsys) -> None:
    for budget in (0, 1 << 62):
        with pytest.raises(grpc.RpcError) as info:
            admin.stub.SetBudget(admin_pb2.SetBudgetRequest(budget_bytes=budget), metadata=admin.auth(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    code, _, err = admin.ctl(capsys, "budget", "0")
    assert code == graphctl.EXIT_USAGE and "budget" in one_line_error(err)
    code, _, err = admin.ctl(capsys, "budget", "lots")
    assert code == graphctl.EXIT_USAGE and "not a byte count" in one_line_error(err)


def test_budget_accepts_units(admin: Admin, capsys) -> None:
    response = admin.ctl_json(capsys, "budget", "512MiB")
    assert int(response["budget_bytes"]) == 512 << 20 and response["results"] == []
    code, out, _ = admin.ctl(capsys, "budget", "1GiB")
    assert code == 0 and "nothing evicted" in out and "budget 1.0 GiB" in out


def test_budget_in_fractional_bytes_is_refused_not_rounded(admin: Admin, capsys) -> None:
    before = admin.ctl_json(capsys, "state")["budget_bytes"]
    for text, message in (("1.999", "'1.999' is 1.999 bytes, not a whole number; write e.g. 1 or 2"),
                          ("0.1KiB", "'0.1KiB' is 102.4 bytes, not a whole number; write e.g. 102 or 103"),
                          ("1e999999", "more bytes than any device has")):
        code, out, err = admin.ctl(capsys, "budget", text)
        assert code == graphctl.EXIT_USAGE and out == ""
        assert message in one_line_error(err)
    assert admin.ctl_json(capsys, "state")["budget_bytes"] == before  # nothing was sent
    response = admin.ctl_json(capsys, "budget", "1.5GiB")  # a fraction of a unit that is whole bytes
    assert int(response["budget_bytes"]) == 3 << 29
    admin.ctl_json(capsys, "budget", str(before))


def test_token_file_that_is_not_a_token_is_one_line_and_exit_2(admin: Admin, capsys, tmp_path) -> None:
    binary, spaced, big = tmp_path / "binary", tmp_path / "spaced", tmp_path / "big"
    binary.write_bytes(TOKEN.encode() + b"\xff\xfe")
    spaced.write_text("s3cret admin")
    big.write_text(TOKEN + "x" * 5000)
    for path, message in (("/dev/zero", "is larger than 4096 bytes; it must hold only the admin token"),
                          (str(big), "is larger than 4096 bytes"),
                          (str(binary), "is not UTF-8 text; it must hold only the admin token"),
                          (str(spaced), "the admin token must be visible ASCII characters")):
        code, out, err = admin.ctl(capsys, "state", token_file=path)
        assert code == graphctl.EXIT_USAGE and out == ""
        assert f"--token-file {path}" in one_line_error(err) and message in err


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0", "1e20"])
def test_timeout_must_be_finite_and_positive(admin: Admin, capsys, timeout: str) -> None:
    code, out, err = admin.ctl(capsys, "--timeout", timeout, "state")
    assert code == graphctl.EXIT_USAGE and out == ""
    assert "--timeout must be a number of seconds in (0, 86400]" in one_line_error(err)


def test_reset_stats_zeroes_the_histogram(admin: Admin, capsys) -> None:
    generate(admin.server.stub(), **greedy("before the reset", 4))
    assert requested(admin.ctl_json(capsys, "stats"))
    code, out, _ = admin.ctl(capsys, "reset-stats")
    assert code == 0 and "reset" in out
    stats = admin.ctl_json(capsys, "stats")
    assert requested(stats) == {} and requested(stats, "persisted") == {}


def test_unreachable_target_is_one_line_and_exit_3(capsys, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    capsys.readouterr()
    code = graphctl.main(["--target", f"127.0.0.1:{free_port()}", "--token-file", str(token), "--timeout", "5", "state"])
    assert code == graphctl.EXIT_UNREACHABLE
    assert "cannot reach the admin server" in one_line_error(capsys.readouterr().err)


def test_no_token_configured_keeps_the_admin_port_closed(server: ServerThread) -> None:
    assert server.config.admin_token is None
    assert getattr(server.app, "admin_port", None) is None
    started = asyncio.run_coroutine_threadsafe(
        start_admin_server(server.config, server.app.engine), server.loop
    ).result(30)
    assert started == (None, None)


@pytest.fixture(params=[True], ids=["pad_single_rows"])
def fake_graphs_admin(request, tmp_path) -> Iterator[Admin]:  # noqa: ANN001
    """The admin server over a graph cache whose backend fakes graphs of 1000 bytes per row (CPU).

    Exercises capture, evict and budget end to end through a real engine thread; the real-GPU
    version is tests/gpu/test_admin_gpu.py. Parametrized indirectly with pad_single_rows (False: as
    with FP8 weights).
    """
    yield from _fake_graphs_admin(tmp_path, request.param, lora=False)


@pytest.fixture
def fake_lora_graphs_admin(tmp_path) -> Iterator[Admin]:  # noqa: ANN001
    """As fake_graphs_admin, with adapter slots: the cache holds LoRA graphs too ("lora:s" in the fake's records)."""
    yield from _fake_graphs_admin(tmp_path, True, lora=True)


def _fake_graphs_admin(tmp_path, pad_single_rows: bool, lora: bool) -> Iterator[Admin]:  # noqa: ANN001
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    config = GraphCacheConfig(mode="full", capture_sizes=None, max_batch=16, memory_budget=100_000,
                              pad_single_rows=pad_single_rows)
    fingerprint = Fingerprint("fake", "float32", "cpu", torch.__version__, config.sizes, 16)
    steps = {GraphFamily(FULL): CountingStep(16)}
    if lora:
        steps[GraphFamily(FULL, lora=True)] = CountingStep(16, name="lora")
    graphs = GraphCache(steps, config, torch.device("cpu"), fingerprint, FakeGraphBackend())
    # As builder.new_engine wires it: a finished capture is committed between steps.
    engine = Engine(runner=None, scheduler=Scheduler(16, 4096), tokenizer=None, eos_token_ids=frozenset(),
                    between_steps=graphs.poll)
    graphs.hooks.attach(engine)
    engine.start()
    facts = EngineFacts(model_path="", spec=None, max_seq_len=256, device="cpu", dtype="float32", graph_config=config,
                        graph_mode="full", graphs_device="cpu", has_graph_backend=True, max_loras=2 if lora else 0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = InProcessEngine(engine, types.SimpleNamespace(graphs=graphs, adapters=None,
                                                           runner=types.SimpleNamespace(rank_memory=list)), facts)
    serve = ServeConfig(admin_port=0, admin_token=TOKEN)
    with structlog.testing.capture_logs() as logs:
        server, port = asyncio.run_coroutine_threadsafe(
            start_admin_server(serve, client), loop).result(30)
        try:
            yield Admin(None, port, str(token_file), logs)
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            client.stop()


def test_a_budget_above_the_device_s_memory_is_invalid_argument(fake_graphs_admin: Admin) -> None:
    admin = fake_graphs_admin
    with pytest.raises(grpc.RpcError) as info:  # the fake device has 10**9 bytes
        admin.stub.SetBudget(admin_pb2.SetBudgetRequest(budget_bytes=2 * 10**9), metadata=admin.auth(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the device's 1000000000 bytes of memory" in info.value.details()


def by_size(response: dict) -> dict[int, dict]:
    return {int(r["size"]): r for r in response.get("results", response.get("buckets", []))}


def test_capture_evict_and_budget_with_fake_graphs(fake_graphs_admin: Admin, capsys) -> None:
    admin = fake_graphs_admin
    code, out, err = admin.ctl(capsys, "capture", "8")
    assert code == 0, err
    assert "captured" in out and "7.8 KiB" in out
    state = admin.ctl_json(capsys, "state")
    assert state["mode"] == "full" and int(state["used_bytes"]) == 8000
    assert by_size(state)[8]["state"] == "BUCKET_STATE_CAPTURED" and int(by_size(state)[8]["bytes"]) == 8000
    assert by_size(admin.ctl_json(capsys, "capture", "8"))[8]["outcome"] == "already_captured"
    assert {s: r["outcome"] for s, r in by_size(admin.ctl_json(capsys, "capture", "16", "4")).items()} == {
        16: "captured", 4: "captured"}

    code, out, _ = admin.ctl(capsys, "state")
    rows = {int(r.split()[1]): r.split()[2] for r in out.splitlines()[3:]}  # after the two head lines and the header
    assert rows == {1: "not_captured", 2: "not_captured", 4: "captured", 8: "captured", 16: "captured"}

    response = admin.ctl_json(capsys, "budget", "10000")
    assert int(response["budget_bytes"]) == 10000 and int(response["used_bytes"]) <= 10000
    assert {r["outcome"] for r in response["results"]} == {"evicted"}
    evicted = set(by_size(response))
    assert evicted and 16 in evicted

    code, out, err = admin.ctl(capsys, "capture", "16")
    assert code == graphctl.EXIT_REFUSED and "over_budget" in out
    assert "did not complete for 16" in one_line_error(err)

    kept = sorted({4, 8} - evicted)
    response = admin.ctl_json(capsys, "evict", *map(str, [*kept, 16]))
    assert by_size(response)[16]["outcome"] == "not_captured"
    assert all(by_size(response)[s]["outcome"] == "evicted" for s in kept)
    assert int(response["used_bytes"]) == 0
    state = admin.ctl_json(capsys, "state")
    assert by_size(state)[16]["state"] == "BUCKET_STATE_EVICTED" and int(by_size(state)[16]["evictions"]) == 1


@pytest.mark.parametrize("fake_graphs_admin", [False], indirect=True, ids=["no_single_row_padding"])
def test_with_fp8_weights_size_1_is_shown_kept_and_only_an_explicit_evict_removes_it(fake_graphs_admin, capsys) -> None:  # noqa: ANN001
    """As with FP8 weights (no one-row padding): the state says which graph is kept and why, a budget
    below it leaves it, and `graphctl evict 1` removes it."""
    admin = fake_graphs_admin
    assert admin.ctl(capsys, "capture", "1", "2")[0] == 0
    state = admin.ctl_json(capsys, "state")
    assert by_size(state)[1].get("kept") is True and not by_size(state)[2].get("kept")
    code, out, _ = admin.ctl(capsys, "state")
    assert "bucket full:1: kept (a lone row may not pad into a larger graph)" in out and "full:2: kept" not in out
    response = admin.ctl_json(capsys, "budget", "500")
    assert set(by_size(response)) == {2} and int(response["used_bytes"]) == 1000
    assert by_size(admin.ctl_json(capsys, "evict", "1"))[1]["outcome"] == "evicted"


def test_lora_and_base_graphs_are_rows_of_one_table_under_one_budget(fake_lora_graphs_admin: Admin, capsys) -> None:
    """One cache: the LoRA graphs are listed by their descriptor beside the base ones (the wire keeps
    them in lora_buckets, each flagged), their bytes count against the one budget, a shrink evicts
    from both, and the stats name their kind "full+lora"."""
    admin = fake_lora_graphs_admin
    assert admin.ctl(capsys, "capture", "8")[0] == 0
    code, out, err = admin.ctl(capsys, "capture", "--kind", "full+lora", "4", "16")
    assert code == 0, err
    assert "full+lora" in out and "captured" in out
    state = admin.ctl_json(capsys, "state")
    assert {int(b["size"]): b["state"] for b in state["lora_buckets"] if b["state"] != "BUCKET_STATE_NOT_CAPTURED"} == {
        4: "BUCKET_STATE_CAPTURED", 16: "BUCKET_STATE_CAPTURED"}
    assert all(b["lora"] and b["kind"] == "full" for b in state["lora_buckets"])
    assert not any(b["lora"] for b in state["buckets"])
    assert int(state["used_bytes"]) == 8000 and int(state["lora_used_bytes"]) == 20_000
    code, out, _ = admin.ctl(capsys, "state")
    assert "used 27.3 KiB of budget 97.7 KiB" in out and "LoRA graphs (steps with any adapter row)" in out
    rows = {(r.split()[0], int(r.split()[1])): r.split()[2] for r in out.splitlines()[4:]}  # two head lines, LoRA's, header
    assert rows[("full", 8)] == "captured" and rows[("full+lora", 16)] == "captured" and rows[("full", 16)] == "not_captured"
    # 28,000 held: a budget of 10,000 evicts the largest cold graphs, LoRA or not.
    response = admin.ctl_json(capsys, "budget", "10000")
    evicted = {(r["kind"], int(r["size"])) for r in response["results"]}
    assert evicted and ("full+lora", 16) in evicted and int(response["used_bytes"]) <= 10_000
    assert {r["outcome"] for r in response["results"]} == {"evicted"}
    stats = admin.ctl_json(capsys, "stats")
    assert {(b["kind"], int(b["size"])) for b in stats["since_start"]["buckets"]} >= {("full", 8), ("full+lora", 16)}
