"""The adapter registry and scheduler admission with adapter slots (pure logic), and the LoRA reader
and products against peft on the built-in model."""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass

import pytest
import torch

from service.engine.adapters import AdapterExists, AdapterInUse, AdapterNotFound, AdapterRegistry
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class FakeAdapter:
    name: str
    path: str = "/adapters/x"
    rank: int = 8
    targets: tuple[str, ...] = ("q_proj",)


class Writes:
    def __init__(self) -> None:
        self.log: list[tuple[str, int, str | None]] = []

    def load(self, slot: int, adapter: FakeAdapter) -> None:
        self.log.append(("load", slot, adapter.name))

    def clear(self, slot: int) -> None:
        self.log.append(("clear", slot, None))


def registry(slots: int, *names: str) -> tuple[AdapterRegistry, Writes]:
    writes = Writes()
    reg = AdapterRegistry(slots, writes)
    for n in names:
        reg.register(FakeAdapter(n))
    return reg, writes


def test_lru_slot_is_reused_never_one_in_use() -> None:
    reg, writes = registry(2, "a", "b", "c")
    assert reg.admit("a") == 1 and reg.admit("b") == 2
    assert reg.admit("c") is None  # both slots run sequences: c waits
    reg.release(1)
    assert reg.admit("c") == 1  # a's slot, not b's (in use)
    assert writes.log == [("load", 1, "a"), ("load", 2, "b"), ("load", 1, "c")]
    reg.release(2)
    reg.release(1)
    assert reg.admit("b") == 2 and writes.log[-1] == ("load", 1, "c")  # resident: no copy
    assert reg.admit("a") == 1  # c's slot is the least recently used free one
    assert {i.name: i.slot for i in reg.list()} == {"a": 1, "b": 2, "c": 0}


def test_unload_refused_while_streams_hold_the_adapter() -> None:
    reg, writes = registry(2, "a")
    reg.hold("a")
    with pytest.raises(AdapterInUse, match="used by 1 stream"):
        reg.unregister("a")
    slot = reg.admit("a")
    reg.release(slot)
    reg.unhold("a")
    reg.unregister("a")
    assert writes.log[-1] == ("clear", slot, None)
    with pytest.raises(AdapterNotFound, match="'a' is not loaded; loaded: none"):
        reg.hold("a")
    reg.register(FakeAdapter("a"))
    with pytest.raises(AdapterExists):
        reg.register(FakeAdapter("a"))


def _seq(i: int, adapter: str) -> Sequence:
    request = GenerationRequest(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, seed=0), adapter=adapter)
    return Sequence(request)


def test_a_request_waiting_for_an_adapter_slot_does_not_block_those_behind_it() -> None:
    reg, _ = registry(1, "a", "b")
    s = Scheduler(4, 64, adapters=reg)
    seqs = [_seq(0, "a"), _seq(1, "b"), _seq(2, ""), _seq(3, "a")]
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    # b needs a's slot: it keeps its place, the base request and a's second one run past it.
    assert [c.seq for c in batch.prefills] == [seqs[0], seqs[2], seqs[3]]
    assert (seqs[0].lora_slot, seqs[2].lora_slot, seqs[3].lora_slot) == (1, 0, 1)
    assert s.num_waiting == 1
    s.finish(seqs[0])
    assert seqs[0].lora_slot == 0
    assert s.schedule().prefills == ()  # a's slot is still held by seqs[3]
    s.finish(seqs[3])
    batch = s.schedule()
    assert [c.seq for c in batch.prefills] == [seqs[1]] and seqs[1].lora_slot == 1


