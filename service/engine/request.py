"""Domain types of one generation request and the events the engine publishes for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The request's vocabulary lives in its own module; a request is written with it.
from service.engine.sampling_params import CONSTRAINT_KINDS, MAX_LOGPROBS, Constraint, SamplingParams  # noqa: F401


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class GenerationRequest:
    """A validated request, already tokenized, as the engine receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # resolved (validation.resolve): seed and max_tokens set
    stream_interval: int = 1
    arrival_time: float = 0.0  # time.monotonic() at arrival
    adapter: str = ""  # a loaded LoRA adapter's name; "" is the base model
    # Whether the client reads the completion's text. The vLLM protocol streams token ids only: its
    # deltas carry no text unless stop strings need the text decoded anyway.
    stream_text: bool = True

    def __post_init__(self) -> None:
        assert self.sampling.seed is not None and self.sampling.max_tokens is not None, (
            "the engine takes resolved sampling parameters (validation.resolve): a seed and max_tokens")


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely tokens at its position, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)
    rank: int = 1  # the token's rank in the vocabulary by log-probability (1: the most likely)


@dataclass(slots=True)  # not frozen: one is made per token of every stream, and a frozen one costs 4x to make
class TokenDelta:
    """New completion tokens and the text they complete (valid UTF-8, may be empty; always empty for
    a request that streams no text and has no stop strings). Not changed once made."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked for them
    # In a request's first delta when it asked for prompt logprobs: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


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
class ConstraintFailed(EngineError):
    """The request's constraint was refused or gave up (bad input, not a fault): over a compile or
    mask budget, or the grammar library could not follow it. Never a normal finish: the output so
    far does not follow the constraint to its end. INVALID_ARGUMENT."""

    kind: str = ""  # the constraint's kind ("regex", ...): protocols name the field with it


@dataclass(frozen=True)
class EngineBusy(EngineError):
    """The engine could not take this request now (every grammar worker taken): RESOURCE_EXHAUSTED,
    retry later."""


@dataclass(frozen=True)
class AdapterGone(EngineError):
    """The request's adapter was unloaded after the request was accepted (an unload raced it): the
    caller must load it again or pick another; retrying elsewhere does not help."""


@dataclass(frozen=True)
class StepTokens:
    """A step's sampled tokens on the host, one per sampling row, and their log-probabilities
    (None for a row that asked for none; the list is None when no row did)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    # Prompt logprobs the step computed: (sequence key, first prompt position, one per position from
    # there: the log-probability of the prompt token after it).
    prompt_logprobs: tuple[tuple[str, int, list[TokenLogprobs]], ...] = ()


RequestEvent = TokenDelta | Finish | EngineError

