"""The engine-process boundary: every message that crosses the pipe between the gRPC process
(process.py) and the engine process (worker.py), in both directions.

gRPC process -> engine process: `Submit`, `Abort`, `Pause`, `Call` (an `EngineCall` and its id),
`Stop`. Engine process -> gRPC process: `WorkerReady` or `LoadFailed` once, at start; `Events`
per step (the engine's counters with the step's token deltas, finishes and errors);
`WorkerStatus` (the counters alone) every 0.2 s; `Reply` to each `Call`; `Stopped` last. The process itself starts
with a `WorkerSpec`.

An `EngineCall[T]` asks the engine process for something whose reply is a T: the graph cache's
reads and operations, the adapters, the prefix cache, the metrics (host.py says where
each runs there; engine_control.py is the gRPC process's typed side of them).

Per step the engine sends one `Events` message, whose events stay the plain tuples (kind, key,
payload) that worker.encode_events makes: no object per token on the hot path.

Torch-free, like everything the engine process imports before its model: the types named only
in annotations are imported for the type checker alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:  # the calls' reply types, named in strings (EngineCall["..."])
    from cache_manager import CacheSnapshot, OpResult  # noqa: F401
    from cache_manager.stats import StatsTables  # noqa: F401
    from service.engine.adapters import AdapterInfo  # noqa: F401
    from service.engine.block_pool import PoolStats  # noqa: F401
    from service.engine.rank_memory import RankMemory  # noqa: F401
    from service.engine.request import GenerationRequest

T = TypeVar("T")

# Event kinds inside an Events message: (kind, key, payload)
DELTA, FINISH, ERROR = "d", "f", "e"


# ---- the engine process's start ----------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    config: Any  # ServeConfig
    faults: Any  # Faults
    # Taken in the gRPC process: the worker may start after that process already died (and it was
    # re-parented), so its own os.getppid() at start would not tell.
    parent_pid: int = field(default_factory=os.getpid)


@dataclass(frozen=True)
class WorkerReady:
    """What the gRPC process needs to serve: the model's description and the graph cache's shape."""

    model_path: str
    spec: Any  # ModelSpec
    max_seq_len: int
    device: str
    dtype: str
    graph_config: Any  # GraphCacheConfig
    graph_mode: str
    graphs_device: str
    has_graph_backend: bool
    adapters: tuple[str, ...] = ()  # loaded at start (--lora-modules)
    max_loras: int = 0  # adapter slots; 0: adapters are off
    max_lora_rank: int = 0
    kv_cache_dtype: str = ""  # what the KV cache stores, e.g. bfloat16 or float8_e4m3fn ("": dtype)


@dataclass(frozen=True)
class LoadFailed:
    """The engine process could not load: a ModelLoadError's message (`model`), or another error's."""

    message: str
    model: bool


# ---- gRPC process -> engine process ------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    key: str
    request: GenerationRequest


@dataclass(frozen=True)
class Abort:
    key: str


@dataclass(frozen=True)
class Pause:
    key: str
    paused: bool


@dataclass(frozen=True)
class Call:
    call_id: int
    call: EngineCall


@dataclass(frozen=True)
class Stop:
    pass


# ---- engine process -> gRPC process ------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStatus:
    """The engine's counters, sent with every step and every 0.2 s."""

    received: int  # submits the worker has handed to the engine
    received_tokens: int
    num_running: int
    num_free_slots: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    waiting_prompt_tokens: int
    has_work: bool
    last_progress: float  # time.monotonic(), the same clock in both processes
    error: str | None


@dataclass(frozen=True)
class Events(WorkerStatus):
    """A step's message: the engine's counters after it, and its events, (kind, key, payload) with
    kind DELTA, FINISH or ERROR. A status itself rather than a status inside: one object per step,
    which pickles as cheaply as the tuple of a status and events did."""

    events: list[tuple[str, str, Any]]


@dataclass(frozen=True)
class Reply:
    """A call's result (ok) or the exception it raised."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True)
class Stopped:
    stats_saved: bool


# What each side sends.
ToWorker = Submit | Abort | Pause | Call | Stop
FromWorker = WorkerReady | LoadFailed | WorkerStatus | Events | Reply | Stopped


# ---- calls -------------------------------------------------------------------------------------


class EngineCall(Generic[T]):
    """A request to the engine process whose reply is a T."""


@dataclass(frozen=True)
class ReadMetrics(EngineCall["list[Any]"]):
    """The engine's metric families (EngineMetrics), for a scrape of the gRPC process."""


@dataclass(frozen=True)
class ReadSnapshot(EngineCall["CacheSnapshot"]):
    """The graph cache's snapshot (every family's graphs, LoRA ones too)."""


@dataclass(frozen=True)
class ReadRankMemory(EngineCall["list[RankMemory]"]):
    """Every tensor-parallel rank's graph memory, rank 0 first (empty on one rank)."""


@dataclass(frozen=True)
class ReadKvState(EngineCall["PoolStats"]):
    """The KV block pool's counts."""


@dataclass(frozen=True)
class ReadPersistedStats(EngineCall["StatsTables"]):
    pass


@dataclass(frozen=True)
class ReadGraphMemory(EngineCall["tuple[int, int]"]):
    """(budget, used) bytes: the one budget, and what counts against it (every graph, LoRA ones too)."""


@dataclass(frozen=True)
class ReadTotalMemory(EngineCall["int | None"]):
    """The device's memory as the graph backend sees it (None without one)."""


@dataclass(frozen=True)
class _GraphSizes:
    sizes: tuple[int, ...]
    kind: str = "full"  # or "piecewise"
    lora: bool = False  # the LoRA family's graphs (steps with adapter rows)


@dataclass(frozen=True)
class Capture(_GraphSizes, EngineCall["dict[int, OpResult]"]):
    pass


@dataclass(frozen=True)
class Evict(_GraphSizes, EngineCall["dict[int, OpResult]"]):
    pass


@dataclass(frozen=True)
class SetBudget(EngineCall["dict[tuple[int, str], OpResult]"]):
    """The one budget of every graph; the reply is the evictions keyed (size, kind), the kind as
    operators name the descriptor's family ("full", "piecewise+lora")."""

    budget_bytes: int


@dataclass(frozen=True)
class ResetStats(EngineCall[None]):
    pass


@dataclass(frozen=True)
class ResetPrefixCache(EngineCall[bool]):
    """Empty the prefix cache; False while requests hold KV blocks."""


@dataclass(frozen=True)
class LoadAdapter(EngineCall["AdapterInfo"]):
    name: str
    path: str


@dataclass(frozen=True)
class UnloadAdapter(EngineCall[None]):
    name: str


@dataclass(frozen=True)
class ListAdapters(EngineCall["list[AdapterInfo]"]):
    pass
