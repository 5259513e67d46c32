"""Speculative decoding beside LoRA adapters, with the graph cache in mode full_and_piecewise (a fake
backend replays eagerly, padded, as graphs would be replayed): adapter rows decode without drafts
in the same steps as verify rows, verify steps are dispatched as PIECEWISE steps of their token
count, and every request's tokens equal those without speculation."""

from __future__ import annotations

import pathlib
import time

import pytest

from cache_manager import CudaGraphMode, EngineHooks, GraphCacheConfig
from service.engine.adapters import AdapterRegistry
from service.engine.engine import Engine
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.model.lora import read_adapter
from tests.support.lora import make_adapter
from tests.unit.test_lora_graphs import PerStepFakeBackend, replays
from tests.unit.test_overlap import Results
from tests.unit.test_spec_decode import Oracle

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SLOTS, MAX_SEQ, MAX_TOKENS, NEW = 4, 128, 64, 24
JOBS = [([766, 5, 6, 7, 8], ""), ([766, 11, 12], "a"), ([766, 20, 21, 22, 23, 24], ""), ([766, 30, 31, 32], "a")]


def serve(loaded, adapter_dir: pathlib.Path, proposer=None):  # noqa: ANN001, ANN201
    config = GraphCacheConfig(mode=CudaGraphMode.FULL_AND_PIECEWISE, capture_sizes=None, max_batch=SLOTS,
                              max_tokens=MAX_TOKENS)
    hooks = EngineHooks()
    runner = ModelRunner(loaded, SLOTS, MAX_SEQ, config, graph_backend=PerStepFakeBackend(), max_loras=2,
                         max_lora_rank=8, hooks=hooks)
    registry = AdapterRegistry(2, runner.lora)
    registry.register(read_adapter("a", adapter_dir, loaded.spec, 8))
    scheduler = Scheduler(SLOTS, MAX_TOKENS, adapters=registry, proposer=proposer,
                          num_speculative_tokens=4 if proposer is not None else 0)
    engine = Engine(runner, scheduler, loaded.tokenizer, frozenset(loaded.spec.eos_token_ids))
    hooks.attach(engine)
    out = Results()
    for i, (prompt, adapter) in enumerate(JOBS):
        request = GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                                                    seed=0), arrival_time=time.monotonic(), adapter=adapter)
        engine.submit(request, out.sink(request.request_id))
    engine.start()
    try:
        out.wait([f"r{i}" for i in range(len(JOBS))], timeout=300)
    finally:
        engine.stop()
    snap = runner.graphs.snapshot()
    runner.graphs.close()
    return out, engine.spec_stats, snap


def test_adapter_rows_decode_beside_verify_rows_and_outputs_equal_off(loaded, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    adapter_dir = make_adapter(loaded.path, tmp_path / "a", seed=31, r=4)
    off, _, _ = serve(loaded, adapter_dir)
    references = [prompt + off.tokens[f"r{i}"] for i, (prompt, _) in enumerate(JOBS)]
    oracle = Oracle(references, corrupt=3)
    on, stats, snap = serve(loaded, adapter_dir, oracle)
    for i in range(len(JOBS)):
        assert off.summary(f"r{i}") == on.summary(f"r{i}"), i
    assert oracle.asked == {"r0", "r2"}  # adapter requests are refused speculation
    # Only the base rows speculated (20+ accepted tokens each of 2 rows); their steps ran as pieces.
    assert stats.accepted > 20 and stats.drafts <= 2 * NEW
    assert replays(snap, "piecewise", lora=True) > 0
