"""Chat prompts: a conversation rendered with the model's chat template, then tokenized.

The template is the model's own (tokenizer_config.json `chat_template`, or `chat_template.jinja`,
as transformers loads them), rendered by transformers with the generation prompt added, exactly as
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` does. The rendered text
already holds the special tokens the template writes (e.g. BOS), so it is tokenized without adding
them again. Used by the gRPC servicer and by `LLM.chat`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A conversation that cannot become a prompt: the message says what to change."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


Conversation = Sequence[ChatMessage | Mapping[str, str]]


def check_messages(messages: Conversation) -> list[dict[str, str]]:
    """The conversation as the template expects it (a list of {"role", "content"}); ChatError
    naming the first bad message otherwise."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatError(f"messages must be a list of {{'role', 'content'}} messages, not {type(messages).__name__}")
    if not messages:
        raise ChatError("messages is empty: send at least one message")
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
    conversation = check_messages(messages)
    if not has_chat_template(tokenizer):
        raise ChatError(f"{model} has no chat template (neither tokenizer_config.json `chat_template` nor "
                        "chat_template.jinja); send the prompt as text instead")
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception() in the template
        raise ChatError(f"the chat template of {model} refused the conversation: {exc}") from None


def chat_prompt(tokenizer: Any, messages: Conversation, model: str = "the model") -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (the template wrote the special tokens it wants)."""
    text = render_chat(tokenizer, messages, model)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ChatError("the rendered conversation encodes to no tokens")
    return text, ids


def chat_prompt_ids(tokenizer: Any, messages: Conversation, model: str = "the model") -> list[int]:
    return chat_prompt(tokenizer, messages, model)[1]
