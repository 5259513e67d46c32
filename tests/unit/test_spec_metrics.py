"""Speculative decoding's metrics on /metrics: graphserve's counters and vLLM's spec_decode series,
as the server exports an engine's (its families pickled across the pipe)."""

from __future__ import annotations

from service.telemetry.engine_metrics import EngineMetrics
from tests.unit.test_metrics import VLLM, families_of, scrape, server_metrics, value


def test_drafts_draft_tokens_and_accepted_tokens_under_vllms_names() -> None:
    engine = EngineMetrics(model_name="builtin:tiny")
    m = server_metrics(engine)
    assert not any(name.startswith("vllm:spec_decode") for name in families_of(m))  # as vLLM without speculation
    engine.on_speculation(0, 0, [])  # the builder's report at start: the series are there, at 0
    assert value(scrape(m), "vllm:spec_decode_num_drafts_total", **VLLM) == 0
    engine.on_speculation(3, 9, [3, 0, 1])  # three verify rows of 3 draft tokens
    engine.on_speculation(1, 2, [2])
    types = families_of(m)
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert types[name] == "counter", name
    s = scrape(m)
    assert value(s, "vllm:spec_decode_num_drafts_total", **VLLM) == 4
    assert value(s, "vllm:spec_decode_num_draft_tokens_total", **VLLM) == 11
    assert value(s, "vllm:spec_decode_num_accepted_tokens_total", **VLLM) == 6
    assert [value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p), **VLLM)
            for p in range(3)] == [3, 2, 1]
    # Acceptance length: tokens each verify row emitted (accepted + 1): 4, 1, 2, 3.
    assert value(s, "graphserve_spec_decode_acceptance_length_count") == 4
    assert value(s, "graphserve_spec_decode_acceptance_length_sum") == 10
