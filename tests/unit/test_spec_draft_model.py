"""A separate draft model (method draft_model): a second checkpoint loaded by the same engine drafts
greedily with all its layers. Greedy output with it equals output with speculation off (float32,
token for token), whether the draft is the target itself (every draft accepted) or a perturbed copy;
a draft with another vocabulary fails at start naming `model`; a draft that is nowhere is refused
before the server starts; vLLM's older spelling (a model, no method) means draft_model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import ConfigError, SpeculativeConfig, load_config
from service.engine.spec.draft_model import DraftModelProposer, load_draft_model
from service.engine.spec.proposer import new_proposer
from service.llm import LLM
from service.preflight import check_serve
from tests.unit.test_spec_decode import assert_same, request, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draft_config(model: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.parse({"method": "draft_model", "model": model, "num_speculative_tokens": k})


def requests(loaded):  # noqa: ANN001, ANN201
    return [request(loaded, "a", "The service reads a request", max_tokens=40),
            request(loaded, "b", "one two three one two three one two", max_tokens=40)]


@pytest.fixture
def copy_of_tiny(loaded, tmp_path):  # noqa: ANN001, ANN201
    path = tmp_path / "draft"
    shutil.copytree(loaded.path, path)
    return path


def test_the_target_as_its_own_draft_keeps_output_and_every_draft_stands(loaded, model_cache_dir):  # noqa: ANN001
    draft = load_draft_model(draft_config("builtin:tiny"), loaded, model_cache_dir)
    assert draft.model is not loaded.model  # a second model, loaded as the target was
    assert (draft.device, draft.dtype) == (loaded.device, loaded.dtype)
    reqs = requests(loaded)
    off, _, _ = run(loaded, reqs)
    proposer = new_proposer(draft_config("builtin:tiny"), loaded.model, loaded.device, draft=draft)
    assert isinstance(proposer, DraftModelProposer) and proposer.num_layers is None
    on, counts, _ = run(loaded, reqs, proposer, k=4)
    assert_same(off, on, reqs)
    assert counts.draft_tokens > 0 and counts.accepted >= 0.95 * counts.draft_tokens


def test_a_draft_that_differs_keeps_output(loaded, model_cache_dir, copy_of_tiny):  # noqa: ANN001
    weights = copy_of_tiny / "model.safetensors"
    state = load_file(weights)
    generator = torch.Generator().manual_seed(3)
    save_file({n: t + 0.5 * t.std() * torch.randn(t.shape, generator=generator, dtype=t.dtype)
               for n, t in state.items()}, weights)
    draft = load_draft_model(draft_config(str(copy_of_tiny)), loaded, model_cache_dir)
    reqs = requests(loaded)
    off, _, _ = run(loaded, reqs)
    on, counts, _ = run(loaded, reqs, DraftModelProposer(draft), k=4)
    assert_same(off, on, reqs)
    assert counts.drafts > 0 and counts.accepted < counts.draft_tokens  # it drafts, not always right


def test_a_draft_with_another_vocab_size_fails_at_start_naming_model(model_cache_dir, copy_of_tiny) -> None:  # noqa: ANN001
    config = json.loads((copy_of_tiny / "config.json").read_text())
    (copy_of_tiny / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 32}))
    with pytest.raises(ConfigError, match=r"--speculative-config: speculative_config.model .*vocab_size 800 is not "
                                          r"the target builtin:tiny's 768: a draft model must share"):
        LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, device="cpu", dtype="float32",
            speculative_config={"method": "draft_model", "model": str(copy_of_tiny)})
    # preflight sees it too, before the server starts
    served = load_config(["--model", "builtin:tiny", "--model-cache-dir", str(model_cache_dir), "--port", "0",
                          "--metrics-port", "0", "--speculative-config",
                          json.dumps({"method": "draft_model", "model": str(copy_of_tiny)})], {})
    [problem] = check_serve(served)
    assert problem.startswith("--speculative-config: speculative_config.model ") and "vocab_size 800" in problem


def test_a_draft_with_another_tokenizer_fails_naming_model(loaded, model_cache_dir, copy_of_tiny) -> None:  # noqa: ANN001
    tokenizer = json.loads((copy_of_tiny / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (copy_of_tiny / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="speculative_config.model .*tokenizer's vocabulary differs"):
        load_draft_model(draft_config(str(copy_of_tiny)), loaded, model_cache_dir)


def test_a_draft_that_is_nowhere_is_refused_before_the_server_starts(tmp_path) -> None:  # noqa: ANN001
    missing = tmp_path / "no-such-draft"
    config = load_config(["--model", "builtin:tiny", "--port", "0", "--metrics-port", "0", "--speculative-config",
                          json.dumps({"method": "draft_model", "model": str(missing)})], {})
    [problem] = check_serve(config)
    assert problem.startswith(f"--speculative-config: speculative_config.model {missing}: ")
    ok = load_config(["--model", "builtin:tiny", "--port", "0", "--metrics-port", "0", "--speculative-config",
                      '{"method": "draft_model", "model": "builtin:tiny"}'], {})
    assert check_serve(ok) == []


def test_the_config_spellings() -> None:
    assert SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 5}) == SpeculativeConfig(
        method="draft_model", model="some/draft", num_speculative_tokens=5)  # vLLM's older spelling
    assert SpeculativeConfig.parse({"model": "[ngram]"}) == SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match="speculative_config.model is required by method draft_model"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model is for method draft_model, not 'suffix'"):
        SpeculativeConfig.parse({"method": "suffix", "model": "some/draft"})


def test_the_draft_loads_phases_are_its_own_on_the_start_up_timeline(monkeypatch) -> None:  # noqa: ANN001
    from service.telemetry import startup

    timeline = startup.Timeline()
    monkeypatch.setattr(startup, "_TIMELINE", timeline)
    startup.mark("weights_read")
    with startup.prefixed("draft_"):
        startup.mark("weights_read")
    startup.mark("kv_pool")
    assert [name for name, _ in timeline.phases] == ["weights_read", "draft_weights_read", "kv_pool"]
