"""Domain types of one generation request and the events the engine publishes for it."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORT = "abort"


MAX_LOGPROBS = 20  # top log-probabilities per token at most (the OpenAI API's limit)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """Structured output: the completion follows a JSON schema, any JSON object, a regex (the whole
    output), an EBNF grammar (GBNF with a `root` rule, or Lark) or one of a list of choices
    (service/engine/structured.py compiles it)."""

    kind: str  # one of CONSTRAINT_KINDS
    value: str | tuple[str, ...] = ""  # schema text, regex, grammar, or the choices ("" for json_object)

    def __post_init__(self) -> None:
        if isinstance(self.value, list):  # keep it hashable: it is the compiler's cache key
            object.__setattr__(self, "value", tuple(self.value))


@dataclass(frozen=True)
class SamplingParams:
    """How a request's next token is chosen (service/engine/sampler.py applies it, in vLLM's order:
    logit bias and min_tokens, then the penalties, then temperature, min_p, top-k and top-p)."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = 0  # 0 disables
    seed: int = 0  # always set: the servicer assigns one when the client gave none
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 disables
    # OpenAI's penalties, on the completion's tokens only: logit -= presence * (count > 0) + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The CTRL / transformers penalty on every token of the prompt and the completion: a positive
    # logit is divided by it, a negative one multiplied. 1 disables.
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and the stop token ids are not sampled before this many completion tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # Log-probabilities of each sampled token and of the `logprobs` most likely ones (None: none;
    # 0: the sampled token's only). They are the model's (log_softmax of its logits), before any of
    # the processing above, as vLLM reports them.
    logprobs: int | None = None
    constraint: Constraint | None = None  # the grammar the completion must follow
    # Log-probabilities of each prompt token after the first (given the tokens before it) and of the
    # `prompt_logprobs` most likely ones there (None: none). Such a prompt is computed whole: it takes
    # nothing from the prefix cache (the cached part has no logits).
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # the fields are frozen; the engine asks per row per step
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy and nothing else that changes the logits or asks for more than the token (a grammar
        aside: its mask applies either way): such a row samples the argmax."""
        return (self.temperature == 0.0 and not self.logit_bias and not self.penalized and self.logprobs is None
                and self.min_tokens == 0)


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
    # Whether the client reads the completion's text. The vLLM protocol streams token ids only: its
    # deltas carry no text unless stop strings need the text decoded anyway.
    stream_text: bool = True


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely tokens at its position, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


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

