"""EngineControl: the gRPC process's typed control of the engine, what the admin servicer, the
metrics and FlushCache ask of it: the graph cache's reads and operations, the adapters, the prefix
cache, the engine's metric families.

Each method is one call into the engine process (engine_messages.EngineCall, run there as
engine_calls.py says) and blocks until its reply, so none runs on the event loop; `call` runs a
function of them on a thread of this process, one at a time (the admin operations). The facts
fixed at start (the graph cache's sizes and device, the adapter slots) are answered here, as are
the names of the loaded adapters, which Generate checks without a call.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from service.engine_client.messages import (
    Capture,
    EngineCall,
    Evict,
    ListAdapters,
    LoadAdapter,
    ReadGraphMemory,
    ReadKvState,
    ReadMetrics,
    ReadPersistedStats,
    ReadRankMemory,
    ReadSnapshot,
    ReadTotalMemory,
    ResetPrefixCache,
    ResetStats,
    SetBudget,
    UnloadAdapter,
    WorkerReady,
)

if TYPE_CHECKING:
    from cache_manager import CacheSnapshot, GraphCacheConfig, OpResult
    from cache_manager.stats import StatsTables
    from service.engine.adapters import AdapterInfo
    from service.engine.block_pool import PoolStats
    from service.engine.rank_memory import RankMemory

T = TypeVar("T")

_CALL_TIMEOUT_S = 60.0
_READ_TIMEOUT_S = 5.0
# A scrape reads the engine's metrics, then the graph snapshot (5 s): both within Prometheus's
# default scrape timeout of 10 s.
_METRICS_TIMEOUT_S = 2.0
_LOAD_TIMEOUT_S = 300.0  # an adapter's files are read from disk


class EngineLink(Protocol):
    """How the calls reach the engine: EngineProcess (a pipe to the engine process)."""

    @property
    def alive(self) -> bool: ...

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future: ...

    def request(self, call: EngineCall[T], timeout: float) -> T: ...


class EngineControl:
    def __init__(self, link: EngineLink, ready: WorkerReady) -> None:
        self._link = link
        self.graph_config: GraphCacheConfig = ready.graph_config
        self.graphs_device = ready.graphs_device
        self.has_graph_backend = ready.has_graph_backend
        self.max_loras = ready.max_loras  # adapter slots; 0: no adapters, and no LoRA graphs
        self.max_lora_rank = ready.max_lora_rank
        self.adapter_names: set[str] = set(ready.adapters)  # what Generate accepts
        self.kv_cache_dtype = ready.kv_cache_dtype or ready.dtype  # what the KV cache stores
        self.architecture = getattr(ready.spec, "architecture", "")  # the served model's, e.g. "Qwen3MoeForCausalLM"

    @property
    def alive(self) -> bool:
        return self._link.alive

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn (which calls this object's methods) off the event loop, one call at a time."""
        return self._link.call(fn)

    # ---- reads --------------------------------------------------------------------------------

    def metric_families(self) -> list[Any]:
        """The engine's metric families (engine_metrics.EngineMetrics), for a scrape."""
        return self._link.request(ReadMetrics(), _METRICS_TIMEOUT_S)

    def snapshot(self) -> CacheSnapshot:
        return self._link.request(ReadSnapshot(), _READ_TIMEOUT_S)

    def rank_memory(self) -> list[RankMemory]:
        """Every tensor-parallel rank's graph memory, rank 0 first (empty on one rank)."""
        return self._link.request(ReadRankMemory(), _READ_TIMEOUT_S)

    def kv_state(self) -> PoolStats:
        """The KV block pool's counts."""
        return self._link.request(ReadKvState(), _READ_TIMEOUT_S)

    def persisted_stats(self) -> StatsTables:
        return self._link.request(ReadPersistedStats(), _CALL_TIMEOUT_S)

    def graph_memory(self) -> tuple[int, int]:
        """(budget, used) bytes: the one budget, and what every graph (LoRA ones too) holds."""
        return self._link.request(ReadGraphMemory(), _CALL_TIMEOUT_S)

    def total_memory(self) -> int | None:
        """The device's memory (None without a graph backend)."""
        return self._link.request(ReadTotalMemory(), _CALL_TIMEOUT_S) if self.has_graph_backend else None

    # ---- graph operations (on the engine thread, between steps) -------------------------------

    def capture(self, sizes: Iterable[int], kind: str = "full", lora: bool = False) -> dict[int, OpResult]:
        """kind: "full" or "piecewise"; lora: the graphs of steps with adapter rows."""
        return self._link.request(Capture(tuple(sizes), kind, lora), _CALL_TIMEOUT_S)

    def evict(self, sizes: Iterable[int], kind: str = "full", lora: bool = False) -> dict[int, OpResult]:
        return self._link.request(Evict(tuple(sizes), kind, lora), _CALL_TIMEOUT_S)

    def set_budget(self, budget_bytes: int) -> dict[tuple[int, str], OpResult]:
        """The one budget of every graph; the evictions keyed (size, kind), e.g. (8, "full+lora")."""
        return self._link.request(SetBudget(budget_bytes), _CALL_TIMEOUT_S)

    def reset_stats(self) -> None:
        self._link.request(ResetStats(), _CALL_TIMEOUT_S)

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache; False while requests hold KV blocks."""
        return self._link.request(ResetPrefixCache(), _READ_TIMEOUT_S)

    # ---- adapters -----------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Reads the files in the engine process (off its engine thread) and registers the adapter."""
        info = self._link.request(LoadAdapter(name, path), _LOAD_TIMEOUT_S)
        self.adapter_names.add(name)
        return info

    def unload_adapter(self, name: str) -> None:
        self._link.request(UnloadAdapter(name), _CALL_TIMEOUT_S)
        self.adapter_names.discard(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self._link.request(ListAdapters(), _CALL_TIMEOUT_S)
