"""The Python API with speculative decoding: `LLM(speculative_config={...})` builds the engine with
the proposer, and its outputs (tokens, text, finish reasons, usage) equal those without it."""

from __future__ import annotations

import pytest

from service.config import ConfigError
from service.llm import LLM, SamplingParams

PROMPTS = ["one two three one two three one two three", "def f(x): return x\ndef g(x): return x\ndef",
           "hello hello hello hello"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_generate_with_speculation_equals_without(model_cache_dir, method: str) -> None:  # noqa: ANN001
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=64, ignore_eos=True)]
    results = []
    for spec in (None, {"method": method, "num_speculative_tokens": 4, "prompt_lookup_max": 3}):
        with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=4, max_seq_len=256,
                 device="cpu", dtype="float32", speculative_config=spec) as llm:
            engine = llm._held["engine"]  # the engine the config built: with the proposer, no overlap
            assert (engine.scheduler.proposer is not None) == (spec is not None) and engine.overlap == (spec is None)
            results.append([[(o.token_ids, o.text, o.finish_reason) for o in llm.generate(PROMPTS, p)]
                            for p in params])
            assert spec is None or engine.spec_stats.drafts > 0  # drafts were proposed and verified
    assert results[0] == results[1]


def test_a_bad_speculative_config_fails_at_start_naming_the_keyword_and_field(model_cache_dir) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="speculative_config.*prompt_lookup_max"):
        LLM(model="builtin:tiny", model_cache_dir=model_cache_dir,
            speculative_config={"method": "ngram", "prompt_lookup_max": 0})
