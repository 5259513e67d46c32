"""Operator graph operations in the engine process with adapter slots (fake graphs on the CPU):
capture and evict of kinds "full+lora" / "piecewise+lora" act on the LoRA graph cache, and a budget
set binds both caches, its reply listing the evictions of both."""

from __future__ import annotations

import queue
import types
from concurrent.futures import Future

import pytest
import torch

from cache_manager import Fingerprint, GraphCache, GraphCacheConfig, OpOutcome
from cache_manager.testing import CountingStep, FakeGraphBackend
from service.config import ServeConfig
from service.server.engine_worker import RESULT, WorkerSpec, _Worker

SIZES = (1, 2, 4, 8)


class _InlineEngine:
    """Runs a call at once on the caller's thread: the test thread owns the caches here."""

    def call(self, fn) -> Future:  # noqa: ANN001
        future: Future = Future()
        future.set_result(fn())
        return future


class _Pipe:
    def __init__(self) -> None:
        self.sent: queue.Queue = queue.Queue()

    def send(self, message: tuple) -> None:
        self.sent.put(message)


def _cache(step: CountingStep, backend: FakeGraphBackend) -> GraphCache:
    config = GraphCacheConfig("full", SIZES, 8, memory_budget=100_000)
    return GraphCache(step, config, torch.device("cpu"), Fingerprint("fake", "float32", "cpu", "-", SIZES, 8), backend)


@pytest.fixture
def worker():
    base, lora = _cache(CountingStep(8), FakeGraphBackend()), _cache(CountingStep(8), FakeGraphBackend())
    base.share_budget_with(lora)
    w = _Worker(_Pipe(), spec=WorkerSpec(ServeConfig(), faults=None))
    w.engine, w.graphs, w.runner = _InlineEngine(), base, types.SimpleNamespace(lora_graphs=lora)
    yield w
    w.replies.shutdown()
    base.close()
    lora.close()


def call(w: _Worker, name: str, *args: object) -> object:
    """One call as the gRPC process makes it; the caches commit between steps (here: poll until idle)."""
    w.call(7, name, args)
    w.graphs.wait_idle()
    w.runner.lora_graphs.wait_idle()
    tag, call_id, ok, value = w.conn.sent.get(timeout=10)
    assert (tag, call_id) == (RESULT, 7)
    if not ok:
        raise value
    return value


def test_lora_kinds_act_on_the_lora_cache(worker: _Worker) -> None:
    base, lora = worker.graphs, worker.runner.lora_graphs
    result = call(worker, "capture", [2, 8], "full+lora")
    assert {s: r.outcome for s, r in result.items()} == {2: OpOutcome.CAPTURED, 8: OpOutcome.CAPTURED}
    assert lora.used_bytes == 10_000 and base.used_bytes == 0
    call(worker, "capture", [4], "full")
    assert call(worker, "used_bytes") == 14_000  # what counts against the one budget: both caches
    assert call(worker, "evict", [8], "full+lora")[8].outcome is OpOutcome.EVICTED
    assert lora.used_bytes == 2000 and base.used_bytes == 4000


def test_a_budget_binds_both_caches_and_lists_both_caches_evictions(worker: _Worker) -> None:
    base, lora = worker.graphs, worker.runner.lora_graphs
    call(worker, "capture", [1, 2, 4], "full")
    call(worker, "capture", [2, 8], "full+lora")
    for n in (1, 2, 4, 1, 2, 4):  # the base graphs are hot; the LoRA ones were never replayed
        base.run(n)
    # 17_000 held, 12_000 over: the cold LoRA graph of 8, then the base graph of 4 (the fewest replays
    # per byte among the base ones) free it exactly.
    result = call(worker, "set_budget", 5000)
    assert set(result) == {(8, "full+lora"), (4, "full")}
    assert all(r.outcome is OpOutcome.EVICTED for r in result.values())
    assert result[(8, "full+lora")].bytes == 8000 and result[(4, "full")].bytes == 4000
    assert base.budget_bytes == lora.budget_bytes == 5000 == call(worker, "budget_bytes")
    assert base.used_bytes + lora.used_bytes == 5000 == call(worker, "used_bytes")
    assert call(worker, "set_budget", 6000) == {}  # everything fits: nothing evicted
    assert set(call(worker, "set_budget", 2000)) == {(2, "full+lora"), (2, "full")}  # the rest by policy


def test_lora_kinds_without_adapter_slots_are_refused(worker: _Worker) -> None:
    worker.runner = types.SimpleNamespace(lora_graphs=None)
    with pytest.raises(ValueError, match="no adapter slots"):
        call(worker, "capture", [8], "full+lora")
