"""GBNF grammars converted to Lark in a child process (service/engine/gbnf.py): the same Lark as the
grammar library's converter gives in-process, its errors as InvalidConstraint, a conversion over its
budget killed (and the next one served by a new child), nothing of it run in the engine's process."""

from __future__ import annotations

import pytest
from llguidance.gbnf_to_lark import any_to_lark

from service.engine.constraint_limits import InvalidConstraint
from service.engine.gbnf import GbnfConverter

GRAMMARS = [
    'root ::= "yes" | "no"',
    'root ::= item ("," item)*\nitem ::= [a-z]+ | "\\"" [^"]* "\\""',
    "root ::= " + " | ".join(f'"w{j}"' for j in range(300)),
]


@pytest.fixture
def converter():
    c = GbnfConverter(timeout_s=30)
    yield c
    c.close()


@pytest.mark.parametrize("text", GRAMMARS)
def test_the_child_converts_as_the_library_does_in_process(converter, text):
    assert converter.to_lark(text) == any_to_lark(text)


def test_a_grammar_the_converter_rejects_is_invalid_with_its_reason(converter):
    with pytest.raises(InvalidConstraint, match="Failed to convert the grammar from GBNF to Lark: .+"):
        converter.to_lark('root ::= "unclosed')
    assert converter.to_lark(GRAMMARS[0]) == any_to_lark(GRAMMARS[0])  # the child serves on


def test_the_conversion_runs_outside_this_process(converter, monkeypatch):
    import llguidance.gbnf_to_lark

    expected = any_to_lark(GRAMMARS[1])

    def here(text: str) -> str:
        raise AssertionError("converted in the engine's process")

    monkeypatch.setattr(llguidance.gbnf_to_lark, "any_to_lark", here)
    assert converter.to_lark(GRAMMARS[1]) == expected


def test_a_conversion_over_its_budget_kills_the_child_and_the_next_gets_a_new_one():
    c = GbnfConverter(timeout_s=1e-6)
    try:
        with pytest.raises(InvalidConstraint, match="took over .* s \\(--constraint-compile-timeout\\)"):
            c.to_lark(GRAMMARS[2])
        assert c._proc is None  # killed
        c.timeout_s = 30
        assert c.to_lark(GRAMMARS[0]) == any_to_lark(GRAMMARS[0])
    finally:
        c.close()


def test_close_ends_the_child(converter):
    converter.to_lark(GRAMMARS[0])
    proc = converter._proc
    converter.close()
    assert proc.poll() is not None
