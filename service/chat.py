"""Chat prompts: a conversation rendered with the model's chat template, then tokenized.

The template is the model's own (tokenizer_config.json `chat_template`, or `chat_template.jinja`,
as transformers loads them), rendered by transformers with the generation prompt added, exactly as
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` does. The rendered text
already holds the special tokens the template writes (e.g. BOS), so it is tokenized without adding
them again. Used by the gRPC servicer and by `LLM.chat`.

Special tokens that a message's content spells out (`<|eot_id|>`, `<|end_of_text|>`) are tokenized
as plain text, not as the control tokens the template writes, so a user cannot end a turn or forge a
system turn (`special_tokens_in_content=True` restores the raw behaviour). Each occurrence is swapped
for an unguessable placeholder before rendering, and the rendered text is tokenized between the
placeholders as usual (the template's own special tokens stay special) and each placeholder as the
plain-text tokens of the string it stands for.
"""

from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.engine.validation import encode_capped, need, too_many_tokens

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A conversation that cannot become a prompt: the message says what to change."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


Conversation = Sequence[ChatMessage | Mapping[str, str]]


def check_messages(messages: Conversation, max_messages: int | None = None) -> list[dict[str, str]]:
    """The conversation as the template expects it (a list of {"role", "content"}); ChatError
    naming the first bad message otherwise."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatError(f"messages must be a list of {{'role', 'content'}} messages, not {type(messages).__name__}")
    if not messages:
        raise ChatError("messages is empty: send at least one message")
    if max_messages is not None and len(messages) > max_messages:
        raise ChatError(f"messages holds {len(messages)} messages; at most {max_messages} are allowed "
                        "(--max-chat-messages)")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            role, content = m.role, m.content
        elif isinstance(m, Mapping):
            role, content = m.get("role"), m.get("content")
        else:
            role, content = getattr(m, "role", None), getattr(m, "content", None)
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role is {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content:
            raise ChatError(f"messages[{i}].content is empty: every message needs some text")
        out.append({"role": role, "content": content})
    return out


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Conversation, model: str = "the model") -> str:
    """The prompt text of a conversation, ending with the template's generation prompt."""
    return _render(tokenizer, check_messages(messages), model)


def _render(tokenizer: Any, conversation: list[dict[str, str]], model: str) -> str:
    if not has_chat_template(tokenizer):
        raise ChatError(f"{model} has no chat template (neither tokenizer_config.json `chat_template` nor "
                        "chat_template.jinja); send the prompt as text instead")
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception() in the template
        raise ChatError(f"the chat template of {model} refused the conversation: {exc}") from None


def chat_prompt(tokenizer: Any, messages: Conversation, model: str = "the model", *, max_tokens: int | None = None,
                max_messages: int | None = None, special_tokens_in_content: bool = False) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (the template wrote the special tokens it wants).

    `max_tokens`: InvalidRequest as soon as the prompt is known to be longer (validation.encode_capped),
    so a huge conversation costs tokenizer memory in proportion to the context, not to its bytes.
    """
    conversation = check_messages(messages, max_messages)
    field = "prompt.messages"
    if special_tokens_in_content:
        text = _render(tokenizer, conversation, model)
        ids = _encode(tokenizer, text, max_tokens, field)
    else:
        text, ids = _render_content_as_text(tokenizer, conversation, model, max_tokens, field)
    if not ids:
        raise ChatError("the rendered conversation encodes to no tokens")
    return text, ids


def chat_prompt_ids(tokenizer: Any, messages: Conversation, model: str = "the model", **limits: Any) -> list[int]:
    return chat_prompt(tokenizer, messages, model, **limits)[1]


def _encode(tokenizer: Any, text: str, max_tokens: int | None, field: str) -> list[int]:
    if max_tokens is None:
        return tokenizer.encode(text, add_special_tokens=False)
    return encode_capped(tokenizer, text, max_tokens, field, add_special_tokens=False)


def _render_content_as_text(tokenizer: Any, conversation: list[dict[str, str]], model: str, max_tokens: int | None,
                            field: str) -> tuple[str, list[int]]:
    specials = _Specials.of(tokenizer)
    if specials.pattern is None or not any(specials.pattern.search(m["content"]) for m in conversation):
        text = _render(tokenizer, conversation, model)
        return text, _encode(tokenizer, text, max_tokens, field)
    nonce = secrets.token_hex(8)  # the user cannot write a placeholder of its own
    found = 0

    def placeholder(match: re.Match) -> str:
        nonlocal found
        found += 1
        return f"\ue000{nonce}{specials.index[match.group(0)]}\ue001"

    escaped = [{**m, "content": specials.pattern.sub(placeholder, m["content"])} for m in conversation]
    if max_tokens is not None:  # each occurrence is at least one token
        need(found <= max_tokens, too_many_tokens(field, max_tokens))
    parts = re.split(f"\ue000{nonce}(\\d+)\ue001", _render(tokenizer, escaped, model))
    texts, ids = [], []
    for i, part in enumerate(parts):  # text, placeholder index, text, ...
        if i % 2:
            part = specials.strings[int(part)]
            ids += specials.as_text(tokenizer, part)
        elif part:
            ids += _encode(tokenizer, part, None if max_tokens is None else max_tokens - len(ids), field)
        texts.append(part)
        if max_tokens is not None:
            need(len(ids) <= max_tokens, too_many_tokens(field, max_tokens))
    return "".join(texts), ids


class _Specials:
    """A tokenizer's special-token strings, a pattern that finds them, and their plain-text tokens."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: Any) -> None:
        found = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        found |= {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
        self.strings = sorted((s for s in found if s), key=lambda s: (-len(s), s))  # longest first: no prefix wins
        self.index = {s: i for i, s in enumerate(self.strings)}
        self.pattern = re.compile("|".join(map(re.escape, self.strings))) if self.strings else None
        self._plain: dict[str, list[int]] = {}

    @classmethod
    def of(cls, tokenizer: Any) -> _Specials:
        try:
            specials = cls._cache.get(tokenizer)
        except TypeError:  # not weakly referenceable
            return cls(tokenizer)
        if specials is None:
            specials = cls._cache[tokenizer] = cls(tokenizer)
        return specials

    def as_text(self, tokenizer: Any, special: str) -> list[int]:
        ids = self._plain.get(special)
        if ids is None:
            ids = self._plain[special] = tokenizer.encode(special, add_special_tokens=False, split_special_tokens=True)
        return ids
