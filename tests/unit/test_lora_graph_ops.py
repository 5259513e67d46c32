"""Operator graph operations in the engine process with adapter slots (fake graphs on the CPU):
capture and evict of the LoRA graphs act on the LoRA graph cache, and a budget set binds both
caches, its reply listing the evictions of both (the LoRA ones as kinds "full+lora" / "piecewise+lora")."""

from __future__ import annotations

import types
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from cache_manager import Fingerprint, GraphCache, GraphCacheConfig, OpOutcome
from cache_manager.testing import CountingStep, FakeGraphBackend
from service.server.engine_calls import EngineCalls
from service.server.engine_messages import Capture, EngineCall, Evict, ReadGraphMemory, SetBudget

SIZES = (1, 2, 4, 8)


class _InlineEngine:
    """Runs a call at once on the caller's thread: the test thread owns the caches here."""

    def call(self, fn) -> Future:  # noqa: ANN001
        future: Future = Future()
        future.set_result(fn())
        return future


def _cache(step: CountingStep, backend: FakeGraphBackend) -> GraphCache:
    config = GraphCacheConfig("full", SIZES, 8, memory_budget=100_000)
    return GraphCache(step, config, torch.device("cpu"), Fingerprint("fake", "float32", "cpu", "-", SIZES, 8), backend)


@pytest.fixture
def calls():
    base, lora = _cache(CountingStep(8), FakeGraphBackend()), _cache(CountingStep(8), FakeGraphBackend())
    base.share_budget_with(lora)
    reads = ThreadPoolExecutor(1)
    c = EngineCalls(_InlineEngine(), types.SimpleNamespace(graphs=base, lora_graphs=lora), list, reads)
    yield c
    c.close()
    reads.shutdown()
    base.close()
    lora.close()


def call(c: EngineCalls, request: EngineCall) -> object:
    """One call as the gRPC process makes it; the caches commit between steps (here: poll until idle)."""
    future = c.start(request)
    c.lr.graphs.wait_idle()
    if c.lr.lora_graphs is not None:
        c.lr.lora_graphs.wait_idle()
    return future.result(timeout=10)


def test_lora_kinds_act_on_the_lora_cache(calls: EngineCalls) -> None:
    base, lora = calls.lr.graphs, calls.lr.lora_graphs
    result = call(calls, Capture((2, 8), "full", lora=True))
    assert {s: r.outcome for s, r in result.items()} == {2: OpOutcome.CAPTURED, 8: OpOutcome.CAPTURED}
    assert lora.used_bytes == 10_000 and base.used_bytes == 0
    call(calls, Capture((4,), "full"))
    assert call(calls, ReadGraphMemory())[1] == 14_000  # what counts against the one budget: both caches
    assert call(calls, Evict((8,), "full", lora=True))[8].outcome is OpOutcome.EVICTED
    assert lora.used_bytes == 2000 and base.used_bytes == 4000


def test_a_budget_binds_both_caches_and_lists_both_caches_evictions(calls: EngineCalls) -> None:
    base, lora = calls.lr.graphs, calls.lr.lora_graphs
    call(calls, Capture((1, 2, 4), "full"))
    call(calls, Capture((2, 8), "full", lora=True))
    for n in (1, 2, 4, 1, 2, 4):  # the base graphs are hot; the LoRA ones were never replayed
        base.run(n)
    # 17_000 held, 12_000 over: the cold LoRA graph of 8, then the base graph of 4 (the fewest replays
    # per byte among the base ones) free it exactly.
    result = call(calls, SetBudget(5000))
    assert set(result) == {(8, "full+lora"), (4, "full")}
    assert all(r.outcome is OpOutcome.EVICTED for r in result.values())
    assert result[(8, "full+lora")].bytes == 8000 and result[(4, "full")].bytes == 4000
    assert base.budget_bytes == lora.budget_bytes == 5000
    assert base.used_bytes + lora.used_bytes == 5000
    assert call(calls, ReadGraphMemory()) == (5000, 5000)
    assert call(calls, SetBudget(6000)) == {}  # everything fits: nothing evicted
    assert set(call(calls, SetBudget(2000))) == {(2, "full+lora"), (2, "full")}  # the rest by policy


def test_lora_kinds_without_adapter_slots_are_refused(calls: EngineCalls) -> None:
    calls.lr.lora_graphs = None
    with pytest.raises(ValueError, match="no adapter slots"):
        call(calls, Capture((8,), "full", lora=True))
