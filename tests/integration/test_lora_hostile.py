"""Hostile adapters through a real server on loopback: what a user with the admin token can send must
not reach other users' output, freeze the server, keep memory, or reveal the server's filesystem."""

from __future__ import annotations

import json
import pathlib
import shutil
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from safetensors.torch import load_file, save_file

from service.engine_client.calls import EngineCall, LoadAdapter, UnloadAdapter
from service.model import ensure_builtin
from service.proto import admin_pb2, admin_pb2_grpc, inference_pb2
from tests.support.lora import make_adapter
from tests.support.server import ServerThread, running_server

TOKEN = "hostile-admin-token"
PROMPT = [766, 5, 6, 7, 8, 9]
MAX_CPU_LORAS = 4


class Hostile:
    def __init__(self, server: ServerThread, root: pathlib.Path, good: pathlib.Path) -> None:
        self.server, self.root, self.good = server, root, good
        self.stub = server.stub()
        self.admin = admin_pb2_grpc.GraphCacheAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.app.admin_port}"))
        self.auth = (("authorization", f"Bearer {TOKEN}"),)
        self._n = 0

    def generate(self, adapter: str = "", max_tokens: int = 8, gaps: list[float] | None = None) -> list[int]:
        request = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=PROMPT), adapter=adapter,
            sampling=inference_pb2.SamplingParams(temperature=0.0),
            stopping=inference_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
        tokens, last = [], time.monotonic()
        for response in self.stub.Generate(request, timeout=60):
            if response.WhichOneof("kind") == "chunk":
                tokens += response.chunk.token_ids
                if gaps is not None:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        return tokens

    def load(self, name: str, path: str | pathlib.Path, timeout: float = 30) -> admin_pb2.AdapterInfo:
        return self.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name=name, path=str(path)), metadata=self.auth,
                                      timeout=timeout)

    def unload(self, name: str) -> None:
        self.admin.UnloadAdapter(admin_pb2.UnloadAdapterRequest(name=name), metadata=self.auth, timeout=30)

    def refused(self, name: str, path: str | pathlib.Path) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            self.load(name, path)
        return err.value

    def copy(self, **config_changes: object) -> pathlib.Path:
        """The good adapter copied under the root, its config changed."""
        self._n += 1
        dst = self.root / f"copy{self._n}"
        shutil.copytree(self.good, dst)
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(config))  # NaN / Infinity as Python writes them
        return dst

    def engine_rss(self) -> int:
        pid = self.server.app.engine.process.pid
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def hostile(model_cache_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    root = tmp_path_factory.mktemp("adapters")
    model_dir = ensure_builtin("tiny", model_cache_dir)
    good = make_adapter(model_dir, root / "good", seed=4, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    token_file = root.parent / "hostile-token"
    token_file.write_text(TOKEN)
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "8", "--max-seq-len", "256",
            "--lora-modules", f"good={good}", "--max-loras", "2", "--max-lora-rank", "8", "--lora-root", str(root),
            "--max-cpu-loras", str(MAX_CPU_LORAS), "--admin-token-file", str(token_file)]
    with running_server(argv) as server:
        yield Hostile(server, root, good)


def _poisoned_weights(src: pathlib.Path, value: float, which: str) -> None:
    tensors = load_file(src / "adapter_model.safetensors")
    name = next(k for k in sorted(tensors) if which in k and "layers.1." in k)
    tensors[name][0, 0] = value
    save_file(tensors, src / "adapter_model.safetensors")


@pytest.mark.parametrize("case, message", [
    ("alpha-nan", "lora_alpha must be a finite positive number, got nan"),
    ("alpha-inf", "lora_alpha must be a finite positive number, got inf"),
    ("weights-nan", "lora_B holds NaN or inf"),
    ("weights-inf", "lora_A holds NaN or inf"),
])
def test_non_finite_adapters_are_refused_and_base_output_is_unchanged(hostile: Hostile, case: str,
                                                                      message: str) -> None:
    base, good = hostile.generate(), hostile.generate("good")
    if case.startswith("alpha"):
        path = hostile.copy(lora_alpha=float("nan") if case == "alpha-nan" else float("inf"))
    else:
        path = hostile.copy()
        _poisoned_weights(path, float("nan") if case == "weights-nan" else float("inf"),
                          "lora_B" if case == "weights-nan" else "lora_A")
    err = hostile.refused(f"bad-{case}", path)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
    assert hostile.generate() == base and hostile.generate("good") == good
    listed = hostile.admin.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=hostile.auth, timeout=30)
    assert [a.name for a in listed.adapters] == ["good"]


