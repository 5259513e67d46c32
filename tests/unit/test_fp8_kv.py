"""The FP8 KV cache (`--kv-cache-dtype fp8`) on the CPU, where the torch paths serve it: the write and
read against float32, the memory it saves, the checkpoint's KV scales, the engine generating with it,
and the start-up errors. The Triton kernels on FP8 KV run on the GPU (tests/gpu/test_fp8_kv_gpu.py)."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import ConfigError, ServeConfig
from service.engine.kv_sizing import size_kv_cache
from service.model import KVCache, ModelLoadError, ensure_builtin, load_model
from service.model.fp8 import FP8, FP8_MAX
from service.model.kernels.decode_attention import decode_attention_torch
from service.model.kernels.prefill_attention import prefill_attention_torch
from service.model.kernels.rope import rope_kv_write_torch
from service.model.kv_quant import load_kv, store_kv
from service.model.llama import LlamaForCausalLM
from tests.unit.test_kernels import spec

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_write_then_a_read_is_within_e4m3s_rounding_of_the_float32_values() -> None:
    s = spec()
    gen = torch.Generator().manual_seed(0)
    n, width = 40, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    qkv = torch.randn(n, width, generator=gen) * torch.logspace(-2, 1, n)[:, None]  # rows of 0.01 .. 10 x randn
    cos, sin = torch.ones(n, 1, s.head_dim), torch.zeros(n, 1, s.head_dim)  # no rotation: k is qkv's
    caches = {dtype: KVCache(s, 4, 16, CPU, torch.float32, cache_dtype=dtype) for dtype in (torch.float32, FP8)}
    caches[FP8].scales[0] = torch.tensor([0.2, 0.15])  # all of them within 448 x the scale
    slots, positions = torch.arange(n) % 4, torch.arange(n) // 4
    for kv in caches.values():
        blocks, offsets = kv.write_index(slots, positions)
        rope_kv_write_torch(qkv, cos, sin, kv.k[0], kv.v[0], blocks, offsets, s.num_heads, s.num_kv_heads,
                            kv.scales[0])
    assert caches[FP8].k[0].dtype == FP8
    exact, fp8 = caches[torch.float32], caches[FP8]
    k, v = load_kv(fp8.k[0], fp8.v[0], fp8.scales[0], torch.float32)
    for read, want, scale in ((k, exact.k[0], 0.2), (v, exact.v[0], 0.15)):
        # 3 mantissa bits after the scale: 2^-4 of a normal value, half of E4M3's smallest
        # subnormal (2^-9) times the scale for the tiniest
        bound = want.abs() * 2.0**-4 + scale * 2.0**-10
        assert ((read - want).abs() <= bound * (1 + 1e-6)).all()
        assert (read != want).any()  # (it was rounded)


def test_values_past_e4m3s_range_clamp_to_448_times_the_scale() -> None:
    scale = torch.tensor([1.0, 4.0])
    k, v = store_kv(torch.tensor([1000.0, -1000.0, 3.0]), torch.tensor([960.0, -2000.0, 3.0]), scale, FP8)
    assert k.float().tolist() == [FP8_MAX, -FP8_MAX, 3.0]
    assert v.float().tolist() == [240.0, -FP8_MAX, 0.75]
    assert load_kv(k, v, scale, torch.float32)[1].tolist() == [960.0, -4 * FP8_MAX, 3.0]


def test_attention_over_an_fp8_cache_is_attention_over_its_dequantized_values() -> None:
    """Both torch readers (decode rows, prompt chunks) read an FP8 cache as its values times the
    layer's scales, and nothing else changes."""
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(9, 2, 16, 32, generator=gen) for _ in range(2))
    scale = torch.tensor([0.03, 0.01])
    k8, v8 = store_kv(k, v, scale, FP8)
    kf, vf = load_kv(k8, v8, scale, torch.float32)
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)
    q = torch.randn(3, 4, 32, generator=gen)
    slots, positions = torch.tensor([0, 1, 1]), torch.tensor([5, 63, 20])
    assert torch.equal(decode_attention_torch(q, k8, v8, table, slots, positions, scale),
                       decode_attention_torch(q, kf, vf, table, slots, positions))
    chunks = [(0, 2, 7, 0), (2, 1, 40, 1)]
    out8, out = torch.zeros(3, 128), torch.zeros(3, 128)
    prefill_attention_torch(q, k8, v8, table, chunks, out8, scale)
    prefill_attention_torch(q, kf, vf, table, chunks, out)
    assert torch.equal(out8, out)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (not a project dependency)")
