"""Structured outputs: text generated under each constraint parses and validates.

Generation is a seeded random walk over the real built-in tokenizer: fill the mask, pick an allowed
token, accept it. The walk leans toward tokens that end things (EOS, closing quotes and brackets)
so that it terminates, but it still picks arbitrary allowed tokens, multi-byte ones included.
"""

import json
import os
import random
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from service.engine.constraint_limits import ConstraintLimits
from service.engine.mask_fill import MaskFiller
from service.engine.structured import (
    Constraint,
    GrammarCompiler,
    InvalidConstraint,
    Matcher,
    allocate_bitmask,
    apply_bitmask,
    bitmask_words,
)
from service.model.builtin import BUILTIN_SHAPES, write_tokenizer

PAD = 40  # the compiler's vocabulary is wider than the tokenizer's, like a padded LM head
CAP = 400  # tokens per walk


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):  # noqa: ANN001, ANN201
    return tiny_tokenizer


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:  # noqa: ANN001
    return GrammarCompiler(tok, len(tok) + PAD, [tok.eos_token_id])


class Walker:
    def __init__(self, tok, vocab_size: int) -> None:  # noqa: ANN001
        self.tok, self.vocab_size, self.eos = tok, vocab_size, tok.eos_token_id
        texts = [tok.decode([i]) for i in range(len(tok))]
        pad = [False] * (vocab_size - len(tok))
        self.closer = np.array([t != "" and set(t) <= set('"}])') for t in texts] + pad)
        self.opener = np.array([t != "" and set(t) <= set("{[") for t in texts] + pad)
        self.bitmask = allocate_bitmask(1, vocab_size, pin=False)

    def allowed(self, m: Matcher) -> np.ndarray:
        m.fill_bitmask(self.bitmask, 0)
        bits = np.unpackbits(self.bitmask[0].numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return np.flatnonzero(bits)

    def walk(self, m: Matcher, seed: int, warmup: int = 0) -> tuple[str, bool]:
        """(text, terminated): terminated when EOS was picked or the grammar allows nothing else.
        The first `warmup` picks do not lean toward ending, so structures open and nest."""
        rng = random.Random(seed)
        out: list[int] = []
        for step in range(CAP):
            ids = self.allowed(m)
            assert len(ids) and ids[-1] < len(self.tok), "ids past the tokenizer's vocabulary are never allowed"
            if m.is_terminated or (len(ids) == 1 and ids[0] == self.eos):
                assert list(ids) == [self.eos]
                return self.tok.decode(out), True
            t = self._pick(rng, ids, ending=step >= warmup)
            assert m.accept(t)
            if t == self.eos:
                return self.tok.decode(out), True
            out.append(t)
        return self.tok.decode(out), False

    def _pick(self, rng: random.Random, ids: np.ndarray, ending: bool) -> int:
        r = rng.random()
        if not ending:
            openers = ids[self.opener[ids]]
            if r < 0.15 and len(openers):
                return int(rng.choice(openers))
            r = 0.6 + 0.4 * rng.random()
        if r < 0.4 and self.eos in ids:
            return self.eos
        closers = ids[self.closer[ids]]
        if r < 0.6 and len(closers):
            return int(rng.choice(closers))
        single_bytes = ids[ids < 256]
        if r < 0.9 and len(single_bytes):
            return int(rng.choice(single_bytes))
        return int(rng.choice(ids))


@pytest.fixture(scope="module")
def walker(tok, compiler) -> Walker:  # noqa: ANN001
    return Walker(tok, compiler.vocab_size)


def _field_schemas() -> st.SearchStrategy[dict]:
    words = st.text(alphabet="abcxyz _", min_size=1, max_size=6)
    scalar = st.one_of(
        st.just({"type": "string"}),
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "integer"}),
        st.tuples(st.integers(-50, 0), st.integers(0, 50)).map(lambda r: {"type": "integer", "minimum": r[0], "maximum": r[1]}),
        st.just({"type": "boolean"}),
        st.lists(words, min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e}),
    )
    array = st.tuples(scalar, st.integers(0, 4)).map(lambda a: {"type": "array", "items": a[0], "maxItems": a[1]})
    return st.one_of(scalar, array)


