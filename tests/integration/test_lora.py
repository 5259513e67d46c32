"""LoRA adapters through a real server on loopback: greedy tokens equal peft's (float32 CPU) for base
rows, one adapter and mixed batches; load and unload while streams run; clear errors for bad files."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from service import graphctl
from service.model import ensure_builtin
from service.proto import admin_pb2, admin_pb2_grpc, inference_pb2
from tests.support.lora import make_adapter, peft_greedy
from tests.support.server import ServerThread, running_server

TOKEN = "lora-admin-token"
MAX_TOKENS = 10
PROMPTS = [[766, 5, 6, 7, 8, 9], [766, 11, 12, 13], [766, 20, 21, 22, 23, 24, 25, 26], [766, 30, 31],
           [766, 40, 41, 42, 43], [766, 50, 51, 52, 53, 54]]


class Lora:
    def __init__(self, server: ServerThread, model_dir: pathlib.Path, adapters: dict[str, pathlib.Path],
                 token_file: pathlib.Path) -> None:
        self.server, self.model_dir, self.adapters = server, model_dir, adapters
        self.token_file = token_file
        self.stub = server.stub()
        self.target = f"127.0.0.1:{server.app.admin_port}"
        self.admin = admin_pb2_grpc.GraphCacheAdminStub(grpc.insecure_channel(self.target))
        self._ref: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
        self._lock = threading.Lock()

    def auth(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"),)

    def generate(self, prompt: list[int], adapter: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
        request = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=prompt), adapter=adapter,
            sampling=inference_pb2.SamplingParams(temperature=0.0),
            stopping=inference_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
        tokens: list[int] = []
        for response in self.stub.Generate(request, timeout=120):
            if response.WhichOneof("kind") == "chunk":
                tokens += response.chunk.token_ids
            else:
                assert response.finished.usage.completion_tokens == max_tokens
        return tokens

    def reference(self, prompt: list[int], adapter: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (adapter, tuple(prompt), max_tokens)
        with self._lock:
            if key not in self._ref:
                path = self.adapters[adapter] if adapter else None
                self._ref[key] = peft_greedy(self.model_dir, path, prompt, max_tokens)
            return self._ref[key]

    def ctl(self, capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = graphctl.main(["--target", self.target, "--token-file", str(self.token_file), *argv])
        out, err = capsys.readouterr()
        return code, out, err


@pytest.fixture(scope="module")
def lora(model_cache_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lora]:
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = ensure_builtin("tiny", model_cache_dir)
    adapters = {name: make_adapter(model_dir, tmp / name, seed=i + 1) for i, name in enumerate(["sql", "chat", "poet"])}
    adapters["late"] = make_adapter(model_dir, tmp / "late", seed=9, r=4, alpha=8, targets=["q_proj", "v_proj"],
                                    use_rslora=True)
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    modules = ",".join(f"{n}={adapters[n]}" for n in ("sql", "chat", "poet"))
    # Two slots for three adapters: mixed batches also exercise taking turns on the slots.
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "8", "--max-seq-len", "256",
            "--lora-modules", modules, "--max-loras", "2", "--max-lora-rank", "8", "--admin-token-file", str(token_file),
            "--lora-root", str(tmp_path_factory.getbasetemp())]  # every test's tmp_path is under it
    with running_server(argv) as server:
        yield Lora(server, model_dir, adapters, token_file)


def test_base_and_one_adapter_match_peft(lora: Lora) -> None:
    assert lora.generate(PROMPTS[0]) == lora.reference(PROMPTS[0])
    tokens = lora.generate(PROMPTS[0], "sql")
    assert tokens == lora.reference(PROMPTS[0], "sql")
    assert tokens != lora.reference(PROMPTS[0])  # the adapter changes the output


def test_mixed_batch_of_three_adapters_and_base_matches_peft(lora: Lora) -> None:
    jobs = [(p, a) for p, a in zip(PROMPTS, ["sql", "", "chat", "poet", "", "sql"])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: lora.generate(*job), jobs))
    for (prompt, adapter), tokens in zip(jobs, outs):
        assert tokens == lora.reference(prompt, adapter), f"adapter {adapter or 'base'!r}, prompt {prompt}"


def test_unknown_adapter_is_invalid_argument_listing_the_loaded(lora: Lora) -> None:
    with pytest.raises(grpc.RpcError) as err:
        lora.generate(PROMPTS[1], "nope")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'nope' is not loaded" in err.value.details() and "'chat', 'poet', 'sql'" in err.value.details()
    info = lora.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert list(info.adapters) == ["chat", "poet", "sql"]


def test_load_and_unload_while_streams_run_lose_no_stream(lora: Lora, capsys: pytest.CaptureFixture) -> None:
    long = 48
    jobs = [(PROMPTS[i % len(PROMPTS)], ["sql", "", "chat"][i % 3]) for i in range(6)]
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        holder = pool.submit(lora.generate, PROMPTS[1], "sql", 240)  # keeps "sql" in use throughout
        futures = [pool.submit(lora.generate, p, a, long) for p, a in jobs]
        # While they stream: load an adapter, refuse to unload one in use.
        info = lora.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name="late", path=str(lora.adapters["late"])),
                                      metadata=lora.auth(), timeout=60)
        assert (info.name, info.rank) == ("late", 4)
        assert list(info.target_modules) == ["q_proj", "v_proj"]
        with pytest.raises(grpc.RpcError) as err:
            lora.admin.UnloadAdapter(admin_pb2.UnloadAdapterRequest(name="sql"), metadata=lora.auth(), timeout=60)
        assert not holder.done()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'sql' is used by" in err.value.details() and "after they end" in err.value.details()
        late = lora.generate(PROMPTS[2], "late")
        outs = [f.result(timeout=120) for f in futures]
        assert len(holder.result(timeout=120)) == 240
    for (prompt, adapter), tokens in zip(jobs, outs):
        assert tokens == lora.reference(prompt, adapter, long)
    assert late == lora.reference(PROMPTS[2], "late")

    code, out, _ = lora.ctl(capsys, "--json", "adapters")
    listed = json.loads(out)
    assert code == 0 and listed["max_loras"] == 2
    assert sorted(a["name"] for a in listed["adapters"]) == ["chat", "late", "poet", "sql"]
    assert all(a["active_streams"] == 0 for a in listed["adapters"])
    code, out, _ = lora.ctl(capsys, "unload-adapter", "late")
    assert code == 0 and "unloaded adapter 'late'" in out
    with pytest.raises(grpc.RpcError) as err:
        lora.generate(PROMPTS[2], "late")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    code, _, err_text = lora.ctl(capsys, "unload-adapter", "late")
    assert code == graphctl.EXIT_REFUSED and "NOT_FOUND" in err_text and "not loaded" in err_text
    code, out, _ = lora.ctl(capsys, "load-adapter", "late", str(lora.adapters["late"]))
    assert code == 0 and "loaded adapter 'late': rank 4" in out
    assert lora.generate(PROMPTS[2], "late") == late


def _broken(src: pathlib.Path, dst: pathlib.Path, change: str) -> pathlib.Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    if change == "missing-weights":
        (dst / "adapter_model.safetensors").unlink()
    elif change == "corrupt-weights":
        (dst / "adapter_model.safetensors").write_bytes(b"not safetensors")
    elif change == "rank":
        config["r"] = 4
    elif change == "target":
        config["target_modules"] = ["q_proj", "lm_head"]
    elif change == "bad-json":
        (dst / "adapter_config.json").write_text("{")
        return dst
    elif change == "not-utf8":
        (dst / "adapter_config.json").write_bytes(b'{"r": 8, "lora_alpha": "\xff\xfe"}')
        return dst
    elif change in ("nan-alpha", "inf-alpha", "inf-r"):
        config["lora_alpha" if "alpha" in change else "r"] = math.nan if change.startswith("nan") else math.inf
    elif change == "huge-alpha":  # finite, but alpha / r overflows float32 once folded into B
        config["lora_alpha"] = 1e308
    elif change == "catastrophic-regex":
        config["rank_pattern"] = {"(.*.*)*X": 8}
    elif change == "list-rank-pattern":
        config["rank_pattern"] = ["q_proj", 8]
    elif change == "invalid-regex":
        config["target_modules"] = "(q_proj"
    elif change == "nan-weights":
        from safetensors.torch import load_file, save_file

        tensors = load_file(dst / "adapter_model.safetensors")
        first = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[first][0, 0] = math.nan
        save_file(tensors, dst / "adapter_model.safetensors")
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("change, message", [
    ("missing-weights", "holds no readable adapter_model.safetensors"),
    ("corrupt-weights", "adapter_model.safetensors: not a readable safetensors file"),
    ("rank", "has rank 8 but"),
    ("target", "target_modules ['lm_head'] are not supported"),
    ("bad-json", "adapter_config.json: not valid JSON"),
    ("not-utf8", "adapter_config.json: not UTF-8 text"),
    ("nan-alpha", "lora_alpha must be a finite positive number"),
    ("inf-alpha", "lora_alpha must be a finite positive number"),
    ("inf-r", "r must be a positive integer, got inf"),
    ("huge-alpha", "overflows float32"),
    ("nan-weights", "lora_B holds NaN or inf"),
    ("list-rank-pattern", "rank_pattern must be an object"),
    ("invalid-regex", "is not a valid regular expression"),
])
def test_bad_adapter_files_give_clear_errors(lora: Lora, tmp_path: pathlib.Path, change: str, message: str) -> None:
    """Adapter files are untrusted input: each is refused by name, and the base model's output is as before."""
    base = lora.generate(PROMPTS[0])
    path = _broken(lora.adapters["chat"], tmp_path / change, change)
    with pytest.raises(grpc.RpcError) as err:
        lora.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name=f"bad-{change}", path=str(path)),
                               metadata=lora.auth(), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details() and str(path) in err.value.details()
    assert lora.generate(PROMPTS[0]) == base


