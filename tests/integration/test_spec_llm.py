"""Speculative decoding through the Python API (`LLM(speculative_config={...})`) and a gRPC server
(`--speculative-config`): the engine is built with the proposer, outputs equal those without it,
and /metrics exports vLLM's spec_decode series."""

from __future__ import annotations

import pytest

from service.config import ConfigError
from service.llm import LLM, SamplingParams

PROMPTS = ["one two three one two three one two three", "def f(x): return x\ndef g(x): return x\ndef",
           "hello hello hello hello"]


@pytest.mark.parametrize("method, fields", [("ngram", {}), ("suffix", {}), ("draft_layers", {"num_draft_layers": 2}),
                                           ("draft_model", {"model": "builtin:tiny"})])
def test_generate_with_speculation_equals_without(model_cache_dir, method: str, fields: dict) -> None:  # noqa: ANN001
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=64, ignore_eos=True)]
    results = []
    for spec in (None, {"method": method, "num_speculative_tokens": 4, "prompt_lookup_max": 3, **fields}):
        with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=4, max_seq_len=256,
                 device="cpu", dtype="float32", speculative_config=spec) as llm:
            engine = llm._engine.engine  # the engine the config built: with the proposer, no overlap
            assert (engine.scheduler.proposer is not None) == (spec is not None) and engine.overlap == (spec is None)
            results.append([[(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                             for o in llm.generate(PROMPTS, p)]
                            for p in params])
            assert spec is None or engine.spec_stats.drafts > 0  # drafts were proposed and verified
    assert results[0] == results[1]


def test_a_bad_speculative_config_fails_at_start_naming_the_keyword_and_field(model_cache_dir) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="speculative_config.*prompt_lookup_max"):
        LLM(model="builtin:tiny", model_cache_dir=model_cache_dir,
            speculative_config={"method": "ngram", "prompt_lookup_max": 0})


def test_a_server_with_speculative_config_streams_the_same_tokens_and_exports_spec_decode_metrics(
        model_cache_dir) -> None:  # noqa: ANN001
    from tests.integration.test_metrics_endpoint import scrape
    from tests.support.server import generate, greedy, running_server

    common = ["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256", "--max-running-seqs", "4"]
    streams = []
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    for extra in ([], ["--speculative-config", spec]):
        with running_server(common + extra) as server:
            stub = server.stub()
            streams.append([[t for c in generate(stub, **greedy(p, 48))[0] for t in c.token_ids] for p in PROMPTS])
            samples = scrape(server.app.metrics_port)
    assert streams[0] == streams[1]
    labels = {(name, dict(lab).get("model_name") is not None) for name, lab in samples}
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert (name, True) in labels, name
    drafts = next(v for (name, _), v in samples.items() if name == "vllm:spec_decode_num_drafts_total")
    assert drafts > 0
