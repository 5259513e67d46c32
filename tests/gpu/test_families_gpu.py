"""The new families on a real GPU: the fused MoE kernels against the torch path (bf16 and FP8 experts,
per channel and per 128 x 128 block, at every padded size a step can have), the families' fast
paths enabled, and CUDA graph replay (FULL decode graphs at every capture size, PIECEWISE graphs of
mixed steps) against eager on the same inputs, the MoE models' replays routing their tokens to other
experts than the capture's inputs did.

Run: python -m pytest tests/gpu/test_families_gpu.py -q -rs
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256]
MAX_SEQ = 256
PROMPT_LEN = 20
# Real expert shapes: Qwen3-30B-A3B's (128 experts of 768 over 2048, top 8) and Mixtral-8x7B's scaled
# to a quarter (8 experts of 3584 over 1024, top 2)
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, True, 2048, 768), "mixtral-quarter": (8, 2, True, 1024, 3584)}
TOKENS = [1, 2, 3, 8, 16, 31, 64, 65, 128, 200, 256, 512, 2048]


@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
@pytest.mark.parametrize("weights", ["bf16", "fp8-channel", "fp8-block"])
def test_fused_moe_matches_the_torch_path_at_every_padded_size(shape, weights):
    from service.model.kernels.fast_path import check_moe

    experts, top_k, renorm, hidden, inter = MOE_SHAPES[shape]
    fp8 = weights != "bf16"
    check_moe(DEVICE, torch.bfloat16, experts, top_k, renorm, hidden=hidden, intermediate=inter, token_counts=TOKENS,
              fp8=fp8, block=(128, 128) if weights == "fp8-block" else None)
    check_moe(DEVICE, torch.bfloat16, experts, top_k, renorm, act="gelu_tanh", hidden=256, intermediate=128,
              token_counts=(1, 64, 300), fp8=fp8)


def _family_spec(name: str):  # noqa: ANN202 - ModelSpec
    """A GPU-sized model of the family: the real one's switches, a few layers of 512."""
    from service.model.builtin import BUILTIN_SHAPES, _hf_config
    from service.model.spec import ModelSpec

    shape = {**BUILTIN_SHAPES[f"tiny-{name}"], "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 4096}
    if "moe_intermediate_size" in shape:
        shape["moe_intermediate_size"] = 256
    if name == "gemma3":
        shape.update(sliding_window=16, query_pre_attn_scalar=64)  # windows shorter than the contexts
    return ModelSpec.from_hf_config(types.SimpleNamespace(**_hf_config(shape, 1, 2)))


def make_model(name: str, fp8: bool = False):  # noqa: ANN201
    from service.model.builtin import random_init
    from service.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(_family_spec(name), DEVICE, torch.bfloat16)
    random_init(model, 0.05, torch.Generator(DEVICE).manual_seed(0))
    if fp8:
        model.use_fp8()
    return model.eval()


FAMILIES = ["qwen3", "gemma3", "qwen3-moe", "mixtral"]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_fast_path_kernel_of_the_family_passes_its_check(name):
    model = make_model(name)
    assert all(v for k, v in vars(model.fast).items() if k != "moe" or model.spec.is_moe), model.fast


class Experts:
    """Records which experts the first MoE layer's router picks (eager runs only: hooks do not replay).
    While a graph is captured the hook records nothing: reading the picks to the host is a sync, which
    a capturing stream refuses (the capture then fails)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        from service.model.moe import SparseMoe

        moe = next((layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)), None)
        self.picked: list[set[int]] = []
        if moe is not None:
            def record(module, args, out) -> None:  # noqa: ANN001
                if not torch.cuda.is_current_stream_capturing():
                    self.picked.append(set(torch.topk(out.float(), moe.top_k, dim=-1).indices.flatten().tolist()))

            moe.gate.register_forward_hook(record)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_full_decode_graphs_replay_as_eager_at_every_size(name, fp8):
    """A decode graph per capture size, captured on the warm-up's inputs (every row token 0 at
    position 0 of the scratch slot: one routing for all), replayed on live rows at other positions
    (other experts): the replay's logits are eager's on the same inputs and caches."""
    from service.engine.decode_step import ModelDecodeStep
    from service.model.kv_cache import KVCache

    model = make_model(name, fp8)
    experts = Experts(model)
    slots = max(CAPTURE_SIZES)
    kvs = [KVCache(model.spec, slots, MAX_SEQ, DEVICE, torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    first = []
    for slot in range(slots):
        ids = torch.randint(0, model.spec.vocab_size, (PROMPT_LEN,), generator=gen).to(DEVICE)
        for kv in kvs:
            logits = model.prefill(ids, slot, kv)
        first.append(int(logits.argmax()))
    graph_step, eager_step = (ModelDecodeStep(model, kv, slots, DEVICE) for kv in kvs)
    stream = torch.cuda.Stream()
    for size in CAPTURE_SIZES:
        graph_step.set_padding_rows(0, size)
        experts.picked.clear()
        with torch.cuda.stream(stream):
            graph_step.run(size)  # warm-up on the padding rows
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = graph_step.run(size)
        capture_picks = set().union(*experts.picked) if experts.picked else set()
        rows = list(range(size))
        rerouted = False
        for step in range(2):
            positions = [PROMPT_LEN + step] * size
            tokens = [(first[r] + step) % model.spec.vocab_size for r in rows]  # an argmax may be the last id
            for s in (graph_step, eager_step):
                s.write_rows(tokens, positions, rows)
            experts.picked.clear()
            want = eager_step.run(size)
            graph.replay()
            torch.cuda.synchronize()
            err = float((out.float() - want.float()).norm() / want.float().norm())
            assert err < 2e-2, (name, size, step, err)
            assert torch.equal(out.argmax(-1), want.argmax(-1)) or err < 5e-3, (name, size, step)
            rerouted |= bool(experts.picked) and set().union(*experts.picked) != capture_picks
        # a row or two may pick the capture's experts by chance; four and more rows never did
        assert rerouted or not model.spec.is_moe or size < 4, (name, size, "the replays routed like the capture")
        del graph


@pytest.mark.parametrize("name", FAMILIES)
def test_piecewise_graphs_replay_as_eager_for_mixed_steps(name):
    """A mixed step (decodes, a prompt start, a prompt continuation past the window) through the
    pieces captured as graphs per token bucket, attention eager between them: its logits are the
    unsplit eager forward's on the same inputs."""
    from service.engine.piecewise_step import PiecewiseStep
    from service.model.kv_cache import KVCache
    from service.model.pieces import PiecewiseForward
    from service.model.step_batch import ChunkSpec, build_step_batch

    model = make_model(name)
    kvs = [KVCache(model.spec, 8, MAX_SEQ, DEVICE, torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.spec.vocab_size, (40,), generator=gen).tolist() for _ in range(4)]
    for kv in kvs:  # slots 0, 1 decode; slot 2 continues its prompt from 24
        for slot in (0, 1):
            model.prefill(torch.tensor(prompts[slot], device=DEVICE), slot, kv)
        model.prefill(torch.tensor(prompts[2][:24], device=DEVICE), 2, kv)
    step = PiecewiseStep(PiecewiseForward(model, kvs[0]), kvs[0], 256, DEVICE)
    chunks = [ChunkSpec(2, 24, 16), ChunkSpec(3, 0, 30)]
    ids = [prompts[0][-1], prompts[1][-1], *prompts[2][24:], *prompts[3][:30]]
    for bucket in (64, 256):
        batches = [build_step_batch([40, 40], [0, 1], chunks, ids, MAX_SEQ, kv.scratch_slot, DEVICE, pad_to=bucket)
                   for kv in kvs]
        step.write(batches[0])
        step.set_padding_rows(batches[0].attention.num_tokens, bucket)
        segments = step.segments(bucket)
        graphs = []
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            segments.run()  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        for piece in segments.pieces:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                piece()
            graphs.append(g)
        # rewrite the KV the warm-up wrote, then replay: pieces as graphs, attention eager
        step.write(batches[0])
        for i, g in enumerate(graphs):
            g.replay()
            if i < len(segments.between):
                segments.between[i]()
        got = model.logits(segments.output()[batches[0].sample_rows])
        want = model.forward_step(batches[1], kvs[1])
        torch.cuda.synchronize()
        err = float((got - want).norm() / want.norm())
        assert err < 2e-2, (name, bucket, err)