def test_a_catastrophic_regex_in_an_adapter_config_costs_nothing(lora: Lora, tmp_path: pathlib.Path) -> None:
    """`(.*.*)*X` backtracks for hours in Python's re on a module name; RE2 matches it in linear time."""
    path = _broken(lora.adapters["chat"], tmp_path / "regex", "catastrophic-regex")
    started = time.monotonic()
    lora.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name="regex", path=str(path)), metadata=lora.auth(), timeout=60)
    assert time.monotonic() - started < 10
    lora.admin.UnloadAdapter(admin_pb2.UnloadAdapterRequest(name="regex"), metadata=lora.auth(), timeout=60)


def test_adapter_above_max_rank_and_from_another_model_are_refused(lora: Lora, tmp_path: pathlib.Path) -> None:
    big = make_adapter(lora.model_dir, tmp_path / "big", seed=3, r=16, alpha=16, targets=["o_proj"])
    with pytest.raises(grpc.RpcError) as err:
        lora.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name="big", path=str(big)), metadata=lora.auth(), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 16, above --max-lora-rank 8" in err.value.details()
    # Shapes of another model: lora_B of o_proj one row too long.
    from safetensors.torch import load_file, save_file

    other = _broken(lora.adapters["chat"], tmp_path / "other", "none")
    tensors = load_file(other / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("o_proj.lora_B.weight"))
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, other / "adapter_model.safetensors")
    with pytest.raises(grpc.RpcError) as err:
        lora.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name="another-model", path=str(other)), metadata=lora.auth(),
                               timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "do not fit the base projection" in err.value.details() and "o_proj" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        lora.admin.LoadAdapter(admin_pb2.LoadAdapterRequest(name="sql", path=str(lora.adapters["sql"])),
                               metadata=lora.auth(), timeout=60)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_cache_state_has_separate_lora_entries(lora: Lora, capsys: pytest.CaptureFixture) -> None:
    state = lora.admin.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=lora.auth(), timeout=30)
    # Every LoRA entry is an allowed size of its kind (with graphs on, entries appear as sizes are used).
    allowed = {("full", s) for s in state.capture_sizes} | {("piecewise", s) for s in state.piecewise_sizes}
    assert state.lora_buckets and {(b.kind or "full", b.size) for b in state.lora_buckets} <= allowed
    code, out, _ = lora.ctl(capsys, "state")
    assert code == 0 and "LoRA graphs (steps with any adapter row)" in out and "full+lora" in out