@pytest.mark.parametrize("fp8_kv", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_the_kv_kernels_compile_for_hopper_with_either_cache(fp8_kv: bool, tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton KV write, decode and prompt-chunk kernels compiled to PTX for sm_90 (no GPU needed):
    the interpreter runs their Python, so it misses what only the compiler refuses (a value's type
    changed inside a branch on the program id)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.model.kernels import decode_attention, prefill_attention, rope

    kv = "*fp8e4nv" if fp8_kv else "*bf16"
    ptrs = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_ptr": "*bf16", "out_ptr": "*bf16",
            "k_ptr": kv, "v_ptr": kv, "scale_ptr": "*fp32", "part_ptr": "*fp32", "lse_ptr": "*fp32",
            "table_ptr": "*i32", "slot_ptr": "*i64", "pos_ptr": "*i64", "chunks_ptr": "*i64", "tiles_ptr": "*i64",
            "sm_scale": "fp32", "qk_scale": "fp32"}
    shapes = {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_N": 64, "KV_BLOCK": 16, "FP8_KV": fp8_kv}
    kernels = [
        (rope._rope_kv_kernel, {"NUM_HEADS": 8, "NUM_KV_HEADS": 2, "HALF": 32, "BLOCK": 32, "FP8_MAX": FP8_MAX,
                                "PDL": False, "HEAD_DIM": 64, "FP8_KV": fp8_kv}),
        (decode_attention._decode_attn_kernel, {**shapes, "GROUPS": 4, "BLOCK_G": 16, "SPLIT_LEN": 256,
                                                "NUM_SPLITS": 4, "DYNAMIC_LOOP": True, "PDL": False}),
        (prefill_attention._prefill_attn_kernel, {**shapes, "GROUPS": 4, "BLOCK_M": 64, "DYNAMIC_LOOP": True,
                                                  "MAX_KEYS": 1024}),
    ]
    for fn, constants in kernels:
        signature = {a: "constexpr" if a in constants else ptrs.get(a, "i32") for a in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32))
        assert ".target sm_90" in compiled.asm["ptx"], fn.__name__


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (not a project dependency)")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_kv_write_rounds_each_product_of_the_rotation_as_torch_does(head_dim: int, tmp_path: pathlib.Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled for sm_90 with its launch's NO_FP_FUSION, the RoPE + KV write has no fused multiply-add
    (with Triton's default FP fusion one bf16 product skips its rounding: k two E4M3 steps off torch's)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.model.kernels import rope
    from service.model.kernels._triton import NO_FP_FUSION

    constants = {"NUM_HEADS": 8, "NUM_KV_HEADS": 2, "HEAD_DIM": head_dim, "HALF": head_dim // 2, "BLOCK": head_dim // 2,
                 "FP8_KV": True, "FP8_MAX": FP8_MAX, "PDL": False}
    ptrs = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "slot_ptr": "*i64", "pos_ptr": "*i64"}
    fn = rope._rope_kv_kernel
    signature = {a: "constexpr" if a in constants else ptrs.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 1, **NO_FP_FUSION}).asm["ptx"]
    assert "fma." not in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_an_fp8_block_costs_half_a_bf16_one_so_the_same_memory_holds_twice_the_blocks(model_cache_dir) -> None:  # noqa: ANN001
    from service.model.loader import read_model_spec

    s = read_model_spec("builtin:tiny", model_cache_dir)
    assert KVCache.bytes_per_block(s, 16, FP8) * 2 == KVCache.bytes_per_block(s, 16, torch.bfloat16)
    sized = {dtype: size_kv_cache(s, dtype, CPU, "64MiB", 16, 8, 512, None, False)
             for dtype in (torch.bfloat16, FP8)}
    assert sized[FP8].num_blocks == 2 * sized[torch.bfloat16].num_blocks
    assert sized[FP8].tokens > 2 * sized[torch.bfloat16].tokens - 32  # (the null block is counted once)
    kv = KVCache(s, 2, 64, CPU, torch.float32, num_blocks=10, cache_dtype=FP8)
    assert kv.nbytes() == 10 * KVCache.bytes_per_block(s, 16, FP8)


def _with_kv_scales(src: pathlib.Path, dst: pathlib.Path, extra: dict[str, torch.Tensor]) -> pathlib.Path:
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    save_file({**load_file(str(weights)), **extra}, str(weights))
    return dst


def test_a_checkpoints_kv_scales_are_read_under_vllms_names(tmp_path: pathlib.Path) -> None:
    src = ensure_builtin("tiny", tmp_path / "cache")
    layer = "model.layers.{}.self_attn."
    path = _with_kv_scales(src, tmp_path / "scaled", {
        layer.format(0) + "k_scale": torch.tensor(0.5), layer.format(0) + "v_scale": torch.tensor([0.25]),
        layer.format(1) + "k_proj.output_scale": torch.tensor([2.0]),  # llm-compressor's
        layer.format(2) + "kv_scale": torch.tensor(4.0),  # the deprecated one scale for both
    })
    loaded = load_model(str(path), CPU, torch.float32, kv_cache_dtype="fp8")
    assert loaded.kv_cache_dtype == FP8
    assert loaded.kv_scales.tolist() == [[0.5, 0.25], [2.0, 1.0], [4.0, 4.0], [1.0, 1.0]]
    from cache_manager import CudaGraphMode, GraphCacheConfig
    from service.engine.runner import ModelRunner

    runner = ModelRunner(loaded, 2, 64, GraphCacheConfig(mode=CudaGraphMode.NONE, capture_sizes=None, max_batch=2))
    assert runner.kv.k[0].dtype == FP8 and torch.equal(runner.kv.scales, loaded.kv_scales)
    # With auto KV the scales are read and unused: the model still loads
    assert load_model(str(path), CPU, torch.float32).kv_cache_dtype == torch.float32