# ---- the reader and the products, on the built-in model --------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from service.model import ensure_builtin

    return ensure_builtin("tiny", tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("kernel", ["stacked", "gather"])
def test_rows_of_different_adapters_match_peft(model_dir: pathlib.Path, tmp_path: pathlib.Path, kernel: str) -> None:
    import peft

    from service.model import load_model
    from service.model.lora import LoraSlots, lora_tokens, read_adapter
    from tests.support.lora import hf_model, make_adapter

    loaded = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    slots = LoraSlots(loaded.model, 2, 8, kernel)
    paths = [make_adapter(model_dir, tmp_path / "plain", seed=5),
             make_adapter(model_dir, tmp_path / "rs", seed=6, r=4, alpha=32, use_rslora=True,
                          targets="model.layers.1.*(gate_proj|down_proj)")]
    for slot, path in enumerate(paths, start=1):
        slots.load(slot, read_adapter(path.name, path, loaded.spec, 8))
    ids = torch.tensor([[766, 5, 6, 7, 8, 9]])
    for slot, path in [(0, None), *enumerate(paths, start=1)]:
        ref = hf_model(model_dir) if path is None else peft.PeftModel.from_pretrained(hf_model(model_dir), path)
        with torch.no_grad():
            want = ref(input_ids=ids).logits
        with lora_tokens(torch.full((6,), slot), slots):
            got = loaded.model.forward_full(ids)
        assert (got - want).abs().max().item() < 1e-4, (kernel, slot)
    adapter = read_adapter("rs", paths[1], loaded.spec, 8)
    assert adapter.targets == ("gate_proj", "down_proj") and adapter.rank == 4


def test_reader_checks_patterns_and_pairs(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    from service.model import load_model
    from service.model.lora import LoraError, read_adapter
    from tests.support.lora import make_adapter

    spec = load_model(str(model_dir), torch.device("cpu"), torch.float32).spec
    path = make_adapter(model_dir, tmp_path / "a", seed=7, r=4, alpha=4, targets=["q_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    config["rank_pattern"] = {"q_proj": 2}
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraError, match=r"has rank 4 but .*adapter_config.json says r=2"):
        read_adapter("a", path, spec, 8)
    config["rank_pattern"] = {}
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "lora_B" not in k or "layers.0." not in k},
              path / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"model.layers.0.self_attn.q_proj has lora_A but not its pair"):
        read_adapter("a", path, spec, 8)


def test_lora_flags(tmp_path: pathlib.Path) -> None:
    from service.config import ConfigError, ServeConfig, load_config

    (tmp_path / "a").mkdir()
    c = load_config(["--lora-modules", f"sql={tmp_path / 'a'}, chat={tmp_path / 'a'}"], {})
    assert c.lora_module_paths() == [("sql", tmp_path / "a"), ("chat", tmp_path / "a")]
    assert c.lora_slots == 4 and ServeConfig().lora_slots == 0
    assert load_config(["--max-loras", "2"], {}).lora_slots == 2
    for value, message in [("sql", "'sql' is not NAME=PATH"), (f"a={tmp_path / 'a'},a={tmp_path / 'a'}", "'a' is given twice"),
                           (f"b={tmp_path / 'nope'}", "no such directory")]:
        with pytest.raises(ConfigError, match=message):
            load_config(["--lora-modules", value], {})
    with pytest.raises(ConfigError, match="--max-lora-rank must be >= 1"):
        load_config(["--max-lora-rank", "0"], {})


def test_request_adapters_name_the_adapters_of_running_and_of_waiting_streams() -> None:
    reg, _ = registry(1, "a", "b", "c")
    assert reg.request_adapters() == ([], [])
    for name in ("a", "a", "b"):  # submitted: two streams of a, one of b
        reg.hold(name)
    assert reg.request_adapters() == ([], ["a", "b"])
    assert reg.admit("a") == 1  # one of a's streams runs, the other still waits
    assert reg.request_adapters() == (["a"], ["a", "b"])
    assert reg.admit("a") == 1 and reg.admit("b") is None  # b waits for the slot
    assert reg.request_adapters() == (["a"], ["b"])
    for _ in range(2):
        reg.release(1)
        reg.unhold("a")
    assert reg.request_adapters() == ([], ["b"])  # a stays resident but runs nothing
    assert reg.admit("b") == 1
    assert reg.request_adapters() == (["b"], [])


def _with_config(src: pathlib.Path, dst: pathlib.Path, **changes: object) -> pathlib.Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))  # NaN and Infinity as Python writes them
    return dst


