"""Overlapped steps: the engine launches step t+1 before it reads step t's tokens. With the real
built-in model, every request's tokens, text and finish are the same as without overlap and as when
it runs alone; stops, aborts and slot reuse lose nothing, and no row is wasted on a request that
ends by max_tokens."""

from __future__ import annotations

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
    StepTokens,
    TokenDelta,
)
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.model.loader import LoadedModel

SLOTS = 3  # fewer slots than requests: slots are freed and reused while others decode
MAX_SEQ = 160
PROMPTS = ["The service reads a request", "Tokens stream back", "A graph is captured once",
           "Eviction keeps memory under budget", "Hello", "Batches are padded to a size"]
STOP_STRING_REQUEST = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingRunner:
    """The real runner, with a log of launches and collects (which rows each launch ran)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.log: list[tuple[str, int]] = []
        self.rows: dict[str, int] = {}  # request id -> rows launched that sample a token for it
        self._launches = 0

    def launch(self, step):  # noqa: ANN001, ANN201
        self._launches += 1
        self.log.append(("launch", self._launches))
        for seq in [*step.decodes, *(chunk.seq for chunk in step.prefills if chunk.completes_prompt)]:
            self.rows[seq.request_id] = self.rows.get(seq.request_id, 0) + 1
        return self._launches, self.runner.launch(step)

    def collect(self, launched) -> StepTokens:  # noqa: ANN001
        number, handle = launched
        self.log.append(("collect", number))
        return self.runner.collect(handle)

    def take_failed_constraints(self) -> list:
        return self.runner.take_failed_constraints()

    def take_sat_out(self) -> list:
        return self.runner.take_sat_out()


class Results:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.finish: dict[str, Finish | EngineError] = {}
        self.cond = threading.Condition()

    def sink(self, request_id: str):  # noqa: ANN201
        self.tokens[request_id], self.text[request_id] = [], ""

        def put(event) -> None:  # noqa: ANN001
            with self.cond:
                if isinstance(event, TokenDelta):
                    self.tokens[request_id] += list(event.token_ids)
                    self.text[request_id] += event.text
                else:
                    assert request_id not in self.finish, f"{request_id}: a second terminal event"
                    self.finish[request_id] = event
                    if isinstance(event, Finish) and event.final_delta is not None:
                        self.tokens[request_id] += list(event.final_delta.token_ids)
                        self.text[request_id] += event.final_delta.text
                self.cond.notify_all()
        return put

    def wait(self, ids: list[str], timeout: float = 60.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: all(i in self.finish for i in ids), timeout), (
                f"unfinished: {[i for i in ids if i not in self.finish]}")

    def summary(self, request_id: str) -> tuple:
        finish = self.finish[request_id]
        assert isinstance(finish, Finish), finish
        return self.tokens[request_id], self.text[request_id], finish.reason, finish.completion_tokens


def make_engine(loaded: LoadedModel, overlap: bool, graphs: CudaGraphMode = CudaGraphMode.NONE,
                ) -> tuple[Engine, RecordingRunner]:
    config = GraphCacheConfig(mode=graphs, capture_sizes=None, max_batch=SLOTS)
    runner = RecordingRunner(ModelRunner(loaded, SLOTS, MAX_SEQ, config))
    # A small token budget: admissions spread over several steps, between decodes.
    engine = Engine(runner, Scheduler(SLOTS, max_num_batched_tokens=24), loaded.tokenizer,
                    frozenset(loaded.spec.eos_token_ids), overlap=overlap)
    return engine, runner


def requests(loaded: LoadedModel, stop_text: str) -> list[GenerationRequest]:
    tok = loaded.tokenizer
    greedy = SamplingParams(temperature=0.0, seed=0)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    specs = [
        replace(greedy, max_tokens=1),
        replace(greedy, max_tokens=2, ignore_eos=True),
        replace(sampled, max_tokens=40, ignore_eos=True),
        replace(greedy, max_tokens=40, stop=(stop_text,), ignore_eos=True),
        replace(sampled, max_tokens=17),
        replace(greedy, max_tokens=25, ignore_eos=True),
        replace(greedy, max_tokens=9, ignore_eos=True),
    ]
    return [
        GenerationRequest(f"r{i}", tok(PROMPTS[i % len(PROMPTS)])["input_ids"], sampling, arrival_time=time.monotonic())
        for i, sampling in enumerate(specs)
    ]


def run(loaded: LoadedModel, reqs: list[GenerationRequest], overlap: bool,
        graphs: CudaGraphMode = CudaGraphMode.NONE) -> tuple[Results, Engine, RecordingRunner]:
    engine, runner = make_engine(loaded, overlap, graphs)
    out = Results()
    for r in reqs:  # queued before the engine starts: the same admissions in every run
        engine.submit(r, out.sink(r.request_id))
    engine.start()
    out.wait([r.request_id for r in reqs])
    engine.stop()
    return out, engine, runner


@pytest.fixture(scope="module")
def stop_text(loaded: LoadedModel) -> str:
    """A piece of what the stop-string request generates alone by its 12th token, so it stops early."""
    probe = GenerationRequest("probe", loaded.tokenizer(PROMPTS[STOP_STRING_REQUEST])["input_ids"],
                              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=0),
                              arrival_time=time.monotonic())
    out, _, _ = run(loaded, [probe], overlap=False)
    text = out.text["probe"]
    assert len(text) > 6, text
    return text[-6:]


def test_outputs_match_without_overlap_and_alone(loaded: LoadedModel, stop_text: str):
    reqs = requests(loaded, stop_text)
    overlapped, engine, recorded = run(loaded, reqs, overlap=True)
    plain, _, _ = run(loaded, reqs, overlap=False)
    # The overlapped run reused its decode rows from launch to launch (input_batch.py) most of the time
    assert recorded.runner.input_batch.reused > 20
    for r in reqs:
        alone, _, _ = run(loaded, [r], overlap=True)
        assert overlapped.summary(r.request_id) == plain.summary(r.request_id) == alone.summary(r.request_id), r
    assert overlapped.finish[f"r{STOP_STRING_REQUEST}"].reason is FinishReason.STOP  # the stop string ended it early
    assert overlapped.finish["r0"].completion_tokens == 1
    # Nothing left behind: every slot free, nothing in flight, no output kept.
    assert engine.scheduler.num_free_slots == SLOTS and not engine.has_pending_work()


def test_step_t_plus_1_is_launched_before_step_t_is_read(loaded: LoadedModel, stop_text: str):
    _, _, runner = run(loaded, requests(loaded, stop_text), overlap=True)
    log = runner.log
    launches = [n for kind, n in log if kind == "launch"]
    assert [n for kind, n in log if kind == "collect"] == launches  # each read once, in order
    for n in launches[:-1]:
        assert log.index(("launch", n + 1)) < log.index(("collect", n)), n
    _, _, plain = run(loaded, requests(loaded, stop_text), overlap=False)
    assert plain.log[:4] == [("launch", 1), ("collect", 1), ("launch", 2), ("collect", 2)]


def test_no_row_is_wasted_on_a_request_that_ends_by_length(loaded: LoadedModel, stop_text: str):
    reqs = requests(loaded, stop_text)
    out, _, runner = run(loaded, reqs, overlap=True)
    for r in reqs:
        finish = out.finish[r.request_id]
        if finish.reason is FinishReason.LENGTH:
            assert runner.rows[r.request_id] == r.sampling.max_tokens, r.request_id
        else:  # found only when its token is read: at most the one step launched meanwhile is surplus
            assert finish.completion_tokens <= runner.rows[r.request_id] <= finish.completion_tokens + 1


def test_abort_while_a_step_is_in_flight(loaded: LoadedModel, stop_text: str):
    reqs = requests(loaded, stop_text)
    engine, runner = make_engine(loaded, overlap=True)
    out = Results()
    keys = {r.request_id: engine.submit(r, out.sink(r.request_id)) for r in reqs}
    aborted = "r5"
    launched = threading.Event()
    real_launch = runner.launch

    def launch(step):  # noqa: ANN001, ANN202
        handle = real_launch(step)
        if any(s.request_id == aborted and s.num_completion_tokens >= 3 for s in step.decodes):
            launched.set()
        return handle

    runner.launch = launch  # type: ignore[method-assign]
    engine.start()
    assert launched.wait(60)
    engine.abort(keys[aborted])
    out.wait([r.request_id for r in reqs])
    engine.stop()
    finish = out.finish[aborted]
    assert isinstance(finish, Finish) and finish.reason is FinishReason.ABORT
    assert 3 <= len(out.tokens[aborted]) < reqs[5].sampling.max_tokens
    plain, _, _ = run(loaded, reqs, overlap=False)
    for r in reqs:
        if r.request_id != aborted:
            assert out.summary(r.request_id) == plain.summary(r.request_id), r.request_id
    assert engine.scheduler.num_free_slots == SLOTS and not engine.has_pending_work()
