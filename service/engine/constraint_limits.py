"""The checks made on a structured-output constraint before any compile (its budgets:
config.ConstraintLimits).

A constraint of a few bytes can ask a grammar library for unbounded work (`p{1000}{1129}` is a
million-character literal; a 50,000-entry choice list is a 50,000-item grammar row), so every way in
checks a constraint's size here first (cheap, linear, never recursive), and the engine's grammar
workers bound the rest (compile time, the first mask, each step's mask) with the budgets below.
"""

from __future__ import annotations

import re

from service.config import ConstraintLimits
from service.engine.request import CONSTRAINT_KINDS, Constraint

__all__ = ["ConstraintLimits", "InvalidConstraint", "check_size", "json_depth"]


class InvalidConstraint(ValueError):
    """A constraint refused before or while compiling; the message names the kind, what is wrong and,
    for a limit, the flag that sets it."""


def check_size(c: Constraint, limits: ConstraintLimits) -> None:
    """InvalidConstraint when c is over a size limit (or not a known kind): before any compile."""
    if c.kind not in CONSTRAINT_KINDS:
        raise InvalidConstraint(f"unknown constraint kind {c.kind!r}; known: {', '.join(CONSTRAINT_KINDS)}")
    if c.kind == "choice":
        if not isinstance(c.value, tuple) or not c.value:
            raise InvalidConstraint("invalid choice: the list of choices is empty")
        if len(c.value) > limits.max_constraint_choices:
            raise InvalidConstraint(too_many_choices(len(c.value), limits))
        if not all(isinstance(s, str) for s in c.value):
            raise InvalidConstraint("invalid choice: every choice must be a string")
        size = sum(_utf8_len(s) for s in c.value)
        what = "the choices hold"
    else:
        if not isinstance(c.value, str):
            raise InvalidConstraint(f"invalid {c.kind}: the value must be a string")
        size = _utf8_len(c.value)
        what = f"{c.kind} is"
    if size > limits.max_constraint_bytes:
        raise InvalidConstraint(f"{what} {size} bytes, over the limit of {limits.max_constraint_bytes} bytes "
                                "(--max-constraint-bytes)")
    if c.kind == "json_schema":
        depth = json_depth(c.value)
        if depth > limits.max_constraint_depth:
            raise InvalidConstraint(f"json_schema nests {depth} levels of objects and arrays; at most "
                                    f"{limits.max_constraint_depth} are allowed (--max-constraint-depth)")


def too_many_choices(count: int, limits: ConstraintLimits) -> str:
    return f"choice has {count} entries; at most {limits.max_constraint_choices} are allowed (--max-constraint-choices)"


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, outside strings (a scan, no parse: a parser's
    recursion is what a deep document attacks). Linear: the loop visits only quotes, backslashes and
    brackets. Malformed text gets a number too; the parse later says what is wrong with it."""
    depth = deepest = 0
    in_string = False
    skip_to = -1  # the character after a backslash is escaped
    for m in _SPECIAL.finditer(text):
        ch, at = m.group(), m.start()
        if at < skip_to:
            continue
        if in_string:
            if ch == "\\":
                skip_to = at + 2
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


_SPECIAL = re.compile(r'["\\\[\]{}]')


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
