"""The engine's interfaces: what it drives (`Runner`), whom it tells what it did (`EngineObserver`),
where its events go (`Sink`, `Publish`, `deliver`), and what it raises when it takes no more work
(`EngineStopped`). Torch-free: the engine's callers import them without the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from service.engine.request import Finish, RequestEvent, StepTokens
from service.engine.scheduled_step import ScheduledStep
from service.engine.sequence import Sequence

Sink = Callable[[RequestEvent], None]


class EngineStopped(RuntimeError):
    """The engine accepts no more work (it failed or is shutting down)."""


Publish = Callable[[list[tuple[Sink, RequestEvent]]], None]


class Runner(Protocol):
    def launch(self, step: ScheduledStep, before_sampling: Callable[[], None] | None = None) -> Any:
        """Queue one forward pass over the step's decodes (one token each) and prompt chunks; returns
        a handle for `collect`. A decode may have a token pending from the previous launch: the
        runner feeds it on the device. before_sampling (given only while a constrained request
        runs) is called after the forward pass is queued and before the tokens are sampled."""
        ...

    def collect(self, launched: Any) -> StepTokens:
        """The launched step's sampled tokens: one per decode, 1 + k per verify row (the target's
        token after each of its tokens), then one per chunk that completes its prompt
        (ScheduledStep.sampling's order), with the log-probabilities rows asked for."""
        ...

    def take_failed_constraints(self) -> list[tuple[Sequence, str]]:
        """The sequences whose grammar mask failed in the launches since the last call, and why
        (their rows sampled anyway: those tokens are to be discarded)."""
        ...

    def take_sat_out(self) -> list[Sequence]:
        """The decodes whose grammar mask was not ready in the launches since the last call (their
        rows sampled anyway: those tokens are void, and the positions are computed again)."""
        ...


class EngineObserver(Protocol):
    """Receives what the engine did, for metrics. Called on the engine thread."""

    def on_step(self, num_running: int, num_waiting: int, num_decode: int, num_prefill: int) -> None: ...
    def on_tokens(self, seqs: list[Sequence], now: float) -> None:
        """One new completion token of each of seqs: a step's, read at `now`."""
    def on_finish(self, seq: Sequence, finish: Finish) -> None: ...
    def on_step_gap(self, seconds: float) -> None:
        """Time since the previous step that delivered tokens, while streams were running: the gap
        every running stream saw (a stall of any cause, e.g. a capture beside the step, shows here)."""
    def on_speculation(self, num_drafts: int, num_draft_tokens: int, accepted: list[int]) -> None:
        """A step's verify rows: how many, their draft tokens, and per row the draft tokens accepted."""
    def on_speculative_k(self, k: int) -> None:
        """A step whose decodes were offered at most k draft tokens each (adaptive k; 0: none)."""


def deliver(pairs: list[tuple[Sink, RequestEvent]]) -> None:
    """Call each sink with its event, in order (on the calling thread)."""
    for sink, event in pairs:
        sink(event)
