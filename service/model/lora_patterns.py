"""PEFT's module patterns (target_modules, rank_pattern, alpha_pattern) against the model's module names,
with a bound on what an adapter's config can cost.

An adapter's config is untrusted input, and Python's `re` backtracks: a pattern such as `(.*.*)*X` runs
for hours while holding the GIL, which would freeze every stream of the engine process. So:
- an entry of a target_modules list matches by exact name or dotted suffix (PEFT's rule), no regex;
- a regex (target_modules as a string, rank_pattern / alpha_pattern keys) is compiled and matched by
  RE2, whose matching is linear in the name (no backtracking), and the regex text is bounded
  (MAX_PATTERN_CHARS each, MAX_REGEX_CHARS in all), so one config's matching against every module name
  of a large model stays within milliseconds. RE2 refuses what it cannot match in linear time
  (backreferences, lookarounds): such a pattern is refused as not a valid regular expression.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PATTERN_CHARS = 1024
MAX_PATTERNS = 1024  # rank_pattern and alpha_pattern keys together
MAX_REGEX_CHARS = 8192  # all the regexes of one config together
_RE2_MAX_MEM = 8 << 20  # per compiled pattern


class PatternError(ValueError):
    """A pattern that is not a valid regular expression, or too long; the message says which."""


@dataclass(frozen=True)
class Pattern:
    field: str  # where the config gave it, for the messages: "target_modules", "rank_pattern key 'x'"
    text: str
    # "name": a module name or a dotted suffix of it, literally (an entry of a target_modules list);
    # "full": a regex matching the whole name (target_modules as a string);
    # "suffix": a regex matching a dotted suffix of the name (rank_pattern / alpha_pattern keys, as
    # PEFT's get_pattern_key: re.match(rf"(.*\.)?({key})$", name))
    mode: str


def match_patterns(patterns: list[Pattern], names: list[str]) -> list[set[str]]:
    """For each pattern, the names it matches (PEFT's semantics); PatternError naming the pattern's
    field when one is too long or not a valid regular expression."""
    regex_chars = sum(len(p.text) for p in patterns if p.mode != "name")
    if regex_chars > MAX_REGEX_CHARS:
        raise PatternError(f"the regular expressions of target_modules, rank_pattern and alpha_pattern hold "
                           f"{regex_chars} characters; at most {MAX_REGEX_CHARS}")
    found = []
    for p in patterns:
        if len(p.text) > MAX_PATTERN_CHARS:
            raise PatternError(f"{p.field} is {len(p.text)} characters long; at most {MAX_PATTERN_CHARS}")
        if p.mode == "name":
            found.append({n for n in names if n == p.text or n.endswith(f".{p.text}")})
            continue
        import re2  # only for a config with regexes

        options = re2.Options()
        options.max_mem = _RE2_MAX_MEM
        options.log_errors = False  # the refusal says why; RE2 would also print it on stderr
        try:
            rx = re2.compile(p.text if p.mode == "full" else rf"(?:.*\.)?(?:{p.text})", options)
        except re2.error as exc:
            why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
            raise PatternError(f"{p.field} {p.text[:64]!r} is not a valid regular expression ({why[:200]})") from None
        found.append({n for n in names if rx.fullmatch(n)})
    return found
