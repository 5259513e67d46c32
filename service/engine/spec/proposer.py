"""Proposers: a draft of a decoding row's next tokens, guessed without the target model.

Pure Python (no torch), called by the scheduler on the engine thread for each decode that may
speculate. A proposer never changes output (the target verifies every draft token); a good one
is cheap and right often.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from typing import Protocol

from service.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, tokens: Tokens[int], k: int) -> list[int]:
        """At most k tokens guessed to follow `tokens` (the row's prompt and output so far)."""
        ...

    def finished(self, tokens: Tokens[int], num_prompt_tokens: int) -> None:
        """A request ended with `tokens` (its prompt, then its output)."""
        ...


def find_ngram(tokens: Tokens[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the k tokens (or fewer, at the end) after the latest earlier occurrence of the
    last n tokens, for the largest n in [min_n, max_n] that occurs; [] when none does."""
    size = len(tokens)
    last = tokens[-1] if size else None
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = list(tokens[size - n:])
        # Candidates end where the last token occurs again, newest first (the newest repeat is the
        # likeliest to continue as it did).
        end = size - 1
        while True:
            end = _rfind(tokens, last, end)
            if end < n - 1:
                break
            if list(tokens[end - n + 1: end + 1]) == tail:
                return list(tokens[end + 1: end + 1 + k])
    return []


def _rfind(tokens: Tokens[int], value: int | None, before: int) -> int:
    """The last index < before holding value, or -1."""
    for i in range(before - 1, -1, -1):
        if tokens[i] == value:
            return i
    return -1


class NgramProposer:
    """The row's own prompt and output are the only corpus (vLLM's "ngram", prompt lookup decoding)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, tokens: Tokens[int], k: int) -> list[int]:
        return find_ngram(tokens, k, self.min_n, self.max_n)

    def finished(self, tokens: Tokens[int], num_prompt_tokens: int) -> None:
        pass


def new_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "suffix":
        from service.engine.spec.suffix import SuffixProposer

        return SuffixProposer(config)
    return NgramProposer(config)
