"""The engine process's side of the gRPC process's calls (engine_messages.EngineCall): each runs
where it must, and its reply comes back as a future.

Reads (the metrics, the graph snapshot, every rank's graph memory, the KV pool's counts) run on
the reply thread: a snapshot may wait for the graph cache's lock (a capture), which the pipe
thread must not. Graph-cache operations and the prefix-cache reset run on the engine thread
between two steps; capture, evict and set_budget finish on the capture thread (with tensor
parallelism: on the engine thread, a capture once the engine is idle), and their reply is that
one's. An adapter load reads its files on a thread of its own (one load at a time), then
registers the adapter on the engine thread (a load costs the engine one short call, not the disk
read); unload and list only queue a call there.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from service.engine.adapters import AdaptersOff
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
)

if TYPE_CHECKING:
    from service.engine.builder import LoadedRunner
    from service.engine.engine import Engine


class EngineCalls:
    """Runs the calls against an engine (its `call` runs a function between two steps) and its
    loaded runner (the graph cache, the adapters, the ranks); `reads` is the reply thread."""

    def __init__(self, engine: Engine, lr: LoadedRunner, metric_families: Callable[[], list[Any]],
                 reads: concurrent.futures.Executor) -> None:
        self.engine = engine
        self.lr = lr
        self.metric_families = metric_families
        self.reads = reads
        self.adapter_reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-adapter-read")

    def start(self, call: EngineCall) -> Future:
        """The future of the call's reply (its exception, if it fails)."""
        lr, engine = self.lr, self.engine
        match call:
            case ReadMetrics():
                return self.reads.submit(self.metric_families)
            case ReadSnapshot():
                return self.reads.submit(lr.graphs.snapshot)
            case ReadRankMemory():
                return self.reads.submit(lr.runner.rank_memory)
            case ReadKvState():
                return self.reads.submit(engine.scheduler.block_stats)
            case ReadPersistedStats():
                return engine.call(lr.graphs.persisted_stats)
            case ReadGraphMemory():
                return engine.call(lambda: (lr.graphs.budget_bytes, lr.graphs.used_bytes))
            case ReadTotalMemory():
                return engine.call(lambda: None if lr.graphs.backend is None else lr.graphs.backend.total_memory())
            case Capture() | Evict():
                return _settled(engine.call(lambda: self._sizes_op(call)))
            case SetBudget(budget_bytes):
                return _settled(engine.call(lambda: _by_size_and_kind(lr.graphs.set_budget_async(budget_bytes))))
            case ResetStats():
                return engine.call(lr.graphs.reset_stats)
            case ResetPrefixCache():
                return engine.call(engine.scheduler.reset_prefix_cache)
            case LoadAdapter(name, path):
                return self._load_adapter(name, path)
            case UnloadAdapter(name) if lr.adapters is not None:
                return engine.call(lambda: lr.adapters.unregister(name))
            case UnloadAdapter():
                return _failed(AdaptersOff())
            case ListAdapters() if lr.adapters is not None:
                return engine.call(lr.adapters.list)
            case ListAdapters():
                return _done([])
        return _failed(ValueError(f"unknown engine call {type(call).__name__}"))

    def close(self) -> None:
        self.adapter_reads.shutdown(wait=False)

    def _sizes_op(self, call: Capture | Evict) -> Future:
        """Capture or evict: queued for the capture thread, never waited for here."""
        from cache_manager.sizes import CudaGraphMode, GraphFamily  # torch: imported with the model, not before

        graphs = self.lr.graphs
        if call.lora and not graphs.has_lora:  # the graphs of steps with adapter rows
            raise ValueError("this server has no adapter slots (start with --max-loras or --lora-modules)")
        family = GraphFamily(CudaGraphMode.parse(call.kind), call.lora)
        if isinstance(call, Capture):
            return graphs.capture_async(list(call.sizes), family)
        return graphs.evict_async(list(call.sizes), family)

    def _load_adapter(self, name: str, path: str) -> Future:
        """Read the files on the adapter thread, then register the adapter on the engine thread."""
        lr, reply = self.lr, Future()

        def read() -> None:
            try:
                adapter = lr.read_adapter(name, path, remote=True)
            except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
                # Without its traceback: the frames it holds (a refused adapter's tensors) go now, not at a gc.
                reply.set_exception(exc.with_traceback(None))
                return
            registered = self.engine.call(lambda: (lr.adapters.register(adapter), _info(lr, adapter.name))[1])
            registered.add_done_callback(lambda f: _copy(f, reply))

        self.adapter_reads.submit(read)
        return reply


def _settled(future: Future) -> Future:
    """The reply of an operation that returns a future of its own (one that finishes on the capture
    thread): that future's result."""
    reply: Future = Future()

    def on_done(f: Future) -> None:
        if not f.cancelled() and f.exception() is None and isinstance(f.result(), Future):
            f.result().add_done_callback(on_done)
        else:
            _copy(f, reply)

    future.add_done_callback(on_done)
    return reply


def _copy(source: Future, target: Future) -> None:
    if source.cancelled():
        target.set_exception(concurrent.futures.CancelledError())
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


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


def _info(lr: LoadedRunner, name: str) -> Any:
    return next(a for a in lr.adapters.list() if a.name == name)
