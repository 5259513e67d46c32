"""Request validation, the one source of truth for every way in: both gRPC protocols
(service/server/inference_servicer.py, vllm_servicer.py) and the Python API (service/llm.py).

Protocol-free: each caller hands over plain values and a `Fields` that names them as its users
spell them, so every message names the field and says what to change. Runs before admission and
never lets a malformed request reach the engine.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.config import ServeConfig
from service.engine.constraint_limits import ConstraintLimits, InvalidConstraint, check_size
from service.engine.request import (
    CONSTRAINT_KINDS,
    MAX_LOGPROBS,
    Constraint,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)

MAX_REQUEST_ID_BYTES = 256
MAX_STREAM_INTERVAL = 1024
# The first prefix a long prompt is tokenized in: this many characters per token of context.
_CHARS_PER_TOKEN_GUESS = 4
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS). Sampling at a temperature t -> 0 tends
# to argmax, which greedy computes exactly; dividing the logits by a tiny t does not: 1e-45 makes
# them +-inf in float32 and the sampler picks the first infinite one, a degenerate stream. Mapped,
# not refused: OpenAI-style clients send tiny temperatures to mean "deterministic".
GREEDY_TEMPERATURE_EPSILON = 1e-5
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| at most, as in the OpenAI API
MAX_SAMPLES = 16  # n: completions of one prompt per request
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most, as in the OpenAI API


class InvalidRequest(ValueError):
    """Bad input from the client: becomes INVALID_ARGUMENT with this message."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int
    default_max_tokens: int
    max_tokens_limit: int
    max_prompt_bytes: int
    max_stop_strings: int
    max_stop_string_bytes: int
    max_stop_token_ids: int
    max_chat_messages: int = 1024
    allow_chat_special_tokens: bool = False
    constraints: ConstraintLimits = ConstraintLimits()  # sizes checked here; the engine's workers compile

    @classmethod
    def from_config(cls, config: ServeConfig, vocab_size: int) -> Limits:
        return cls(
            constraints=config.constraint_limits,
            vocab_size=vocab_size,
            max_seq_len=config.max_seq_len,
            default_max_tokens=config.default_max_tokens,
            max_tokens_limit=config.max_tokens_limit,
            max_prompt_bytes=config.max_prompt_bytes,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_bytes=config.max_stop_string_bytes,
            max_stop_token_ids=config.max_stop_token_ids,
            max_chat_messages=config.max_chat_messages,
            allow_chat_special_tokens=config.allow_chat_special_tokens,
        )


@dataclass(frozen=True)
class Fields:
    """How one way in names the values it checks (for the messages)."""

    sampling: str  # prefix of the sampling fields: "sampling." -> "sampling.temperature"
    stopping: str  # prefix of the stopping fields
    prompt_ids: str  # the prompt's token ids
    max_seq_len: str  # the setting that bounds the context


GRAPHSERVE_FIELDS = Fields("sampling.", "stopping.", "prompt.token_ids", "--max-seq-len")


@dataclass(frozen=True)
class RequestValues:
    """What every protocol's request comes down to, before the checks. None: not given."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Sequence[tuple[int, float]] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None
    prompt_logprobs: int | None = None


def need(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def check_prompt_ids(ids: Sequence[int], limits: Limits, f: Fields) -> list[int]:
    """Token ids of a prompt: non-empty, in the vocabulary, leaving room for one completion token."""
    need(len(ids) > 0, f"{f.prompt_ids} is empty: send at least one token id")
    need(len(ids) < limits.max_seq_len,
         f"{f.prompt_ids} has {len(ids)} tokens; the context holds {limits.max_seq_len} ({f.max_seq_len}): shorten it")
    bad = next((i for i in ids if not 0 <= i < limits.vocab_size), None)
    need(bad is None, f"{f.prompt_ids}: token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    return list(ids)


def encode_capped(tokenizer: Any, text: str, max_tokens: int, field: str = "prompt.text",
                  add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`, or InvalidRequest as soon as a prefix has more than `max_tokens`.

    Tokenizes prefixes of growing length (cut before whitespace, where tokenizers split words anyway),
    so a megabyte of text costs memory in proportion to the context, not to the bytes sent: the
    tokenizer's per-token buffers are the expensive part, several hundred bytes a token.
    """
    window = _CHARS_PER_TOKEN_GUESS * (max_tokens + 1)
    while len(text) > window:
        ids = tokenizer.encode(text[:_cut(text, window)], add_special_tokens=add_special_tokens)
        need(len(ids) <= max_tokens, too_many_tokens(field, max_tokens))
        window *= 2
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def too_many_tokens(field: str, max_tokens: int) -> str:
    return f"{field} has more than {max_tokens} tokens; the context holds {max_tokens + 1} (--max-seq-len): shorten it"