@pytest.fixture(scope="module")
def small_adapter(model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tests.support.lora import make_adapter

    return make_adapter(model_dir, tmp_path_factory.mktemp("small") / "a", seed=11, r=4, alpha=8,
                        targets=["q_proj", "v_proj"])


@pytest.mark.parametrize("changes, message", [
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite positive number, got nan"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite positive number, got inf"),
    ({"r": float("inf")}, "r must be a positive integer, got inf"),
    ({"r": True}, "r must be a positive integer"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object mapping module patterns to a positive integer "
                                   "ranks, got a list"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, r"alpha_pattern\['q_proj'\] must be a finite positive alpha"),
    ({"target_modules": "(q_proj"}, r"target_modules '\(q_proj' is not a valid regular expression"),
    ({"rank_pattern": {"[": 4}}, r"rank_pattern key '\[' '\[' is not a valid regular expression"),
    ({"use_rslora": "yes"}, "use_rslora must be true or false"),
])
def test_malformed_configs_are_refused_naming_the_field(model_dir, small_adapter, tmp_path, changes, message) -> None:
    from service.model.loader import read_model_spec
    from service.model.lora import LoraError, read_adapter

    path = _with_config(small_adapter, tmp_path / "bad", **changes)
    with pytest.raises(LoraError, match=message):
        read_adapter("bad", path, read_model_spec(str(model_dir)), 8)


def test_non_utf8_and_deeply_nested_configs_are_refused(model_dir, small_adapter, tmp_path) -> None:
    import shutil

    from service.model.loader import read_model_spec
    from service.model.lora import LoraError, read_adapter

    spec = read_model_spec(str(model_dir))
    path = tmp_path / "bad"
    shutil.copytree(small_adapter, path)
    for text, message in [(b'{"r": "\xff"}', "adapter_config.json: not UTF-8 text"),
                          (b"[" * 100_000 + b"]" * 100_000, "adapter_config.json: not valid JSON"),
                          (b'{"r": ' + b"9" * 5000 + b"}", "adapter_config.json: not valid JSON")]:
        (path / "adapter_config.json").write_bytes(text)
        with pytest.raises(LoraError, match=message):
            read_adapter("bad", path, spec, 8)


def test_regexes_match_as_peft_in_linear_time(model_dir, small_adapter, tmp_path) -> None:
    """PEFT allows regexes; RE2 matches them in linear time, so one that backtracks for hours in
    Python's re costs milliseconds; names, suffixes and ordinary regexes match as PEFT's do."""
    import time

    from service.model.loader import read_model_spec
    from service.model.lora import LoraError, read_adapter
    from service.model.lora_patterns import Pattern, match_patterns

    spec = read_model_spec(str(model_dir))
    names = [f"model.layers.{i}.{o}.{t}" for i in range(2) for o in ("self_attn", "mlp") for t in ("q_proj", "v_proj")]
    for text, mode in [(r".*\.(q|v)_proj", "full"), ("q_proj", "suffix"), ("q.proj", "suffix"),
                       ("layers.1.self_attn.q_proj", "suffix"), (r"layers\.1\..*", "suffix"), ("proj", "suffix")]:
        rx = re.compile(text if mode == "full" else rf"(.*\.)?({text})$")
        match = rx.fullmatch if mode == "full" else rx.match
        assert match_patterns([Pattern("f", text, mode)], names)[0] == {n for n in names if match(n)}, text
    start = time.monotonic()
    path = _with_config(small_adapter, tmp_path / "slow", rank_pattern={"(.*.*)*X": 2})
    assert read_adapter("slow", path, spec, 8).rank == 4  # the pattern matches no module: r applies
    with pytest.raises(LoraError, match=r"target_modules '\(\.\*\.\*\)\*X' matches none"):
        read_adapter("slow", _with_config(small_adapter, tmp_path / "slow2", target_modules="(.*.*)*X"), spec, 8)
    assert time.monotonic() - start < 1.0
    with pytest.raises(LoraError, match=r"target_modules .* is not a valid regular expression \(invalid escape"):
        read_adapter("br", _with_config(small_adapter, tmp_path / "br", target_modules=r"(a)\1"), spec, 8)
    path = _with_config(small_adapter, tmp_path / "ok", target_modules=r".*\.(q|v)_proj",
                        rank_pattern={"layers\\.1\\..*": 4, "q.proj": 4})
    assert read_adapter("ok", path, spec, 8).targets == ("q_proj", "v_proj")


