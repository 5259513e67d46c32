"""Operator graph operations in the engine process with adapter slots (fake graphs on the CPU):
capture and evict of the LoRA graphs act on the LoRA family's graphs of the one cache, and a budget
set binds them all, its reply listing the evictions of both families (the LoRA ones as kinds
"full+lora" / "piecewise+lora")."""

from __future__ import annotations

import types
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from cache_manager import Fingerprint, GraphCache, GraphCacheConfig, GraphFamily, OpOutcome
from cache_manager.sizes import FULL
from cache_manager.testing import CountingStep, FakeGraphBackend
from service.engine_client.calls import Capture, EngineCall, Evict, ReadGraphMemory, SetBudget
from service.engine_client.host import EngineHost

SIZES = (1, 2, 4, 8)


class _InlineEngine:
    """Runs a call at once on the caller's thread: the test thread owns the caches here."""

    def call(self, fn) -> Future:  # noqa: ANN001
        future: Future = Future()
        future.set_result(fn())
        return future


def _cache(lora: bool = True) -> GraphCache:
    config = GraphCacheConfig("full", SIZES, 8, memory_budget=100_000)
    steps = {GraphFamily(FULL): CountingStep(8)} | ({GraphFamily(FULL, lora=True): CountingStep(8, name="lora")} if lora else {})
    fingerprint = Fingerprint("fake", "float32", "cpu", "-", SIZES, 8)
    return GraphCache(steps, config, torch.device("cpu"), fingerprint, FakeGraphBackend())


def _calls(graphs: GraphCache):
    reads = ThreadPoolExecutor(1)
    c = EngineHost(_InlineEngine(), types.SimpleNamespace(graphs=graphs), list, reads)
    yield c
    c.close()
    reads.shutdown()
    graphs.close()


@pytest.fixture
def calls():
    yield from _calls(_cache())


def call(c: EngineHost, request: EngineCall) -> object:
    """One call as the gRPC process makes it; the cache commits between steps (here: poll until idle)."""
    future = c.start(request)
    c.lr.graphs.wait_idle()
    return future.result(timeout=10)


def held(graphs: GraphCache, lora: bool) -> int:
    """What the graphs of one family hold now (the fake's bytes, measured at capture)."""
    return sum(b.bytes for b in graphs.snapshot().buckets if b.lora == lora and b.state.value == "captured")


def test_lora_kinds_act_on_the_lora_graphs(calls: EngineHost) -> None:
    graphs = calls.lr.graphs
    result = call(calls, Capture((2, 8), "full", lora=True))
    assert {s: r.outcome for s, r in result.items()} == {2: OpOutcome.CAPTURED, 8: OpOutcome.CAPTURED}
    assert held(graphs, lora=True) == 10_000 and held(graphs, lora=False) == 0
    call(calls, Capture((4,), "full"))
    assert call(calls, ReadGraphMemory())[1] == 14_000  # what counts against the one budget: every graph
    assert call(calls, Evict((8,), "full", lora=True))[8].outcome is OpOutcome.EVICTED
    assert held(graphs, lora=True) == 2000 and held(graphs, lora=False) == 4000


def test_a_budget_binds_lora_and_base_graphs_and_lists_the_evictions_of_both(calls: EngineHost) -> None:
    base = graphs = calls.lr.graphs
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
    assert graphs.budget_bytes == 5000
    assert graphs.used_bytes == held(graphs, lora=False) + held(graphs, lora=True) == 5000
    assert call(calls, ReadGraphMemory()) == (5000, 5000)
    assert call(calls, SetBudget(6000)) == {}  # everything fits: nothing evicted
    assert set(call(calls, SetBudget(2000))) == {(2, "full+lora"), (2, "full")}  # the rest by policy


def test_lora_kinds_without_adapter_slots_are_refused() -> None:
    for calls in _calls(_cache(lora=False)):
        with pytest.raises(ValueError, match="no adapter slots"):
            call(calls, Capture((8,), "full", lora=True))
