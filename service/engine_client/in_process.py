"""`InProcessEngine`: an EngineClient whose engine runs on a thread of this process (the Python
API's `LLM`). Its typed calls run themselves against the engine's host here, as they do in the
engine process; its sinks are called on the engine thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from service.engine_client.calls import EngineCall
from service.engine_client.client import EngineFacts, facts_of
from service.engine_client.host import EngineHost

if TYPE_CHECKING:
    from service.config import ServeConfig
    from service.engine.builder import LoadedRunner
    from service.engine.engine import Engine
    from service.engine.interfaces import Sink
    from service.engine.request import GenerationRequest

T = TypeVar("T")


class InProcessEngine:
    """An engine (not yet started: `start` it) over its loaded runner, and the facts it reports."""

    def __init__(self, engine: Engine, lr: LoadedRunner, facts: EngineFacts,
                 metric_families: Callable[[], list[Any]] = list) -> None:
        self.engine = engine
        self.lr = lr
        self.facts = facts
        self.adapter_names: set[str] = set(facts.adapters)
        self._reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-reply")
        self._ops = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-engine-call")
        self._host = EngineHost(engine, lr, metric_families, self._reads)

    @classmethod
    def load(cls, config: ServeConfig) -> InProcessEngine:
        """Load the model and build the engine as the engine process does (service/engine/builder.py)."""
        from service.engine.builder import load_runner, new_engine

        lr = load_runner(config)
        return cls(new_engine(config, lr), lr, facts_of(config, lr))

    def start(self) -> None:
        self.engine.start()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded with it: callers in this process tokenize with the engine's own."""
        return self.lr.loaded.tokenizer

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> str:
        return self.engine.submit(request, sink)

    def abort(self, key: str) -> None:
        self.engine.abort(key)

    def pause(self, key: str, paused: bool) -> None:
        self.engine.pause(key, paused)

    # ---- state --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.engine.alive

    @property
    def responsive(self) -> bool:
        return self.engine.thread_alive  # its queues are lists in this process: nothing to read them late

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    @property
    def last_progress(self) -> float:
        return self.engine.last_progress

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_free_slots(self) -> int:
        return self.engine.num_free_slots

    @property
    def num_waiting(self) -> int:
        return self.waiting_after(0)

    def waiting_after(self, samples: int) -> int:
        return max(0, self.engine.num_waiting + samples - self.engine.num_free_slots)

    @property
    def waiting_prompt_tokens(self) -> int:
        return self.engine.waiting_prompt_tokens

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        return self.engine.kv_cache_usage

    def has_pending_work(self) -> bool:
        return self.engine.has_pending_work()

    # ---- typed calls --------------------------------------------------------------------------

    def request(self, call: EngineCall[T], timeout: float | None = None) -> T:
        reply = self._host.start(call).result(call.timeout_s if timeout is None else timeout)
        call.on_reply(self, reply)
        return reply

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if not self.alive:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(RuntimeError("the engine is not running"))
            return future
        return self._ops.submit(fn)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine and free the graphs (close_engine); returns whether the stats were saved."""
        from service.engine.builder import close_engine

        saved = close_engine(self.engine, self.lr.graphs, timeout)
        self._host.close()
        self._ops.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False)
        return saved
