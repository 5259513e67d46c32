"""Request validation, the one source of truth for every way in: both gRPC protocols
(service/server/inference_servicer.py, vllm_servicer.py) and the Python API (service/llm.py).

Protocol-free: each caller hands over plain values and a `Fields` that names them as its users
spell them, so every message names the field and says what to change. Runs before admission and
never lets a malformed request reach the engine.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.config import ServeConfig
from service.engine.constraint_limits import ConstraintLimits, InvalidConstraint, check_size, too_many_choices
from service.engine.request import CONSTRAINT_KINDS, Constraint, GenerationRequest
from service.engine.sampling_params import (
    GRAPHSERVE_FIELDS,
    GREEDY_TEMPERATURE_EPSILON,
    MAX_SAMPLES,
    Fields,
    InvalidRequest,
    SamplingParams,
    need,
)

__all__ = ["GRAPHSERVE_FIELDS", "MAX_SAMPLES", "Fields", "InvalidRequest", "Limits", "SamplingParams", "need"]

MAX_REQUEST_ID_BYTES = 256
MAX_STREAM_INTERVAL = 1024
# The first prefix a long prompt is tokenized in: this many characters per token of context.
_CHARS_PER_TOKEN_GUESS = 4


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


def constraint_of(p: Any, limits: Limits, f: Fields) -> Constraint | None:
    """The structured-output constraint of a sampling message: graphserve.v1's SamplingParams and
    vLLM's name the oneof (`constraint`) and its fields alike. A kind graphserve does not serve
    (vLLM's structural_tag) is refused by the caller's field checks, not mapped. Too many choices
    are refused before they become Python strings (150,000 of them: 13 ms holding the gRPC
    process's GIL, which every stream's messages wait on)."""
    kind = p.WhichOneof("constraint")
    if kind not in CONSTRAINT_KINDS or (kind == "json_object" and not p.json_object):
        return None
    if kind == "choice":
        choices = p.choice.choices
        if len(choices) > limits.constraints.max_constraint_choices:
            raise InvalidRequest(constraint_message("choice", too_many_choices(len(choices), limits.constraints), f))
        return Constraint("choice", tuple(choices))
    return Constraint(kind, "" if kind == "json_object" else getattr(p, kind))


def check_constraint(c: Constraint | None, limits: Limits, f: Fields) -> None:
    """A constraint within the size limits (a linear scan, no compile: the engine's grammar workers
    compile it under their budget). INVALID_ARGUMENT names the field and the limit."""
    if c is None:
        return
    try:
        check_size(c, limits.constraints)
    except InvalidConstraint as exc:
        raise InvalidRequest(constraint_message(c.kind, str(exc), f)) from None


def constraint_message(kind: str, detail: str, f: Fields) -> str:
    """A constraint's error as a protocol names the field: "sampling.regex: ..."."""
    return f"{f.sampling}{kind}: {detail}"


def resolve(p: SamplingParams, prompt_len: int, limits: Limits, f: Fields) -> SamplingParams:
    """p checked against this server (its context, vocabulary and limits), with what the client left
    to the server filled in: a seed drawn when none was given, max_tokens (the default, capped by
    the room the context leaves), a temperature below 1e-5 made greedy. InvalidRequest names the
    first bad field."""
    need(prompt_len < limits.max_seq_len,
         f"the prompt has {prompt_len} tokens; the context holds {limits.max_seq_len} ({f.max_seq_len}): shorten it")
    room = limits.max_seq_len - prompt_len
    if p.max_tokens is not None:
        need(p.max_tokens <= limits.max_tokens_limit,
             f"{f.stopping}max_tokens is {p.max_tokens}, over the server limit of {limits.max_tokens_limit}")
        need(p.max_tokens <= room,
             f"prompt ({prompt_len} tokens) plus {f.stopping}max_tokens ({p.max_tokens}) exceeds the context of "
             f"{limits.max_seq_len} tokens ({f.max_seq_len}): ask for at most {room}")
    max_tokens = p.max_tokens if p.max_tokens is not None else min(limits.default_max_tokens, room)
    need(len(p.stop) <= limits.max_stop_strings,
         f"{f.stopping}stop has {len(p.stop)} strings; at most {limits.max_stop_strings} are allowed")
    for text in p.stop:
        need(len(text.encode("utf-8", "surrogatepass")) <= limits.max_stop_string_bytes,
             f"a {f.stopping}stop string is longer than {limits.max_stop_string_bytes} bytes")
    need(p.min_tokens <= max_tokens,
         f"{f.stopping}min_tokens ({p.min_tokens}) is above {f.stopping}max_tokens ({max_tokens}): lower it")
    need(len(p.stop_token_ids) <= limits.max_stop_token_ids,
         f"{f.stopping}stop_token_ids has {len(p.stop_token_ids)} ids; at most {limits.max_stop_token_ids} are allowed")
    bad = next((i for i in p.stop_token_ids if not 0 <= i < limits.vocab_size), None)
    need(bad is None, f"{f.stopping}stop_token_ids: id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    bad = next((t for t, _ in p.logit_bias if not 0 <= t < limits.vocab_size), None)
    need(bad is None, f"{f.sampling}logit_bias: token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    check_constraint(p.constraint, limits, f)
    return dataclasses.replace(
        p, max_tokens=max_tokens, seed=p.seed if p.seed is not None else secrets.randbits(63),
        temperature=0.0 if p.temperature < GREEDY_TEMPERATURE_EPSILON else p.temperature, fields=f)


def generation_request(request_id: str, prompt: list[int], p: SamplingParams, limits: Limits, f: Fields, *,
                       adapter: str = "", stream_interval: int = 1, arrival_time: float | None = None,
                       stream_text: bool = True) -> GenerationRequest:
    """The engine's request for checked values; InvalidRequest names the first bad field."""
    return GenerationRequest(
        request_id=request_id,
        adapter=adapter,
        prompt_token_ids=prompt,
        sampling=resolve(p, len(prompt), limits, f),
        stream_interval=stream_interval,
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        stream_text=stream_text,
    )


def samples(gen: GenerationRequest) -> list[GenerationRequest]:
    """The request's n samples (its SamplingParams.n): the same prompt (they share its KV blocks
    through the prefix cache: the scheduler runs the first's prefill, then the others take its
    blocks), seeds seed, seed + 1, ... so that each is reproducible and they differ."""
    p = gen.sampling
    return [gen] + [dataclasses.replace(gen, sampling=dataclasses.replace(p, seed=(p.seed + i) % 2**64))
                    for i in range(1, p.n)]
