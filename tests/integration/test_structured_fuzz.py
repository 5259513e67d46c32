"""Structured outputs over generated JSON schemas, through the Python API on the built-in model:
every completion parses, validates against its schema and ends by the grammar (finish "stop"), and
the engine's batched, overlapped steps (masks filled on the mask workers while the next forward pass
runs) give the tokens of stepping one request at a time without overlap."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import LLM, SamplingParams, StructuredOutputsParams

SAMPLES = 3  # completions per schema, seeds 0..2, in one generate call
# The longest completion a schema below allows: 4 properties of at most 3 items of 8 characters,
# nested twice, with up to 16 whitespace characters between JSON tokens; well under this many tokens.
MAX_TOKENS = 900


def leaves() -> st.SearchStrategy[dict]:
    """Bounded leaves: every string has a maxLength and every integer a range, so that a random
    model's completion always ends."""
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-1000, 1000), st.integers(0, 10**5)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.text("abxyz", min_size=1, max_size=5), min_size=1, max_size=5,
                                                      unique=True)),
        st.builds(lambda n: {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": n},
                  st.integers(0, 3)),
    )


def objects(depth: int) -> st.SearchStrategy[dict]:
    value = leaves() if depth == 0 else st.one_of(leaves(), objects(depth - 1))

    def build(properties: dict[str, dict], required: list[bool]) -> dict:
        names = [n for n, r in zip(properties, required) if r]
        return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}

    return st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), value, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda required: build(props, required)))


def make(model_cache_dir, overlap: bool, running: int) -> LLM:  # noqa: ANN001
    return LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=running, max_seq_len=1024,
               device="cpu", dtype="float32", overlap_steps=overlap)


@pytest.fixture(scope="module")
def llms(model_cache_dir) -> Iterator[tuple[LLM, LLM]]:  # noqa: ANN001
    """The engine as served (batched, overlapped) and the slow path (one request at a time, stepwise)."""
    with make(model_cache_dir, True, 16) as served, make(model_cache_dir, False, 1) as slow:
        yield served, slow


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(schema=objects(depth=2))
def test_completions_parse_validate_and_equal_the_slow_path(llms: tuple[LLM, LLM], schema: dict) -> None:
    served, slow = llms
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=schema)) for seed in range(SAMPLES)]
    prompts = ["Answer in JSON:"] * SAMPLES
    outs = [o.outputs[0] for o in served.generate(prompts, params)]
    for out in outs:
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert [o.token_ids for o in outs] == [o.outputs[0].token_ids for o in slow.generate(prompts, params)]
