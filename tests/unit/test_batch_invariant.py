"""The batch-invariant mode on the CPU: the fallback matmul's rows do not depend on the other rows,
and the real model's logits for a prompt are bit-identical alone, packed with other prompts, in
chunks beside other work, and (for its next token) decoded alone or in a batch with padding, in
float32 and bfloat16. The Triton kernels of the mode run under TRITON_INTERPRET=1 when triton is
importable. Config: the combinations the mode refuses."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from service.config import ConfigError, load_config
from service.model.kernels import FastPath
from service.model.kernels.invariant import InvariantKernels
from service.model.kernels.matmul import ROW_BLOCK, matmul_blocked_torch
from service.model.kv_cache import KVCache
from service.model.llama import LlamaForCausalLM
from service.model.spec import ModelLoadError
from service.model.step_batch import ChunkSpec, build_step_batch
from tests.unit.test_kernels import spec

REPO = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
LENS = (37, 5, 60, 21, 1, 44, 9, 70)  # prompt 0 is the one followed everywhere
MAX_SEQ = 128


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocked_matmul_row_does_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 200, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(3 * ROW_BLOCK + 5, 200, generator=gen).to(dtype)
    whole = matmul_blocked_torch(x, w, b)
    assert whole.shape == (x.shape[0], 96) and whole.dtype == dtype
    torch.testing.assert_close(whole.float(), F.linear(x.float(), w.float(), b.float()), atol=0.3, rtol=2e-2)
    for i in (0, 7, ROW_BLOCK, x.shape[0] - 1):  # alone, and moved to another place in its block
        assert torch.equal(matmul_blocked_torch(x[i: i + 1], w, b), whole[i: i + 1])
        assert torch.equal(matmul_blocked_torch(torch.cat([x[:3], x[i: i + 1]]), w, b)[3], whole[i])
    assert matmul_blocked_torch(x[:0], w, b).shape == (0, 96)


def invariant_model(dtype: torch.dtype, device: torch.device = CPU, std: float = 0.1, **over) -> LlamaForCausalLM:  # noqa: ANN003
    model = LlamaForCausalLM(spec(**over), device, dtype, batch_invariant=True)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = std * torch.randn(p.shape, generator=gen, device=device)
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + noise)
    return model.eval()


def follow_prompt_zero(model: LlamaForCausalLM, max_seq: int = MAX_SEQ) -> dict[str, torch.Tensor]:
    """Prompt 0's last-token logits and its next decode's, computed four ways."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=gen) for n in LENS]
    dtype, device = model.dtype, model.inv_freq.device
    prompts = [p.to(device) for p in prompts]

    def cache() -> KVCache:
        return KVCache(model.spec, len(LENS), max_seq, device, dtype)

    kv_solo, kv_packed, kv_chunked = cache(), cache(), cache()
    got = {"solo": model.prefill(prompts[0], 0, kv_solo)}
    got["packed"] = model.prefill_packed(torch.cat(prompts), list(LENS), list(range(len(LENS))), kv_packed)[0]
    # In chunks of 10 tokens; the first chunk beside another prompt, the others beside a decode.
    p, s = prompts[0], kv_chunked.scratch_slot
    model.prefill(prompts[2], 2, kv_chunked)
    for start in range(0, len(p), 10):
        n = min(10, len(p) - start)
        chunks, ids = [ChunkSpec(0, start, n)], p[start: start + n].tolist()
        decodes: tuple[list[int], list[int]] = ([], [])
        if start == 0:
            chunks.append(ChunkSpec(1, 0, LENS[1]))
            ids += prompts[1].tolist()
        else:
            decodes = ([LENS[2] + start // 10 - 1], [2])
            ids = [7, *ids]
        batch = build_step_batch(*decodes, chunks, ids, max_seq, s, device, pad_to=len(ids) + 3)
        got["chunked"] = model.forward_step(batch, kv_chunked)[len(decodes[0])]
    token = int(got["solo"].argmax())
    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=device)

    got["decode_solo"] = model.decode(t([token]), t([LENS[0]]), t([0]), kv_solo)[0]
    ids = t([3, 5, token, *[11] * (len(LENS) - 3), 0])  # prompt 0 in row 2, a padding row last
    positions = t([LENS[1], LENS[2], LENS[0], *LENS[3:], 0])
    slots = t([1, 2, 0, *range(3, len(LENS)), s])
    got["decode_batch"] = model.decode(ids, positions, slots, kv_packed)[2]
    return got


@pytest.mark.parametrize("over", [{}, {"attention_bias": True, "tie_word_embeddings": True}], ids=["gqa", "bias-tied"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_logits_are_bit_identical_alone_packed_chunked_and_batched(dtype: torch.dtype, over: dict) -> None:
    got = follow_prompt_zero(invariant_model(dtype, **over))
    for way in ("packed", "chunked"):
        assert torch.equal(got[way], got["solo"]), f"{way}: max diff {(got[way] - got['solo']).abs().max()}"
    assert torch.equal(got["decode_batch"], got["decode_solo"])


def test_one_switch_routes_every_linear_and_attention() -> None:
    model = invariant_model(torch.float32)
    assert model.batch_invariant and model.invariant.backend == "torch"
    assert model.matmul is matmul_blocked_torch
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.matmul is matmul_blocked_torch
    assert not LlamaForCausalLM(spec(), CPU, torch.float32).batch_invariant


def test_cuda_without_its_kernels_refuses_to_load() -> None:
    """Checked before any device work: float32 has no Triton path, so the guarantee cannot be kept."""
    with pytest.raises(ModelLoadError, match="--batch-invariant on cuda needs its Triton kernels.*dtype"):
        InvariantKernels.build("cuda", torch.float32, FastPath(), set(), (4, 2, 16))


def test_config_flag_env_and_refusals(tmp_path: pathlib.Path) -> None:
    assert not load_config([], {}).batch_invariant
    assert load_config(["--batch-invariant"], {}).batch_invariant
    assert load_config([], {"GRAPHSERVE_BATCH_INVARIANT": "true"}).batch_invariant
    assert not load_config(["--no-batch-invariant"], {"GRAPHSERVE_BATCH_INVARIANT": "1"}).batch_invariant
    with pytest.raises(ConfigError, match="--batch-invariant is not served with tensor parallelism.*"
                                          "--tensor-parallel-size 1"):
        load_config(["--batch-invariant", "--tensor-parallel-size", "2"], {})
    with pytest.raises(ConfigError, match="--batch-invariant is not served with LoRA adapters.*--max-loras"):
        load_config(["--batch-invariant", "--max-loras", "2"], {})
    (tmp_path / "a").mkdir()
    with pytest.raises(ConfigError, match="LoRA adapters"):
        load_config(["--batch-invariant", "--lora-modules", f"a={tmp_path / 'a'}"], {})


def test_llm_keyword_refusal_names_keywords() -> None:
    from service.llm import LLM

    with pytest.raises(ConfigError, match="not served with tensor parallelism.*tensor_parallel_size 1"):
        LLM("builtin:tiny", batch_invariant=True, tensor_parallel_size=2)


# ---- Triton kernels under the interpreter ------------------------------------------------------

INTERPRETER_CHECKS = """
import torch
from service.model.kernels import fast_path as fp
cpu, dt = torch.device("cpu"), torch.float16
fp.check_matmul(cpu, dt, 64, 32)
fp.check_matmul(cpu, dt, 96, 200, bias=True)                # K not a multiple of BLOCK_K, a partial N tile
fp.check_matmul(cpu, dt, 300, 64, rows=130)                 # three M tiles
fp.check_attention(cpu, dt, 4, 2, 16, batch=5, max_seq_len=600, split_len=256)
fp.check_attention(cpu, dt, 8, 2, 64, batch=4, max_seq_len=150, split_len=256)

# The whole model on the mode's Triton kernels: prompt 0 alone, packed, chunked and batched.
from service.model.kernels.invariant import InvariantKernels, decode_attention_fixed_split
from service.model.kernels.matmul import matmul_triton
from tests.unit import test_batch_invariant as t
model = t.invariant_model(dt)
model.fast = fp.FastPath(attention=True, norm=True, rope_kv=True, silu_mul=True)
model.use_invariant(InvariantKernels(matmul_triton, decode_attention_fixed_split, "triton"))
got = t.follow_prompt_zero(model)
for way in ("packed", "chunked"):
    assert torch.equal(got[way], got["solo"]), way
assert torch.equal(got["decode_batch"], got["decode_solo"])
print("interpreter checks passed")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (not a project dependency)"
)
def test_triton_kernels_are_invariant_under_interpreter() -> None:
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECKS],
        cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "interpreter checks passed" in out.stdout
