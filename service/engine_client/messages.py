"""The engine-process boundary: every message that crosses the pipe between the gRPC process
(process.py) and the engine process (worker.py), in both directions.

gRPC process -> engine process: `Submit`, `Abort`, `Pause`, `Call` (an `EngineCall` of calls.py
and its id), `Stop`. Engine process -> gRPC process: `EngineFacts` or `LoadFailed` once, at start; `Events`
per step (the engine's counters with the step's token deltas, finishes and errors);
`WorkerStatus` (the counters alone) every 0.2 s; `Reply` to each `Call`; `Stopped` last. The process itself starts
with a `WorkerSpec`.

Per step the engine sends one `Events` message, whose events stay the plain tuples (kind, key,
payload) that worker.encode_events makes: no object per token on the hot path.

Torch-free, like everything the engine process imports before its model: the types named only
in annotations are imported for the type checker alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine_client.client import EngineFacts

if TYPE_CHECKING:
    from service.engine.request import GenerationRequest
    from service.engine_client.calls import EngineCall

# Event kinds inside an Events message: (kind, key, payload); a step's KV events (kv_events.to_wire)
# have the key "".
DELTA, FINISH, ERROR, KV = "d", "f", "e", "k"


# ---- the engine process's start ----------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    config: Any  # ServeConfig
    faults: Any  # Faults


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
FromWorker = EngineFacts | LoadFailed | WorkerStatus | Events | Reply | Stopped
