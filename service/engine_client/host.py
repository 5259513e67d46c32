"""The engine's side of the typed calls (calls.py): what a call runs against, and the threads it
may run on. Each call's `run` says where it runs; the host only holds what they share.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cache_manager import GraphCache
    from service.engine.builder import LoadedRunner
    from service.engine.engine import Engine


class Runnable(Protocol):
    """A typed engine call (calls.EngineCall), as the host sees it."""

    def run(self, host: EngineHost) -> Future: ...


class EngineHost:
    """An engine (its `call` runs a function between two steps) and its loaded runner (the graph
    cache, the adapters, the ranks); `reads` is the reply thread, `adapter_reads` the thread that
    reads adapters' files."""

    def __init__(self, engine: Engine, lr: LoadedRunner, metric_families: Callable[[], list[Any]],
                 reads: concurrent.futures.Executor) -> None:
        self.engine = engine
        self.lr = lr
        self.metric_families = metric_families
        self.reads = reads
        self.adapter_reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-adapter-read")

    @property
    def graphs(self) -> GraphCache:
        return self.lr.graphs

    def start(self, call: Runnable) -> Future:
        """The future of the call's reply (its exception, if it fails)."""
        try:
            return call.run(self)
        except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
            return failed(exc)

    @staticmethod
    def settled(future: Future) -> Future:
        """The reply of an operation that returns a future of its own (one that finishes on the
        capture thread): that future's result."""
        reply: Future = Future()

        def on_done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None and isinstance(f.result(), Future):
                f.result().add_done_callback(on_done)
            else:
                copy_future(f, reply)

        future.add_done_callback(on_done)
        return reply

    def close(self) -> None:
        self.adapter_reads.shutdown(wait=False)


def copy_future(source: Future, target: Future) -> None:
    if source.cancelled():
        target.set_exception(concurrent.futures.CancelledError())
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future