@pytest.mark.parametrize("change, outcome", [
    ({"target_modules": "(.*.*)*X"}, "target_modules '(.*.*)*X' matches none"),
    ({"rank_pattern": {"(.*.*)*X": 2}}, "loaded"),  # matches no module: r applies
])
def test_a_catastrophic_regex_costs_nothing_while_streams_and_admin_calls_go_on(hostile: Hostile, change: dict,
                                                                               outcome: str) -> None:
    """`(.*.*)*X` backtracks for hours in Python's re (holding the engine's GIL); RE2 matches in linear time."""
    gaps: list[float] = []
    stream = threading.Thread(target=hostile.generate, kwargs={"max_tokens": 100, "gaps": gaps})
    stream.start()
    start = time.monotonic()
    try:
        info = hostile.load("regex", hostile.copy(**change))
        assert outcome == "loaded" and info.rank == 4
        hostile.unload("regex")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and outcome in err.details(), err.details()
    assert time.monotonic() - start < 2.0
    t0 = time.monotonic()
    hostile.admin.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=hostile.auth, timeout=30)
    assert time.monotonic() - t0 < 1.0
    stream.join(60)
    assert gaps and max(gaps) < 1.0, max(gaps)  # the engine kept stepping throughout


def test_admin_calls_do_not_wait_behind_a_load(hostile: Hostile, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that takes long (a slow disk) holds up no other admin call."""
    engine = hostile.server.app.engine
    real_request = engine.request

    def slow_request(call: EngineCall, timeout: float | None = None) -> object:
        if isinstance(call, LoadAdapter):
            time.sleep(2.0)
        return real_request(call, timeout)

    monkeypatch.setattr(engine, "request", slow_request)
    loader = threading.Thread(target=hostile.load, args=("slow", hostile.good))
    loader.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    listed = hostile.admin.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=hostile.auth, timeout=30)
    hostile.admin.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=hostile.auth, timeout=30)
    assert time.monotonic() - t0 < 1.0 and "slow" not in [a.name for a in listed.adapters]
    loader.join(30)
    hostile.unload("slow")


def test_malformed_configs_are_invalid_argument_naming_the_field(hostile: Hostile) -> None:
    path = hostile.copy()
    (path / "adapter_config.json").write_bytes(b'{"r": 4, "lora_alpha": 8, "target_modules": ["\xff"]}')
    cases = [(path, "adapter_config.json: not UTF-8 text"),
             (hostile.copy(target_modules="([a-z]"), "target_modules '([a-z]' is not a valid regular expression"),
             (hostile.copy(rank_pattern=["q_proj"]), "rank_pattern must be an object mapping module patterns"),
             (hostile.copy(r=float("inf")), "r must be a positive integer, got inf")]
    for path, message in cases:
        err = hostile.refused("malformed", path)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (message, err.details())
        assert message in err.details(), err.details()


def test_a_huge_sparse_file_is_refused_and_memory_is_as_before(hostile: Hostile) -> None:
    """A 4 GiB adapter_model.safetensors (a hole: no disk used) whose header is valid, and one whose
    header declares a tensor of gigabytes: refused from the header and the file's size, nothing read."""
    before = hostile.engine_rss()
    valid = hostile.copy()
    weights = valid / "adapter_model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(4 << 30)
    huge = hostile.copy()
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    blob = json.dumps({key: {"dtype": "F32", "shape": [8, 1 << 27], "data_offsets": [0, 1 << 32]}}).encode()
    with open(huge / "adapter_model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + (1 << 32))
    for path in (valid, huge):
        start = time.monotonic()
        err = hostile.refused("huge", path)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than an adapter of this model" in err.details()
        assert time.monotonic() - start < 2.0
    assert hostile.engine_rss() - before < 64 << 20


def test_registered_adapters_are_capped(hostile: Hostile) -> None:
    names = [f"cap{i}" for i in range(MAX_CPU_LORAS - 1)]  # "good" is the first
    for name in names:
        hostile.load(name, hostile.good)
    try:
        err = hostile.refused("one-too-many", hostile.good)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"as many as --max-cpu-loras {MAX_CPU_LORAS} allows" in err.details()
        hostile.unload(names.pop())
        assert hostile.load("one-more", "good").rank == 4  # a relative path: under --lora-root
        names.append("one-more")
    finally:
        for name in names:
            hostile.unload(name)


@pytest.mark.parametrize("name", ["base", "other", "BASE"])
def test_names_of_the_metric_labels_are_refused(hostile: Hostile, name: str) -> None:
    err = hostile.refused(name, hostile.good)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is reserved (the metric labels" in err.details()


def test_lora_root_is_enforced_and_errors_do_not_reveal_the_filesystem(hostile: Hostile, tmp_path: pathlib.Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    outside = shutil.copytree(hostile.good, tmp_path / "outside")
    (hostile.root / "escape").symlink_to(outside)
    details = set()
    for path in (outside, tmp_path / "missing", "/etc", hostile.root / "escape", hostile.root / ".." / "x"):
        err = hostile.refused("escape", path)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "is outside --lora-root" in err.details()
        details.add(err.details().replace(str(path), "<path>"))
    assert len(details) == 1  # existing or not, a directory or not: the same answer
    missing = {hostile.refused("nope", hostile.root / p).details().replace(p, "<p>") for p in ("none", "good/none")}
    assert len(missing) == 1 and "holds no readable adapter_config.json" in missing.pop()
    from service import graphctl  # as README shows it

    capsys.readouterr()
    code = graphctl.main(["--target", f"127.0.0.1:{hostile.server.app.admin_port}", "--token-file",
                          str(hostile.root.parent / "hostile-token"), "load-adapter", "x", "/etc"])
    assert code == graphctl.EXIT_REFUSED
    assert capsys.readouterr().err.strip() == ("graphctl: load-adapter refused (PERMISSION_DENIED): load_adapter: "
                                               "adapter 'x': /etc is outside --lora-root; adapters load only from "
                                               "under it")


def test_a_generate_racing_its_adapters_unload_is_not_found(hostile: Hostile) -> None:
    """Unloaded after the server accepted the request (here: unloaded in the engine before the gRPC
    process's list of names follows, the window of a real race)."""
    hostile.load("race", hostile.good)
    hostile.server.app.engine.request(UnloadAdapter("race"), timeout=60)
    hostile.server.app.engine.adapter_names.add("race")  # the names as before the reply came back
    with pytest.raises(grpc.RpcError) as err:
        hostile.generate("race")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'race' is not loaded" in err.value.details()
    hostile.server.app.engine.adapter_names.discard("race")
    with pytest.raises(grpc.RpcError) as err:
        hostile.generate("race")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_without_a_root_adapters_load_only_at_start(model_cache_dir, hostile: Hostile) -> None:
    """LoadAdapter needs --lora-root; without one, --lora-modules load from anywhere, and one whose
    config holds a catastrophic regex does not keep the server from getting ready."""
    slow = hostile.copy(rank_pattern={"(.*.*)*X": 2})
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "4", "--max-seq-len", "128",
            "--max-lora-rank", "8", "--admin-token-file", str(hostile.root.parent / "hostile-token"),
            "--lora-modules", f"good={hostile.good},slow={slow}"]
    start = time.monotonic()
    with running_server(argv) as server:
        assert time.monotonic() - start < 60
        info = server.stub().GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
        assert list(info.adapters) == ["good", "slow"]
        admin = admin_pb2_grpc.GraphCacheAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.app.admin_port}"))
        with pytest.raises(grpc.RpcError) as err:
            admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name="x", path=str(hostile.good)), metadata=hostile.auth,
                              timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--lora-root" in err.value.details()
