"""Suffix decoding over a bounded corpus of this server's recent outputs (after the request's own
prompt and output, which the n-gram lookup searches first).

Agentic and code-editing traffic repeats what earlier requests produced. The corpus keeps the
outputs of finished requests, newest last, up to `suffix_corpus_tokens` tokens in all: adding one
beyond the cap evicts the oldest whole outputs first (an output longer than the cap keeps its last
cap tokens). An index maps every n-gram of the corpus (prompt_lookup_min <= n <= prompt_lookup_max,
each followed by at least one token) to its newest occurrence, so a lookup costs O(max n) dict
probes whatever the corpus's size; the index holds at most (max - min + 1) entries per corpus
token, each a small tuple key and an (output, position) pair, so the cap bounds its memory too.
A hash of the last n tokens stands in for the paper's suffix tree walk: the same matches up to
prompt_lookup_max tokens deep, with the newest continuation instead of the most frequent one.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence as Tokens

from service.config import SpeculativeConfig
from service.engine.sequence import Sequence
from service.engine.spec.proposer import NgramProposer


class SuffixCorpus:
    def __init__(self, max_tokens: int, min_n: int, max_n: int) -> None:
        self.max_tokens = max_tokens
        self.min_n, self.max_n = min_n, max_n
        self._outputs: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, position after it)
        self._ids = itertools.count()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def num_index_entries(self) -> int:
        return len(self._index)

    def add(self, output: Tokens[int]) -> None:
        """An output joins the corpus (its last max_tokens tokens); the oldest leave while it is full."""
        tokens = tuple(output[-self.max_tokens:])
        if len(tokens) < 2:
            return
        while self._outputs and self.num_tokens + len(tokens) > self.max_tokens:
            self._evict()
        key = next(self._ids)
        self._outputs[key] = tokens
        self.num_tokens += len(tokens)
        for n, end in self._grams(tokens):
            self._index[tokens[end - n: end]] = (key, end)

    def lookup(self, tokens: Tokens[int], k: int) -> list[int]:
        """The k tokens after the newest corpus occurrence of the longest matching tail of tokens."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._index.get(tuple(tokens[len(tokens) - n:]))
            if hit is not None:
                output, end = hit
                return list(self._outputs[output][end: end + k])
        return []

    def _grams(self, tokens: tuple[int, ...]) -> list[tuple[int, int]]:
        """(n, end) of each n-gram tokens[end - n: end] that a token follows."""
        return [(n, end) for end in range(1, len(tokens)) for n in range(self.min_n, min(self.max_n, end) + 1)]

    def _evict(self) -> None:
        key, tokens = self._outputs.popitem(last=False)
        self.num_tokens -= len(tokens)
        for n, end in self._grams(tokens):
            gram = tokens[end - n: end]
            if self._index.get(gram, (None,))[0] == key:  # not taken over by a newer output
                del self._index[gram]


class SuffixProposer(NgramProposer):
    """The request's own tokens first (prompt lookup), then the corpus of recent outputs, which each
    request that finishes (not aborted) joins."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.corpus = SuffixCorpus(config.suffix_corpus_tokens, self.min_n, self.max_n)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return super().propose(seq, k) or self.corpus.lookup(seq.token_ids(0, seq.num_tokens), k)

    def finished(self, seq: Sequence) -> None:
        super().finished(seq)
        if not seq.aborted:
            self.corpus.add(seq.completion_token_ids)
