"""Proposers: a draft of a decoding row's next tokens, guessed without running the whole target.

The n-gram and suffix proposers here are pure Python (no torch); the draft_layers one
(draft_layers.py) runs the target's first layers, the draft_model one (draft_model.py) a second,
smaller checkpoint through the same greedy-draft path. Each is called by the scheduler on the engine
thread for each decode that may speculate. A proposer never changes output (the target verifies every draft token); a good one
is cheap and right often. Per sequence it may keep state (an index of its tokens, extended as they
come), which it drops when the scheduler tells it the sequence left.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Tokens
from typing import Any, Protocol

from service.config import SpeculativeConfig
from service.engine.sequence import Sequence

# Earlier occurrences of the row's last token examined per lookup, newest first: bounds a lookup's
# cost on long, repetitive rows (a common token occurs thousands of times) to O(SCAN * max n).
SCAN = 64


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most k tokens guessed to follow seq's tokens (its prompt and output so far)."""
        ...

    def finished(self, seq: Sequence) -> None:
        """seq left the engine: it finished, or it was aborted (seq.aborted)."""
        ...


def find_ngram(tokens: Tokens[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup, the reference (O(len) per call): the k tokens (or fewer, at the end) after the
    latest earlier occurrence of the last n tokens, for the largest n in [min_n, max_n] that occurs;
    [] when none does."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = list(tokens[size - n:])
        for end in range(size - 2, n - 2, -1):  # an occurrence ending at `end`, a token after it
            if list(tokens[end - n + 1: end + 1]) == tail:
                return list(tokens[end + 1: end + 1 + k])
    return []


class TokenIndex:
    """Where each token occurs in a row's tokens (all but the newest), extended as tokens come, so a
    lookup never scans the row."""

    def __init__(self) -> None:
        self.positions: collections.defaultdict[int, list[int]] = collections.defaultdict(list)
        self.size = 0  # tokens [0, size) are indexed

    def lookup(self, tokens: Tokens[int], k: int, min_n: int, max_n: int) -> list[int]:
        """find_ngram's answer from the index (among the newest SCAN occurrences of the last token)."""
        size = len(tokens)
        for i in range(self.size, size - 1):
            self.positions[tokens[i]].append(i)
        self.size = max(self.size, size - 1)
        if size < 2:
            return []
        best_n, best_end = 0, -1
        occurrences = self.positions.get(tokens[-1], ())
        for end in reversed(occurrences[-SCAN:]):
            n = 1
            while n < max_n and n <= end and tokens[end - n] == tokens[size - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == max_n:
                    break
        if best_n < min_n:
            return []
        return list(tokens[best_end + 1: best_end + 1 + k])


class NgramProposer:
    """The row's own prompt and output are the only corpus (vLLM's "ngram", prompt lookup decoding)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._indexes: dict[Sequence, TokenIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = TokenIndex()
        return index.lookup(seq.token_ids(0, seq.num_tokens), k, self.min_n, self.max_n)

    def finished(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)


def new_proposer(config: SpeculativeConfig, model: Any = None, device: Any = None, draft: Any = None) -> Proposer:
    """config's proposer; draft_layers drafts with `model` (the target's LlamaForCausalLM) on `device`,
    draft_model with `draft` (the draft checkpoint's LoadedModel, draft_model.load_draft_model)."""
    if config.method == "draft_model":
        from service.engine.spec.draft_model import DraftModelProposer

        if draft is None:
            raise ValueError("speculative_config.model: method draft_model needs its draft loaded (load_draft_model)")
        return DraftModelProposer(draft)
    if config.method == "draft_layers":
        from service.engine.spec.draft_layers import DraftLayersProposer

        return DraftLayersProposer(config, model, device)
    if config.method == "suffix":
        from service.engine.spec.suffix import SuffixProposer

        return SuffixProposer(config)
    return NgramProposer(config)
