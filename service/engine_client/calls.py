"""The typed engine calls: each asks the engine for something whose reply is a T, carries its
arguments, and runs itself on the engine's side (`run`, given the engine's `EngineHost`).

A call is sent as it is: over the pipe to the engine process (a pickled dataclass), or handed to an
in-process engine's host. Where each runs: reads (the metrics, the graph snapshot, every rank's
graph memory, the KV pool's counts) on the host's reply thread, since a snapshot may wait for the
graph cache's lock (a capture), which the engine process's pipe thread must not; graph-cache
operations and the prefix-cache reset on the engine thread between two steps, with capture, evict
and set_budget finishing on the capture thread (with tensor parallelism: on the engine thread, a
capture once the engine is idle), and their reply is that one's. An adapter load reads its files on
a thread of its own (one load at a time), then registers the adapter on the engine thread (a load
costs the engine one short call, not the disk read); unload and list only queue a call there.

A new operation is one class here: its arguments, its reply type, its timeout, its `run`.

Torch-free, like everything the engine process imports before its model: the types named only in
annotations are imported for the type checker alone.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from service.engine.adapters import AdaptersOff
from service.engine_client.host import EngineHost, copy_future, done, failed

if TYPE_CHECKING:  # the calls' reply types, named in strings (EngineCall["..."])
    from cache_manager import CacheSnapshot, OpResult  # noqa: F401
    from cache_manager.stats import StatsTables  # noqa: F401
    from service.engine.adapters import AdapterInfo  # noqa: F401
    from service.engine.block_pool import PoolStats  # noqa: F401
    from service.engine.rank_memory import RankMemory  # noqa: F401
    from service.engine.request import Constraint

T = TypeVar("T")

CALL_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 5.0
# A scrape reads the engine's metrics, then the graph snapshot (5 s): both within Prometheus's
# default scrape timeout of 10 s.
METRICS_TIMEOUT_S = 2.0
LOAD_TIMEOUT_S = 300.0  # an adapter's files are read from disk


class ClientSide(Protocol):
    """What a reply may change on the client's side (an EngineClient's)."""

    adapter_names: set[str]  # what Generate accepts without asking the engine


class EngineCall(Generic[T]):
    """A request to the engine whose reply is a T."""

    timeout_s: ClassVar[float] = CALL_TIMEOUT_S  # how long the client waits for the reply

    def run(self, host: EngineHost) -> Future:
        """On the engine's side: the future of the reply (its exception, if the call fails)."""
        raise NotImplementedError

    def on_reply(self, client: ClientSide, reply: T) -> None:
        """On the client's side, after a reply: what the call changes there (nothing, mostly)."""


# ---- reads --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadMetrics(EngineCall["list[Any]"]):
    """The engine's metric families (EngineMetrics), for a scrape of the gRPC process."""

    timeout_s = METRICS_TIMEOUT_S

    def run(self, host: EngineHost) -> Future:
        return host.reads.submit(host.metric_families)


@dataclass(frozen=True)
class ReadSnapshot(EngineCall["CacheSnapshot"]):
    """The graph cache's snapshot (every family's graphs, LoRA ones too)."""

    timeout_s = READ_TIMEOUT_S

    def run(self, host: EngineHost) -> Future:
        return host.reads.submit(host.graphs.snapshot)


@dataclass(frozen=True)
class ReadRankMemory(EngineCall["list[RankMemory]"]):
    """Every tensor-parallel rank's graph memory, rank 0 first (empty on one rank)."""

    timeout_s = READ_TIMEOUT_S

    def run(self, host: EngineHost) -> Future:
        return host.reads.submit(host.lr.runner.rank_memory)


@dataclass(frozen=True)
class ReadKvState(EngineCall["PoolStats"]):
    """The KV block pool's counts."""

    timeout_s = READ_TIMEOUT_S

    def run(self, host: EngineHost) -> Future:
        return host.reads.submit(host.engine.scheduler.block_stats)


@dataclass(frozen=True)
class ReadPersistedStats(EngineCall["StatsTables"]):
    def run(self, host: EngineHost) -> Future:
        return host.engine.call(host.graphs.persisted_stats)


@dataclass(frozen=True)
class ReadGraphMemory(EngineCall["tuple[int, int]"]):
    """(budget, used) bytes: the one budget, and what counts against it (every graph, LoRA ones too)."""

    def run(self, host: EngineHost) -> Future:
        graphs = host.graphs
        return host.engine.call(lambda: (graphs.budget_bytes, graphs.used_bytes))


@dataclass(frozen=True)
class ReadTotalMemory(EngineCall["int | None"]):
    """The device's memory as the graph backend sees it (None without one)."""

    def run(self, host: EngineHost) -> Future:
        backend = host.graphs.backend
        return host.engine.call(lambda: None if backend is None else backend.total_memory())


# ---- graph operations (on the engine thread, between steps) -------------------------------------


