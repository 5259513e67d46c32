"""The gpt-fast anchor computes our model: same shape, same weights, same logits. Its timing then
compares two implementations of one model, not two models."""

from __future__ import annotations

import pytest
import torch

from bench.anchors import gpt_fast
from bench.decode_bench import _random_init


@pytest.fixture(scope="module")
def ours() -> torch.nn.Module:
    torch.manual_seed(0)
    model, _ = _random_init("tiny", torch.device("cpu"), torch.float32)
    return model


def test_gpt_fast_built_from_our_weights_gives_our_logits_for_a_prompt_and_a_decode_step(ours, one_torch_thread) -> None:
    ids = torch.randint(3, ours.spec.vocab_size, (1, 12))
    expected = ours.forward_full(ids)[0]  # [12, vocab]
    anchor = gpt_fast.build(ours.spec, ours.state_dict(), 64, torch.device("cpu"), torch.float32)
    gpt_fast.setup_caches(anchor, 1, 64, torch.device("cpu"))
    with torch.no_grad():
        prompt = anchor(ids[:, :11], torch.arange(11))[0]  # prefill of 11 tokens
        step = anchor(ids[:, 11:], torch.tensor([11]))[0, 0]  # the 12th as a decode step, from the cache
    torch.testing.assert_close(prompt.float(), expected[:11], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(step.float(), expected[11], atol=2e-4, rtol=1e-4)


def test_the_anchor_times_each_batch_and_keeps_every_sample(ours, one_torch_thread) -> None:
    out = gpt_fast.run(ours, [1, 2], context=16, compile_mode="none", iters=3, warmup=1)
    assert not out["errors"], out["errors"]
    assert [r["batch"] for r in out["rows"]] == [1, 2] and out["max_seq_len"] == 80
    for row in out["rows"]:
        assert len(row["samples_ms"]) == 3 and min(row["samples_ms"]) <= row["ms"] <= max(row["samples_ms"])
