"""Incremental detokenization: per-token text deltas at O(1) cost, never splitting a character."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tokenizers import decoders

from service.model.byte_level import BYTE_CHARS

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context of the first completion tokens: enough for tokenizers whose
# decoders strip a leading space from the first token of a sequence (SentencePiece "Metaspace"),
# so a completion that starts with "▁Paris" streams as " Paris", as it reads after the prompt.
_PROMPT_CONTEXT_TOKENS = 5


def new_detokenizer(tokenizer: Any, prompt_token_ids: list[int]) -> IncrementalDetokenizer | ByteDetokenizer:
    """The detokenizer of one request's completion: a ByteDetokenizer for a byte-level tokenizer,
    which gives the same deltas for less work, else an IncrementalDetokenizer."""
    table = token_bytes(tokenizer)
    return ByteDetokenizer(table) if table is not None else IncrementalDetokenizer(tokenizer, prompt_token_ids)


class IncrementalDetokenizer:
    """Streams the text of one request's completion tokens.

    Decodes a sliding window and emits only what it adds beyond the text of its first read_offset
    tokens (the prefix/read offsets of TGI and vLLM): the window holds the last emitted chunk as
    context plus the tokens not yet emitted, so each step costs O(1) in the length of the
    completion. Context matters because tokenizer decoders are not additive at the edges
    (leading-space stripping, byte-level tokens that only together form a UTF-8 character). A token
    costs one decode: the context is usually one token, whose text alone is cached per tokenizer.
    While the window's text ends in U+FFFD, the trailing bytes may be an incomplete character: those
    are held back until a later token completes them (or flush() at finish gives them up), while the
    complete characters before them are emitted at once.

    For byte-level tokenizers the concatenated deltas equal tokenizer.decode(completion ids,
    skip_special_tokens=True). For SentencePiece-style ones they differ from it in one deliberate
    way: the first completion token keeps its leading space (" Paris" after the prompt), because
    the last prompt tokens are decoded as context. Decoding never applies clean_up_tokenization_spaces: that rewrite
    (" ." -> ".") looks across token boundaries and cannot be streamed.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self._decode_ids = fast_decoder(tokenizer)
        self._token_texts = _token_texts(tokenizer)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode_ids(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: that character's bytes belong to the prompt, so
            # the completion must not emit it. Start without context instead.
            context, context_text = [], ""
        self._ids: list[int] = context  # the context, then the tokens not yet emitted
        self._read_offset = len(context)
        self._context_chars = len(context_text)
        # Characters of ids[read_offset:] already emitted: complete ones before an incomplete tail.
        self._emitted_ahead = 0

    def add(self, token_ids: list[int]) -> str:
        """Append new completion tokens; return the text they complete (possibly empty)."""
        ids = self._ids
        ids += token_ids
        full_text = self._decode_ids(ids)
        start = self._context_chars + self._emitted_ahead
        if full_text[-1:] != _REPLACEMENT:
            return self._advance(full_text) if len(full_text) > start else ""
        end = _complete_end(full_text, start)
        self._emitted_ahead += end - start
        return full_text[start:end]

    def flush(self) -> str:
        """At finish: everything not yet emitted, including a character the model left incomplete."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode_ids(self._ids))

    def _advance(self, full_text: str) -> str:
        delta = full_text[self._context_chars + self._emitted_ahead:]
        # The emitted tokens become the next window's context; older tokens are never decoded again.
        ids = self._ids
        del ids[: self._read_offset]
        self._read_offset = len(ids)
        if len(ids) == 1:  # the usual case, one token per step: its text alone is cached
            text = self._token_texts.get(ids[0])
            if text is None:
                text = self._token_texts[ids[0]] = self._decode_ids(ids)
        else:
            text = self._decode_ids(ids)
        self._context_chars = len(text)
        self._emitted_ahead = 0
        return delta


class ByteDetokenizer:
    """IncrementalDetokenizer's deltas for a byte-level tokenizer (GPT-2, Llama 3), with no window of
    ids to decode. The text of ids is the lossy UTF-8 decoding of their bytes one after another, and
    an emitted chunk ends in a complete character, after which decoding starts afresh: the context
    adds nothing, so the window is the bytes not yet emitted (token_bytes), and Python's UTF-8 codec
    decodes them as the Rust decoder does (a U+FFFD per maximal invalid subsequence)."""

    def __init__(self, token_bytes: dict[int, bytes]) -> None:
        self._token_bytes = token_bytes
        self._pending = b""  # the bytes of the tokens not yet emitted
        self._emitted_ahead = 0  # characters of their text already emitted: complete ones

    def add(self, token_ids: list[int]) -> str:
        """Append new completion tokens; return the text they complete (possibly empty)."""
        table = self._token_bytes
        self._pending = pending = self._pending + (
            table[token_ids[0]] if len(token_ids) == 1 else b"".join(map(table.__getitem__, token_ids)))
        full_text = pending.decode("utf-8", "replace")
        start = self._emitted_ahead
        if full_text[-1:] != _REPLACEMENT:
            self._pending, self._emitted_ahead = b"", 0
            return full_text[start:] if start else full_text
        end = _complete_end(full_text, start)
        self._emitted_ahead = end
        return full_text[start:end]

    def flush(self) -> str:
        """At finish: everything not yet emitted, including a character the model left incomplete."""
        text = self._pending.decode("utf-8", "replace")[self._emitted_ahead:]
        self._pending, self._emitted_ahead = b"", 0
        return text


def _complete_end(full_text: str, start: int) -> int:
    """Where the complete characters of a window's text end, at least at `start` (what was emitted).
    The tail is (perhaps) an incomplete character, but a token such as b"\xe6\x97\xa5\xe6" also
    completes "日" before it: those are emitted now. Appending bytes can only change the trailing
    replacement characters, so the text before them is final."""
    return max(start, len(full_text.rstrip(_REPLACEMENT)))


_PROBE_IDS = list(range(0, 64)) + list(range(256, 320))


class _TokenBytes(dict):
    """token id -> the bytes a byte-level decoder makes of the token: each character of its string
    stands for a byte (BYTE_CHARS), or, when one does not, the string is taken as UTF-8 (an added
    token such as "<|eot_id|>"). A special token, which decoding skips, is no bytes, and so is an
    id outside the vocabulary."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        for i in range(backend.get_vocab_size(with_added_tokens=True)):
            text = None if i in special else backend.id_to_token(i)
            if text is None:
                self[i] = b""
                continue
            try:  # one C call per token: a character that stands for no byte fails the encoding
                self[i] = text.translate(_AS_BYTE).encode("latin-1")
            except UnicodeEncodeError:
                self[i] = text.encode("utf-8")

    def __missing__(self, token: int) -> bytes:
        return b""


# Maps each byte-level character to the code point of its byte, and every other character below
# U+0100 to U+0100 (those above are left as they are), so that .encode("latin-1") gives a
# byte-level token's bytes and fails on any other string.
_AS_BYTE = {ord(c): b for b, c in enumerate(BYTE_CHARS)} | {
    cp: 0x100 for cp in range(0x100) if chr(cp) not in set(BYTE_CHARS)}


def token_bytes(tokenizer: Any) -> dict[int, bytes] | None:
    """The bytes of each token, for a byte-level tokenizer whose Rust decode gives the same text as
    decoding them (checked on probe ids and sequences of them); None for any other. Made once per
    tokenizer (~0.1 s for 128k tokens: the engine asks at start, not at its first request)."""
    cached = getattr(tokenizer, "_graphserve_token_bytes", False)
    if cached is not False:
        return cached
    table = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
            and fast_decoder(tokenizer).__name__ == "direct"):
        candidate = _TokenBytes(backend)
        if _decodes_as_rust(candidate, backend, len(tokenizer)):
            table = candidate
    try:
        tokenizer._graphserve_token_bytes = table
    except AttributeError:
        pass
    return table