def test_lora_graph_operations_take_the_lora_kinds(lora: Lora, capsys: pytest.CaptureFixture) -> None:
    """Capture and evict of kind full+lora act on the LoRA cache; without graphs (CPU) they are
    refused as the base kinds are; a wrong size names the allowed ones; the budget is the one of both."""
    if lora.server.app.model.graph_mode != "none":
        pytest.skip("needs a server without CUDA graphs (CPU); tests/gpu/test_lora_gpu.py captures them")
    for method in (lora.admin.Capture, lora.admin.Evict):
        with pytest.raises(grpc.RpcError) as err:
            method(admin_pb2.SizesRequest(sizes=[8], kind="full+lora"), metadata=lora.auth(), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "CUDA graphs are unavailable" in err.value.details() and "mode none" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        lora.admin.Capture(admin_pb2.SizesRequest(sizes=[3], kind="full+lora"), metadata=lora.auth(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "are not full+lora capture sizes" in err.value.details() and "allowed: [1, 2, 4, 8]" in err.value.details()
    code, out, err_text = lora.ctl(capsys, "capture", "--kind", "full+lora", "8")
    assert code == graphctl.EXIT_REFUSED and out == "" and "FAILED_PRECONDITION" in err_text
    code, _, err_text = lora.ctl(capsys, "evict", "--kind", "lora", "8")
    assert code == graphctl.EXIT_USAGE and "invalid choice" in err_text
    code, out, _ = lora.ctl(capsys, "budget", "64MiB")
    assert code == 0 and "nothing evicted" in out and "used 0 B of budget 64.0 MiB" in out


def test_metrics_count_requests_and_tokens_per_adapter(lora: Lora) -> None:
    from tests.integration.test_metrics_endpoint import scrape

    before = scrape(lora.server.app.metrics_port)
    lora.generate(PROMPTS[3], "poet")
    lora.generate(PROMPTS[3])
    after = scrape(lora.server.app.metrics_port)

    def delta(name: str, adapter: str) -> float:
        key = (name, (("adapter", adapter),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("graphserve_adapter_requests_total", "poet") == 1
    assert delta("graphserve_adapter_generated_tokens_total", "poet") == MAX_TOKENS
    assert delta("graphserve_adapter_requests_total", "base") == 1
    # The LoRA graphs have their own families beside the base graphs', one count per bucket state.
    state = lora.admin.GetCacheState(admin_pb2.GetCacheStateRequest(), metadata=lora.auth(), timeout=30)
    for family, buckets in (("graphserve_lora_graph_buckets", state.lora_buckets),
                            ("graphserve_graph_buckets", state.buckets)):
        counted = sum(v for (name, _), v in after.items() if name == family)
        assert counted == len(buckets), (family, counted, len(buckets))


def test_adapter_labels_are_bounded() -> None:
    from service.telemetry.engine_metrics import MAX_ADAPTER_LABELS, EngineMetrics

    metrics = EngineMetrics()
    labels = {metrics.adapter_label(f"a{i}") for i in range(MAX_ADAPTER_LABELS + 10)}
    assert len(labels) == MAX_ADAPTER_LABELS + 1 and "other" in labels and metrics.adapter_label("") == "base"


def test_a_bad_adapter_at_start_fails_the_start_naming_the_file(model_cache_dir, tmp_path: pathlib.Path) -> None:
    from service.model.spec import ModelLoadError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    server = ServerThread(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "4", "--max-seq-len", "128",
                           "--lora-modules", f"bad={bad}"])
    try:
        with pytest.raises(ModelLoadError, match=r"--lora-modules bad=.*holds no readable adapter_model.safetensors"):
            server.start()
    finally:
        server.stop()
