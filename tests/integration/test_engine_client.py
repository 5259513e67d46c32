"""The engine-client contract: the same test body runs against both implementations of
`EngineClient`, an engine on a thread of this process (what the Python API uses) and an engine
process of its own (what the server uses), each with the built-in tiny model on the CPU."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cache_manager import CacheSnapshot
from service.config import ServeConfig
from service.engine.adapters import AdaptersOff
from service.engine.constraint_limits import InvalidConstraint
from service.engine.interfaces import EngineStopped
from service.engine.request import Constraint, Finish, FinishReason, GenerationRequest, SamplingParams, TokenDelta
from service.engine_client.calls import (
    CheckConstraint,
    ListAdapters,
    ReadGraphMemory,
    ReadKvState,
    ReadSnapshot,
    ResetPrefixCache,
    UnloadAdapter,
)
from service.engine_client.client import EngineClient
from service.engine_client.faults import Faults
from service.engine_client.in_process import InProcessEngine
from service.engine_client.messages import WorkerSpec
from service.engine_client.process import EngineProcess

MAX_SEQ_LEN = 128
PROMPT = [5, 6, 7, 8, 9]
GREEDY: dict[str, list[int]] = {}  # each implementation's greedy tokens: they must agree


def _in_process(config: ServeConfig) -> Iterator[EngineClient]:
    engine = InProcessEngine.load(config)
    engine.start()
    yield engine
    engine.stop()


def _engine_process(config: ServeConfig) -> Iterator[EngineClient]:
    loop = asyncio.new_event_loop()  # reads the pipe and calls the sinks, as the gRPC process's loop does
    thread = threading.Thread(target=loop.run_forever, name="engine-pipe", daemon=True)
    thread.start()
    engine = EngineProcess(WorkerSpec(config, Faults()), loop)
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(params=[_in_process, _engine_process], ids=["in_process", "engine_process"])
def engine(request: pytest.FixtureRequest, model_cache_dir) -> Iterator[EngineClient]:  # noqa: ANN001
    config = ServeConfig(model="builtin:tiny", model_cache_dir=str(model_cache_dir), device="cpu",
                         max_running_seqs=4, max_seq_len=MAX_SEQ_LEN, log_level="warning")
    yield from request.param(config)


class Events:
    """A request's events, from whichever thread the implementation calls its sink on."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, event: object) -> None:
        self.queue.put(event)

    def next(self) -> object:
        return self.queue.get(timeout=60)

    def finish(self) -> tuple[list[int], Finish]:
        tokens = []
        while not isinstance(event := self.next(), Finish):
            assert isinstance(event, TokenDelta), event
            tokens += event.token_ids
        return tokens + (event.final_delta.token_ids if event.final_delta is not None else []), event


def generation(request_id: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True, seed=0),
                             arrival_time=time.monotonic())


def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_the_engine_client_contract(engine: EngineClient, request: pytest.FixtureRequest) -> None:
    # What it reports once loaded.
    assert engine.alive and engine.error is None
    assert eventually(lambda: engine.responsive)  # the engine process's statuses arrive every 0.2 s
    assert engine.facts.max_seq_len == MAX_SEQ_LEN and engine.facts.spec.vocab_size > max(PROMPT)
    assert engine.facts.adapters == () and engine.adapter_names == set() and engine.facts.max_loras == 0

    # A request streams its tokens and ends with a finish; greedy tokens are the same on both.
    events = Events()
    engine.submit(generation("greedy", 8), events)
    tokens, finish = events.finish()
    assert finish.reason is FinishReason.LENGTH and finish.completion_tokens == len(tokens) == 8
    assert GREEDY.setdefault("greedy", tokens) == tokens, request.node.callspec.id
    assert eventually(lambda: engine.num_running == engine.num_waiting == 0 and not engine.has_pending_work())
    assert engine.waiting_after(4) == 0 and engine.waiting_after(5) == 1  # 4 slots, all free
    used, total = engine.kv_cache_usage
    assert used == 0 and total > 0

    # An abort ends a running request with finish_reason abort.
    long = Events()
    key = engine.submit(generation("long", MAX_SEQ_LEN - len(PROMPT)), long)
    assert isinstance(long.next(), TokenDelta)
    engine.abort(key)
    assert long.finish()[1].reason is FinishReason.ABORT

    # Typed calls run themselves on the engine's side, their replies and exceptions come back.
    snapshot = engine.request(ReadSnapshot())
    assert isinstance(snapshot, CacheSnapshot) and snapshot.mode == "none"
    assert engine.request(ReadKvState()).num_blocks == total
    assert engine.request(ReadGraphMemory()) == (snapshot.budget_bytes, 0)
    assert engine.request(ListAdapters()) == []
    with pytest.raises(AdaptersOff):
        engine.request(UnloadAdapter("nope"))
    assert eventually(lambda: engine.num_running == 0)
    assert engine.request(ResetPrefixCache()) is True  # idle: nothing holds a block
    engine.request(CheckConstraint(Constraint("json_object", "")))
    with pytest.raises(InvalidConstraint):
        engine.request(CheckConstraint(Constraint("regex", "(unclosed")))
    # `call` runs a function of requests off the caller's thread, one at a time.
    assert engine.call(lambda: engine.request(ListAdapters())).result(30) == []

    # Stopped, it accepts no more work.
    engine.stop()
    assert not engine.alive
    with pytest.raises(EngineStopped):
        engine.submit(generation("late", 4), Events())
