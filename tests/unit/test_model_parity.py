"""Our model against transformers on tiny random checkpoints of each family, loaded through load_model."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

import pytest
import torch
import transformers

from service.model import KVCache, LoadedModel, ModelLoadError, ModelSpec, ensure_builtin, load_model

CPU = torch.device("cpu")
VOCAB = 768  # the builtin tiny tokenizer's size, reused by every test checkpoint
TOL = 1e-4
STEPS = 32
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 766,
    "eos_token_id": 767,
}
# Llama3 scaling with a short original context so positions used here actually hit scaled frequencies.
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama3-tied": (transformers.LlamaConfig, {"rope_parameters": _LLAMA3, "tie_word_embeddings": True}),
    "llama-untied-bias": (transformers.LlamaConfig, {"attention_bias": True, "tie_word_embeddings": False}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None, "tie_word_embeddings": False}),
    "qwen2-tied": (
        transformers.Qwen2Config,
        {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return ensure_builtin("tiny", tmp_path_factory.mktemp("cache"))


def make_checkpoint(
    variant: str, path: pathlib.Path, tokenizer_dir: pathlib.Path
) -> transformers.PreTrainedModel:
    """Saves a seeded random HF model (biases and norm weights randomised too) plus the tiny tokenizer."""
    config_cls, extra = VARIANTS[variant]

    def perturb(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
        if name.endswith("bias") or "norm" in name:  # HF inits these to 0 / 1, which would hide bugs
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)

    # Shard one variant so the index path is exercised.
    return save_checkpoint(config_cls(**_COMMON, **extra), path, tokenizer_dir, perturb,
                           "100KB" if variant == "mistral" else "5GB")


def save_checkpoint(config: transformers.PretrainedConfig, path: pathlib.Path, tokenizer_dir: pathlib.Path,
                    perturb: Callable[[str, torch.Tensor, torch.Generator], None],
                    max_shard_size: str) -> transformers.PreTrainedModel:
    """A seeded random HF model of `config`, its parameters `perturb`ed in place, saved by transformers
    (eager attention: a reference independent of the SDPA calls we make) with the tiny tokenizer."""
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in ref.named_parameters():
            perturb(name, p, gen)
    ref.save_pretrained(path, max_shard_size=max_shard_size)
    for f in _TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, path / f)
    return ref


def rel_errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    norm = ((ours - ref).norm() / ref.norm()).item()
    elem = ((ours - ref).abs().max() / ref.abs().max()).item()
    return norm, elem


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: pathlib.Path
) -> tuple[transformers.PreTrainedModel, LoadedModel, str]:
    path = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(request.param, path, tokenizer_dir)
    return ref, load_model(str(path), CPU, torch.float32), request.param


def test_spec_matches_config(pair):
    ref, loaded, variant = pair
    assert loaded.spec.architecture == type(ref).__name__
    assert loaded.spec.tie_word_embeddings == variant.endswith("tied")
    assert loaded.spec.attention_bias == (variant in ("llama-untied-bias", "qwen2-tied"))
    assert (loaded.spec.rope_scaling is not None) == (variant == "llama3-tied")
    assert loaded.spec.vocab_size == VOCAB <= len(loaded.tokenizer)  # AutoTokenizer may add a family token


def test_forward_full_matches_transformers(pair):
    ref, loaded, _ = pair
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids).logits.float()
    ours = loaded.model.forward_full(ids)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert max(rel_errors(ours, expected)) < TOL


def reference_greedy(
    ref: transformers.PreTrainedModel, prompt: list[int], steps: int = STEPS
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits, by a cache-free full forward per step."""
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            step = ref(torch.tensor([seq])).logits[0, -1].float()
            logits.append(step)
            seq.append(int(step.argmax()))
    return seq[len(prompt) :], logits


def test_prefill_decode_batch_matches_greedy_reference(pair):
    ref, loaded, _ = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 13)]
    slots = [2, 1]  # not slot 0, and not in prompt order
    kv = KVCache(loaded.spec, num_slots=3, max_seq_len=64, device=CPU, dtype=torch.float32)
    model = loaded.model

    step_logits = [[model.prefill(torch.tensor(p), s, kv)] for p, s in zip(prompts, slots)]
    tokens = [[int(lg[0].argmax())] for lg in step_logits]
    for step in range(1, STEPS):
        # Rows: the two live sequences at different positions, then a padding row on the scratch slot.
        ids = torch.tensor([t[-1] for t in tokens] + [0])
        positions = torch.tensor([len(p) + step - 1 for p in prompts] + [0])
        slot_ids = torch.tensor(slots + [kv.scratch_slot])
        logits = model.decode(ids, positions, slot_ids, kv)
        assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
        for row in range(2):
            step_logits[row].append(logits[row])
            tokens[row].append(int(logits[row].argmax()))

    for row, prompt in enumerate(prompts):
        expected_tokens, expected_logits = reference_greedy(ref, prompt)
        assert tokens[row] == expected_tokens
        for ours, expected in zip(step_logits[row], expected_logits):
            assert max(rel_errors(ours, expected)) < TOL
        # The cache-based logits also agree with our own cache-free path.
        full = model.forward_full(torch.tensor([prompt + tokens[row][:-1]]))[0, len(prompt) - 1 :]
        assert max(rel_errors(torch.stack(step_logits[row]), full)) < TOL
    assert not kv.slot_view(kv.k[0])[0].any(), "unused slot 0 was written"


def test_generate_agrees_with_manual_reference(pair):
    # Guards the reference itself: transformers' own greedy generate gives the same tokens.
    ref, _loaded, _ = pair
    prompt = [766, 5, 300, 42, 17]
    out = ref.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0
    )
    assert out[0, len(prompt) :].tolist() == reference_greedy(ref, prompt)[0][:8]


def test_unsupported_architecture(tmp_path: pathlib.Path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="(?i)unsupported architecture.*gpt2"):
        load_model(str(tmp_path), CPU, torch.float32)


@pytest.fixture
def good_dir(tmp_path: pathlib.Path, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    make_checkpoint("llama-untied-bias", tmp_path, tokenizer_dir)
    return tmp_path


@pytest.mark.parametrize(
    "remove, message",
    [
        (("config.json",), "config.json is missing"),
        (("model.safetensors",), r"no \*.safetensors weight files"),
        (_TOKENIZER_FILES, "no tokenizer"),
    ],
)
def test_incomplete_directory(good_dir: pathlib.Path, remove: tuple[str, ...], message: str):
    for f in remove:
        (good_dir / f).unlink()
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(good_dir), CPU, torch.float32)


def test_missing_directory(tmp_path: pathlib.Path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(str(tmp_path / "nope"), CPU, torch.float32)


def test_weight_names_checked(good_dir: pathlib.Path):
    loaded = load_model(str(good_dir), CPU, torch.float32)
    state = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.9.foo.weight"] = torch.zeros(1)
    with pytest.raises(
        ModelLoadError, match=r"missing: model.layers.1.mlp.up_proj.weight.*unexpected: model.layers.9"
    ):
        loaded.model.load_weights(state)


def test_spec_reports_sliding_window_and_rejects_unknown_rope():
    mistral = transformers.MistralConfig(sliding_window=4096, max_position_embeddings=32768)
    assert ModelSpec.from_hf_config(mistral).sliding_window == 4096
    qwen_off = transformers.Qwen2Config(use_sliding_window=False, sliding_window=4096)
    assert ModelSpec.from_hf_config(qwen_off).sliding_window is None
    yarn = transformers.LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        ModelSpec.from_hf_config(yarn)
