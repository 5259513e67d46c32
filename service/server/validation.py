"""Request validation: every check names the field and says what to change.

Runs before admission, on the event loop, and never lets a malformed request reach the engine.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from service.chat import ChatError, chat_prompt_ids
from service.config import ServeConfig
from service.engine.request import GenerationRequest, SamplingParams, StoppingParams
from service.proto import inference_pb2

MAX_REQUEST_ID_BYTES = 256
MAX_STREAM_INTERVAL = 1024
# The first prefix a long prompt is tokenized in: this many characters per token of context.
_CHARS_PER_TOKEN_GUESS = 4


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

    @classmethod
    def from_config(cls, config: ServeConfig, vocab_size: int) -> Limits:
        return cls(
            vocab_size=vocab_size,
            max_seq_len=config.max_seq_len,
            default_max_tokens=config.default_max_tokens,
            max_tokens_limit=config.max_tokens_limit,
            max_prompt_bytes=config.max_prompt_bytes,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_bytes=config.max_stop_string_bytes,
            max_stop_token_ids=config.max_stop_token_ids,
        )


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def prompt_bytes(request: inference_pb2.GenerateRequest) -> int:
    """Bytes of a text or chat prompt (at most one token per byte); 0 for token ids."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text.encode("utf-8", "surrogatepass"))
    if kind == "messages":
        return sum(len(m.content.encode("utf-8", "surrogatepass")) for m in request.messages.messages)
    return 0


def check_prompt_size(request: inference_pb2.GenerateRequest, limits: Limits) -> int:
    """Cheap checks done before any tokenization; returns the prompt's bytes (0 for token ids)."""
    kind = request.WhichOneof("prompt")
    _need(kind is not None, "prompt: set text, token_ids or messages")
    if kind == "messages":
        _need(len(request.messages.messages) > 0, "prompt.messages is empty: send at least one message")
        size = prompt_bytes(request)
        _need(size <= limits.max_prompt_bytes,
              f"prompt.messages hold {size} bytes, over the limit of {limits.max_prompt_bytes} bytes (--max-prompt-bytes)")
    elif kind == "text":
        size = prompt_bytes(request)
        _need(size > 0, "prompt.text is empty: send at least one character")
        _need(size <= limits.max_prompt_bytes,
              f"prompt.text is {size} bytes, over the limit of {limits.max_prompt_bytes} bytes (--max-prompt-bytes)")
    else:
        count = len(request.token_ids.ids)
        _need(count > 0, "prompt.token_ids is empty: send at least one token id")
        _need(count < limits.max_seq_len,
              f"prompt.token_ids has {count} tokens; the context holds {limits.max_seq_len} (--max-seq-len)")
        size = 0
    return size


def prompt_ids(request: inference_pb2.GenerateRequest, tokenizer: Any, limits: Limits) -> list[int]:
    if request.WhichOneof("prompt") == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((i for i in ids if i >= limits.vocab_size), None)
        _need(bad is None, f"prompt.token_ids: id {bad} is outside the vocabulary [0, {limits.vocab_size})")
        return ids
    if request.WhichOneof("prompt") == "messages":
        try:
            return chat_prompt_ids(tokenizer, list(request.messages.messages), model="this model")
        except ChatError as exc:
            raise InvalidRequest(str(exc)) from None
    ids = encode_capped(tokenizer, request.text, limits.max_seq_len - 1)
    _need(len(ids) > 0, "prompt.text encodes to no tokens")
    return ids


