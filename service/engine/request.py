"""Domain types of one generation request and the events the engine publishes for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = 0  # 0 disables
    seed: int = 0  # always set: the servicer assigns one when the client gave none

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class StoppingParams:
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class GenerationRequest:
    """A validated request, already tokenized, as the engine receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    stream_interval: int = 1
    arrival_time: float = 0.0  # time.monotonic() at arrival
    adapter: str = ""  # a loaded LoRA adapter's name; "" is the base model


@dataclass(frozen=True)
class TokenDelta:
    """New completion tokens and the text they complete (valid UTF-8, may be empty)."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Finish:
    """The terminal event of a request: exactly one per request."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    matched_stop: str | int | None = None  # the stop string or stop token id that ended it
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    queue_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    total_seconds: float = 0.0
    seed: int = 0
    # Tokens and text produced since the last TokenDelta; delivered before the finish.
    final_delta: TokenDelta | None = None


@dataclass(frozen=True)
class EngineError:
    """The engine failed this request (a fault, not bad input): the stream ends with this message."""

    message: str


@dataclass(frozen=True)
class AdapterGone(EngineError):
    """The request's adapter was unloaded after the request was accepted (an unload raced it): the
    caller must load it again or pick another; retrying elsewhere does not help."""


RequestEvent = TokenDelta | Finish | EngineError

