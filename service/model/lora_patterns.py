"""PEFT's module patterns (target_modules, rank_pattern, alpha_pattern) against the model's module names,
with a bound on what an adapter's config can cost.

An adapter's config is untrusted input, and Python's `re` backtracks: a pattern such as `(.*.*)*X` runs
for hours while holding the GIL, which would freeze every stream of the engine process. So:
- an entry of a list matches by exact name or dotted suffix (PEFT's rule for lists), no regex;
- a pattern made only of name characters and dots (`q_proj`, `layers.0.self_attn.q_proj`) is a
  fixed-length pattern whose dots match any one character: matched here in linear time, exactly as
  PEFT's regex would;
- any other pattern is a regular expression: every such pattern of one config is matched in one
  short-lived child Python process (the standard library only) against the module names, killed after
  REGEX_TIMEOUT_S and limited in memory. The engine process only waits on a pipe (the GIL free), so a
  catastrophic pattern costs the load that many seconds and nothing else.

A child process rather than a linear-time engine (RE2) because that is another native dependency,
and RE2's syntax is not Python's, which PEFT uses; the plain names that nearly every adapter uses
never start one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass

REGEX_TIMEOUT_S = 2.0
MAX_PATTERN_CHARS = 1024
MAX_PATTERNS = 1024  # rank_pattern and alpha_pattern keys together
_CHILD_MEMORY_BYTES = 512 << 20
_PLAIN = re.compile(r"[A-Za-z0-9_.]+")  # only ever matched against config text of bounded length

# Reads {"names": [...], "patterns": [[mode, pattern], ...]} on stdin; writes, per pattern, the indices
# of the names it matches or the regex error. mode "full": re.fullmatch (target_modules);
# "suffix": PEFT's get_pattern_key, re.match(rf"(.*\.)?({key})$").
_CHILD = r"""
import json, re, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (%d, %d))
job = json.load(sys.stdin)
out = []
for mode, pattern in job["patterns"]:
    try:
        rx = re.compile(pattern if mode == "full" else r"(.*\.)?(" + pattern + r")$")
    except (re.error, RecursionError, OverflowError, MemoryError) as exc:
        out.append({"error": str(exc)[:200]})
        continue
    match = rx.fullmatch if mode == "full" else rx.match
    out.append({"matches": [i for i, name in enumerate(job["names"]) if match(name)]})
json.dump(out, sys.stdout)
""" % (_CHILD_MEMORY_BYTES, _CHILD_MEMORY_BYTES)


class PatternError(ValueError):
    """A pattern that is not a regular expression, or took too long; the message says which."""


@dataclass(frozen=True)
class Pattern:
    field: str  # where the config gave it, for the messages: "target_modules", "rank_pattern key 'x'"
    text: str
    # "name": a module name or a dotted suffix of it, literally (an entry of a target_modules list);
    # "full": a regex matching the whole name (target_modules as a string);
    # "suffix": a regex matching a dotted suffix of the name (rank_pattern / alpha_pattern keys)
    mode: str


def _dots_match(text: str, pattern: str) -> bool:
    return len(text) == len(pattern) and all(p == "." or p == c for c, p in zip(text, pattern))


def _plain_match(pattern: Pattern, name: str) -> bool:
    if pattern.mode == "full":
        return _dots_match(name, pattern.text)
    n = len(pattern.text)
    if len(name) < n or not _dots_match(name[len(name) - n:], pattern.text):
        return False
    return len(name) == n or name[len(name) - n - 1] == "."


def match_patterns(patterns: list[Pattern], names: list[str]) -> list[set[str]]:
    """For each pattern, the names it matches (PEFT's semantics); PatternError naming the pattern's
    field when one is too long, is not a valid regex, or does not finish within REGEX_TIMEOUT_S."""
    results: list[set[str] | None] = []
    regexes: list[int] = []
    for i, p in enumerate(patterns):
        if len(p.text) > MAX_PATTERN_CHARS:
            raise PatternError(f"{p.field} is {len(p.text)} characters long; at most {MAX_PATTERN_CHARS}")
        if p.mode == "name":
            results.append({n for n in names if n == p.text or n.endswith(f".{p.text}")})
        elif _PLAIN.fullmatch(p.text):
            results.append({n for n in names if _plain_match(p, n)})
        else:
            results.append(None)
            regexes.append(i)
    if regexes:
        for i, found in zip(regexes, _match_in_child([patterns[i] for i in regexes], names), strict=True):
            results[i] = found
    return [r if r is not None else set() for r in results]


def _match_in_child(patterns: list[Pattern], names: list[str]) -> list[set[str]]:
    job = json.dumps({"names": names, "patterns": [[p.mode, p.text] for p in patterns]})
    shown = ", ".join(p.field for p in patterns[:3]) + (f" and {len(patterns) - 3} more" if len(patterns) > 3 else "")
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD], input=job, capture_output=True, text=True,
                              timeout=REGEX_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise PatternError(f"{shown}: matching the regular expression against the model's {len(names)} module "
                           f"names took over {REGEX_TIMEOUT_S:g} s (a pattern that backtracks); give module "
                           "names instead, e.g. [\"q_proj\", \"v_proj\"]") from None
    try:
        out = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        out = None
    if not isinstance(out, list) or len(out) != len(patterns):
        raise PatternError(f"{shown}: the regular expression could not be matched (it needs more memory than "
                           f"{_CHILD_MEMORY_BYTES >> 20} MiB or failed); give module names instead")
    found = []
    for p, r in zip(patterns, out):
        if "error" in r:
            raise PatternError(f"{p.field} {p.text!r} is not a valid regular expression ({r['error']})")
        found.append({names[i] for i in r["matches"]})
    return found
