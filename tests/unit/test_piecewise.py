"""Piecewise graphs' logic on the CPU: the PiecewiseStep (static buffers, padding, pieces with
attention between them) equals the unsplit forward; its segments, run as a replay runs them, equal
its eager run; and through the engine the dispatcher sends uniform decode to FULL graphs and any
other step to PIECEWISE ones (a fake backend stands in for CUDA graphs and replays eagerly, padded),
with the same tokens in every mode."""

from __future__ import annotations

import time

import pytest
import torch

from cache_manager import BucketState, CudaGraphMode, GraphCacheConfig
from cache_manager.testing import FakeGraphBackend
from service.engine.engine import Engine
from service.engine.piecewise_step import PiecewiseStep
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.model.kv_cache import KVCache
from service.model.pieces import PiecewiseForward
from service.model.step_batch import ChunkSpec
from tests.unit.test_chunked_prefill import batch_of, new_cache, prompt
from tests.unit.test_overlap import Results

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_TOKENS = 64


def mixed_batch(kv: KVCache) -> tuple:
    """Two decodes (slots 0, 1 at positions 5 and 9, their KV filled by prefills) and a prompt chunk
    (slot 2) continuing a prompt whose first 6 tokens are in the KV."""
    return batch_of(kv, [(7, 5, 0), (11, 9, 1)], [(prompt(10, 3)[6:], ChunkSpec(2, 6, 4))])


def filled_cache(model, kv: KVCache) -> None:  # noqa: ANN001
    for slot, (n, seed) in enumerate([(5, 1), (9, 2), (6, 3)]):
        model.forward_step(batch_of(kv, [], [(prompt(n, seed), ChunkSpec(slot, 0, n))]), kv)


@pytest.mark.parametrize("padding", [0, 5])
def test_piecewise_step_equals_the_unsplit_forward_padded_or_not(random_llama, padding):
    kv, ref_kv = new_cache(random_llama), new_cache(random_llama)
    filled_cache(random_llama, kv)
    filled_cache(random_llama, ref_kv)
    step = PiecewiseStep(PiecewiseForward(random_llama, kv), kv, MAX_TOKENS, torch.device("cpu"))
    batch = mixed_batch(kv)
    n = batch.size
    step.write(batch)
    step.set_padding_rows(n, n + padding)
    hidden = step.run(n + padding)
    got = random_llama.logits(hidden[batch.sample_rows])
    want = random_llama.forward_step(mixed_batch(ref_kv), ref_kv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(step.attn_out[n: n + padding], torch.zeros_like(step.attn_out[n: n + padding]))
    for layer in range(len(kv.k)):  # the padding rows wrote only the scratch slot (the null block)
        torch.testing.assert_close(kv.slot_view(kv.k[layer])[:kv.scratch_slot],
                                   ref_kv.slot_view(ref_kv.k[layer])[:kv.scratch_slot], atol=1e-5, rtol=0)


def test_segments_run_as_a_replay_runs_them_equal_the_eager_run(random_llama):
    """What the CUDA backend records: L + 1 pieces over the serving buffers with attention between
    them reading the batch given to `write` at replay time, not at capture time."""
    kv = new_cache(random_llama)
    filled_cache(random_llama, kv)
    step = PiecewiseStep(PiecewiseForward(random_llama, kv), kv, MAX_TOKENS, torch.device("cpu"))
    segments = step.segments(16)
    assert len(segments.pieces) == len(random_llama.model.layers) + 1 == len(segments.between) + 1
    batch = mixed_batch(kv)
    step.write(batch)
    step.set_padding_rows(batch.size, 16)
    for i, piece in enumerate(segments.pieces):
        piece()
        if i < len(segments.between):
            segments.between[i]()
    replayed = segments.output()
    kv2 = new_cache(random_llama)
    filled_cache(random_llama, kv2)
    want = random_llama.forward_step(mixed_batch(kv2), kv2)
    torch.testing.assert_close(random_llama.logits(replayed[batch.sample_rows]), want, atol=1e-5, rtol=1e-5)
    assert step.run_scratch(16).shape == replayed.shape  # the warm-up: same shapes, private inputs


SLOTS, MAX_SEQ = 4, 256


def run_engine(loaded, mode: CudaGraphMode, sizes: tuple[int, ...] | None = None, prepare: bool = False):  # noqa: ANN001, F811
    config = GraphCacheConfig(mode=mode, capture_sizes=sizes, max_batch=SLOTS, max_tokens=MAX_TOKENS)
    runner = ModelRunner(loaded, SLOTS, MAX_SEQ, config, graph_backend=FakeGraphBackend())
    engine = Engine(runner, Scheduler(SLOTS, MAX_TOKENS), loaded.tokenizer, frozenset(loaded.spec.eos_token_ids))
    runner.graphs.hooks.attach(engine)
    if prepare:  # as a server's start does: the largest graph of each kind before the first step
        runner.graphs.prepare(timeout_s=60)
    greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=12, ignore_eos=True)
    prompts = [prompt(n, seed) for n, seed in [(5, 1), (40, 2), (3, 3), (100, 4), (12, 5)]]  # 100: chunked over steps
    out = Results()
    for i, p in enumerate(prompts):
        request = GenerationRequest(f"r{i}", p, greedy,
                                    arrival_time=time.monotonic())
        engine.submit(request, out.sink(request.request_id))
    engine.start()
    out.wait([f"r{i}" for i in range(len(prompts))], timeout=120)
    engine.stop()
    snap = runner.graphs.snapshot()
    runner.graphs.close()
    return {f"r{i}": out.summary(f"r{i}") for i in range(len(prompts))}, snap


