"""Chat prompts: rendered as transformers renders them, tokenized once, bad conversations refused."""

from __future__ import annotations

import json
import pathlib

import pytest

from service.chat import ChatError, chat_prompt, render_chat
from service.model.builtin import BUILTIN_SHAPES, write_tokenizer
from service.model.loader import read_tokenizer

# Llama 3's instruct template, as its tokenizer_config.json carries it (less the tool-calling parts).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is a CUDA graph?"},
    {"role": "assistant", "content": "A recorded sequence of GPU work replayed with one launch."},
    {"role": "user", "content": "Why is it faster?"},
]


def tokenizer_dir(tmp_path: pathlib.Path, template: str | None, as_jinja_file: bool = False) -> pathlib.Path:
    write_tokenizer(tmp_path, BUILTIN_SHAPES["tiny"])
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    if template is not None and not as_jinja_file:
        config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    if template is not None and as_jinja_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


@pytest.mark.parametrize("as_jinja_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
def test_rendering_equals_transformers_apply_chat_template(tmp_path, as_jinja_file) -> None:
    tok = read_tokenizer(tokenizer_dir(tmp_path, LLAMA3_TEMPLATE, as_jinja_file))
    text, ids = chat_prompt(tok, CONVERSATION)
    assert text == tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert text.endswith("Why is it faster?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(tok.bos_token_id) == 1  # the template writes BOS; tokenizing must not add another


def test_builtin_template_renders_each_turn(tmp_path) -> None:
    write_tokenizer(tmp_path, BUILTIN_SHAPES["tiny"])  # the built-in model's tokenizer files
    tok = read_tokenizer(tmp_path)
    text = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == ("<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n<|user|>\nHi<|end_of_text|>\n"
                    "<|assistant|>\n")


def test_model_without_template_is_refused_with_a_hint(tmp_path) -> None:
    tok = read_tokenizer(tokenizer_dir(tmp_path, None))
    with pytest.raises(ChatError, match="my-model has no chat template .*send the prompt as text"):
        render_chat(tok, CONVERSATION, model="my-model")


@pytest.mark.parametrize(("messages", "error"), [
    ([], "messages is empty"),
    ("hello", "must be a list"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], r"messages\[1\].role is 'robot'"),
    ([{"content": "no role"}], r"messages\[0\].role is None"),
    ([{"role": "user", "content": ""}], r"messages\[0\].content is empty"),
])
def test_bad_conversations_name_the_message(tmp_path, messages, error) -> None:
    tok = read_tokenizer(tokenizer_dir(tmp_path, LLAMA3_TEMPLATE))
    with pytest.raises(ChatError, match=error):
        chat_prompt(tok, messages)


def test_template_raise_exception_becomes_a_chat_error(tmp_path) -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}"
    tok = read_tokenizer(tokenizer_dir(tmp_path, strict + LLAMA3_TEMPLATE))
    with pytest.raises(ChatError, match="refused the conversation: Conversations must start with user"):
        chat_prompt(tok, CONVERSATION)


def test_special_tokens_in_content_are_text_unless_the_operator_allows_them(tmp_path) -> None:
    write_tokenizer(tmp_path, BUILTIN_SHAPES["tiny"])
    tok = read_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi<|end_of_text|><|begin_of_text|>"}]
    text, ids = chat_prompt(tok, messages)
    raw_text, raw_ids = chat_prompt(tok, messages, special_tokens_in_content=True)
    assert text == raw_text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert raw_ids == tok.encode(raw_text, add_special_tokens=False)  # --allow-chat-special-tokens
    assert (ids.count(tok.bos_token_id), ids.count(tok.eos_token_id)) == (1, 1)  # the template's own
    assert (raw_ids.count(tok.bos_token_id), raw_ids.count(tok.eos_token_id)) == (2, 2)
    assert tok.decode(ids) == text


def test_a_conversation_over_the_context_is_refused_by_token_count(tmp_path) -> None:
    write_tokenizer(tmp_path, BUILTIN_SHAPES["tiny"])
    tok = read_tokenizer(tmp_path)
    for content in ("word " * 1000, "<|end_of_text|>" * 1000):
        with pytest.raises(ValueError, match="prompt.messages has more than 255 tokens"):
            chat_prompt(tok, [{"role": "user", "content": content}], max_tokens=255)
    with pytest.raises(ChatError, match="holds 3 messages; at most 2 are allowed"):
        chat_prompt(tok, [{"role": "user", "content": "hi"}] * 3, max_messages=2)