@dataclass(frozen=True)
class _GraphSizes:
    sizes: tuple[int, ...]
    kind: str = "full"  # or "piecewise"
    lora: bool = False  # the LoRA family's graphs (steps with adapter rows)

    def family(self, host: EngineHost) -> Any:
        from cache_manager.sizes import CudaGraphMode, GraphFamily  # torch: imported with the model, not before

        if self.lora and not host.graphs.has_lora:  # the graphs of steps with adapter rows
            raise ValueError("this server has no adapter slots (start with --max-loras or --lora-modules)")
        return GraphFamily(CudaGraphMode.parse(self.kind), self.lora)


@dataclass(frozen=True)
class Capture(_GraphSizes, EngineCall["dict[int, OpResult]"]):
    """Queued for the capture thread, never waited for on the engine thread."""

    def run(self, host: EngineHost) -> Future:
        return host.settled(host.engine.call(lambda: host.graphs.capture_async(list(self.sizes), self.family(host))))


@dataclass(frozen=True)
class Evict(_GraphSizes, EngineCall["dict[int, OpResult]"]):
    def run(self, host: EngineHost) -> Future:
        return host.settled(host.engine.call(lambda: host.graphs.evict_async(list(self.sizes), self.family(host))))


@dataclass(frozen=True)
class SetBudget(EngineCall["dict[tuple[int, str], OpResult]"]):
    """The one budget of every graph; the reply is the evictions keyed (size, kind), the kind as
    operators name the descriptor's family ("full", "piecewise+lora"), e.g. (8, "full+lora")."""

    budget_bytes: int

    def run(self, host: EngineHost) -> Future:
        graphs = host.graphs
        return host.settled(host.engine.call(lambda: _by_size_and_kind(graphs.set_budget_async(self.budget_bytes))))


@dataclass(frozen=True)
class ResetStats(EngineCall[None]):
    def run(self, host: EngineHost) -> Future:
        return host.engine.call(host.graphs.reset_stats)


@dataclass(frozen=True)
class ResetPrefixCache(EngineCall[bool]):
    """Empty the prefix cache; False while requests hold KV blocks."""

    timeout_s = READ_TIMEOUT_S

    def run(self, host: EngineHost) -> Future:
        return host.engine.call(host.engine.scheduler.reset_prefix_cache)


# ---- adapters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadAdapter(EngineCall["AdapterInfo"]):
    """Reads the files off the engine thread (one load at a time), then registers the adapter on it."""

    name: str
    path: str
    timeout_s = LOAD_TIMEOUT_S

    def run(self, host: EngineHost) -> Future:
        lr, reply = host.lr, Future()

        def read() -> None:
            try:
                adapter = lr.read_adapter(self.name, self.path, remote=True)
            except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
                # Without its traceback: the frames it holds (a refused adapter's tensors) go now, not at a gc.
                reply.set_exception(exc.with_traceback(None))
                return

            def register() -> Any:
                lr.adapters.register(adapter)
                return next(a for a in lr.adapters.list() if a.name == adapter.name)

            host.engine.call(register).add_done_callback(lambda f: copy_future(f, reply))

        host.adapter_reads.submit(read)
        return reply

    def on_reply(self, client: ClientSide, reply: Any) -> None:
        client.adapter_names.add(self.name)


@dataclass(frozen=True)
class UnloadAdapter(EngineCall[None]):
    name: str

    def run(self, host: EngineHost) -> Future:
        adapters = host.lr.adapters
        if adapters is None:
            return failed(AdaptersOff())
        return host.engine.call(lambda: adapters.unregister(self.name))

    def on_reply(self, client: ClientSide, reply: None) -> None:
        client.adapter_names.discard(self.name)


@dataclass(frozen=True)
class ListAdapters(EngineCall["list[AdapterInfo]"]):
    def run(self, host: EngineHost) -> Future:
        adapters = host.lr.adapters
        return done([]) if adapters is None else host.engine.call(adapters.list)


# ---- structured outputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckConstraint(EngineCall[None]):
    """Compile a constraint and its first mask on the grammar workers (bounded, cached), so that a bad
    one fails before anything is submitted: InvalidConstraint, or ConstraintsBusy."""

    constraint: Constraint

    def run(self, host: EngineHost) -> Future:
        constraints = host.engine.constraints
        if constraints is None:
            return failed(ValueError("this engine serves no structured outputs (no grammar compiler)"))
        reply: Future = Future()
        constraints.preparer.prepare(self.constraint, lambda result: (
            reply.set_exception(result) if isinstance(result, Exception) else reply.set_result(None)))
        return reply


def _by_size_and_kind(future: Future) -> Future:
    """The evictions of a budget set, keyed (size, kind) with the kind as operators name the
    descriptor's family ("full", "piecewise+lora") instead of by descriptor."""
    keyed: Future = Future()

    def on_done(f: Future) -> None:
        try:
            keyed.set_result({(k.padded_size, str(k.family)): r for k, r in f.result().items()})
        except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
            keyed.set_exception(exc)

    future.add_done_callback(on_done)
    return keyed
