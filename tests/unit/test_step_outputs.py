"""A step's outputs as clients see them, with the real built-in model: a dozen streams decode
together, with and without text, stop strings, stop ids, stream intervals and logprobs, while some
are aborted mid-stream. Each gets every token exactly once and in order, in deltas of its interval,
the text of exactly those tokens (none when it reads token ids only), the same as when it runs
alone (an aborted one: a prefix of that), and one finish after everything else."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import replace

import pytest

from cache_manager import CudaGraphMode, GraphCacheConfig
from service.engine.engine import Engine
from service.engine.request import (
    EngineError,
    Finish,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.model.loader import LoadedModel

SLOTS = 12
MAX_SEQ = 128
MAX_TOKENS = 40
PROMPTS = ["The service reads a request", "Tokens stream back", "A graph is captured once", "Hello",
           "Eviction keeps memory under budget", "Batches are padded to a size", "日本語のテキスト",
           "one two three four", "Stop strings end it", "x", "Prefix caching hashes blocks", "a b c d e f"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Client:
    """What one stream's client receives, in order; it aborts its request after `abort_after` tokens."""

    def __init__(self, abort_after: int | None = None) -> None:
        self.events: list[TokenDelta | Finish | EngineError] = []
        self.abort_after = abort_after
        self.abort: threading.Event | None = None

    @property
    def deltas(self) -> list[TokenDelta]:
        finish = self.events[-1]
        last = [finish.final_delta] if isinstance(finish, Finish) and finish.final_delta is not None else []
        return [e for e in self.events if isinstance(e, TokenDelta)] + last

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def finish(self) -> Finish:
        terminals = [e for e in self.events if not isinstance(e, TokenDelta)]
        assert terminals == [self.events[-1]], f"not one terminal event, last: {self.events}"
        assert isinstance(terminals[0], Finish), terminals[0]
        return terminals[0]


def run(loaded: LoadedModel, reqs: list[GenerationRequest], abort_after: dict[str, int] | None = None
        ) -> dict[str, Client]:
    """Every request in one engine (SLOTS streams decode together); returns each one's client."""
    abort_after = abort_after or {}
    config = GraphCacheConfig(mode=CudaGraphMode.NONE, capture_sizes=None, max_batch=SLOTS)
    engine = Engine(ModelRunner(loaded, SLOTS, MAX_SEQ, config), Scheduler(SLOTS, max_num_batched_tokens=512),
                    loaded.tokenizer, frozenset(loaded.spec.eos_token_ids))
    clients = {r.request_id: Client(abort_after.get(r.request_id)) for r in reqs}
    keys: dict[str, str] = {}
    done = threading.Condition()

    def sink(request_id: str):  # noqa: ANN202 - called on the engine thread, one event at a time
        client = clients[request_id]

        def put(event) -> None:  # noqa: ANN001
            with done:
                client.events.append(event)
                done.notify_all()
            if client.abort_after is not None and isinstance(event, TokenDelta) and \
                    len(client.tokens) >= client.abort_after:
                client.abort_after = None
                engine.abort(keys[request_id])
        return put

    for r in reqs:  # queued before the engine starts: the same admissions in every run
        keys[r.request_id] = engine.submit(r, sink(r.request_id))
    engine.start()
    with done:
        assert done.wait_for(lambda: all(c.events and not isinstance(c.events[-1], TokenDelta)
                                         for c in clients.values()), 120), "a stream did not end"
    # Nothing left behind: a step launched before the last finish was read is read, every slot is free.
    deadline = time.monotonic() + 10
    while engine.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()
    assert engine.scheduler.num_free_slots == SLOTS and not engine.has_pending_work()
    return clients


def request(loaded: LoadedModel, i: int, **fields) -> GenerationRequest:  # noqa: ANN003
    sampling = replace(fields.pop("sampling", SamplingParams(temperature=0.0, seed=0)), max_tokens=MAX_TOKENS,
                       ignore_eos=True, stop=fields.pop("stop", ()), stop_token_ids=fields.pop("stop_token_ids", ()))
    return GenerationRequest(f"r{i}", loaded.tokenizer(PROMPTS[i])["input_ids"], sampling,
                             arrival_time=time.monotonic(), **fields)


def test_streams_of_one_batch_get_their_tokens_once_in_order_under_aborts(loaded: LoadedModel) -> None:
    free = run(loaded, [request(loaded, i) for i in range(SLOTS)])  # what each generates without stops
    text_of = {rid: c.text for rid, c in free.items()}

    def stop_in(rid: str) -> str:
        """A visible piece of the request's free text, from about a third in: it stops early."""
        text = text_of[rid]
        start = len(text) // 3
        stop = text[start:start + 3]
        assert stop.strip() and text.index(stop) > 0, text
        return stop

    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    reqs = [
        request(loaded, 0),
        request(loaded, 1, stream_interval=3),
        request(loaded, 2, stream_interval=7, sampling=SamplingParams(temperature=0.0, logprobs=2, seed=0)),
        request(loaded, 3, stream_text=False),
        request(loaded, 4, stream_text=False, stop=(stop_in("r4"),)),
        request(loaded, 5, stop=(stop_in("r5"),)),
        request(loaded, 6, stream_interval=4, stop=(stop_in("r6"),)),
        request(loaded, 7, stop_token_ids=(free["r7"].tokens[9],)),
        request(loaded, 8, sampling=sampled),
        request(loaded, 9, stream_interval=4),  # aborted
        request(loaded, 10, stream_text=False),  # aborted
        request(loaded, 11, sampling=sampled, stream_interval=2),  # aborted
    ]
    aborts = {"r9": 3, "r10": 8, "r11": 13}
    together = run(loaded, reqs, abort_after=aborts)
    decode = loaded.tokenizer.decode
    for r in reqs:
        rid, client = r.request_id, together[r.request_id]
        alone = run(loaded, [dataclasses.replace(r, request_id=rid)])[rid]
        finish = client.finish
        tokens = client.tokens
        # Deltas of the request's interval: only the last may be shorter.
        assert all(len(d.token_ids) == r.stream_interval for d in client.deltas[:-1]), rid
        if rid in aborts:
            assert finish.reason is FinishReason.ABORT, rid
            assert aborts[rid] <= len(tokens) < MAX_TOKENS and tokens == alone.tokens[:len(tokens)], rid
            assert finish.completion_tokens == len(tokens), rid
        else:
            assert (tokens, client.text, finish.reason, finish.matched_stop) == (
                alone.tokens, alone.text, alone.finish.reason, alone.finish.matched_stop), rid
        if not r.stream_text and not r.sampling.stop:
            assert client.text == "", rid
        elif not r.sampling.stop:
            assert client.text == decode(tokens, skip_special_tokens=True), rid
        if r.sampling.logprobs is not None:
            assert all(len(d.logprobs) == len(d.token_ids) for d in client.deltas), rid
    for rid in ("r4", "r5", "r6"):  # stop strings: the text ends right before the first one
        client, stop = together[rid], together[rid].finish.matched_stop
        assert client.finish.reason is FinishReason.STOP and stop == reqs[int(rid[1:])].sampling.stop[0]
        assert client.text == text_of[rid][:text_of[rid].index(stop)], rid
        assert client.tokens == free[rid].tokens[:len(client.tokens)], rid
    stop_id = reqs[7].sampling.stop_token_ids[0]
    assert together["r7"].finish.matched_stop == stop_id
    assert together["r7"].tokens == free["r7"].tokens[:free["r7"].tokens.index(stop_id)]