def _write_safetensors(path: pathlib.Path, header: dict, data_bytes: int = 0, sparse_size: int | None = None) -> None:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        if sparse_size is not None:
            f.truncate(sparse_size)  # a hole: no disk used, reads as zeros
        else:
            f.write(b"\0" * data_bytes)


def test_weights_are_checked_before_they_are_read(model_dir, small_adapter, tmp_path) -> None:
    """A file larger than such an adapter can be, a tensor of the wrong shape or dtype, overlapping or
    unused bytes: refused from the header alone (the data here is a sparse hole of gigabytes)."""
    import shutil

    from service.model.loader import read_model_spec
    from service.model.lora import LoraError, read_adapter

    spec = read_model_spec(str(model_dir))
    path = tmp_path / "bad"
    shutil.copytree(small_adapter, path)
    weights = path / "adapter_model.safetensors"
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    h, q = spec.hidden_size, spec.num_heads * spec.head_dim
    huge = 1 << 31
    for header, size, message in [
        ({key.format("A"): {"dtype": "F32", "shape": [4, h], "data_offsets": [0, 16 * h]}}, huge,
         "more than an adapter of this model at rank <= 8 can hold"),
        ({key.format("A"): {"dtype": "F32", "shape": [4, 1 << 27], "data_offsets": [0, 1 << 31]}}, None,
         "do not hold a F32 tensor"),
        ({key.format("A"): {"dtype": "I64", "shape": [4, h], "data_offsets": [0, 32 * h]}}, None, "has dtype 'I64'"),
        ({key.format("A"): {"dtype": "F32", "shape": [4, h], "data_offsets": [0, 16 * h]},
          key.format("B"): {"dtype": "F32", "shape": [q, 4], "data_offsets": [0, 16 * q]}}, None, "tensors overlap"),
        ({key.format("A"): {"dtype": "F32", "shape": [4, h + 1], "data_offsets": [0, 16 * (h + 1)]},
          key.format("B"): {"dtype": "F32", "shape": [q, 4], "data_offsets": [16 * (h + 1), 16 * (h + 1 + q)]}},
         None, "do not fit the base projection"),
    ]:
        ends = [m["data_offsets"][1] for m in header.values()]
        _write_safetensors(weights, header, max(ends) if size is None and max(ends) < 1 << 24 else 0, size)
        with pytest.raises(LoraError, match=message):
            read_adapter("bad", path, spec, 8)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(model_dir, small_adapter, tmp_path, poison) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from service.model.loader import read_model_spec
    from service.model.lora import LoraError, read_adapter

    spec = read_model_spec(str(model_dir))
    for which in ("lora_A", "lora_B"):
        path = tmp_path / which
        shutil.copytree(small_adapter, path)
        tensors = load_file(path / "adapter_model.safetensors")
        name = next(k for k in sorted(tensors) if which in k and "layers.1." in k)
        tensors[name][0, 0] = poison
        save_file(tensors, path / "adapter_model.safetensors")
        with pytest.raises(LoraError, match=rf"model.layers.1.self_attn.\w+: {which} holds NaN or inf"):
            read_adapter("bad", path, spec, 8)
    # Finite in float32, but not once the scale is folded in and the model's dtype is float16.
    path = tmp_path / "big"
    shutil.copytree(small_adapter, path)
    tensors = load_file(path / "adapter_model.safetensors")
    name = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[name][0, 0] = 60000.0
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"lora_B x scale 2 overflows float16"):
        read_adapter("big", path, spec, 8, dtype=torch.float16)