@st.composite
def object_schemas(draw) -> dict:  # noqa: ANN001
    names = draw(st.lists(st.text(alphabet="abcdefgh_", min_size=1, max_size=8), min_size=1, max_size=5, unique=True))
    props = {n: draw(_field_schemas()) for n in names}
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=object_schemas(), seed=st.integers(0, 2**16), warmup=st.integers(0, 40))
def test_json_schema_walk_validates(compiler, walker, schema, seed, warmup) -> None:  # noqa: ANN001
    text, terminated = walker.walk(compiler.matcher(Constraint("json_schema", json.dumps(schema))), seed, warmup)
    assert terminated, text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("prefix", ["", '{"a": [', '{"a": {"b": [{"c": '])
def test_json_object_walk_is_an_object(compiler, walker, tok, prefix) -> None:  # noqa: ANN001
    for seed in range(6):
        m = compiler.matcher(Constraint("json_object", ""))
        assert all(m.accept(t) for t in tok.encode(prefix, add_special_tokens=False))
        text, terminated = walker.walk(m, seed, warmup=40)
        assert terminated, prefix + text
        assert isinstance(json.loads(prefix + text), dict)


def _accepts(compiler, tok, c: Constraint, text: str) -> bool:  # noqa: ANN001
    m = compiler.matcher(c)
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.accept(tok.eos_token_id)


def test_json_whitespace_is_flexible_but_bounded(compiler, tok) -> None:  # noqa: ANN001
    any_object = Constraint("json_object", "")
    assert _accepts(compiler, tok, any_object, '{"a": [1, 2], "b": {"c": true}}')
    assert _accepts(compiler, tok, any_object, '{\n  "a": {\n    "b": null\n  }\n}')
    assert not _accepts(compiler, tok, any_object, '{"a":' + " " * 17 + "1}")


REGEXES = [
    r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})? (USD|EUR)",
    r"\d{3}-\d{4}",
    r"(ab|cd)+x?",
    r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]+)?",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walk_matches_fully(compiler, walker, regex) -> None:  # noqa: ANN001
    for seed in range(6):
        text, terminated = walker.walk(compiler.matcher(Constraint("regex", regex)), seed, warmup=10)
        assert terminated, text
        assert re.fullmatch(regex, text), text


def test_choice_walk_is_one_of_the_choices(compiler, walker) -> None:  # noqa: ANN001
    choices = ("yes", "no", "yes!", "maybe so", "naïve", 'say "hi"')
    seen = set()
    for seed in range(20):
        text, terminated = walker.walk(compiler.matcher(Constraint("choice", choices)), seed)
        assert terminated and text in choices, text
        seen.add(text)
    assert len(seen) >= 3


