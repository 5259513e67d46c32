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
from service.model.step_batch import ChunkSpec, build_step_batch

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
    blocks, offsets = kv[0].write_index(slot_ids, positions)  # each row's (block, offset), as the model passes them
    cos, sin = rope_cos_sin(rope_inv_freq(s), positions, dtype)
    q = rope_kv_write_torch(
        qkv, cos, sin, kv[0].k[0], kv[0].v[0], blocks, offsets, s.num_heads, s.num_kv_heads
    )

    qv, kvv, vv = qkv.split((s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd), dim=-1)
    k_rot = apply_rope(kvv.reshape(b, s.num_kv_heads, hd), cos, sin)
    v_rows = vv.reshape(b, s.num_kv_heads, hd)
    kv[1].k[0][blocks, :, offsets] = k_rot
    kv[1].v[0][blocks, :, offsets] = v_rows
    assert torch.equal(q, apply_rope(qv.reshape(b, s.num_heads, hd), cos, sin))
    assert torch.equal(kv[0].k[0], kv[1].k[0]) and torch.equal(kv[0].v[0], kv[1].v[0])
    # The live rows landed at (slot, position) of their sequences, the padding row in the null block.
    for cache, rows in ((kv[0].k[0], k_rot), (kv[0].v[0], v_rows)):
        assert torch.equal(kv[0].slot_view(cache)[slot_ids[:2], :, positions[:2]], rows[:2])
        assert torch.equal(cache[0, :, 0], rows[2])


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
    """A sequence's KV blocks whose positions past a row's own hold NaN or inf (left by an earlier
    sequence there) give the same attention as clean ones: masked positions are selected away, not
    biased by -inf. The rows' blocks are shuffled over the pool, and the poison starts inside a block."""
    from service.model.kernels.decode_attention import decode_attention_torch

    gen = torch.Generator().manual_seed(3)
    b, h, kvh, t, d, bs = 3, 4, 2, 40, 16, 8
    per_seq = t // bs
    q = torch.randn(b, h, d, generator=gen)
    k, v = (torch.randn(1 + 4 * per_seq, kvh, bs, d, generator=gen) for _ in range(2))
    table = (1 + torch.randperm(4 * per_seq, generator=gen)).view(4, per_seq).to(torch.int32)
    slot_ids, positions = torch.tensor([1, 2, 3]), torch.tensor([0, 17, 39])
    clean = decode_attention_torch(q, k, v, table, slot_ids, positions)
    for cache in (k, v):
        for slot, first in ((1, 1), (2, 18)):  # past every row's position in its sequence
            for p in range(first, t):
                cache[table[slot, p // bs], :, p % bs] = poison
    poisoned = decode_attention_torch(q, k, v, table, slot_ids, positions)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)


def test_paged_block_table_gives_the_contiguous_layout_logits():
    """Paged addressing changes nothing: forward_step (prompt starts, a mixed step of decodes and a
    prompt continuation, padding rows) and decode over a KVCache whose rows hold shuffled blocks of a
    larger pool, two of them sharing a first block that holds their common prefix (written once, by
    the first), give exactly the logits and each sequence's KV of a contiguous-layout cache, and
    write no block outside the rows' tables."""
    s = spec()
    model = random_model(s)
    bs, max_seq, slots = 4, 32, 3
    per_seq = max_seq // bs
    contiguous = KVCache(s, slots, max_seq, CPU, torch.float32, block_size=bs)
    paged = KVCache(s, slots, max_seq, CPU, torch.float32, block_size=bs, num_blocks=1 + slots * per_seq + 4)
    pool = (1 + torch.randperm(paged.num_blocks - 1, generator=torch.Generator().manual_seed(4))).tolist()
    shared, own = pool[0], iter(pool[1:])
    for slot in range(slots):  # rows 0 and 1 start with the shared block; every other block is a row's own
        first = shared if slot < 2 else next(own)
        paged.set_blocks(slot, 0, [first] + [next(own) for _ in range(per_seq - 1)])
    paged.sync_table()
    spare = list(own)
    assert paged.row(0)[0] == paged.row(1)[0] == shared and spare
    assert paged.block_table.tolist() != contiguous.block_table.tolist()

    gen = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, s.vocab_size, (n,), generator=gen).tolist()

    prefix = tokens(bs)  # the shared block's tokens
    prompts = [prefix + tokens(9), prefix + tokens(6), tokens(11)]
    caches = {"contiguous": contiguous, "paged": paged}

    def step(kv: KVCache, decodes: list[tuple[int, int, int]], chunks: list[ChunkSpec], pad: int = 0) -> torch.Tensor:
        """decodes: (token, position, slot); chunks take their tokens from `prompts`."""
        ids = [t for t, _, _ in decodes] + [t for c in chunks for t in prompts[c.slot][c.start: c.start + c.length]]
        batch = build_step_batch([p for _, p, _ in decodes], [sl for _, _, sl in decodes], chunks, ids,
                                 kv.max_seq_len, kv.scratch_slot, CPU, pad_to=len(ids) + pad)
        return model.forward_step(batch, kv)

    def same(got: dict[str, torch.Tensor]) -> torch.Tensor:
        assert torch.equal(got["paged"], got["contiguous"]), (got["paged"] - got["contiguous"]).abs().max()
        return got["contiguous"]

    # Sequences 0 (writing the shared block) and 2 start their prompts.
    first = same({n: step(kv, [], [ChunkSpec(0, 0, 13), ChunkSpec(2, 0, 11)]) for n, kv in caches.items()})
    # Sequence 1's prefix KV is sequence 0's (same tokens, same positions): the paged cache shares the
    # block, the contiguous one gets a copy in sequence 1's own first block.
    for layer in range(s.num_layers):
        for cache in (contiguous.k[layer], contiguous.v[layer]):
            cache[contiguous.row(1)[0]] = cache[contiguous.row(0)[0]]
    # Sequences 0 and 2 decode beside sequence 1's continuation (reading the shared block), with padding.
    nxt = [int(t) for t in first.argmax(-1)]
    mixed = same({n: step(kv, [(nxt[0], 13, 0), (nxt[1], 11, 2)], [ChunkSpec(1, bs, 6)], pad=3)
                  for n, kv in caches.items()})
    ids = [int(mixed[0].argmax()), int(mixed[2].argmax()), int(mixed[1].argmax())]  # rows: 0, 1, 2
    positions = [14, 10, 12]
    for _ in range(6):  # decode steps, the last row padding on the scratch slot; blocks fill and change
        args = (torch.tensor(ids + [0]), torch.tensor(positions + [0]), torch.tensor([0, 1, 2, contiguous.scratch_slot]))
        logits = same({n: model.decode(*args, kv) for n, kv in caches.items()})
        ids, positions = [int(t) for t in logits[:3].argmax(-1)], [p + 1 for p in positions]

    for layer in range(s.num_layers):
        for name in ("k", "v"):
            got, want = (getattr(kv, name)[layer] for kv in (paged, contiguous))
            assert torch.equal(paged.slot_view(got)[:slots], contiguous.slot_view(want)[:slots]), (layer, name)
            assert not got[spare].any(), "a block outside every row's table was written"


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
fp.check_prefill_attention(cpu, dt, 4, 2, 16)               # prompt chunks: fresh, continued, several tiles
fp.check_prefill_attention(cpu, dt, 4, 4, 32, block_size=8, chunks=((0, 3), (5, 65)), seed=2)  # MHA
fp.check_prefill_attention(cpu, dt, 6, 1, 24, chunks=((0, 17), (100, 1)), seed=3)  # head_dim not a power of two
# The families' variants: Gemma's norm and GELU, q/k head norms in the RoPE kernel, sliding windows
# (one position, and windows across splits and tiles) with a score scale, the MoE kernels
fp.check_norm(cpu, dt, 96, rows=2, gemma=True)
fp.check_silu_mul(cpu, dt, 1500, rows=2, act="gelu_tanh")
fp.check_rope_kv(cpu, dt, 4, 2, 16, qk_norm=True)
fp.check_rope_kv(cpu, dt, 4, 2, 16, qk_norm=True, gemma=True)
fp.check_attention(cpu, dt, 4, 2, 16, window=37, scale=0.3)
fp.check_attention(cpu, dt, 8, 2, 64, batch=4, max_seq_len=150, num_splits=3, seed=1, window=70)
fp.check_attention(cpu, dt, 4, 2, 16, window=1)
fp.check_prefill_attention(cpu, dt, 4, 2, 16, window=37, scale=0.3)
fp.check_prefill_attention(cpu, dt, 4, 2, 16, window=1)
fp.check_moe(cpu, dt, 8, 2, True, hidden=32, intermediate=48)
fp.check_moe(cpu, dt, 16, 4, False, act="gelu_tanh", hidden=32, intermediate=48, token_counts=(3, 66))
# NaN in a slot past a row's position (a stale earlier sequence) never reaches the row.
from service.model.kernels.decode_attention import decode_attention_torch, decode_attention_triton
g = torch.Generator().manual_seed(5)
bs, per_seq = 16, 10  # 160 positions per row, its blocks shuffled over the pool
q, k, v = torch.randn(2, 4, 16, generator=g).to(dt), *(torch.randn(1 + 3 * per_seq, 2, bs, 16, generator=g).to(dt) for _ in range(2))
table = (1 + torch.randperm(3 * per_seq, generator=g)).view(3, per_seq).to(torch.int32)
slots, pos = torch.tensor([1, 2]), torch.tensor([10, 70])
ref = decode_attention_torch(q.float(), k.float(), v.float(), table, slots, pos)
for slot, first in ((1, 11), (2, 71)):
    for p in range(first, per_seq * bs):
        block = table[slot, p // bs]
        k[block, :, p % bs], v[block, :, p % bs] = float("nan"), float("nan")
for splits in (1, 3):
    out = decode_attention_triton(q, k, v, table, slots, pos, num_splits=splits)
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
