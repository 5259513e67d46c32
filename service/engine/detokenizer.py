"""Incremental detokenization: per-token text deltas at O(1) cost, never splitting a character."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import decoders

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context of the first completion tokens: enough for tokenizers whose
# decoders strip a leading space from the first token of a sequence (SentencePiece "Metaspace"),
# so a completion that starts with "▁Paris" streams as " Paris", as it reads after the prompt.
_PROMPT_CONTEXT_TOKENS = 5


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
        self._vocab = vocab = token_texts(tokenizer)
        self._decode_ids = vocab.decode
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode_ids(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: that character's bytes belong to the prompt, so
            # the completion must not emit it. Start without context instead.
            context, context_text = [], ""
        self._ids: list[int] = context  # the context, then the tokens not yet emitted
        self._read_offset = len(context)
        self._context_chars = len(context_text)
        # Whether the tokenizer's texts concatenate and the context's text ends in a complete
        # character: then, with nothing held back, a complete token text is what the token adds.
        self._concatenates = vocab.concatenates
        # Characters of ids[read_offset:] already emitted: complete ones before an incomplete tail.
        self._emitted_ahead = 0

    def add(self, token_ids: list[int]) -> str:
        """Append new completion tokens; return the text they complete (possibly empty)."""
        ids = self._ids
        if self._concatenates and self._read_offset == len(ids) and len(token_ids) == 1:
            # The context's text ends in a complete character and nothing is held back: with a
            # tokenizer whose texts concatenate, a token whose own text is complete adds exactly
            # that text, and becomes the context (what decoding the window would give, without it).
            text = self._vocab.text(token_ids[0])
            if text and text[-1] != _REPLACEMENT:
                ids[:] = token_ids
                self._read_offset = 1
                self._context_chars = len(text)
                return text
        ids += token_ids
        full_text = self._decode_ids(ids)
        start = self._context_chars + self._emitted_ahead
        if full_text[-1:] != _REPLACEMENT:
            return self._advance(full_text) if len(full_text) > start else ""
        # The tail is (perhaps) an incomplete character, but a token such as b"\xe6\x97\xa5\xe6"
        # also completes "日" before it: emit the complete characters now. Appending bytes can only
        # change the trailing replacement characters, so the text before them is final.
        stable_end = len(full_text.rstrip(_REPLACEMENT))
        if stable_end <= start:
            return ""
        self._emitted_ahead += stable_end - start
        return full_text[start:stable_end]

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
        text = self._vocab.text(ids[0]) if len(ids) == 1 else self._decode_ids(ids)
        self._context_chars = len(text)
        self._concatenates = self._vocab.concatenates and text[-1:] != _REPLACEMENT
        self._emitted_ahead = 0
        return delta


_PROBE_IDS = list(range(0, 64)) + list(range(256, 320))


class TokenTexts:
    """What the detokenizers of one tokenizer share: its decode (fast_decoder), each token's text
    decoded alone (filled as tokens are seen: at most one entry per vocabulary entry), and whether
    texts concatenate. They do with a byte-level decoder (GPT-2, Llama 3): the text of ids is the
    lossy UTF-8 decoding of their bytes one token after another, so after ids whose text ends in a
    complete character the decoder starts afresh, and the text of a + b is the text of a then the
    text of b. SentencePiece decoders strip a leading space and fuse byte tokens: they do not.
    Engines on several threads may fill it at once; each stores the same text for the same id."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = fast_decoder(tokenizer)
        self.texts: dict[int, str] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.concatenates = (self.decode.__name__ == "direct" and backend is not None
                             and isinstance(backend.decoder, decoders.ByteLevel) and self._probe(len(tokenizer)))

    def text(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.decode([token])
        return text

    def _probe(self, size: int) -> bool:
        """A check of the byte-level property on the probe ids: two complete texts concatenate."""
        clean = [i % size for i in _PROBE_IDS if _REPLACEMENT not in self.text(i % size)]
        return all(self.decode([a, b]) == self.text(a) + self.text(b) for a, b in zip(clean, clean[1:]))


def token_texts(tokenizer: Any) -> TokenTexts:
    """The tokenizer's TokenTexts, made once (kept on the tokenizer)."""
    cached = getattr(tokenizer, "_graphserve_token_texts", None)
    if cached is None:
        cached = TokenTexts(tokenizer)
        try:
            tokenizer._graphserve_token_texts = cached
        except AttributeError:
            pass
    return cached


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
