"""What a structured-output constraint may cost, and the checks made before any compile.

A constraint of a few bytes can ask a grammar library for unbounded work (`p{1000}{1129}` is a
million-character literal; a 50,000-entry choice list is a 50,000-item grammar row), so every way in
checks a constraint's size here first (cheap, linear, never recursive), and the engine's grammar
workers bound the rest (compile time, the first mask, each step's mask) with the budgets below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from service.engine.request import CONSTRAINT_KINDS, Constraint


class InvalidConstraint(ValueError):
    """A constraint refused before or while compiling; the message names the kind, what is wrong and,
    for a limit, the flag that sets it."""


@dataclass(frozen=True)
class ConstraintLimits:
    """Budgets for structured outputs (flags of the same names, `--max-constraint-bytes` ...)."""

    # Text of a regex, a grammar or a JSON schema, or all choices together, in UTF-8 bytes.
    max_constraint_bytes: int = 64 * 1024
    # Entries of a choice list (the grammar library keeps at most 2,000 items in one row).
    max_constraint_choices: int = 1024
    # Nesting of a JSON schema's objects and arrays (brackets deep).
    max_constraint_depth: int = 64
    # CPU seconds for compiling a constraint and computing its first token mask, on a grammar worker.
    constraint_compile_timeout: float = 2.0
    # CPU milliseconds for one row's token mask in one step; a row over it fails, the step goes on.
    # Measured with a 128k vocabulary on a 2-core host: legitimate masks p99 0.6 ms, max 4.4 ms (a
    # 1,000-entry choice's second step); a row also fails if it keeps using over a quarter of this.
    constraint_mask_timeout_ms: float = 10.0
    # Bytes of compiled constraints kept for reuse (each measured when compiled; one over an eighth of
    # this is never kept). Typical JSON schemas take well under a MB.
    constraint_cache_bytes: int = 64 << 20
    # Compiles waiting or running at once; more are refused (RESOURCE_EXHAUSTED, retry later).
    max_pending_constraints: int = 32

    def validate(self) -> None:
        """ValueError naming the flag of the first bad value."""
        for name in ("max_constraint_bytes", "max_constraint_choices", "max_constraint_depth",
                     "constraint_cache_bytes", "max_pending_constraints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("constraint_compile_timeout", "constraint_mask_timeout_ms"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")


def check_size(c: Constraint, limits: ConstraintLimits) -> None:
    """InvalidConstraint when c is over a size limit (or not a known kind): before any compile."""
    if c.kind not in CONSTRAINT_KINDS:
        raise InvalidConstraint(f"unknown constraint kind {c.kind!r}; known: {', '.join(CONSTRAINT_KINDS)}")
    if c.kind == "choice":
        if not isinstance(c.value, tuple) or not c.value:
            raise InvalidConstraint("invalid choice: the list of choices is empty")
        if len(c.value) > limits.max_constraint_choices:
            raise InvalidConstraint(f"choice has {len(c.value)} entries; at most {limits.max_constraint_choices} "
                                    "are allowed (--max-constraint-choices)")
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
