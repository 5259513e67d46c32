"""Fused ops of the decode fast path: torch references equal the unfused originals; fused QKV and
gate/up projections give the unfused model's logits; Triton kernels (when triton is importable)
match the torch references under TRITON_INTERPRET=1 on CPU.

The interpreter runs in a subprocess because TRITON_INTERPRET must be set before triton is
imported. It runs float16 only: the interpreter truncates float32 -> bfloat16 (the GPU rounds to
nearest) and its bfloat16 tl.dot is wrong, so bfloat16 is covered by tests/gpu/test_kernels_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from service.model.kernels.activation import silu_mul_torch
from service.model.kernels.norm import add_rmsnorm_torch
from service.model.kernels.rope import apply_rope, rope_kv_write_torch
from service.model.kv_cache import KVCache
from service.model.llama import LlamaForCausalLM, rope_cos_sin, rope_inv_freq
from service.model.spec import ModelSpec

REPO = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def spec(**over) -> ModelSpec:
    base = {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
        "eos_token_ids": (),
        "bos_token_id": None,
    }
    return ModelSpec(**{**base, **over})


def random_model(s: ModelSpec, dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(s, CPU, dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def old_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def unfused_forward(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The model as it was before fusion: separate q/k/v and gate/up GEMMs, unfused norm and add."""
    from service.model.llama import causal_attention

    s, m = model.spec, model.model
    n = ids.shape[0]
    x = F.embedding(ids, m.embed_tokens.weight)
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(n), x.dtype)
    for layer in m.layers:
        a, mlp = layer.self_attn, layer.mlp
        h = old_rmsnorm(x, layer.input_layernorm.weight, s.rms_norm_eps)
        q = apply_rope(F.linear(h, a.q_proj.weight, a.q_proj.bias).view(n, s.num_heads, s.head_dim), cos, sin)
        k = apply_rope(
            F.linear(h, a.k_proj.weight, a.k_proj.bias).view(n, s.num_kv_heads, s.head_dim), cos, sin
        )
        v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(n, s.num_kv_heads, s.head_dim)
        x = x + a.o_proj(causal_attention(q, k, v))
        h = old_rmsnorm(x, layer.post_attention_layernorm.weight, s.rms_norm_eps)
        x = x + mlp.down_proj(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight))
    h = old_rmsnorm(x, m.norm.weight, s.rms_norm_eps)
    return F.linear(h, m.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_reference_equals_unfused(dtype):
    gen = torch.Generator().manual_seed(0)
    x, d = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    res, h = add_rmsnorm_torch(x, d, w, 1e-5)
    assert torch.equal(res, x + d) and torch.equal(h, old_rmsnorm(x + d, w, 1e-5))
    same, h0 = add_rmsnorm_torch(x, None, w, 1e-5)
    assert same is x and torch.equal(h0, old_rmsnorm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_reference_equals_unfused(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(silu_mul_torch(torch.cat((gate, up), dim=-1)), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write_reference_equals_unfused(dtype):
    s = spec()
    kv = [KVCache(s, num_slots=3, max_seq_len=32, device=CPU, dtype=dtype) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    b, hd = 3, s.head_dim
    qkv = torch.randn(b, (s.num_heads + 2 * s.num_kv_heads) * hd, generator=gen).to(dtype)
    slot_ids, positions = torch.tensor([2, 0, kv[0].scratch_slot]), torch.tensor([5, 31, 0])
    cos, sin = rope_cos_sin(rope_inv_freq(s), positions, dtype)
    q = rope_kv_write_torch(
        qkv, cos, sin, kv[0].k[0], kv[0].v[0], slot_ids, positions, s.num_heads, s.num_kv_heads
    )

    qv, kvv, vv = qkv.split((s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd), dim=-1)
    k_rot = apply_rope(kvv.reshape(b, s.num_kv_heads, hd), cos, sin)
    kv[1].k[0][slot_ids, :, positions] = k_rot
    kv[1].v[0][slot_ids, :, positions] = vv.reshape(b, s.num_kv_heads, hd)
    assert torch.equal(q, apply_rope(qv.reshape(b, s.num_heads, hd), cos, sin))
    assert torch.equal(kv[0].k[0], kv[1].k[0]) and torch.equal(kv[0].v[0], kv[1].v[0])


@pytest.mark.parametrize(
    "over",
    [{}, {"attention_bias": True, "tie_word_embeddings": True}, {"num_kv_heads": 4}],
    ids=["gqa", "bias-tied", "mha"],
)
def test_fused_projections_give_unfused_logits(over):
    s = spec(**over)
    model = random_model(s)
    a = model.model.layers[0].self_attn
    # the HF-named parameters are views of the fused weights: one storage, the same numbers
    assert a.q_proj.weight.data_ptr() == a.qkv_proj.weight.data_ptr()
    assert torch.equal(a.qkv_proj.weight, torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)))
    ids = torch.randint(0, s.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    ours = model.forward_full(ids[None])[0]
    ref = unfused_forward(model, ids)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_load_weights_fills_fused_weights():
    s = spec(attention_bias=True)
    src = random_model(s, seed=3)
    state = {n: p.clone() for n, p in src.named_parameters()}
    dst = LlamaForCausalLM(s, CPU, torch.float32)
    dst.load_weights(state)
    a = dst.model.layers[1].self_attn
    assert torch.equal(
        a.qkv_proj.bias, torch.cat([state[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    )
    ids = torch.arange(10)[None]
    assert torch.equal(dst.forward_full(ids), src.forward_full(ids))


def test_cpu_model_uses_the_torch_path():
    assert not any(vars(random_model(spec()).fast).values())


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_decode_attention_never_reads_a_slot_past_the_row_position(poison):
    """A KV slot whose positions past a row's own hold NaN or inf (left by an earlier sequence there)
    gives the same attention as a clean slot: masked positions are selected away, not biased by -inf."""
    from service.model.kernels.decode_attention import decode_attention_torch

    gen = torch.Generator().manual_seed(3)
    b, h, kvh, t, d = 3, 4, 2, 40, 16
    q = torch.randn(b, h, d, generator=gen)
    k, v = (torch.randn(4, kvh, t, d, generator=gen) for _ in range(2))
    slot_ids, positions = torch.tensor([1, 2, 3]), torch.tensor([0, 17, 39])
    clean = decode_attention_torch(q, k, v, slot_ids, positions)
    for cache in (k, v):
        cache[1, :, 1:] = poison  # past every row's position in its slot
        cache[2, :, 18:] = poison
    poisoned = decode_attention_torch(q, k, v, slot_ids, positions)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)


# ---- Triton kernels under the interpreter ------------------------------------------------------

INTERPRETER_CHECKS = """
import sys, torch
from service.model.kernels import fast_path as fp
cpu, dt = torch.device("cpu"), torch.float16
fp.check_norm(cpu, dt, 64)
fp.check_norm(cpu, dt, 96, rows=2)                          # hidden not a power of two
fp.check_silu_mul(cpu, dt, 96)
fp.check_silu_mul(cpu, dt, 1500, rows=2)                    # more than one block per row
fp.check_gemv(cpu, dt, 64, 176, head=False)                 # K not a power of two (the head's 65k rows: GPU only)
fp.check_gemv(cpu, dt, 96, 4500, head=False)                # K over more than one BLOCK_K
fp.check_rope_kv(cpu, dt, 4, 2, 16)
fp.check_rope_kv(cpu, dt, 6, 6, 32, batch=5)                # MHA, more rows than the default 4 slots
fp.check_attention(cpu, dt, 4, 2, 16)                       # heuristic splits
fp.check_attention(cpu, dt, 8, 2, 64, batch=4, max_seq_len=150, num_splits=1)
fp.check_attention(cpu, dt, 8, 2, 64, batch=4, max_seq_len=150, num_splits=3, seed=1)
fp.check_attention(cpu, dt, 4, 4, 32, batch=2, max_seq_len=70, num_splits=2)   # MHA
fp.check_attention(cpu, dt, 6, 1, 24, batch=1, max_seq_len=64, num_splits=1)   # head_dim not a power of two
# NaN in a slot past a row's position (a stale earlier sequence) never reaches the row.
from service.model.kernels.decode_attention import decode_attention_torch, decode_attention_triton
g = torch.Generator().manual_seed(5)
q, k, v = torch.randn(2, 4, 16, generator=g).to(dt), *(torch.randn(3, 2, 150, 16, generator=g).to(dt) for _ in range(2))
slots, pos = torch.tensor([1, 2]), torch.tensor([10, 70])
ref = decode_attention_torch(q.float(), k.float(), v.float(), slots, pos)
k[1, :, 11:], v[1, :, 11:], k[2, :, 71:], v[2, :, 71:] = (float("nan"),) * 4
for splits in (1, 3):
    out = decode_attention_triton(q, k, v, slots, pos, num_splits=splits)
    assert torch.isfinite(out).all() and torch.allclose(out.float(), ref, atol=2e-2), splits

# The whole decode step wired through every kernel vs the torch path, on the same weights and cache.
from service.model.kernels import FastPath
from service.model.kv_cache import KVCache
from tests.unit.test_kernels import random_model, spec
s = spec()
model = random_model(s, dt)
kv = [KVCache(s, num_slots=3, max_seq_len=80, device=cpu, dtype=dt) for _ in range(2)]
for slot, n in ((0, 7), (2, 66)):
    prompt = torch.randint(0, s.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    for cache in kv:
        model.prefill(prompt, slot, cache)
ids, positions, slots = torch.tensor([5, 9, 0]), torch.tensor([7, 66, 0]), torch.tensor([0, 2, 3])
for step in range(3):
    model.set_fast(FastPath())
    ref = model.decode(ids, positions, slots, kv[0])
    model.set_fast(FastPath(attention=True, norm=True, rope_kv=True, silu_mul=True, gemv=True))
    ours = model.decode(ids, positions, slots, kv[1])
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-2 and torch.equal(ours[:2].argmax(-1), ref[:2].argmax(-1)), err
    assert torch.allclose(kv[0].k[1].float(), kv[1].k[1].float(), atol=1e-2)
    ids, positions = ref.argmax(-1), positions + torch.tensor([1, 1, 0])

# One row: the batch-1 step, where every projection and the LM head run the one-row GEMV.
fast = FastPath(attention=True, norm=True, rope_kv=True, silu_mul=True, gemv=True)
ids, positions, slots = torch.tensor([5]), torch.tensor([7]), torch.tensor([0])
for step in range(3):
    model.set_fast(FastPath())
    ref = model.decode(ids, positions, slots, kv[0])
    model.set_fast(fast)
    ours = model.decode(ids, positions, slots, kv[1])
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    ids, positions = ref.argmax(-1), positions + 1
print("interpreter checks passed")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (not a project dependency)"
)
def test_triton_kernels_match_torch_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECKS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "interpreter checks passed" in out.stdout
