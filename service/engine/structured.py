"""Grammar-constrained decoding: a token mask per step for JSON schema, any JSON object, regex,
EBNF grammar and choice constraints (OpenAI `response_format`, vLLM's structured outputs).

Built on llguidance (bench/results/structured-choice.md says why). The compiler prepares the
tokenizer's vocabulary once and caches one pristine matcher per Constraint; a request's matcher is
a copy of it (about a microsecond). Masks are int32 bitmasks, bit v of word v // 32 for token v,
filled on the CPU and applied to the logits on their own device.

Contract for callers:
- A Matcher belongs to one request and is used by one thread at a time (the engine thread); any
  number of matchers may be used from different threads. Filling a mask releases the GIL.
- Once `accept` returns False the matcher is dead: its mask allows only EOS from then on.
- `apply_bitmask` may copy a pinned CPU bitmask to the GPU asynchronously: do not refill that
  bitmask until the step that used it has synced (the engine's one host sync per step does).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import is_lark_syntax

from service.engine.constraint_limits import ConstraintLimits, InvalidConstraint, check_size
from service.engine.gbnf import GbnfConverter
from service.engine.request import Constraint
from service.model.kernels.bitmask import allocate_bitmask, apply_bitmask, bitmask_words

__all__ = ["Constraint", "GrammarCompiler", "InvalidConstraint", "Matcher", "allocate_bitmask", "apply_bitmask",
           "bitmask_words"]

# llguidance.torch is not imported: it builds a torch.compile'd function at import (1.6 s) that we
# do not use; the two mask calls below are what its helpers do.

# JSON whitespace: flexible, as the library allows by default, but at most 16 characters between
# two tokens of the JSON (enough to pretty-print a few levels deep). Unbounded, a small or random
# model can emit whitespace forever and never close the object; with none at all, a model trained
# on `{"a": 1}` would be forced off its usual spacing. A schema's own "x-guidance" options win.
_JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
_ANY_OBJECT = '{"type": "object"}'
_MAX_MESSAGE = 600


def _check_row(bitmask: torch.Tensor, row: int, words: int) -> torch.Tensor:
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.dim() == 2, "int32 [B, words] CPU bitmask"
    assert bitmask.shape[1] == words, f"bitmask has {bitmask.shape[1]} words per row, the vocabulary needs {words}"
    assert bitmask.is_contiguous()
    return bitmask[row]


class Matcher:
    """One request's position in its grammar."""

    __slots__ = ("_m", "_words", "_on_free", "_known_mask", "cpu_debt", "mask_row")

    def __init__(self, m: llguidance.LLMatcher, words: int, on_free: Callable[[], None] | None = None) -> None:
        """on_free: called when this matcher is garbage (one of a huge grammar: its memory can go back)."""
        self._m = m
        self._words = words
        self._on_free = on_free
        self._known_mask: torch.Tensor | None = None  # the mask of the current position, computed already
        self.cpu_debt = 0.0  # the mask filler's CPU account of this matcher (mask_fill.py), seconds
        self.mask_row: Any = None  # the mask filler's fill of this position, running since a step it sat out

    def __del__(self) -> None:
        if self._on_free is not None:
            self._on_free()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (EOS once the grammar may end). Releases the GIL."""
        v = _check_row(bitmask, row, self._words)
        if self._known_mask is not None:
            v.copy_(self._known_mask)
            return
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), self._words * 4)

    @property
    def mask_pending(self) -> bool:
        """The mask of this position is still being computed since a step it sat out: the sequence
        waits (it is not scheduled) until it is done (mask_fill.py)."""
        row = self.mask_row
        return row is not None and row.error is None

    def keep_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] is this position's mask (filled by fill_bitmask): the next fill copies it
        instead of computing it again, until the matcher moves. The first mask is computed on the
        grammar workers before admission; for some grammars each mask costs as much as the first."""
        self._known_mask = _check_row(bitmask, row, self._words).clone()

    def accept(self, token: int) -> bool:
        """Advances by token; False if it was not allowed (the matcher is then dead)."""
        self._known_mask = None
        return self._m.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow (also true once EOS was accepted, or after a rejected token)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher is dead (the library gave up: a limit, a rejected token), or "" while it is not."""
        return _first_line(self._m.get_error())

    def rollback(self, n: int) -> None:
        """Undoes the last n accepted tokens (speculative decoding, stop strings)."""
        if not n:
            return
        self._known_mask = None
        if not self._m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self.error}")


# The grammar library's limits where they differ from its defaults (llguidance.LLParserLimits):
# - initial_lexer_fuel 1M -> 200k: `p{1000}{1129}` spent 3.3 s on its first mask with a 128k
#   vocabulary at 1M, 0.33 s at 200k (and then fails cleanly); JSON schemas of 60 fields, 40 tools,
#   1,000 choices and EBNF grammars compiled and walked 200 random steps alike under both.
# - max_lexer_states 250k -> 50k: memory, at 1-2 kB per state (500 MB per grammar at the default).
# - verbose_errors off: errors name the limit, without dumping the parser's state (and the schema) into
#   messages and logs.
_SEEN = 4096  # constraints remembered as compiled once (the cache admits one on its second compile)
_PARSER_LIMITS = {"initial_lexer_fuel": 200_000, "max_lexer_states": 50_000, "verbose_errors": False}


class GrammarCompiler:
    """One per process: the tokenizer's vocabulary prepared once; compiled grammars (pristine matchers)
    kept for reuse, bounded in count and in bytes.

    Thread-safe. Compiling is up to hundreds of milliseconds of CPU for large grammars, and the first
    mask of a grammar can cost far more (its lexer is built lazily): the engine compiles and computes
    the first mask on its grammar workers (constraint_prepare.py), which measure each and decide with
    `keep` what is cached. Copies of a matcher share its lexer: a copy's first mask warms the others'.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], *,
                 limits: ConstraintLimits | None = None, max_cached: int = 256,
                 on_free: Callable[[], None] | None = None) -> None:
        """tokenizer: a Hugging Face fast tokenizer; vocab_size: the model's logits width (may exceed
        len(tokenizer): the extra ids are never allowed); limits: the size checks made before a
        compile and the cache's bytes; on_free: called when a huge grammar's matcher is garbage
        (MemoryTrimmer.request)."""
        eos = sorted({int(t) for t in eos_token_ids})
        assert eos, "a grammar needs an EOS token to end on"
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.limits = limits or ConstraintLimits()
        self.max_cached = max_cached
        self.cache_bytes = self.limits.constraint_cache_bytes
        self.hits = 0  # lookups served from the cache
        self.misses = 0  # constraints compiled
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._limits = llguidance.LLParserLimits(**_PARSER_LIMITS)
        self._on_free = on_free
        self._cache: OrderedDict[Constraint, tuple[llguidance.LLMatcher, int]] = OrderedDict()  # -> (proto, bytes)
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of constraints compiled once, not kept
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._gbnf = GbnfConverter(self.limits.constraint_compile_timeout)

    def close(self) -> None:
        """End the GBNF converter's child process (a later GBNF grammar starts another)."""
        self._gbnf.close()

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def cached(self, c: Constraint) -> llguidance.LLMatcher | None:
        """c's compiled pristine matcher, if kept."""
        with self._lock:
            entry = self._cache.get(c)
            if entry is None:
                return None
            self._cache.move_to_end(c)
            self.hits += 1
            return entry[0]

    def compile(self, c: Constraint) -> llguidance.LLMatcher:
        """c compiled (a pristine matcher, not kept: see `keep`); raises InvalidConstraint. Any error
        of the grammar library (a Rust panic, a RecursionError) is the constraint's, not the server's."""
        check_size(c, self.limits)
        try:
            proto = llguidance.LLMatcher(self._tokenizer, _grammar(c, self._gbnf), log_level=0, limits=self._limits)
        except InvalidConstraint:
            raise
        except BaseException as exc:  # noqa: BLE001 - pyo3's PanicException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            raise InvalidConstraint(_message(c.kind, f"the grammar library failed on it: {_first_line(str(exc))}")) from None
        if proto.is_error():
            raise InvalidConstraint(_message(c.kind, proto.get_error()))
        with self._lock:
            self.misses += 1
        return proto

    def keep(self, c: Constraint, proto: llguidance.LLMatcher, nbytes: int) -> bool:
        """Cache c's pristine matcher, which holds about nbytes, if c was asked for before (a constraint
        seen once is not kept: a flood of distinct ones must not fill the cache, nor fragment the heap
        with what they hold) and it alone would take at most an eighth of the cache. Evicts the least
        recently used entries beyond the bytes and the count. Returns whether it was kept."""
        nbytes = max(1, nbytes)
        with self._lock:
            key = hash(c)
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > _SEEN:
                    self._seen.popitem(last=False)
                return False
            if nbytes > self.cache_bytes // 8:
                return False
            old = self._cache.pop(c, None)
            if old is not None:
                self._cached_bytes -= old[1]
            self._cache[c] = (proto, nbytes)
            self._cached_bytes += nbytes
            while len(self._cache) > self.max_cached or self._cached_bytes > self.cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self._cached_bytes -= dropped
        return True

    def evict(self, c: Constraint) -> None:
        """Drop c's cached matcher (its requests failed: a grammar that gave up, or ran over a budget,
        must not keep the memory its lexer grew, nor be served again without its cost measured)."""
        with self._lock:
            entry = self._cache.pop(c, None)
            if entry is not None:
                self._cached_bytes -= entry[1]

    def new_matcher(self, proto: llguidance.LLMatcher, huge: bool = False) -> Matcher:
        """A fresh matcher at the start of proto's grammar (a copy: about a microsecond). huge: its
        memory is given back to the system once it is garbage."""
        return Matcher(proto.deep_copy(), self.words, self._on_free if huge else None)

    def matcher(self, c: Constraint) -> Matcher:
        """A matcher for c, compiled now unless cached (kept). For tools and tests: unbounded; the
        engine goes through its grammar workers instead."""
        proto = self.cached(c)
        if proto is None:
            proto = self.compile(c)
            self.keep(c, proto, len(repr(c.value)))
        return self.new_matcher(proto)


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