SQL = r"""
root ::= select_statement
# the example of vLLM's structured outputs guide
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
ARITH = r"""
root ::= expr
expr ::= term ("+" term)*
term ::= [0-9]{1,3} | "(" expr ")"
"""


def _is_arith(text: str) -> bool:
    while (reduced := re.sub(r"\([0-9]+(\+[0-9]+)*\)", "0", text)) != text:
        text = reduced
    return re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text) is not None


@pytest.mark.parametrize("seed", range(8))
def test_ebnf_grammar_walk_is_in_the_language(compiler, walker, seed) -> None:  # noqa: ANN001
    text, terminated = walker.walk(compiler.matcher(Constraint("grammar", SQL)), seed)
    assert terminated and re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text), text
    text, terminated = walker.walk(compiler.matcher(Constraint("grammar", ARITH)), seed, warmup=20)
    assert terminated and _is_arith(text), text


def test_ebnf_unicode_escapes(compiler, tok) -> None:  # noqa: ANN001
    c = Constraint("grammar", r'root ::= "caf\u00e9 " [\u0100-\u017f]+ "\u005d" [\x41-\x43]? "\\u"')
    assert _accepts(compiler, tok, c, "café āž]B\\u")
    assert not _accepts(compiler, tok, c, "cafe ā]\\u")
    assert not _accepts(compiler, tok, c, "café a]\\u")


def test_lark_grammar_is_accepted_too(compiler, walker) -> None:  # noqa: ANN001
    text, terminated = walker.walk(compiler.matcher(Constraint("grammar", 'start: ("ab" | "c")+ "!"')), 0)
    assert terminated and re.fullmatch(r"(ab|c)+!", text), text


def test_rejected_token_leaves_only_eos(compiler, walker, tok) -> None:  # noqa: ANN001
    m = compiler.matcher(Constraint("regex", "[0-9]+"))
    assert not m.accept(tok.encode("x", add_special_tokens=False)[0])
    assert m.is_terminated and m.error
    assert list(walker.allowed(m)) == [tok.eos_token_id]


def test_rollback_restores_the_mask(compiler, walker, tok) -> None:  # noqa: ANN001
    m = compiler.matcher(Constraint("json_object", ""))
    ids = tok.encode('{"key": [1, "two"', add_special_tokens=False)
    for t in ids[:3]:
        assert m.accept(t)
    before = walker.allowed(m)
    for t in ids[3:]:
        assert m.accept(t)
    m.rollback(len(ids) - 3)
    assert np.array_equal(walker.allowed(m), before)


def test_mask_filler_equals_row_by_row(compiler, tok) -> None:  # noqa: ANN001
    matchers = []
    for c, prefix in [(Constraint("json_object", ""), '{"a": "'), (Constraint("regex", r"\d+"), "12"),
                      (Constraint("choice", ("red", "green")), "gr"), (Constraint("json_object", ""), "")]:
        m = compiler.matcher(c)
        assert all(m.accept(t) for t in tok.encode(prefix, add_special_tokens=False))
        matchers.append(m)
    before = set(threading.enumerate())
    filler = MaskFiller(compiler.vocab_size, workers=2, budget_ms=1000)
    try:
        batch = allocate_bitmask(6, compiler.vocab_size, pin=False)
        assert filler.fill(matchers, batch[:4]) == ({}, [])
    finally:
        filler.close()
    # Its workers have ended when close returns: a worker that frees its tensors while the interpreter
    # exits aborts the process (std::terminate), so nothing of the pool may outlive an engine's stop.
    assert set(threading.enumerate()) <= before
    one = allocate_bitmask(1, compiler.vocab_size, pin=False)
    for i, m in enumerate(matchers):
        m.fill_bitmask(one, 0)
        assert torch.equal(batch[i], one[0])
    assert bool((batch[4:] == -1).all())  # rows past the step's are untouched


def _policies_of_threads() -> dict[int, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return out


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux: a thread has its own scheduling policy")
def test_a_row_over_its_budget_fails_and_its_worker_yields_the_cpu(compiler, tok) -> None:  # noqa: ANN001
    """A row whose mask takes longer than the step's budget fails and the step goes on; the worker
    left computing it (the library cannot be interrupted) runs at the idle priority: its result is
    thrown away, and at the default priority it competed with the engine thread for a core."""
    slow = compiler.matcher(Constraint("regex", "p{1000}{1300}"))  # its first mask: ~150 ms of CPU
    cheap = compiler.matcher(Constraint("choice", ("red", "green")))
    before = _policies_of_threads()
    filler = MaskFiller(compiler.vocab_size, workers=2, budget_ms=5)
    try:
        batch = allocate_bitmask(2, compiler.vocab_size, pin=False)
        failed, _ = filler.fill([slow, cheap], batch)
        policies = _policies_of_threads()  # the abandoned worker is still inside the library
    finally:
        filler.close()
    assert list(failed) == [0] and "--constraint-mask-timeout-ms" in failed[0]
    assert bool((batch[0] == -1).all())  # the failed row allows every token; its token is discarded
    one = allocate_bitmask(1, compiler.vocab_size, pin=False)
    cheap.fill_bitmask(one, 0)
    assert torch.equal(batch[1], one[0])
    workers = [policy for tid, policy in policies.items() if tid not in before]  # two, and one in a place
    assert sorted(workers) == sorted([os.SCHED_OTHER, os.SCHED_OTHER, os.SCHED_IDLE]), policies


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux: a thread has its own scheduling policy")
def test_compiles_run_at_the_idle_priority(compiler) -> None:  # noqa: ANN001
    """Compiles and first masks (a hostile regex's: ~150 ms of CPU) take only CPU time that nothing
    else wants: at nice 10 one kept a core of two while the engine thread waited for the other."""
    from service.engine.constraint_prepare import ConstraintPreparer

    before = _policies_of_threads()
    preparer = ConstraintPreparer(compiler, ConstraintLimits(), workers=2)
    try:
        m = preparer.prepare_now(Constraint("regex", "[ab]{3}"))
        policies = _policies_of_threads()
    finally:
        preparer.close()
    assert isinstance(m, Matcher)
    new = [policy for tid, policy in policies.items() if tid not in before]  # two workers and a watcher
    assert sorted(new) == sorted([os.SCHED_IDLE, os.SCHED_IDLE, os.SCHED_OTHER]), policies


def test_a_full_compile_queue_refuses_at_once_naming_the_flag(compiler) -> None:  # noqa: ANN001
    """Over --max-pending-constraints compiles (one running, one queued) a new constraint is refused at
    once with ConstraintsBusy (RESOURCE_EXHAUSTED: retry later); the two accepted still finish."""
    from service.engine.constraint_prepare import ConstraintPreparer, ConstraintsBusy

    preparer = ConstraintPreparer(compiler, ConstraintLimits(max_pending_constraints=2), workers=1)
    results: dict[int, object] = {}
    done = threading.Event()

    def record(i: int):  # noqa: ANN202
        def got(r: object) -> None:
            results[i] = r
            if len(results) == 3:
                done.set()
        return got

    try:
        # First masks of 13-byte literal regexes: ~90 ms of CPU each, so the first still runs when the
        # third arrives microseconds later.
        for i in range(3):
            preparer.prepare(Constraint("regex", "p{1000}{%d}" % (700 + i)), record(i))
        assert isinstance(results.get(2), ConstraintsBusy), results
        assert "--max-pending-constraints" in str(results[2]) and "retry later" in str(results[2])
        assert done.wait(30), results
    finally:
        preparer.close()
    assert all(not isinstance(results[i], ConstraintsBusy) for i in (0, 1)), results
    assert preparer.stats.busy == 1


def _reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            if not (int(bitmask[b, v // 32]) >> (v % 32)) & 1:
                out[b, v] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_matches_a_loop(dtype) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    vocab = 808  # not a multiple of 32: the last word is partly used
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_words(vocab)), generator=gen, dtype=torch.int32)
    bitmask[2] = -1  # an unconstrained row
    bitmask[4] = 0  # nothing allowed
    logits[0, :4] = torch.tensor([float("inf"), float("-inf"), float("inf"), float("-inf")], dtype=dtype)
    expected = _reference_apply(logits, bitmask)
    got = logits.clone()
    apply_bitmask(got, bitmask)
    assert torch.equal(got, expected)
    assert torch.equal(got[2], logits[2])
    assert bool(torch.isinf(got[4]).all())


def test_apply_bitmask_disallows_ids_past_the_tokenizer(compiler, tok) -> None:  # noqa: ANN001
    bitmask = allocate_bitmask(2, compiler.vocab_size, pin=False)
    compiler.matcher(Constraint("json_object", "")).fill_bitmask(bitmask, 0)  # row 1 stays unconstrained
    logits = torch.zeros(2, compiler.vocab_size)
    apply_bitmask(logits, bitmask)
    assert bool(torch.isinf(logits[0, len(tok):]).all())
    assert torch.isfinite(logits[0]).sum() > 0
    assert bool((logits[1] == 0).all())


@pytest.mark.parametrize(
    ("constraint", "names"),
    [
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", '{"type": "integr"}'), "integr"),
        (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("regex", "(?=a)a"), "look-around"),
        (Constraint("grammar", 'root ::= "a" number'), "number"),
        (Constraint("grammar", 'rot ::= "a"'), "root"),
        (Constraint("grammar", 'root ::= "a" | ('), "grammar"),
        (Constraint("choice", ()), "empty"),
        (Constraint("choice", ("a", 1)), "string"),
        (Constraint("yaml", "a: 1"), "yaml"),
    ],
)
def test_invalid_constraints_say_what_is_wrong(compiler, constraint, names) -> None:  # noqa: ANN001
    with pytest.raises(InvalidConstraint, match=re.escape(names)):
        compiler.matcher(constraint)


def test_compiled_grammars_are_cached_from_their_second_use_lru_by_count_and_bytes(tok) -> None:  # noqa: ANN001
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], max_cached=2)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    compiler.matcher(a)  # seen once: compiled, not kept (a flood of distinct constraints fills nothing)
    compiler.matcher(a)  # again: kept
    compiler.matcher(Constraint("regex", "a+"))  # an equal constraint is the same key
    assert (compiler.misses, compiler.hits) == (2, 1)
    for x in (b, b, c, c):  # b and c kept; c evicts a, the least recently used
        compiler.matcher(x)
    assert compiler.cached(b) is not None and compiler.cached(c) is not None and compiler.cached(a) is None
    # Bytes: one entry over an eighth of the cache is never kept; others are evicted until the rest fit.
    small = GrammarCompiler(tok, len(tok), [tok.eos_token_id], limits=ConstraintLimits(constraint_cache_bytes=8000))
    proto = small.compile(a)
    assert not small.keep(a, proto, 1001) and not small.keep(a, proto, 1001) and small.cached(a) is None
    for i in range(9):
        x = Constraint("regex", f"x{i}")
        assert not small.keep(x, proto, 1000) and small.keep(x, proto, 1000)
    assert small.cached_bytes == 8000 and small.cached(Constraint("regex", "x0")) is None
    assert small.cached(Constraint("regex", "x8")) is not None


def test_large_vocabulary(tmp_path) -> None:  # noqa: ANN001
    """The Llama-3-sized built-in tokenizer (128,256 ids, 256 special): masks stay exact."""
    write_tokenizer(tmp_path, BUILTIN_SHAPES["llama-1b"])
    big = AutoTokenizer.from_pretrained(str(tmp_path))
    compiler = GrammarCompiler(big, len(big), [big.eos_token_id])
    walker = Walker(big, len(big))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
              "required": ["name", "n", "tags"], "additionalProperties": False}
    for seed in range(3):
        text, terminated = walker.walk(compiler.matcher(Constraint("json_schema", json.dumps(schema))), seed, warmup=20)
        assert terminated, text
        jsonschema.validate(json.loads(text), schema)
    ids = walker.allowed(compiler.matcher(Constraint("json_schema", json.dumps(schema))))
    assert len(ids) > 1 and all(big.decode([i]).startswith("{") for i in ids)  # "{", '{"', "{\n", ...
    assert ids[-1] < big.convert_tokens_to_ids("<|begin_of_text|>")  # no special token slips in


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux: a thread has its own scheduling policy")
def test_a_decode_whose_mask_is_late_sits_the_step_out_and_its_mask_is_kept(compiler) -> None:  # noqa: ANN001
    """A decode row whose mask is not done a quarter budget into the step sits the step out (the
    engine voids its token) instead of holding the others; its worker finishes in the background,
    at the idle priority, and the sequence's next fill copies that mask."""
    # `a{1000}{60}`: its first mask ~55 ms of CPU on the tiny vocabulary (then ~12 ms a token), 2-core
    # host; the budget (150 ms) is 2.7x that, its quarter (37.5 ms) under it even on a faster core.
    constraint = Constraint("regex", "a{1000}{60}")
    late, reference = compiler.matcher(constraint), compiler.matcher(constraint)
    cheap = compiler.matcher(Constraint("choice", ("red", "green")))
    before = _policies_of_threads()
    filler = MaskFiller(compiler.vocab_size, workers=2, budget_ms=150)
    ready = threading.Event()
    filler.on_ready = ready.set
    try:
        batch = allocate_bitmask(2, compiler.vocab_size, pin=False)
        assert filler.fill([late, cheap], batch, deferrable=[True, True]) == ({}, [0])
        policies = _policies_of_threads()  # the late row's worker is still inside the library
        assert late.mask_pending  # the engine does not schedule it meanwhile
        assert bool((batch[0] == -1).all())  # its token is void
        assert ready.wait(30)  # the engine is woken when it is done
        assert not late.mask_pending
        again = allocate_bitmask(1, compiler.vocab_size, pin=False)
        assert filler.fill([late], again, deferrable=[True]) == ({}, [])
    finally:
        filler.close()
    one = allocate_bitmask(1, compiler.vocab_size, pin=False)
    reference.fill_bitmask(one, 0)
    assert torch.equal(again[0], one[0])
    cheap.fill_bitmask(one, 0)
    assert torch.equal(batch[1], one[0])
    workers = [policy for tid, policy in policies.items() if tid not in before]  # two, and the late one
    assert sorted(workers) == sorted([os.SCHED_OTHER, os.SCHED_OTHER, os.SCHED_IDLE]), policies


def test_a_late_mask_over_its_budget_fails_its_request_at_the_next_step(compiler) -> None:  # noqa: ANN001
    """A row that sat out is still held to its budget: its next fill fails it (INVALID_ARGUMENT for
    its request) instead of using a mask that cost more CPU than the budget allows."""
    late = compiler.matcher(Constraint("regex", "p{1000}{1300}"))  # its first mask: ~92 ms of CPU (2-core host)
    filler = MaskFiller(compiler.vocab_size, workers=1, budget_ms=40)
    ready = threading.Event()
    filler.on_ready = ready.set
    try:
        batch = allocate_bitmask(1, compiler.vocab_size, pin=False)
        assert filler.fill([late], batch, deferrable=[True]) == ({}, [0])
        assert ready.wait(30)
        assert not late.mask_pending  # it is scheduled again, to fail
        failed, sat_out = filler.fill([late], batch, deferrable=[True])
    finally:
        filler.close()
    assert sat_out == [] and list(failed) == [0] and "--constraint-mask-timeout-ms" in failed[0]
    assert bool((batch[0] == -1).all())
