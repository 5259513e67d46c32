"""A long text prompt is tokenized in growing prefixes: refused once a prefix is over the context,
and tokenized exactly as a whole when it fits."""

from __future__ import annotations

import pytest

from service.engine.validation import InvalidRequest, encode_capped


class WordTokenizer:
    """One token per word; remembers the longest text it was asked to encode."""

    def __init__(self) -> None:
        self.longest = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.longest = max(self.longest, len(text))
        return [len(word) for word in text.split()]


def test_a_megabyte_of_words_is_refused_after_tokenizing_a_prefix_of_about_the_context() -> None:
    tokenizer = WordTokenizer()
    text = "word " * 200_000
    with pytest.raises(InvalidRequest, match="more than 255 tokens; the context holds 256"):
        encode_capped(tokenizer, text, 255)
    assert tokenizer.longest <= 2 * 4 * 256  # two prefixes at most, not the 1 MB


def test_a_prompt_that_fits_gives_the_same_tokens_as_tokenizing_it_whole() -> None:
    text = " ".join(f"longword{i:04d}" for i in range(200))  # 2,999 characters, 200 tokens
    assert encode_capped(WordTokenizer(), text, 255) == WordTokenizer().encode(text)


def test_text_without_whitespace_is_cut_anywhere() -> None:
    tokenizer = WordTokenizer()
    assert encode_capped(tokenizer, "x" * 100_000, 255) == [100_000]  # one token: fits