def _message(kind: str, detail: str) -> str:
    detail = detail.strip()
    return f"invalid {kind}: {detail if len(detail) <= _MAX_MESSAGE else detail[:_MAX_MESSAGE] + '...'}"


def _grammar(c: Constraint, gbnf: GbnfConverter) -> str:
    """The llguidance grammar text for c; raises InvalidConstraint for what fails before compiling."""
    try:
        return _grammar_text(c, gbnf)
    except InvalidConstraint:
        raise
    except (ValueError, RecursionError) as e:  # the library's converters (schema options, GBNF syntax)
        raise InvalidConstraint(_message(c.kind, str(e) or type(e).__name__)) from None


def _grammar_text(c: Constraint, gbnf: GbnfConverter) -> str:
    """c's grammar text; c passed check_size (a known kind, values of the right types, small enough)."""
    if c.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(c.value)))
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.value)
        except json.JSONDecodeError as e:
            raise InvalidConstraint(_message(c.kind, f"the schema is not valid JSON: {e}")) from None
        if not isinstance(schema, dict):
            raise InvalidConstraint(_message(c.kind, "the schema must be a JSON object (boolean schemas are not supported)"))
        return llguidance.LLMatcher.grammar_from_json_schema(c.value, defaults=_JSON_OPTIONS)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.value)
    # "grammar": GBNF-style EBNF with a `root` rule (what vLLM documents), converted to Lark by the
    # library's converter in a child process (gbnf.py says why); or Lark itself (a `start` rule or a
    # %llguidance line), as vLLM's guidance backend takes.
    lark = c.value if is_lark_syntax(c.value) else gbnf.to_lark(_GBNF_ESCAPE.sub(_unicode_escape, c.value))
    return llguidance.LLMatcher.grammar_from_lark(lark)


# Every backslash escape, so that an escaped backslash is skipped as one unit.
_GBNF_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)


def _unicode_escape(m: re.Match[str]) -> str:
    """The library's GBNF converter turns \\u00e9 into an invalid \\ue9: write \\xHH below 256
    (still escaped, so \\u005d stays a literal "]"), the character itself above."""
    esc = m.group(1)
    if esc[0] not in "uU":
        return m.group(0)
    cp = int(esc[1:], 16)
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
        return m.group(0)  # left for the converter to reject
    return chr(cp)