def _decodes_as_rust(table: _TokenBytes, backend: Any, size: int) -> bool:
    """Each probe id, every added token, and runs of probe ids (split characters, invalid bytes,
    special tokens among them) decode to the Rust decoder's text."""
    rng = random.Random(0)
    probes = sorted({i % size for i in _PROBE_IDS} | set(backend.get_added_tokens_decoder())
                    | {rng.randrange(size) for _ in range(256)})
    runs = [[i] for i in probes] + [rng.choices(probes, k=rng.randint(2, 6)) for _ in range(512)]
    return all(b"".join(table[i] for i in ids).decode("utf-8", "replace") == backend.decode(ids, skip_special_tokens=True)
               for ids in runs)


def _token_texts(tokenizer: Any) -> dict[int, str]:
    """token id -> the text of that token decoded alone, filled as tokens are seen (at most one entry
    per vocabulary entry). Shared by every stream of the tokenizer: engines on several threads may
    fill it at once, and each stores the same text for the same id."""
    texts = getattr(tokenizer, "_graphserve_token_texts", None)
    if texts is None:
        texts = {}
        try:
            tokenizer._graphserve_token_texts = texts
        except AttributeError:
            pass
    return texts


def fast_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), through the
    Rust tokenizer directly when it gives the same text: ~1.6 us a call instead of ~7 us, and the
    engine may decode a window for every token of every stream. Cached per tokenizer."""
    cached = getattr(tokenizer, "_graphserve_fast_decode", None)
    if cached is not None:
        return cached

    def wrapper(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    chosen = wrapper
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        def direct(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=True)

        size = len(tokenizer)
        probes = [[i % size] for i in _PROBE_IDS] + [[i % size for i in _PROBE_IDS]]
        try:
            if all(direct(ids) == wrapper(ids) for ids in probes):
                chosen = direct
        except Exception:  # noqa: BLE001 - any doubt: keep the wrapper
            pass
    try:
        tokenizer._graphserve_fast_decode = chosen
    except AttributeError:
        pass
    return chosen