def _cut(text: str, end: int) -> int:
    """Where to end a prefix of about `end` characters: before the last space, newline or tab in its
    second half, else at `end`."""
    cut = max(text.rfind(ch, end // 2, end + 1) for ch in " \n\t")
    return cut if cut > 0 else end


def request_id_of(given: str) -> str:
    """The client's id, checked, or a fresh one when it sent none."""
    request_id = given or uuid.uuid4().hex
    need(len(request_id.encode("utf-8", "surrogatepass")) <= MAX_REQUEST_ID_BYTES,
         f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes")
    need(request_id.isprintable(), "request_id must be printable text")
    return request_id


def check_adapter(name: str, loaded: set[str] | frozenset[str], field: str = "adapter") -> None:
    """An adapter name must be one of the loaded ones (empty: the base model)."""
    if name and name not in loaded:
        shown = ", ".join(repr(n) for n in sorted(loaded)[:32]) or "none"
        raise InvalidRequest(f"{field} {name!r} is not loaded; loaded adapters: {shown} (leave {field} empty for "
                             "the base model)")


def check_sampling(v: RequestValues, f: Fields) -> None:
    """The sampling values alone (the Python API checks them when SamplingParams is made)."""
    if v.temperature is not None:
        need(math.isfinite(v.temperature) and v.temperature >= 0,
             f"{f.sampling}temperature must be a finite number >= 0 (below {GREEDY_TEMPERATURE_EPSILON:g} is greedy), "
             f"got {v.temperature}")
    if v.top_p is not None:
        need(math.isfinite(v.top_p) and 0 < v.top_p <= 1, f"{f.sampling}top_p must be in (0, 1], got {v.top_p}")
    need(v.top_k >= 0, f"{f.sampling}top_k must be >= 0 (0 is off), got {v.top_k}")
    need(v.seed is None or 0 <= v.seed < 2**64, f"{f.sampling}seed must be in [0, 2**64), got {v.seed}")
    need(math.isfinite(v.min_p) and 0 <= v.min_p <= 1, f"{f.sampling}min_p must be in [0, 1] (0 is off), got {v.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(v, name)
        need(math.isfinite(value) and abs(value) <= MAX_PENALTY,
             f"{f.sampling}{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got {value}")
    need(math.isfinite(v.repetition_penalty) and v.repetition_penalty > 0,
         f"{f.sampling}repetition_penalty must be a finite number > 0 (1 is off), got {v.repetition_penalty}")
    need(v.min_tokens >= 0, f"{f.stopping}min_tokens must be >= 0, got {v.min_tokens}")
    need(v.logprobs is None or 0 <= v.logprobs <= MAX_LOGPROBS,
         f"{f.sampling}logprobs must be in [0, {MAX_LOGPROBS}] (the top tokens reported per position), "
         f"got {v.logprobs}")
    need(v.prompt_logprobs is None or 0 <= v.prompt_logprobs <= MAX_LOGPROBS,
         f"{f.sampling}prompt_logprobs must be in [0, {MAX_LOGPROBS}] (the top tokens reported per prompt "
         f"position; the whole vocabulary, -1, is not served), got {v.prompt_logprobs}")
    need(len(v.logit_bias) <= MAX_LOGIT_BIAS,
         f"{f.sampling}logit_bias has {len(v.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for token, bias in v.logit_bias:
        need(math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS_VALUE,
             f"{f.sampling}logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], "
             f"got {bias}")


def constraint_of(p: Any) -> Constraint | None:
    """The structured-output constraint of a sampling message: graphserve.v1's SamplingParams and
    vLLM's name the oneof (`constraint`) and its fields alike. A kind graphserve does not serve
    (vLLM's structural_tag) is refused by the caller's field checks, not mapped."""
    kind = p.WhichOneof("constraint")
    if kind not in CONSTRAINT_KINDS or (kind == "json_object" and not p.json_object):
        return None
    if kind == "choice":
        return Constraint("choice", tuple(p.choice.choices))
    return Constraint(kind, "" if kind == "json_object" else getattr(p, kind))


def check_constraint(v: RequestValues, limits: Limits, f: Fields) -> None:
    """The request's constraint within the size limits (a linear scan, no compile: the engine's
    grammar workers compile it under their budget). INVALID_ARGUMENT names the field and the limit."""
    if v.constraint is None:
        return
    try:
        check_size(v.constraint, limits.constraints)
    except InvalidConstraint as exc:
        raise InvalidRequest(constraint_message(v.constraint.kind, str(exc), f)) from None


def constraint_message(kind: str, detail: str, f: Fields) -> str:
    """A constraint's error as a protocol names the field: "sampling.regex: ..."."""
    return f"{f.sampling}{kind}: {detail}"


def check_logit_bias_ids(v: RequestValues, vocab_size: int, f: Fields) -> None:
    bad = next((t for t, _ in v.logit_bias if not 0 <= t < vocab_size), None)
    need(bad is None, f"{f.sampling}logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")


def sampling_params(v: RequestValues, f: Fields) -> SamplingParams:
    check_sampling(v, f)
    seed = v.seed if v.seed is not None else secrets.randbits(63)
    temperature = 1.0 if v.temperature is None else float(v.temperature)
    if temperature < GREEDY_TEMPERATURE_EPSILON:
        temperature = 0.0
    return SamplingParams(temperature=temperature,
                          top_p=1.0 if v.top_p is None else float(v.top_p), top_k=int(v.top_k), seed=int(seed),
                          min_p=float(v.min_p), presence_penalty=float(v.presence_penalty),
                          frequency_penalty=float(v.frequency_penalty),
                          repetition_penalty=float(v.repetition_penalty), min_tokens=int(v.min_tokens),
                          logit_bias=tuple(sorted((int(t), float(b)) for t, b in v.logit_bias)),
                          logprobs=None if v.logprobs is None else int(v.logprobs), constraint=v.constraint,
                          prompt_logprobs=None if v.prompt_logprobs is None else int(v.prompt_logprobs))


def stopping_params(v: RequestValues, prompt_len: int, limits: Limits, f: Fields) -> StoppingParams:
    need(prompt_len < limits.max_seq_len,
         f"the prompt has {prompt_len} tokens; the context holds {limits.max_seq_len} ({f.max_seq_len}): shorten it")
    room = limits.max_seq_len - prompt_len
    if v.max_tokens is not None:
        max_tokens = v.max_tokens
        need(max_tokens >= 1, f"{f.stopping}max_tokens must be >= 1")
        need(max_tokens <= limits.max_tokens_limit,
             f"{f.stopping}max_tokens is {max_tokens}, over the server limit of {limits.max_tokens_limit}")
        need(max_tokens <= room,
             f"prompt ({prompt_len} tokens) plus {f.stopping}max_tokens ({max_tokens}) exceeds the context of "
             f"{limits.max_seq_len} tokens ({f.max_seq_len}): ask for at most {room}")
    else:
        max_tokens = min(limits.default_max_tokens, room)
    stops = tuple(v.stop)
    need(len(stops) <= limits.max_stop_strings,
         f"{f.stopping}stop has {len(stops)} strings; at most {limits.max_stop_strings} are allowed")
    for text in stops:
        need(text != "", f"{f.stopping}stop contains an empty string")
        need(len(text.encode("utf-8", "surrogatepass")) <= limits.max_stop_string_bytes,
             f"a {f.stopping}stop string is longer than {limits.max_stop_string_bytes} bytes")
    need(v.min_tokens <= max_tokens,
         f"{f.stopping}min_tokens ({v.min_tokens}) is above {f.stopping}max_tokens ({max_tokens}): lower it")
    ids = tuple(v.stop_token_ids)
    need(len(ids) <= limits.max_stop_token_ids,
         f"{f.stopping}stop_token_ids has {len(ids)} ids; at most {limits.max_stop_token_ids} are allowed")
    bad = next((i for i in ids if not 0 <= i < limits.vocab_size), None)
    need(bad is None, f"{f.stopping}stop_token_ids: id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    return StoppingParams(max_tokens=max_tokens, stop=stops, stop_token_ids=ids, ignore_eos=v.ignore_eos)


def generation_request(request_id: str, prompt: list[int], v: RequestValues, limits: Limits, f: Fields, *,
                       adapter: str = "", stream_interval: int = 1, arrival_time: float | None = None,
                       stream_text: bool = True) -> GenerationRequest:
    """The engine's request for checked values; InvalidRequest names the first bad field."""
    check_logit_bias_ids(v, limits.vocab_size, f)
    return GenerationRequest(
        request_id=request_id,
        adapter=adapter,
        prompt_token_ids=prompt,
        sampling=sampling_params(v, f),
        stopping=stopping_params(v, len(prompt), limits, f),
        stream_interval=stream_interval,
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        stream_text=stream_text,
    )


def check_samples(n: int, field: str = "n") -> None:
    """n, the number of samples of one prompt (the Python API checks it when SamplingParams is made)."""
    need(1 <= n <= MAX_SAMPLES, f"{field} must be in [1, {MAX_SAMPLES}], got {n}")


def samples(gen: GenerationRequest, n: int, field: str = "n") -> list[GenerationRequest]:
    """The n samples of one request: the same prompt (they share its KV blocks through the prefix
    cache: the scheduler runs the first's prefill, then the others take its blocks), seeds seed,
    seed + 1, ... so that each is reproducible and they differ."""
    check_samples(n, field)
    return [gen] + [dataclasses.replace(gen, sampling=dataclasses.replace(
        gen.sampling, seed=(gen.sampling.seed + i) % 2**64)) for i in range(1, n)]
