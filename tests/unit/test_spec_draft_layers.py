"""Self-speculative drafting (method draft_layers): the built-in model's first layers, its final norm
and LM head draft; greedy output with the draft on equals output with speculation off (float32,
token for token), also when max_tokens ends a request inside an accepted run; the draft with every
layer but the truncation is the model's own greedy continuation; a bad num_draft_layers fails at
start naming the field."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from service.config import ConfigError, SpeculativeConfig, load_config
from service.engine.spec.draft_layers import DraftLayersProposer
from service.engine.spec.proposer import new_proposer
from service.llm import LLM
from service.preflight import check_serve
from tests.unit.test_spec_decode import assert_same, request, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draft_config(num_draft_layers: int | None, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.parse({"method": "draft_layers", "num_speculative_tokens": k,
                                    "num_draft_layers": num_draft_layers})


def greedy(model, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    """The full model's n greedy tokens after ids (the cache-free reference forward)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model.forward_full(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


def test_the_draft_is_the_truncated_models_greedy_continuation(loaded):  # noqa: ANN001
    model = loaded.model
    ids = loaded.tokenizer("The service reads a request and streams tokens")["input_ids"]
    keep = model.model.layers
    try:  # the reference: the same model with only its first 2 layers, run whole for every token
        model.model.layers = keep[:2]
        expected, from_window = greedy(model, ids, 5), greedy(model, ids[3:], 5)
    finally:
        model.model.layers = keep
    assert model.draft_greedy(torch.tensor(ids), 0, 2, 5).tolist() == expected
    # A window that starts past position 0 (RoPE is relative: the same scores as from 0)
    assert model.draft_greedy(torch.tensor(ids[3:]), 3, 2, 5).tolist() == from_window


def test_greedy_output_with_the_draft_equals_off_and_drafts_are_accepted(loaded):  # noqa: ANN001
    reqs = [request(loaded, "a", "The service reads a request", max_tokens=48),
            request(loaded, "b", "one two three one two three one two", max_tokens=48),
            request(loaded, "c", [(5 * i) % 700 + 3 for i in range(300)], max_tokens=24)]  # past WINDOW
    off, _, _ = run(loaded, reqs)
    proposer = new_proposer(draft_config(3), loaded.model, loaded.device)
    on, counts, _ = run(loaded, reqs, proposer, k=4, budget=32)
    assert_same(off, on, reqs)
    assert counts.drafts > 0 and counts.accepted > 0


@pytest.fixture(scope="module")
def exact_draft(loaded):  # noqa: ANN001, ANN201
    """The built-in model with its last layer's output projections zeroed: that layer adds nothing
    to the residual stream, so a draft with the first 3 layers is the whole model's own greedy
    continuation and every draft token is accepted."""
    model = copy.deepcopy(loaded.model)
    last = model.model.layers[-1]
    with torch.no_grad():
        last.self_attn.o_proj.weight.zero_()
        last.mlp.down_proj.weight.zero_()
    return dataclasses.replace(loaded, model=model)


@pytest.mark.parametrize("max_tokens", [10, 12, 19])
def test_max_tokens_inside_an_accepted_run_equals_off(exact_draft, max_tokens: int):  # noqa: ANN001
    reqs = [request(exact_draft, "r", "Hello there, hello there", max_tokens=max_tokens)]
    off, _, _ = run(exact_draft, reqs)
    proposer = DraftLayersProposer(draft_config(3, k=6), exact_draft.model, exact_draft.device)
    on, counts, _ = run(exact_draft, reqs, proposer, k=6)
    assert_same(off, on, reqs)
    assert len(on.tokens["r"]) == max_tokens and on.finish["r"].reason.name == "LENGTH"
    # Every draft stood: after the prompt's token each verify row emitted its draft and one more,
    # 7 tokens, then the last row's draft was cut to what max_tokens left (1, 3, 3).
    assert counts.accepted == counts.draft_tokens and 1 + counts.draft_tokens + counts.drafts == max_tokens
    assert counts.draft_tokens % 6 == (max_tokens - 1) % 7 - 1


@pytest.mark.parametrize("fields, message", [
    ({"num_draft_layers": 4}, r"num_draft_layers must be in \[1, 3\] \(fewer than the model's 4 layers\), got 4"),
    ({"num_draft_layers": 9}, r"num_draft_layers must be in \[1, 3\].*got 9"),
    ({}, "num_draft_layers is required by method draft_layers"),
    ({"num_draft_layers": 0}, r"num_draft_layers must be an integer in \[1, 1024\], got 0"),
])
def test_a_bad_draft_layers_config_fails_at_start_naming_the_field(model_cache_dir, fields: dict,  # noqa: ANN001
                                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=f"speculative_config.{message}"):
        LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, device="cpu", dtype="float32",
            speculative_config={"method": "draft_layers", **fields})


def test_the_server_refuses_too_many_draft_layers_before_it_starts() -> None:
    config = load_config(["--model", "builtin:tiny", "--port", "0", "--metrics-port", "0", "--speculative-config",
                          '{"method": "draft_layers", "num_draft_layers": 4}'], {})
    assert check_serve(config) == ["--speculative-config: speculative_config.num_draft_layers must be in [1, 3] "
                                   "(fewer than the model's 4 layers), got 4 (builtin:tiny)"]
    ok = load_config(["--model", "builtin:tiny", "--port", "0", "--metrics-port", "0", "--speculative-config",
                      '{"method": "draft_layers", "num_draft_layers": 3}'], {})
    assert check_serve(ok) == []


def test_num_draft_layers_belongs_to_draft_layers_only() -> None:
    with pytest.raises(ValueError, match="speculative_config.num_draft_layers is for method draft_layers"):
        SpeculativeConfig.parse({"method": "ngram", "num_draft_layers": 2})
