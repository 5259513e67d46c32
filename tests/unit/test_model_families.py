"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral against transformers: tiny random checkpoints saved by
transformers itself (float32), loaded through load_model, and compared on logits (1e-4) and greedy
tokens for a prompt alone, prompts in one batch, a prompt prefilled in chunks, a prompt whose prefix
comes from another sequence's KV blocks (a prefix-cache hit), and through the whole engine (the
scheduler's chunked prefill and prefix cache). Each checkpoint exercises its family's switches:
q/k head norms, sliding-window layers shorter than the prompts, Gemma's norms, scales, GELU, local
RoPE and soft-capping, dense layers beside MoE ones, both routing normalisations."""

from __future__ import annotations

import pathlib
import shutil
import types

import pytest
import torch
import transformers

from service.model import KVCache, LlamaForCausalLM, LoadedModel, ModelLoadError, ModelSpec, ensure_builtin, load_model
from service.model.step_batch import ChunkSpec, build_step_batch
from tests.unit.test_model_parity import reference_greedy, save_checkpoint

CPU = torch.device("cpu")
VOCAB = 768  # the builtin tiny tokenizer's size, reused by every test checkpoint
TOL = 1e-4
STEPS = 10
WINDOW = 12  # shorter than the prompts and their continuations
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,  # not hidden / heads: the families take head_dim from the config
    "max_position_embeddings": 256,
    "bos_token_id": 766,
    "eos_token_id": 767,
}
FAMILIES = {
    # layer 0 full, layers 1-2 sliding
    "qwen3": (transformers.Qwen3Config, {"use_sliding_window": True, "sliding_window": WINDOW,
                                         "max_window_layers": 1, "tie_word_embeddings": False}),
    "gemma3": (transformers.Gemma3TextConfig, {
        "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 32, "final_logit_softcapping": 3.0, "tie_word_embeddings": True,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "pad_token_id": 0}),
    # layer 1 dense (mlp_only_layers), the others 8 experts top-2 without renormalisation
    "qwen3-moe": (transformers.Qwen3MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                                "norm_topk_prob": False, "tie_word_embeddings": True}),
    # every layer sliding (Mistral-style), 4 experts top-2, renormalised
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                             "sliding_window": WINDOW, "tie_word_embeddings": False}),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_checkpoint(family: str, path: pathlib.Path, tokenizer_dir: pathlib.Path) -> transformers.PreTrainedModel:
    """A seeded random HF model (norms and routers randomised too) saved by transformers, with the tiny tokenizer."""
    config_cls, extra = FAMILIES[family]

    def perturb(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
        if "norm" in name:  # HF inits these to 1 (Gemma: 0), which would hide a mixed-up norm
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        elif name.endswith("gate.weight"):  # routers: decisive enough that routing is not a coin toss
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    return save_checkpoint(config_cls(**_COMMON, **extra), path, tokenizer_dir, perturb, "200KB")  # sharded


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return max(((ours - ref).norm() / ref.norm()).item(), ((ours - ref).abs().max() / ref.abs().max()).item())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return ensure_builtin("tiny", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: pathlib.Path
         ) -> tuple[transformers.PreTrainedModel, LoadedModel, pathlib.Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(request.param, path, tokenizer_dir)
    return ref, load_model(str(path), CPU, torch.float32), path


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(loaded: LoadedModel, kv: KVCache, decodes: list[tuple[int, int, int]], chunks: list[tuple[list[int], ChunkSpec]],
         pad: int = 0) -> torch.Tensor:
    """One forward_step: decodes (token, position, slot), then chunks (their tokens, where they go)."""
    ids = [t for t, _, _ in decodes] + [t for tokens, _ in chunks for t in tokens]
    batch = build_step_batch([p for _, p, _ in decodes], [s for _, _, s in decodes], [c for _, c in chunks], ids,
                             kv.max_seq_len, kv.scratch_slot, CPU, pad_to=len(ids) + pad)
    return loaded.model.forward_step(batch, kv)


def test_spec_names_the_family(pair):
    ref, loaded, _ = pair
    spec = loaded.spec
    assert spec.architecture == type(ref).__name__
    assert spec.head_dim == 24 and spec.is_moe == (spec.architecture in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"))
    windows = {"Qwen3ForCausalLM": (0, WINDOW, WINDOW), "Gemma3ForCausalLM": (WINDOW, 0, WINDOW),
               "MixtralForCausalLM": (WINDOW,) * 3, "Qwen3MoeForCausalLM": ()}
    assert spec.layer_windows == windows[spec.architecture]


def test_forward_full_matches_transformers(pair):
    ref, loaded, _ = pair
    ids = torch.tensor([prompt(40, 2)])
    with torch.no_grad():
        expected = ref(ids).logits.float()
    ours = loaded.model.forward_full(ids)
    assert ours.shape == expected.shape and rel_error(ours, expected) < TOL


def test_alone_in_a_batch_and_decoding_match_transformers(pair):
    """Two prompts prefilled in one packed step (slots out of order, a padding row), then decoded
    together with a padding row: each row's logits at every step and its greedy tokens are
    transformers' for that prompt alone; past the window on the sliding layers."""
    ref, loaded, _ = pair
    prompts = [prompt(9, 3), prompt(17, 4)]
    slots = [2, 0]
    kv = KVCache(loaded.model.spec, num_slots=3, max_seq_len=64, device=CPU, dtype=torch.float32, block_size=4)
    first = step(loaded, kv, [], [(p, ChunkSpec(s, 0, len(p))) for p, s in zip(prompts, slots)], pad=3)
    logits = [[first[0]], [first[1]]]
    tokens = [[int(first[0].argmax())], [int(first[1].argmax())]]
    for i in range(1, STEPS):
        decodes = [(tokens[r][-1], len(prompts[r]) + i - 1, slots[r]) for r in range(2)]
        out = step(loaded, kv, decodes, [], pad=1)
        for r in range(2):
            logits[r].append(out[r])
            tokens[r].append(int(out[r].argmax()))
    for r, p in enumerate(prompts):
        expected_tokens, expected_logits = reference_greedy(ref, p, STEPS)
        assert tokens[r] == expected_tokens
        assert max(rel_error(a, b) for a, b in zip(logits[r], expected_logits)) < TOL
    # the same prompt alone, through prefill / decode (the FULL graph's step)
    kv_alone = KVCache(loaded.model.spec, num_slots=2, max_seq_len=64, device=CPU, dtype=torch.float32)
    alone = loaded.model.prefill(torch.tensor(prompts[1]), 1, kv_alone)
    assert rel_error(alone, logits[1][0]) < TOL
    decoded = loaded.model.decode(torch.tensor([tokens[1][0], 0]), torch.tensor([len(prompts[1]), 0]),
                                  torch.tensor([1, kv_alone.scratch_slot]), kv_alone)
    assert rel_error(decoded[0], logits[1][1]) < TOL


