"""The engine thread with a scripted runner: every request ends with exactly one terminal event,
whatever happens around it (aborts racing resubmits, a failing step, shutdown)."""

from __future__ import annotations

import threading
import time

from service.engine.engine import Engine
from service.engine.request import (
    EngineError,
    Finish,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StepTokens,
)
from service.engine.scheduler import Scheduler


class LetterTokenizer:
    def decode(self, ids, **_: object) -> str:  # noqa: ANN001
        return "".join(chr(97 + i % 26) for i in ids)


class ScriptedRunner:
    """Returns token 1 for every sequence; can be paused and made to fail."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self.fail_from_call: int | None = None

    def launch(self, step) -> list[int]:  # noqa: ANN001
        self.gate.wait(10)
        self.calls += 1
        if self.fail_from_call is not None and self.calls >= self.fail_from_call:
            raise RuntimeError("scripted failure")
        return [1] * (len(step.decodes) + sum(chunk.completes_prompt for chunk in step.prefills))

    def collect(self, launched: list[int]) -> StepTokens:
        return StepTokens(launched)

    def take_failed_constraints(self) -> list:
        return []

    def take_sat_out(self) -> list:
        return []


class Collector:
    def __init__(self) -> None:
        self.events: dict[str, list] = {}
        self.done = threading.Condition()

    def sink(self, name: str):  # noqa: ANN201
        def put(event) -> None:  # noqa: ANN001
            with self.done:
                self.events.setdefault(name, []).append(event)
                self.done.notify_all()
        return put

    def terminal(self, name: str, timeout: float = 10.0):  # noqa: ANN201
        deadline = time.monotonic() + timeout
        with self.done:
            while not any(isinstance(e, (Finish, EngineError)) for e in self.events.get(name, [])):
                assert self.done.wait(max(0.0, deadline - time.monotonic())), f"{name}: no terminal event"
            terminals = [e for e in self.events[name] if isinstance(e, (Finish, EngineError))]
            assert len(terminals) == 1, terminals
            return terminals[0]


def request(request_id: str, max_tokens: int = 10**9) -> GenerationRequest:
    return GenerationRequest(request_id, [5, 6, 7],
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0),
                             arrival_time=time.monotonic())


def make_engine() -> tuple[Engine, ScriptedRunner, Collector]:
    runner = ScriptedRunner()
    engine = Engine(runner, Scheduler(4, 1000), LetterTokenizer(), frozenset())
    engine.start()
    return engine, runner, Collector()


def test_abort_then_resubmit_of_the_same_request_id() -> None:
    engine, runner, out = make_engine()
    runner.gate.clear()  # hold the engine inside a step
    first = engine.submit(request("same"), out.sink("first"))
    time.sleep(0.1)
    engine.abort(first)
    engine.submit(request("same", max_tokens=3), out.sink("second"))
    runner.gate.set()
    assert out.terminal("first").reason is FinishReason.ABORT
    second = out.terminal("second")
    assert second.reason is FinishReason.LENGTH and second.completion_tokens == 3
    assert engine.alive and engine.scheduler.num_running == 0
    engine.stop()


def test_a_failing_step_still_delivers_the_events_it_built() -> None:
    engine, runner, out = make_engine()
    runner.gate.clear()  # the first step (both prefills) waits here
    aborted = engine.submit(request("aborted"), out.sink("aborted"))
    engine.submit(request("running"), out.sink("running"))
    time.sleep(0.1)
    engine.abort(aborted)
    runner.fail_from_call = 2  # the next step reports the abort, then its decode fails
    runner.gate.set()
    assert out.terminal("aborted").reason is FinishReason.ABORT
    assert isinstance(out.terminal("running"), EngineError)
    assert not engine.alive


def test_stop_ends_every_running_and_queued_request() -> None:
    engine, runner, out = make_engine()
    for name in ("a", "b", "c", "d", "e", "f"):  # 4 slots: two stay queued
        engine.submit(request(name), out.sink(name))
    time.sleep(0.2)
    engine.stop()
    for name in ("a", "b", "c", "d", "e", "f"):
        assert isinstance(out.terminal(name), EngineError)


def test_a_request_waiting_behind_paused_sequences_does_not_spin_the_engine() -> None:
    """Every slot held by a sequence paused for back-pressure and a request waiting for one: the
    engine thread waits for what can change that (a resume, an abort, a new request), it does not
    step in a loop; the waiting request runs once a slot frees."""
    runner = ScriptedRunner()
    engine = Engine(runner, Scheduler(1, 1000), LetterTokenizer(), frozenset())
    schedules = [0]
    schedule = engine.scheduler.schedule

    def counted():  # noqa: ANN202
        schedules[0] += 1
        return schedule()

    engine.scheduler.schedule = counted
    engine.start()
    out = Collector()
    held = engine.submit(request("held"), out.sink("held"))
    deadline = time.monotonic() + 10
    while len(out.events.get("held", [])) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.pause(held, True)
    engine.submit(request("waiting", max_tokens=3), out.sink("waiting"))
    time.sleep(0.2)
    before = schedules[0]
    time.sleep(0.5)
    assert schedules[0] - before <= 3, f"{schedules[0] - before} steps in 0.5 s with nothing to run"
    assert "waiting" not in out.events
    engine.abort(held)
    assert out.terminal("held").reason is FinishReason.ABORT
    finished = out.terminal("waiting")
    assert finished.reason is FinishReason.LENGTH and finished.completion_tokens == 3
    engine.stop()
