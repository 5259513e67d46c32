"""LoRA batches and the graph cache on the CPU (a fake backend stands in for CUDA graphs and replays
eagerly, padded): base-only steps replay base graphs and never a LoRA one; steps with any adapter row
replay the LoRA family's graphs (FULL for uniform decode, PIECEWISE for the rest); adapters taking
turns on the slots never cause a recapture; tokens equal peft's. And the LoRA piecewise step's
segments, run as a replay runs them, equal the unsplit forward with the rows' adapters."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest
import torch

from cache_manager import CudaGraphMode, EngineHooks, GraphCacheConfig
from cache_manager.testing import FakeGraphBackend
from service.engine.adapters import AdapterRegistry
from service.engine.engine import Engine
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.model.lora import read_adapter
from tests.support.lora import make_adapter, peft_greedy
from tests.unit.test_overlap import Results

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SLOTS, MAX_SEQ, MAX_TOKENS, NEW = 4, 128, 64, 8
PROMPTS = [[766, 5, 6, 7, 8], [766, 11, 12], [766, 20, 21, 22, 23, 24], [766, 30, 31, 32]]


class PerStepFakeBackend(FakeGraphBackend):
    """The fake backend of base and LoRA graphs: held per (step, size), as the two families' steps
    have the same sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def capture(self, step, size: int):  # noqa: ANN001, ANN201
        with self.lock:  # the capture thread's, the test thread's reads
            graph = super().capture(step, size)
            self.live[(id(step), size)] = self.live.pop(size)
        return graph

    def release(self, graph, after: object = None) -> int:  # noqa: ANN001
        with self.lock:
            self.released.append(graph.size)
            return self.live.pop((id(graph.step), graph.size))


def replays(snap, kind: str = "full", lora: bool = False) -> int:  # noqa: ANN001
    return sum(b.since_start.replays for b in snap.buckets if b.kind == kind and b.lora == lora)


def test_base_and_lora_batches_use_their_own_graphs(loaded, tmp_path: pathlib.Path) -> None:  # noqa: F811
    paths = {name: make_adapter(loaded.path, tmp_path / name, seed=30 + i, r=4 if i else 8)
             for i, name in enumerate(["a", "b", "c"])}
    config = GraphCacheConfig(mode=CudaGraphMode.FULL_AND_PIECEWISE, capture_sizes=None, max_batch=SLOTS,
                              max_tokens=MAX_TOKENS)
    hooks = EngineHooks()
    runner = ModelRunner(loaded, SLOTS, MAX_SEQ, config, graph_backend=PerStepFakeBackend(), max_loras=2, max_lora_rank=8,
                         hooks=hooks)
    registry = AdapterRegistry(2, runner.lora)
    for name, path in paths.items():
        registry.register(read_adapter(name, path, loaded.spec, 8))
    engine = Engine(runner, Scheduler(SLOTS, MAX_TOKENS, adapters=registry), loaded.tokenizer,
                    frozenset(loaded.spec.eos_token_ids))
    hooks.attach(engine)
    engine.start()
    out = Results()

    def serve(jobs: list[tuple[list[int], str]], tag: str) -> None:
        ids = []
        for i, (p, adapter) in enumerate(jobs):
            request = GenerationRequest(f"{tag}{i}", p,
                                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, seed=0),
                                        arrival_time=time.monotonic(),
                                        adapter=adapter)
            engine.submit(request, out.sink(request.request_id))
            ids.append(request.request_id)
        out.wait(ids, timeout=120)
        for rid, (p, adapter) in zip(ids, jobs):
            assert out.tokens[rid] == peft_greedy(loaded.path, paths[adapter] if adapter else None, p, NEW), rid

    try:
        serve([(p, "") for p in PROMPTS], "base")
        serve([(p, "") for p in PROMPTS], "base-again")  # the first prompt step captured, this one replays
        base_only = runner.graphs.snapshot()
        assert replays(base_only) > 0 and replays(base_only, "piecewise") > 0
        assert replays(base_only, lora=True) == 0
        # Three adapters on two slots, with base rows: they take turns (LRU) within one run.
        serve(list(zip(PROMPTS, ["a", "", "b", "c"])), "mixed")
        serve(list(zip(PROMPTS, ["c", "a", "", "b"])), "again")
        serve(list(zip(PROMPTS, ["b", "c", "a", ""])), "third")
    finally:
        engine.stop()
    snap = runner.graphs.snapshot()
    assert replays(snap, lora=True) > 0 and replays(snap, "piecewise", lora=True) > 0
    # Every step after the base-only ones had adapter rows: the base graphs replayed nothing more.
    assert replays(snap) == replays(base_only) and replays(snap, "piecewise") == replays(base_only, "piecewise")
    # Swapping adapters in and out of slots never recaptured a LoRA graph.
    assert all(b.since_start.captures <= 1 for b in snap.buckets if b.lora)
    runner.graphs.close()


def test_lora_piecewise_segments_equal_the_forward_with_adapters(loaded, tmp_path: pathlib.Path) -> None:  # noqa: F811
    from service.engine.piecewise_step import LoraPiecewiseStep, PiecewiseStep
    from service.model.kv_cache import KVCache
    from service.model.lora import LoraSlots, lora_tokens
    from service.model.pieces import PiecewiseForward
    from service.model.step_batch import ChunkSpec, build_step_batch

    model = loaded.model
    lora = LoraSlots(model, 2, 8)
    for slot, seed in ((1, 41), (2, 42)):
        path = make_adapter(loaded.path, tmp_path / f"s{slot}", seed=seed)
        lora.load(slot, read_adapter(path.name, path, loaded.spec, 8))
    rows = [1, 1, 1, 0, 0, 2, 2, 2, 2]  # three prompts: slot 1, base, slot 2

    def batch(kv: KVCache):  # noqa: ANN202
        chunks = [ChunkSpec(0, 0, 3), ChunkSpec(1, 0, 2), ChunkSpec(2, 0, 4)]
        return build_step_batch([], [], chunks, [766, 5, 6, 766, 9, 766, 20, 21, 22], kv.max_seq_len, kv.scratch_slot,
                                kv.k[0].device, lora_slots=rows)

    kv, ref_kv = (KVCache(loaded.spec, 4, 64, loaded.device, loaded.dtype) for _ in range(2))
    step = LoraPiecewiseStep(PiecewiseStep(PiecewiseForward(model, kv), kv, 16, loaded.device), lora)
    b = batch(kv)
    step.write(b)
    step.set_padding_rows(b.size, 16)
    segments = step.segments(16)
    for i, piece in enumerate(segments.pieces):
        piece()
        if i < len(segments.between):
            segments.between[i]()
    got = model.logits(segments.output()[b.sample_rows])
    ref = batch(ref_kv)
    with lora_tokens(ref.lora_slots, lora):
        want = model.forward_step(ref, ref_kv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert step.run_scratch(16).shape == segments.output().shape