def encode_capped(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """The token ids of `text`, or InvalidRequest as soon as a prefix has more than `max_tokens`.

    Tokenizes prefixes of growing length (cut before whitespace, where tokenizers split words anyway),
    so a megabyte of text costs memory in proportion to the context, not to the bytes sent: the
    tokenizer's per-token buffers are the expensive part, several hundred bytes a token.
    """
    window = _CHARS_PER_TOKEN_GUESS * (max_tokens + 1)
    while len(text) > window:
        ids = tokenizer.encode(text[:_cut(text, window)], add_special_tokens=True)
        _need(len(ids) <= max_tokens,
              f"prompt.text has more than {max_tokens} tokens; the context holds {max_tokens + 1} (--max-seq-len): "
              "shorten it")
        window *= 2
    return tokenizer.encode(text, add_special_tokens=True)


def _cut(text: str, end: int) -> int:
    """Where to end a prefix of about `end` characters: before the last space, newline or tab in its
    second half, else at `end`."""
    cut = max(text.rfind(ch, end // 2, end + 1) for ch in " \n\t")
    return cut if cut > 0 else end


def request_id_of(request: inference_pb2.GenerateRequest) -> str:
    """The client's id, checked, or a fresh one when it sent none."""
    request_id = request.request_id or uuid.uuid4().hex
    _need(len(request_id.encode("utf-8", "surrogatepass")) <= MAX_REQUEST_ID_BYTES,
          f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes")
    _need(request_id.isprintable(), "request_id must be printable text")
    return request_id


def to_generation_request(
    request: inference_pb2.GenerateRequest, request_id: str, prompt: list[int], limits: Limits,
    arrival_time: float | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        adapter=request.adapter,
        prompt_token_ids=prompt,
        sampling=_sampling(request.sampling),
        stopping=_stopping(request.stopping, len(prompt), limits),
        stream_interval=_stream_interval(request),
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
    )


def check_adapter(request: inference_pb2.GenerateRequest, loaded: set[str] | frozenset[str]) -> None:
    """An adapter name must be one of the loaded ones (empty: the base model)."""
    name = request.adapter
    if name and name not in loaded:
        shown = ", ".join(repr(n) for n in sorted(loaded)[:32]) or "none"
        raise InvalidRequest(f"adapter {name!r} is not loaded; loaded adapters: {shown} (leave adapter empty for "
                             "the base model)")


def _sampling(s: inference_pb2.SamplingParams) -> SamplingParams:
    temperature = s.temperature if s.HasField("temperature") else 1.0
    _need(math.isfinite(temperature) and temperature >= 0,
          f"sampling.temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    _need(math.isfinite(top_p) and 0 < top_p <= 1, f"sampling.top_p must be in (0, 1], got {top_p}")
    # top_k is unsigned on the wire, so it cannot be negative; 0 disables it.
    seed = s.seed if s.HasField("seed") else secrets.randbits(63)
    return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=int(s.top_k), seed=int(seed))


def _stopping(s: inference_pb2.StoppingCriteria, prompt_len: int, limits: Limits) -> StoppingParams:
    _need(prompt_len < limits.max_seq_len,
          f"the prompt has {prompt_len} tokens; the context holds {limits.max_seq_len} (--max-seq-len): shorten it")
    room = limits.max_seq_len - prompt_len
    if s.HasField("max_tokens"):
        max_tokens = s.max_tokens
        _need(max_tokens >= 1, "stopping.max_tokens must be >= 1")
        _need(max_tokens <= limits.max_tokens_limit,
              f"stopping.max_tokens is {max_tokens}, over the server limit of {limits.max_tokens_limit}")
        _need(max_tokens <= room,
              f"prompt ({prompt_len} tokens) plus stopping.max_tokens ({max_tokens}) exceeds the context of "
              f"{limits.max_seq_len} tokens: ask for at most {room}")
    else:
        max_tokens = min(limits.default_max_tokens, room)
    stops = tuple(s.stop)
    _need(len(stops) <= limits.max_stop_strings,
          f"stopping.stop has {len(stops)} strings; at most {limits.max_stop_strings} are allowed")
    for text in stops:
        _need(text != "", "stopping.stop contains an empty string")
        _need(len(text.encode("utf-8", "surrogatepass")) <= limits.max_stop_string_bytes,
              f"a stopping.stop string is longer than {limits.max_stop_string_bytes} bytes")
    ids = tuple(s.stop_token_ids)
    _need(len(ids) <= limits.max_stop_token_ids,
          f"stopping.stop_token_ids has {len(ids)} ids; at most {limits.max_stop_token_ids} are allowed")
    bad = next((i for i in ids if i >= limits.vocab_size), None)
    _need(bad is None, f"stopping.stop_token_ids: id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    return StoppingParams(max_tokens=max_tokens, stop=stops, stop_token_ids=ids, ignore_eos=s.ignore_eos)


def _stream_interval(request: inference_pb2.GenerateRequest) -> int:
    if not request.HasField("stream_interval"):
        return 1
    value = request.stream_interval
    _need(1 <= value <= MAX_STREAM_INTERVAL, f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {value}")
    return value
