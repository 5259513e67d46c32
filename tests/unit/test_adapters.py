"""The adapter registry and scheduler admission with adapter slots (pure logic), and the LoRA reader
and products against peft on the built-in model."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import pytest
import torch

from service.engine.adapters import AdapterExists, AdapterInUse, AdapterNotFound, AdapterRegistry
from service.engine.request import GenerationRequest, SamplingParams, StoppingParams
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
    request = GenerationRequest(f"r{i}", [1, 2, 3], SamplingParams(0.0), StoppingParams(4), adapter=adapter)
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
    assert s.schedule().prefills == []  # a's slot is still held by seqs[3]
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
