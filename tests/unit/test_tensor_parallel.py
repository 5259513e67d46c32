"""Tensor-parallel model pieces: shard loading, the sharded forward against the whole model (two
gloo ranks on the CPU), the refusal of a model that does not split, and the per-step message (with
its graph operations)."""

from __future__ import annotations

import dataclasses
import pathlib
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cache_manager import BatchDescriptor
from cache_manager.mirror import CAPTURE, RELEASE, GraphOp
from cache_manager.sizes import FULL, PIECEWISE
from service.engine.step_channel import MAX_OPS, StepChannel, StepInputs
from service.model.builtin import BUILTIN_SHAPES, _hf_config
from service.model.loader import load_model
from service.model.parallel import TensorParallel, read_shard, shard_spec
from service.model.spec import ModelLoadError, ModelSpec
from service.model.step_batch import ChunkSpec
from tests.support.ranks import run_ranks

IDS = [[1, 5, 9, 200, 767, 3, 42, 11]]
SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")


def _rank(rank: int, world: int, port: int, cache_dir: str) -> tuple[dict[str, int], torch.Tensor]:
    from service.engine.ranks import join_group

    tp, _ = join_group(rank, world, port, torch.device("cpu"))
    model = load_model("builtin:tiny", torch.device("cpu"), torch.float32, pathlib.Path(cache_dir), tp=tp).model
    return {name: p.numel() for name, p in model.named_parameters()}, model.forward_full(torch.tensor(IDS))


@pytest.fixture(scope="module")
def two_ranks(model_cache_dir) -> dict[int, tuple[dict[str, int], torch.Tensor]]:  # noqa: ANN001
    """Each of two gloo ranks loads builtin:tiny's shards and runs the cache-free forward."""
    load_model("builtin:tiny", torch.device("cpu"), torch.float32, model_cache_dir)  # generate it once
    return run_ranks(_rank, 2, str(model_cache_dir))