def test_every_tensor_parallel_rank_reads_a_layers_kv_scales_whole(tmp_path: pathlib.Path) -> None:
    from safetensors import safe_open

    from service.model.parallel import TensorParallel, read_shard

    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # 0-dim, as FP8 checkpoints store it
              "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.25])}  # in a column-parallel module
    save_file(scales, str(tmp_path / "scales.safetensors"))
    with safe_open(str(tmp_path / "scales.safetensors"), framework="pt") as sf:
        for rank in (0, 1):
            for key, value in scales.items():
                assert torch.equal(read_shard(sf.get_slice(key), key, TensorParallel(rank, 2)), value), (rank, key)


def test_a_kv_scale_per_head_is_refused_naming_it(tmp_path: pathlib.Path) -> None:
    src = ensure_builtin("tiny", tmp_path / "cache")
    path = _with_kv_scales(src, tmp_path / "bad", {"model.layers.3.self_attn.v_scale": torch.ones(2)})
    with pytest.raises(ModelLoadError, match="self_attn.v_scale holds 2 values: KV scales are served one per tensor"):
        load_model(str(path), CPU, torch.float32, kv_cache_dtype="fp8")


def test_fp8_kv_keeps_the_models_logits_close_step_after_step(loaded) -> None:  # noqa: ANN001
    """The same tokens fed to the built-in model over a float32 and an FP8 cache (teacher forcing):
    each step's logits stay within 25% of their norm (measured: at most 17%, 9% on average) and the
    argmax agrees on at least 75% of the steps (measured 87%). The built-in model's weights are
    random, so its logits are flat (their spread is ~0.2) and a small error flips a near tie."""
    m = loaded.model
    prompts, steps = 8, 32
    caches = [KVCache(m.spec, prompts, 128, CPU, torch.float32, cache_dtype=dtype) for dtype in (None, FP8)]
    gen = torch.Generator().manual_seed(0)
    agree, errors = 0, []
    for p in range(prompts):
        ids = torch.randint(0, loaded.spec.vocab_size, (20 + p,), generator=gen)
        exact, fp8 = (m.prefill(ids, p, kv) for kv in caches)
        for position in range(ids.shape[0], ids.shape[0] + steps):
            agree += int(exact.argmax() == fp8.argmax())
            errors.append(((exact - fp8).norm() / exact.norm()).item())
            token, at, slot = exact.argmax().view(1), torch.tensor([position]), torch.tensor([p])
            exact, fp8 = (m.decode(token, at, slot, kv)[0] for kv in caches)
    assert max(errors) < 0.25 and agree >= 0.75 * prompts * steps, (max(errors), agree)
    assert min(errors) > 0  # (the cache was FP8)


def test_the_engine_generates_with_fp8_kv_mostly_the_tokens_it_gives_with_auto(model_cache_dir) -> None:  # noqa: ANN001
    """Greedy completions through the whole engine (scheduler, paged KV, prefix caching, chunked
    prefill): every request completes, and the first token (read from the prompt's FP8 KV) is the
    auto cache's for at least 10 of 16 prompts (measured 13). Later tokens drift apart once one
    differs (the built-in model's logits are flat, see above)."""
    from service.llm import LLM, SamplingParams

    topics = "graphs tokens blocks caches streams adapters ranks kernels".split() * 2
    prompts = [f"Request number {i} asks the service about {w}" for i, w in enumerate(topics)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for kv_dtype in ("auto", "fp8"):
        with LLM("builtin:tiny", device="cpu", dtype="float32", kv_cache_dtype=kv_dtype, max_seq_len=256,
                 model_cache_dir=model_cache_dir) as llm:
            outputs[kv_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert all(len(ids) == 16 for ids in outputs["fp8"])
    first = sum(a[0] == b[0] for a, b in zip(outputs["auto"], outputs["fp8"]))
    assert first >= 10, (first, outputs)


def test_kv_cache_dtype_errors_say_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be auto \\(the model's dtype\\) or fp8, not 'fp16'"):
        ServeConfig(kv_cache_dtype="fp16").validate()
    from service.llm import LLM

    with pytest.raises(TypeError, match="kv_cache_dtype must be a string"):
        LLM("builtin:tiny", kv_cache_dtype=torch.float8_e4m3fn)
    # A GPU below compute capability 8.9 (an A100): the Triton kernels have no E4M3 there
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype fp8: .* 8.9\\+ .*NVIDIA A100 has 8.0; use "
                                             "--kv-cache-dtype auto"):
        LlamaForCausalLM(spec(), torch.device("cuda"), torch.bfloat16, kv_dtype=FP8)
