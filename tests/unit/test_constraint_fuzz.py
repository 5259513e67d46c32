"""Fuzzed constraint shapes and sizes through the engine's grammar workers (constraints.py): every
constraint is prepared and walked as the engine does (prepare on a worker, then each step's mask on
the mask workers, then the token), and each one ends either as a completion that follows it or as
an error, in bounded time and bounded memory. Counted repetitions nest freely: `p{1000}{1129}` is
the 13-byte shape that once froze a server."""

from __future__ import annotations

import gc
import json
import random
import time

import jsonschema
import numpy as np
import pytest
import re2  # linear time: Python's re backtracks exponentially on nested quantifiers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from service.engine.constraint_limits import ConstraintLimits, InvalidConstraint
from service.engine.constraint_prepare import ConstraintsBusy
from service.engine.constraints import Constraints
from service.engine.grammar_threads import heap_bytes
from service.engine.request import Constraint
from service.engine.structured import allocate_bitmask

LIMITS = ConstraintLimits(constraint_compile_timeout=0.5, constraint_mask_timeout_ms=10.0)
WALL = 10  # the workers' wall-clock limit is 10x their CPU budget (a busy host)
STEPS = 60


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):  # noqa: ANN001, ANN201
    return tiny_tokenizer


@pytest.fixture(scope="module")
def grammar(tok):  # noqa: ANN001, ANN201
    constraints = Constraints(tok, len(tok), [tok.eos_token_id], LIMITS)
    gc.collect()
    constraints.baseline = heap_bytes()
    yield constraints
    constraints.close()


def regexes(depth: int = 3) -> st.SearchStrategy[str]:
    atom = st.sampled_from(["a", "b", "c", "[a-c]", "[0-9]", "x"])
    if depth == 0:
        return atom

    def quantified(inner: str, q: str) -> str:
        return f"({inner}){q}"

    quantifier = st.one_of(st.sampled_from(["*", "+", "?"]),
                           st.integers(0, 1000).map(lambda n: "{%d}" % n),
                           st.tuples(st.integers(0, 50), st.integers(0, 1000)).map(
                               lambda t: "{%d,%d}" % (min(t), max(t))))
    sub = regexes(depth - 1)
    return st.one_of(atom,
                     st.builds(quantified, sub, quantifier),
                     st.lists(sub, min_size=1, max_size=4).map("".join),
                     st.lists(sub, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"))


def schemas(depth: int = 3) -> st.SearchStrategy[dict]:
    leaf = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 40)),
        st.builds(lambda r: {"type": "string", "pattern": f"^{r}$"}, regexes(2)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-100, 100), st.integers(0, 10**6)),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.text("abcxyz", min_size=1, max_size=6), min_size=1, max_size=40,
                                                      unique=True)),
        st.just({"type": "boolean"}),
    )
    if depth == 0:
        return leaf
    sub = schemas(depth - 1)
    return st.one_of(
        leaf,
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, sub, st.integers(0, 3)),
        st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), sub, min_size=1, max_size=4).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False}),
    )


def constraints() -> st.SearchStrategy[Constraint]:
    return st.one_of(
        regexes().map(lambda r: Constraint("regex", r)),
        schemas().map(lambda s: Constraint("json_schema", json.dumps(s))),
        st.lists(st.text("abcdefghij ", min_size=1, max_size=12), min_size=1, max_size=2500, unique=True).map(
            lambda xs: Constraint("choice", tuple(xs))),
    )


def _pattern(validator, pattern: str, instance, schema):  # noqa: ANN001, ANN202 - jsonschema's keyword signature
    if isinstance(instance, str) and _search(pattern, instance) is False:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


# jsonschema's own `pattern` uses Python's re, which backtracks exponentially on nested quantifiers.
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern})


def _search(pattern: str, text: str, full: bool = False) -> bool | None:
    """Whether text matches (None: RE2 refuses the pattern as too large to check, e.g. nested counts)."""
    try:
        return (re2.fullmatch if full else re2.search)(pattern, text) is not None
    except re2.error:
        return None


def follows(c: Constraint, text: str) -> bool:
    if c.kind == "regex":
        return _search(c.value, text, full=True) is not False
    if c.kind == "choice":
        return text in c.value
    try:
        _Validator(json.loads(c.value)).validate(json.loads(text))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@given(c=constraints(), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
def test_every_constraint_ends_valid_or_as_an_error_in_bounded_time_and_memory(grammar, tok, c, seed) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    try:
        matcher = grammar.preparer.prepare_now(c)
    except (InvalidConstraint, ConstraintsBusy) as exc:
        event(f"refused: {type(exc).__name__}")
        matcher = None
    # A compile gets its CPU budget; in wall time at most 10x (a busy host), and a second of slack.
    assert time.monotonic() - t0 < LIMITS.constraint_compile_timeout * WALL + 1.0
    if matcher is not None:
        walk(grammar, tok, c, matcher, random.Random(seed))
    del matcher
    gc.collect()
    # The cache may keep 64 MB of compiled constraints; a walk's grammar is freed with its matcher.
    assert heap_bytes() - grammar.baseline < LIMITS.constraint_cache_bytes + (64 << 20)


def walk(grammar: Constraints, tok, c: Constraint, matcher, rng: random.Random) -> None:  # noqa: ANN001
    bitmask = allocate_bitmask(1, len(tok), pin=False)
    ids: list[int] = []
    for _ in range(STEPS):
        t0 = time.monotonic()
        failed, _ = grammar.masks.fill([matcher], bitmask)
        # A row gets its CPU budget per step; in wall time at most 10x, and half a second of slack.
        assert time.monotonic() - t0 < LIMITS.constraint_mask_timeout_ms / 1000 * WALL + 0.5
        if failed:
            event("failed at a mask")
            return  # an error: the engine ends the request with it
        allowed = np.flatnonzero(np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: len(tok)])
        assert len(allowed), "a live matcher allowed nothing, not even EOS"
        if tok.eos_token_id in allowed and (len(allowed) == 1 or rng.random() < 0.3):
            assert follows(c, tok.decode(ids)), (c, tok.decode(ids))  # a completion: it must follow its constraint
            event("completed")
            return
        token = int(rng.choice([t for t in allowed if t != tok.eos_token_id]))
        if not matcher.accept(token):
            event("gave up on a token")
            return  # the library gave up on a token its mask allowed: an error (ConstraintFailed)
        ids.append(token)
        if matcher.is_terminated:
            assert follows(c, tok.decode(ids)), (c, tok.decode(ids))
            event("completed")
            return
    event("still running after the walk")
