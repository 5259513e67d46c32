"""The MoE layer's torch path (the CPU's, and the shape the CUDA graphs capture) against a per-expert
loop, the padded sort against its definition, and the routing of each family: hypothesis over token
counts, top-k, expert counts and empty experts; FP8 experts per channel and per block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.model import fp8
from service.model.kernels.activation import act_mul_torch
from service.model.kernels.moe import (
    PIPELINE_SMEM_BYTES,
    ExpertWeights,
    align_torch,
    dequantize_experts,
    moe_config,
    moe_torch,
    padded_pairs,
    pipeline_smem,
    route_torch,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def loop_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   act: str) -> torch.Tensor:
    """The oracle: for each expert, the tokens that picked it (data-dependent, as transformers does)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        tokens, slot = torch.where(ids == e)
        if tokens.numel() == 0:
            continue
        h = act_mul_torch(x[tokens].double() @ w13[e].double().T, act)
        out.index_add_(0, tokens, (h @ w2[e].double().T) * weights[tokens, slot, None].double())
    return out


def experts_of(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5,
            torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), num_experts=st.integers(1, 20), data=st.data(), act=st.sampled_from(["silu", "gelu_tanh"]),
       renormalize=st.booleans(), seed=st.integers(0, 2**16))
def test_torch_path_equals_a_per_expert_loop(tokens, num_experts, data, act, renormalize, seed):
    top_k = data.draw(st.integers(1, num_experts))
    # routing concentrated on a few experts, so many are empty
    hot = data.draw(st.integers(1, num_experts))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, :hot] += 4.0
    w13, w2 = experts_of(num_experts, 24, 16, seed)
    x = torch.randn(tokens, 24, generator=gen)
    weights, ids = route_torch(logits, top_k, renormalize)
    got = moe_torch(x, weights, ids, ExpertWeights(w13, w2), act)
    want = loop_reference(x, weights, ids, w13, w2, act)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 70), num_experts=st.integers(1, 40), data=st.data(), block_m=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_the_padded_sort_puts_each_experts_pairs_in_its_own_blocks(tokens, num_experts, data, block_m, seed):
    """Every pair exactly once, in its expert's blocks (in pair order), each expert's run starting on a
    block boundary; blocks past the used ones say so; the size depends only on (pairs, experts, block)."""
    top_k = data.draw(st.integers(1, num_experts))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = torch.where(ids < data.draw(st.integers(1, num_experts)), ids, ids % 2)  # skew: empty experts
    sorted_ids, block_expert, block_rows = align_torch(ids, num_experts, block_m)
    pairs = tokens * top_k
    assert sorted_ids.shape[0] == padded_pairs(pairs, num_experts, block_m) == block_expert.shape[0] * block_m
    flat = ids.reshape(-1)
    seen = []
    for b in range(block_expert.shape[0]):
        e, rows = int(block_expert[b]), int(block_rows[b])
        if e < 0:
            assert rows == 0 and (block_expert[b:] < 0).all()
            break
        assert 1 <= rows <= block_m
        block = sorted_ids[b * block_m: b * block_m + rows].tolist()
        assert all(int(flat[p]) == e for p in block)
        seen += block
    assert sorted(seen) == list(range(pairs))
    for e in range(num_experts):  # ascending pair order within an expert
        mine = [p for p in seen if int(flat[p]) == e]
        assert mine == sorted(mine)


def test_each_familys_routing():
    """Qwen3-MoE without norm_topk_prob keeps the softmax's top-k as they are; Mixtral (and Qwen3-MoE
    with it) renormalises them to sum 1; the picks are the k largest logits."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    weights, ids = route_torch(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, same = route_torch(logits, 2, renormalize=True)
    assert torch.equal(same, ids)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))


@pytest.mark.parametrize("block", [None, (16, 8)], ids=["per-channel", "per-block"])
def test_fp8_experts_through_the_torch_path(block):
    """E4M3 experts (scales per output channel, or per block) give the products of their dequantized
    weights, and within FP8's rounding of the bf16 weights' products."""
    w13, w2 = experts_of(6, 32, 24, 3)
    (q13, s13), (q2, s2) = fp8.quantize_experts(w13, block), fp8.quantize_experts(w2, block)
    assert q13.dtype == fp8.FP8 and s13.shape == ((6, 48) if block is None else (6, 3, 4))
    deq13, deq2 = dequantize_experts(q13, s13, block, torch.float32), dequantize_experts(q2, s2, block, torch.float32)
    assert ((deq13 - w13).abs() <= w13.abs().amax() / 16).all()  # E4M3 keeps 3 mantissa bits
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 32, generator=gen)
    weights, ids = route_torch(torch.randn(9, 6, generator=gen), 2, True)
    got = moe_torch(x, weights, ids, ExpertWeights(q13, q2, s13, s2, block))
    torch.testing.assert_close(got.double(), loop_reference(x, weights, ids, deq13, deq2, "silu"), atol=1e-5, rtol=1e-5)
    exact = loop_reference(x, weights, ids, w13, w2, "silu")
    assert ((got.double() - exact).norm() / exact.norm()) < 0.1


def test_the_torch_path_has_no_data_dependent_shapes():
    """The graphs' premise: two routings of the same tokens run the same ops on tensors of the same
    shapes (the expert groups are a static loop), so one capture serves both."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            out = func(*args, **(kwargs or {}))
            self.ops.append((str(func), tuple(o.shape for o in (out if isinstance(out, tuple) else (out,))
                                               if isinstance(o, torch.Tensor))))
            return out

    w13, w2 = experts_of(20, 16, 8, 5)
    x = torch.randn(7, 16)
    runs = []
    for hot in (0, 10):  # every token on experts 0..3, then on 10..13
        logits = torch.full((7, 20), -5.0)
        logits[:, hot: hot + 4] = torch.randn(7, 4)
        with Record() as rec:
            moe_torch(x, *route_torch(logits, 3, True), ExpertWeights(w13, w2))
        runs.append(rec.ops)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("w_bytes", [1, 2], ids=["fp8", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gate-up", "down"])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_every_tile_config_fits_the_pipelines_shared_memory(w_bytes, gated, block):
    """A bf16 gate-up GEMM in 64-row tiles once asked for 320 KiB of shared memory and failed to
    launch on the H200 (227 KiB a block): every token count's config now fits the budget, and a
    per-block FP8 weight's block_k still divides the scale block's columns."""
    for tokens in (1, 64, 65, 2048):
        for n, k in ((768, 2048), (2048, 768), (3584, 1024), (128, 256)):
            c = moe_config(tokens, n, k, block if w_bytes == 1 else None, 2, w_bytes, gated)
            assert pipeline_smem(c, 2, w_bytes, gated) <= PIPELINE_SMEM_BYTES, c
            assert c.num_stages >= 2 and c.block_k >= 32
            if block is not None and w_bytes == 1:
                assert block[1] % c.block_k == 0, c