def test_chunked_prefill_and_a_prefix_cache_hit_match_transformers(pair):
    """A prompt prefilled in three chunks (beside another sequence's decodes), and a second prompt
    that shares its first two KV blocks (a prefix-cache hit: its table points at the first one's
    blocks) and prefills only the rest: both give transformers' logits and greedy tokens."""
    ref, loaded, _ = pair
    bs = 4
    kv = KVCache(loaded.model.spec, num_slots=3, max_seq_len=64, device=CPU, dtype=torch.float32, block_size=bs,
                 num_blocks=1 + 3 * 16)
    kv.set_blocks(0, 0, list(range(1, 17)))
    kv.set_blocks(1, 0, [1, 2] + list(range(17, 31)))  # the first two blocks are slot 0's
    kv.set_blocks(2, 0, list(range(31, 47)))
    kv.sync_table()
    prefix = prompt(2 * bs, 5)
    first, second, other = prefix + prompt(15, 6), prefix + prompt(6, 7), prompt(5, 8)
    step(loaded, kv, [], [(other, ChunkSpec(2, 0, len(other)))])
    bounds = [0, 3, 11, len(first)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = b == len(first)
        out = step(loaded, kv, [(other[-1] if i == 0 else 5, len(other) + i, 2)],
                   [(first[a:b], ChunkSpec(0, a, b - a, sample=last))])
    chunked = out[1]
    hit = step(loaded, kv, [], [(second[2 * bs:], ChunkSpec(1, 2 * bs, len(second) - 2 * bs))])[0]
    for logits, tokens_of in ((chunked, first), (hit, second)):
        expected_tokens, expected_logits = reference_greedy(ref, tokens_of, steps=1)
        assert rel_error(logits, expected_logits[0]) < TOL
        assert int(logits.argmax()) == expected_tokens[0]


def test_the_engine_serves_the_family_greedily_as_transformers(pair):
    """The whole engine (scheduler, paged KV with prefix caching, chunked prefill of 8 tokens a
    step, the runner's decode and piecewise paths): prompts sharing a prefix complete with
    transformers' greedy tokens."""
    from service.llm import LLM, SamplingParams

    ref, _, path = pair
    shared = prompt(16, 9)
    prompts = [shared + prompt(5, 10), shared + prompt(11, 11), prompt(7, 12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", max_seq_len=128, max_num_batched_tokens=8, max_running_seqs=4,
             block_size=4, enable_prefix_caching=True) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        again = llm.generate([prompts[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids  # a prefix-cache hit
    for p, got in zip(prompts, outputs):
        assert list(got) == reference_greedy(ref, p, steps=6)[0]
    assert list(again) == list(outputs[1])


def test_unsupported_combinations_are_refused_by_name():
    soft = transformers.Gemma3TextConfig(**{**_COMMON, "attn_logit_softcapping": 50.0})
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping is not served"):
        ModelSpec.from_hf_config(soft)
    yarn = transformers.Qwen3Config(**_COMMON, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        ModelSpec.from_hf_config(yarn)
    moe = ModelSpec.from_hf_config(transformers.MixtralConfig(**_COMMON, num_local_experts=4))
    with pytest.raises(ModelLoadError, match="batch-invariant mode is not served with mixture-of-experts"):
        LlamaForCausalLM(moe, CPU, torch.float32, batch_invariant=True)


def _tp_rank(rank: int, world: int, port: int, model: str, cache_dir: str) -> torch.Tensor:
    from service.engine.ranks import join_group

    tp, _ = join_group(rank, world, port, CPU)
    return load_model(model, CPU, torch.float32, pathlib.Path(cache_dir), tp=tp).model.forward_full(
        torch.tensor([prompt(40, 13)]))


@pytest.mark.parametrize("model", ["builtin:tiny-qwen3-moe", "builtin:tiny-gemma3"])
def test_two_ranks_compute_the_whole_models_logits(model: str, model_cache_dir: pathlib.Path):
    """Tensor parallelism: each rank holds every expert's half of the inner dimension (and half the
    heads), the built-in checkpoint's shards read from its files; both ranks' logits are the whole model's."""
    from tests.support.ranks import run_ranks

    ref = load_model(model, CPU, torch.float32, model_cache_dir).model.forward_full(torch.tensor([prompt(40, 13)]))
    for logits in run_ranks(_tp_rank, 2, model, str(model_cache_dir)).values():
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_builtin_checkpoints_are_in_each_familys_layout(model_cache_dir: pathlib.Path):
    """The built-in tiny models load in transformers (Mixtral's experts under their own names) and
    give its logits; a shape too large to write keeps its config and tokenizer on disk and makes its
    weights on the device."""
    from service.model.builtin import BUILTIN_SHAPES

    ids = torch.tensor([prompt(20, 14)])
    for name in ("tiny-mixtral", "tiny-gemma3"):
        path = ensure_builtin(name, model_cache_dir)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = ref(ids).logits
        assert rel_error(load_model(f"builtin:{name}", CPU, torch.float32, model_cache_dir).model.forward_full(ids),
                         expected) < TOL
    big = BUILTIN_SHAPES["qwen3-30b-a3b"]
    assert big["on_device"] and big["num_experts"] == 128
    shape = {**BUILTIN_SHAPES["tiny-qwen3-moe"], "on_device": True}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(BUILTIN_SHAPES, "tiny-qwen3-moe", shape)
        loaded = load_model("builtin:tiny-qwen3-moe", CPU, torch.float32, model_cache_dir / "on-device")
    assert not list(loaded.path.glob("*.safetensors")) and (loaded.path / "tokenizer.json").is_file()
    assert loaded.spec.is_moe and torch.isfinite(loaded.model.forward_full(ids)).all()


def test_lora_on_an_moe_model_is_refused_by_name(model_cache_dir: pathlib.Path):
    from service.model.lora import LoraSlots

    model = load_model("builtin:tiny-qwen3-moe", CPU, torch.float32, model_cache_dir).model
    with pytest.raises(ModelLoadError, match="LoRA adapters are not served on mixture-of-experts models "
                                             r"\(Qwen3MoeForCausalLM"):
        LoraSlots(model, max_loras=2, max_rank=8)


def test_a_block_quantized_fp8_checkpoint_loads_dequantized(tmp_path: pathlib.Path, tokenizer_dir: pathlib.Path):
    """An FP8 checkpoint with 128 x 128-style block scales (weight_scale_inv, config.json's
    weight_block_size; here 16 x 16) reads as its dequantized weights: the model's logits are
    transformers' on the same checkpoint dequantized by hand."""
    import json

    from safetensors.torch import load_file, save_file

    from service.model import fp8

    make_checkpoint("qwen3-moe", tmp_path / "fp8", tokenizer_dir)
    state = {}
    for f in (tmp_path / "fp8").glob("*.safetensors"):
        state.update(load_file(f))
        f.unlink()
    (tmp_path / "fp8" / "model.safetensors.index.json").unlink()
    quantized, expected = {}, {}
    for name, t in state.items():
        if name.endswith("proj.weight") and "experts" in name:
            q, s = (x[0] for x in fp8.quantize_experts(t[None], (16, 16)))
            quantized[name], quantized[name + "_scale_inv"] = q, s
            expected[name] = q.float() * s.repeat_interleave(16, 0)[: t.shape[0]].repeat_interleave(16, 1)[:, : t.shape[1]]
        else:
            quantized[name] = expected[name] = t
    shutil.copytree(tmp_path / "fp8", tmp_path / "dequantized")
    save_file(expected, str(tmp_path / "dequantized" / "model.safetensors"))
    save_file(quantized, str(tmp_path / "fp8" / "model.safetensors"))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [16, 16]}}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    ids = torch.tensor([prompt(30, 15)])
    with torch.no_grad():
        want = ref(ids).logits
    assert rel_error(load_model(str(tmp_path / "fp8"), CPU, torch.float32).model.forward_full(ids), want) < TOL


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3"])
def test_batch_invariant_and_lora_serve_the_dense_families(name: str, model_cache_dir: pathlib.Path):
    """The batch-invariant mode on sliding-window layers: a prompt's logits alone equal its logits
    prefilled in two chunks beside another prompt, bit for bit; adapter slots attach to the family's
    projections, and a row on slot 0 (no adapter) gets exactly the base model's logits."""
    from service.model.lora import LoraSlots, lora_tokens

    model = load_model(f"builtin:{name}", CPU, torch.float32, model_cache_dir, batch_invariant=True).model
    kv = KVCache(model.spec, num_slots=3, max_seq_len=128, device=CPU, dtype=torch.float32)
    loaded = types.SimpleNamespace(model=model)
    tokens, other = prompt(60, 16), prompt(9, 17)
    solo = step(loaded, kv, [], [(tokens, ChunkSpec(0, 0, 60))])[0]
    step(loaded, kv, [], [(tokens[:25], ChunkSpec(1, 0, 25, sample=False)), (other, ChunkSpec(2, 0, 9))])
    assert torch.equal(step(loaded, kv, [], [(tokens[25:], ChunkSpec(1, 25, 35))])[0], solo)
    base = load_model(f"builtin:{name}", CPU, torch.float32, model_cache_dir).model
    ids = torch.tensor([tokens[:20]])
    want = base.forward_full(ids)
    with lora_tokens(torch.zeros(20, dtype=torch.long), LoraSlots(base, max_loras=2, max_rank=4)):
        assert torch.equal(base.forward_full(ids), want)