def test_paths_outside_the_root_are_refused_alike(model_dir, small_adapter, tmp_path) -> None:
    """Under a root, a path that resolves outside it (through .. or a symlink) is refused whether it
    exists or not; inside it, a missing directory and a missing file read the same."""
    import shutil

    from service.model.loader import read_model_spec
    from service.model.lora import LoraError, LoraPathError, read_adapter

    spec = read_model_spec(str(model_dir))
    root = tmp_path / "root"
    shutil.copytree(small_adapter, root / "good")
    (root / "link").symlink_to(small_adapter)  # a real adapter, but outside the root
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").symlink_to(small_adapter / "adapter_config.json")
    assert read_adapter("good", "good", spec, 8, root=root).path == "good"  # relative: under the root
    assert read_adapter("good", root / "good", spec, 8, root=root).rank == 4
    for outside in (small_adapter, root / "link", root / ".." / "root" / ".." / "x", "/etc", "/nonexistent/x"):
        with pytest.raises(LoraPathError, match=r"is outside --lora-root") as err:
            read_adapter("x", outside, spec, 8, root=root)
        assert str(small_adapter) not in str(err.value) or outside == small_adapter
    with pytest.raises(LoraPathError, match=r"half/adapter_config.json is outside --lora-root"):
        read_adapter("x", root / "half", spec, 8, root=root)
    messages = set()
    for missing in ("nope", "half/nope"):
        with pytest.raises(LoraError) as err:
            read_adapter("x", root / missing, spec, 8, root=root)
        messages.add(str(err.value).replace(missing, "<p>"))
    assert len(messages) == 1 and "holds no readable adapter_config.json" in messages.pop()


def test_a_nan_in_one_slot_never_reaches_a_row_of_another() -> None:
    """The LoRA products keep rows apart: NaN in one slot's A (either kernel) or B (gather, which
    reads only each row's slot) leaves every row of the other slots, base rows included, as it was.
    The stacked kernel's expand multiplies the other slots' B by exact zeros, so it relies on slots
    holding finite values, which read_adapter guarantees (test_non_finite_weights_are_refused)."""
    from service.model.lora import LoraTokens, add_lora

    gen = torch.Generator().manual_seed(1)
    num_slots, rank, n_in, n_out = 4, 8, 32, 24
    a = torch.randn(num_slots, rank, n_in, generator=gen)
    b = torch.randn(n_out, num_slots, rank, generator=gen)
    a[0], b[:, 0] = 0, 0
    x = torch.randn(6, n_in, generator=gen)
    slots = torch.tensor([0, 1, 2, 3, 1, 0])
    tokens = LoraTokens(slots, slots[:, None] != torch.arange(num_slots)[None, :])
    others = slots != 2
    for kernel, poisoned in [("stacked", "a"), ("gather", "a"), ("gather", "b")]:
        clean = add_lora(torch.zeros(6, n_out), x, tokens, a, b, kernel)
        bad_a, bad_b = a.clone(), b.clone()
        (bad_a[2] if poisoned == "a" else bad_b[:, 2]).fill_(float("nan"))
        out = add_lora(torch.zeros(6, n_out), x, tokens, bad_a, bad_b, kernel)
        assert torch.equal(out[others], clean[others]), (kernel, poisoned)
        assert out[~others].isnan().all()