def test_each_rank_holds_half_of_every_sharded_weight(two_ranks, model_cache_dir) -> None:  # noqa: ANN001
    whole = {n: p.numel() for n, p in
             load_model("builtin:tiny", torch.device("cpu"), torch.float32, model_cache_dir).model.named_parameters()}
    for rank in (0, 1):
        sizes = two_ranks[rank][0]
        assert sizes.keys() == whole.keys()
        for name, n in whole.items():
            split = name.split(".")[-2] in SHARDED
            assert sizes[name] == (n // 2 if split else n), name


def test_two_ranks_compute_the_whole_models_logits(two_ranks, model_cache_dir) -> None:  # noqa: ANN001
    ref = load_model("builtin:tiny", torch.device("cpu"), torch.float32, model_cache_dir).model.forward_full(
        torch.tensor(IDS))
    for rank in (0, 1):
        logits = two_ranks[rank][1]
        assert logits.shape == ref.shape
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def _tiny_spec(**changes: int) -> ModelSpec:
    shape = {**BUILTIN_SHAPES["tiny"], **changes}
    return ModelSpec.from_hf_config(types.SimpleNamespace(**_hf_config(shape, 0, 1)))


def test_a_model_whose_kv_heads_do_not_divide_is_refused_clearly() -> None:
    spec = _tiny_spec()  # 4 heads, 2 KV heads
    assert shard_spec(spec, TensorParallel(0, 2)).num_kv_heads == 1
    with pytest.raises(ModelLoadError, match="num_key_value_heads 2 does not divide by tensor_parallel_size 4"):
        shard_spec(spec, TensorParallel(0, 4))


def test_a_vocabulary_that_does_not_divide_is_padded_with_zero_rows(tmp_path) -> None:  # noqa: ANN001
    embed = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as sf:
        parts = [read_shard(sf.get_slice("model.embed_tokens.weight"), "model.embed_tokens.weight",
                            TensorParallel(r, 3)) for r in range(3)]
    assert [p.shape[0] for p in parts] == [3, 3, 3]
    assert torch.equal(torch.cat(parts)[:7], embed) and not torch.cat(parts)[7:].any()


def test_a_step_crosses_the_channel_unchanged() -> None:
    step = StepInputs([7, 8, 1, 2, 3], [4, 9], [0, 3], [ChunkSpec(5, 16, 3, True)], [-1, 1], 3)
    buf = torch.zeros(StepInputs.capacity(4, 16), dtype=torch.long)
    step.encode(buf)
    assert StepInputs.decode(buf) == step
    # Prompt logprobs: the rows travel (every rank computes their logits); the targets stay on rank 0.
    asking = StepInputs([1, 2, 3, 4], [], [], [ChunkSpec(2, 0, 2, False, 2), ChunkSpec(3, 8, 2, True, 1)], None, 1,
                        logprob_targets=[2, 9, 4])
    asking.encode(buf)
    assert StepInputs.decode(buf) == dataclasses.replace(asking, logprob_targets=None)
    plain = StepInputs([7], [4], [0], [], None, 1)
    plain.encode(buf)
    assert StepInputs.decode(buf) == plain


def test_graph_operations_and_the_replayed_graph_cross_with_the_step() -> None:
    ops = [GraphOp(RELEASE, BatchDescriptor(PIECEWISE, 64)), GraphOp(CAPTURE, BatchDescriptor(FULL, 4)),
           GraphOp(CAPTURE, BatchDescriptor(PIECEWISE, 16))]
    step = StepInputs([7, 8, 1, 2, 3], [4, 9], [0, 3], [ChunkSpec(5, 16, 3, True)], [-1, 1], 3,
                      graph_ops=ops, replay=BatchDescriptor(PIECEWISE, 8))
    buf = torch.zeros(StepInputs.capacity(4, 16), dtype=torch.long)
    step.encode(buf)
    assert StepInputs.decode(buf) == step
    eager = StepInputs([7], [4], [0], [], None, 1, graph_ops=ops[:1])
    eager.encode(buf)
    assert StepInputs.decode(buf) == eager and StepInputs.decode(buf).replay is None
    between = StepInputs.only_ops(ops)
    between.encode(buf)
    assert StepInputs.decode(buf) == between and not StepInputs.decode(buf).runs_forward


class _LoopbackChannel(StepChannel):
    """Both ends of a channel in one process: what one broadcast sends, the next receive reads."""

    def __init__(self, capacity: int) -> None:
        super().__init__(None, capacity)
        self.sent: list[torch.Tensor] = []
        self.receiving = False

    def _broadcast(self) -> None:
        if self.receiving:
            self.buf.copy_(self.sent.pop(0))
        else:
            self.sent.append(self.buf.clone())


def test_more_graph_operations_than_one_message_holds_arrive_in_order_before_the_step() -> None:
    channel = _LoopbackChannel(StepInputs.capacity(2, 8))
    ops = [GraphOp(CAPTURE if i % 3 else RELEASE, BatchDescriptor(FULL if i % 2 else PIECEWISE, i + 1))
           for i in range(2 * MAX_OPS + 3)]
    step = StepInputs([5, 6], [3, 4], [0, 1], [], None, 2, graph_ops=ops, replay=BatchDescriptor(FULL, 2))
    channel.send(step)
    channel.send(None)
    assert len(channel.sent) == 4  # two with ops only, the step with the last three, the stop
    channel.receiving = True
    assert channel.recv() == step
    assert channel.recv() is None



def test_the_llama_8b_builtin_is_llama_3_1_8b_and_splits_in_two() -> None:
    from service.model.llama import LlamaForCausalLM

    shape = BUILTIN_SHAPES["llama-8b"]
    spec = ModelSpec.from_hf_config(types.SimpleNamespace(**_hf_config(shape, 128000, 128001)))
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        4096, 14336, 32, 32, 8)
    assert spec.rope_scaling["factor"] == 8.0 and not spec.tie_word_embeddings
    whole = sum(p.numel() for p in LlamaForCausalLM(spec, "meta", torch.bfloat16).parameters())
    assert whole == 8_030_261_248  # Llama-3.1-8B's parameter count
    half = LlamaForCausalLM(spec, "meta", torch.bfloat16, tp=TensorParallel(1, 2))
    assert (half.spec.num_heads, half.spec.num_kv_heads, half.spec.intermediate_size) == (16, 4, 7168)
    norms = sum(p.numel() for n, p in half.named_parameters() if n.endswith("norm.weight"))
    assert sum(p.numel() for p in half.parameters()) - norms == (whole - norms) // 2
