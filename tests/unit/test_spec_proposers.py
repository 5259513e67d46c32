"""Proposers (pure logic): prompt lookup over a request's own tokens, and suffix decoding over a
bounded corpus of recent outputs, whose cap holds whatever is added."""

from __future__ import annotations

import random

import pytest

from service.config import ConfigError, ServeConfig, SpeculativeConfig
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.sequence import Sequence
from service.engine.spec.proposer import NgramProposer, TokenIndex, find_ngram, new_proposer
from service.engine.spec.suffix import SuffixCorpus, SuffixProposer


def seq_of(tokens: list[int], num_prompt: int | None = None) -> Sequence:
    """A sequence whose prompt is tokens[:num_prompt] and whose output so far is the rest."""
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    seq = Sequence(GenerationRequest("r", tokens[:num_prompt], SamplingParams(temperature=0.0, seed=0, max_tokens=8)))
    seq.completion_token_ids = tokens[num_prompt:]
    return seq


def test_prompt_lookup_takes_the_longest_tail_and_its_newest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # tail [7, 2, 3] never occurred before; [2, 3] did, newest at 5..6 -> continues 4, 5
    assert find_ngram(tokens, 2, 1, 3) == [4, 5]
    assert find_ngram(tokens, 9, 1, 3) == [4, 5, 7, 2, 3]  # up to the end of what is known
    assert find_ngram([1, 2, 3, 4], 3, 1, 4) == []  # nothing repeats
    assert find_ngram([5, 5], 3, 2, 4) == []  # below prompt_lookup_min
    assert find_ngram([], 3, 1, 4) == [] and find_ngram([5], 3, 1, 4) == []
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    assert proposer.propose(seq_of([8, 1, 2, 6, 0, 1, 2]), 3) == [6, 0, 1]


def test_the_token_index_answers_as_the_scan_does_as_a_row_grows():
    """The proposer's incremental index against the reference scan, on rows of a small alphabet
    (many repeats) growing a token at a time, as the scheduler asks between steps."""
    rng = random.Random(1)
    for trial in range(40):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
        tokens = [rng.randrange(4 if trial % 2 else 9) for _ in range(60)]
        index = TokenIndex()
        for size in range(1, len(tokens) + 1):
            k = rng.randrange(1, 6)
            assert index.lookup(tokens[:size], k, min_n, max_n) == find_ngram(tokens[:size], k, min_n, max_n), (
                trial, size)


def test_suffix_proposer_falls_back_to_earlier_outputs():
    proposer = new_proposer(SpeculativeConfig(method="suffix", prompt_lookup_min=2, prompt_lookup_max=3))
    assert isinstance(proposer, SuffixProposer)
    assert proposer.propose(seq_of([40, 41, 42]), 3) == []
    done = seq_of([100, 101, 40, 41, 42, 43, 44, 45], num_prompt=2)  # the output: 40..45
    proposer.finished(done)
    assert proposer.propose(seq_of([7, 41, 42]), 3) == [43, 44, 45]
    assert proposer.propose(seq_of([7, 8, 42]), 3) == []  # a 1-token tail is below prompt_lookup_min
    assert proposer.propose(seq_of([42, 43, 1, 42, 43]), 2) == [1, 42]  # its own tokens come first
    aborted = seq_of([1, 2, 90, 91, 92, 93], num_prompt=2)
    aborted.aborted = True
    proposer.finished(aborted)  # an aborted request's output does not join the corpus
    assert proposer.propose(seq_of([5, 90, 91]), 2) == []


def test_suffix_corpus_memory_cap_evicts_oldest_outputs():
    rng = random.Random(0)
    corpus = SuffixCorpus(max_tokens=1000, min_n=1, max_n=3)
    outputs = [[rng.randrange(50_000) for _ in range(rng.randrange(2, 300))] for _ in range(200)]
    for out in outputs:
        corpus.add(out)
        assert corpus.num_tokens <= 1000
        assert corpus.num_index_entries <= 3 * corpus.num_tokens  # the index is bounded by the cap too
    newest, oldest = outputs[-1], outputs[0]
    assert corpus.lookup(newest[:3], 2) == newest[3:5]
    assert corpus.lookup(oldest[:3], 2) == []  # evicted long ago
    corpus.add(list(range(5000)))  # longer than the cap: its last 1,000 tokens
    assert corpus.num_tokens == 1000 and len(corpus) == 1
    assert corpus.lookup([4997, 4998], 5) == [4999] and corpus.lookup([10, 11], 2) == []


@pytest.mark.parametrize("value, field", [
    ('{"method": "eagle"}', "speculative_config.method"),
    ('{"num_speculative_tokens": 3}', "speculative_config.method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "speculative_config.prompt_lookup_min"),
    ('{"method": "ngram", "prompt_lookup_maxx": 2}', "prompt_lookup_maxx"),
    ('{"method": "ngram", "model": "tiny-draft"}', "speculative_config.model"),
    ('[1, 2]', "JSON object"),
    ('{"method": ', "not JSON"),
])
def test_bad_speculative_configs_fail_at_start_naming_the_field(value, field):
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        ServeConfig(speculative_config=value).validate()
    assert field in str(err.value)


def test_speculative_config_from_flag_and_python_api():
    from service.config import load_config
    from service.llm_config import config_of

    c = load_config(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'], environ={})
    assert c.speculation == SpeculativeConfig(num_speculative_tokens=5)
    c = config_of("builtin:tiny", {"speculative_config": {"method": "suffix", "prompt_lookup_max": 6}})
    assert c.speculation == SpeculativeConfig(method="suffix", prompt_lookup_max=6)
    with pytest.raises(ConfigError, match="speculative_config"):
        config_of("builtin:tiny", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 99}})
    with pytest.raises(TypeError, match="speculative_config"):
        config_of("builtin:tiny", {"speculative_config": 3})
    with pytest.raises(ConfigError, match="tensor parallelism"):
        ServeConfig(speculative_config='{"method": "ngram"}', tensor_parallel_size=2).validate()
