"""Piecewise CUDA graphs on a real GPU: the pieces of a token bucket captured on the capture thread
and replayed with eager attention between them equal the eager forward for mixed steps of varied
prompt, chunk and KV lengths (bf16 within tolerance, float32 greedy identical); padding writes only
the scratch slot; and every graph mode serves the same greedy streams through gRPC."""

from __future__ import annotations

import pytest
import torch

from cache_manager import BucketState, CudaGraphMode, GraphCache, GraphCacheConfig, GraphFamily
from service.engine.piecewise_step import PiecewiseStep
from service.model.kv_cache import NULL_BLOCK
from service.model.pieces import PiecewiseForward
from service.model.step_batch import ChunkSpec, build_step_batch
from tests.gpu.test_graph_cache import DEVICE, MAX_BATCH, fingerprint, model, new_kv, rel_err  # noqa: F401
from tests.support.server import generate, greedy, running_server

pytestmark = pytest.mark.gpu
MAX_TOKENS = 256


def cases() -> list[tuple[list[tuple[int, int]], list[ChunkSpec]]]:
    """(decodes as (position, slot), chunks): decode-only, prompt starts, continuations, a mix."""
    return [
        ([(9, 0), (17, 1), (40, 2)], []),
        ([], [ChunkSpec(3, 0, 37), ChunkSpec(4, 0, 5)]),
        ([(12, 0)], [ChunkSpec(5, 20, 30), ChunkSpec(6, 0, 64, sample=False)]),
        ([(50, 1), (33, 2)], [ChunkSpec(7, 20, 100)]),
    ]


def batch(kv, decodes, chunks, seed: int):  # noqa: ANN001, ANN201
    n = len(decodes) + sum(c.length for c in chunks)
    ids = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return build_step_batch([p for p, _ in decodes], [s for _, s in decodes], chunks, ids, kv.max_seq_len,
                            kv.scratch_slot, DEVICE)


def filled(kv) -> None:  # noqa: ANN001
    """Random K/V in every real slot, so decodes and continuations attend to something: every block
    but the null one (the contiguous layout gives each slot its own)."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    for t in (*kv.k, *kv.v):
        t[NULL_BLOCK + 1:].normal_(generator=gen)


def test_piecewise_replay_equals_eager_for_mixed_steps(model):  # noqa: F811
    check_piecewise_equals_eager(model)


def check_piecewise_equals_eager(model) -> None:  # noqa: ANN001, F811
    """Token buckets captured as pieces on the capture thread, replayed for each of cases(): the
    logits within bf16 tolerance of the eager forward, the same K/V written, padding only in the
    scratch slot."""
    kv, ref_kv = new_kv(), new_kv()
    filled(kv)
    for a, b in zip((*kv.k, *kv.v), (*ref_kv.k, *ref_kv.v)):
        b.copy_(a)
    step = PiecewiseStep(PiecewiseForward(model, kv), kv, MAX_TOKENS, DEVICE)
    cfg = GraphCacheConfig("piecewise", (8, 64, 128, 256), MAX_BATCH, memory_budget="4GiB", max_tokens=MAX_TOKENS)
    steps = {GraphFamily(CudaGraphMode.FULL): new_step_stub(model, kv), GraphFamily(CudaGraphMode.PIECEWISE): step}
    cache = GraphCache(steps, cfg, DEVICE, fingerprint())
    try:
        captured = cache.capture([8, 64, 128, 256], "piecewise")  # through the capture thread
        assert {r.outcome.value for r in captured.values()} == {"captured"}, captured
        for i, (decodes, chunks) in enumerate(cases()):
            b = batch(kv, decodes, chunks, i)
            step.write(b)
            hidden = cache.run(b.size, CudaGraphMode.PIECEWISE)
            got = model.logits(hidden[b.sample_rows])
            want = model.forward_step(batch(ref_kv, decodes, chunks, i), ref_kv)
            assert got.shape == want.shape and rel_err(got, want) < 2e-2, i
            for layer in range(len(kv.k)):  # same K/V written, and padding wrote only the scratch slot (the null block)
                ours, ref = kv.slot_view(kv.k[layer]), ref_kv.slot_view(ref_kv.k[layer])
                assert rel_err(ours[: kv.scratch_slot], ref[: kv.scratch_slot]) < 1e-2, (i, layer)
        entries = {b.size: b for b in cache.snapshot().buckets if b.kind == "piecewise"}
        assert all(e.state is BucketState.CAPTURED and e.bytes > 0 for e in entries.values())
        assert sum(e.since_start.replays for e in entries.values()) == len(cases())
    finally:
        cache.close()


def new_step_stub(model, kv):  # noqa: ANN001, ANN201, F811
    from service.engine.decode_step import ModelDecodeStep

    return ModelDecodeStep(model, kv, MAX_BATCH, DEVICE)


PROMPTS = ["Once upon a time", "The graph cache captures", "A" * 300]  # the last spans several 64-token chunks


@pytest.fixture(scope="module")
def reference_streams(model_cache_dir) -> list[tuple]:  # noqa: ANN001
    return streams(model_cache_dir, "none")


def streams(model_cache_dir, mode: str, *extra: str) -> list[tuple]:  # noqa: ANN001
    argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "float32",
            "--model", "builtin:tiny", "--cudagraph-mode", mode, "--max-running-seqs", "8",
            "--max-num-batched-tokens", "64", "--max-seq-len", "512", *extra]
    out = []
    with running_server(argv) as server:
        stub = server.stub()
        for _ in range(2):  # the second pass replays what the first captured
            for prompt in PROMPTS:
                chunks, finished = generate(stub, **greedy(prompt, 24))
                out.append(([t for c in chunks for t in c.token_ids], finished.finish_reason))
    return out


@pytest.mark.parametrize("mode", ["full", "piecewise", "FULL_AND_PIECEWISE"])
def test_every_mode_streams_what_eager_streams(model_cache_dir, reference_streams, mode):  # noqa: ANN001
    assert streams(model_cache_dir, mode) == reference_streams