def replays(snap, kind: str) -> int:  # noqa: ANN001
    return sum(b.since_start.replays for b in snap.buckets if b.kind == kind)


def test_dispatcher_sends_decode_to_full_and_other_steps_to_piecewise_with_the_same_tokens(loaded):  # noqa: F811
    eager, snap_none = run_engine(loaded, CudaGraphMode.NONE)
    # Prepared: the prompt steps, all in the first steps, replay graphs instead of racing their captures.
    both, snap_both = run_engine(loaded, CudaGraphMode.FULL_AND_PIECEWISE, prepare=True)
    full, snap_full = run_engine(loaded, CudaGraphMode.FULL, prepare=True)
    pieces, snap_pieces = run_engine(loaded, CudaGraphMode.PIECEWISE, prepare=True)
    assert eager == both == full == pieces
    assert snap_none.mode == "none" and replays(snap_none, "full") == replays(snap_none, "piecewise") == 0
    # full_and_piecewise: decode-only steps replay FULL graphs, steps with a prompt chunk PIECEWISE ones
    assert replays(snap_both, "full") > 0 and replays(snap_both, "piecewise") > 0
    assert {b.kind for b in snap_both.buckets} == {"full", "piecewise"}
    # full: prompt steps run eagerly outside the cache; piecewise: every step runs as pieces
    assert replays(snap_full, "full") > 0 and all(b.kind == "full" for b in snap_full.buckets)
    assert replays(snap_pieces, "piecewise") > 0 and all(b.kind == "piecewise" for b in snap_pieces.buckets)
    captured = {(b.kind, b.size) for b in snap_both.buckets if b.state is BucketState.CAPTURED}
    assert ("piecewise", 64) in captured  # the 100-token prompt's 64-token chunks


def test_steps_above_the_largest_piecewise_size_run_eagerly(loaded):  # noqa: F811
    tokens, snap = run_engine(loaded, CudaGraphMode.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8))
    eager, _ = run_engine(loaded, CudaGraphMode.NONE)
    assert tokens == eager
    above = [r for r in snap.requested_detail if r.kind == "piecewise" and r.size > 8]
    assert above and all(r.eager_fallbacks == {"above_max": r.requests} for r in above)
    assert all(b.kind == "full" for b in snap.buckets if b.state is BucketState.CAPTURED)
