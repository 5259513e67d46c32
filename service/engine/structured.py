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

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import is_lark_syntax

from service.engine.request import CONSTRAINT_KINDS as KINDS
from service.engine.request import Constraint

# llguidance.torch is not imported: it builds a torch.compile'd function at import (1.6 s) that we
# do not use; the two mask calls below are what its helpers do.

# JSON whitespace: flexible, as the library allows by default, but at most 16 characters between
# two tokens of the JSON (enough to pretty-print a few levels deep). Unbounded, a small or random
# model can emit whitespace forever and never close the object; with none at all, a model trained
# on `{"a": 1}` would be forced off its usual spacing. A schema's own "x-guidance" options win.
_JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
_ANY_OBJECT = '{"type": "object"}'
_MAX_MESSAGE = 600


class InvalidConstraint(ValueError):
    """A constraint that cannot be compiled; the message names the kind and what is wrong."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    """int32 [rows, words], every token allowed. pin needs an accelerator build of torch."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[b, v] = -inf where bit v of bitmask row b is 0; in place, on logits' device.

    Pure tensor ops, no host sync: a CPU bitmask (pinned for a CUDA logits tensor) is copied with
    non_blocking. Rows of all ones are unchanged. Ids past the tokenizer's vocabulary are 0 in every
    matcher's mask, so constrained rows never sample them.
    """
    # logits: [B, V] float; bitmask: [B, words] int32
    batch, vocab = logits.shape
    assert bitmask.dtype == torch.int32 and tuple(bitmask.shape) == (batch, bitmask_words(vocab)), (
        f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not fit logits {tuple(logits.shape)}"
    )
    # Byte k of a row of little-endian int32 words holds ids 8k..8k+7, lowest bit first. A table
    # lookup per byte then a minimum is ~10x faster on the CPU than shifting every bit and
    # masked_fill_ (0.05 vs 0.57 ms per 128k row), and a few elementwise kernels on a GPU.
    mask_bytes = bitmask.to(logits.device, non_blocking=True).contiguous().view(torch.uint8)  # [B, 4 * words]
    limits = _byte_limits(logits.device, logits.dtype).index_select(0, mask_bytes.view(-1).int())  # [B * 4 * words, 8]
    torch.minimum(logits, limits.view(batch, -1)[:, :vocab], out=logits)


@functools.cache
def _byte_limits(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row x, column i is +inf if bit i of byte x is set, else -inf. Built on the device
    (no copy from the host); the first call for a device and dtype must not be inside a graph capture."""
    bits = (torch.arange(256, device=device, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, device=device, dtype=torch.int32)) & 1
    return torch.full((256, 8), float("inf"), dtype=dtype, device=device).masked_fill_(bits == 0, float("-inf"))


def _check_row(bitmask: torch.Tensor, row: int, words: int) -> torch.Tensor:
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.dim() == 2, "int32 [B, words] CPU bitmask"
    assert bitmask.shape[1] == words, f"bitmask has {bitmask.shape[1]} words per row, the vocabulary needs {words}"
    assert bitmask.is_contiguous()
    return bitmask[row]


class Matcher:
    """One request's position in its grammar."""

    __slots__ = ("_m", "_words")

    def __init__(self, m: llguidance.LLMatcher, words: int) -> None:
        self._m = m
        self._words = words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (EOS once the grammar may end). Releases the GIL."""
        v = _check_row(bitmask, row, self._words)
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), self._words * 4)

    def accept(self, token: int) -> bool:
        """Advances by token; False if it was not allowed (the matcher is then dead)."""
        return self._m.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow (also true once EOS was accepted, or after a rejected token)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher is dead, or "" while it is not."""
        return self._m.get_error()

    def rollback(self, n: int) -> None:
        """Undoes the last n accepted tokens (speculative decoding, stop strings)."""
        if n and not self._m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error()}")


class GrammarCompiler:
    """One per server: the tokenizer's vocabulary prepared once; compiled grammars cached (LRU, bounded) by Constraint.

    Thread-safe: check() may run on request threads while the engine thread calls matcher().
    Compiling takes about a millisecond for a 10-field schema and up to hundreds for very large
    ones (the GIL is released meanwhile), so an asyncio caller should run check() in a worker thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], *,
                 max_cached: int = 256, mask_threads: int | None = None) -> None:
        """tokenizer: a Hugging Face fast tokenizer; vocab_size: the model's logits width (may exceed
        len(tokenizer): the extra ids are never allowed); mask_threads: fill_bitmasks' pool (None:
        the library's default, most of the CPUs)."""
        eos = sorted({int(t) for t in eos_token_ids})
        assert eos, "a grammar needs an EOS token to end on"
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.max_cached = max_cached
        self.hits = 0  # check()/matcher() calls served from the cache
        self.misses = 0  # constraints compiled
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._mask_threads = mask_threads
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, c: Constraint) -> None:
        """Compiles c (or finds it cached); raises InvalidConstraint. For request validation."""
        self._compiled(c)

    def matcher(self, c: Constraint) -> Matcher:
        """A fresh matcher at the start of c's grammar; raises InvalidConstraint."""
        return Matcher(self._compiled(c).deep_copy(), self.words)

    def fill_bitmasks(self, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """fill_bitmask for many (matcher, row) pairs at once, on a thread pool, without the GIL."""
        if not rows:
            return
        for _, row in rows:
            _check_row(bitmask, row, self.words)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._mask_threads)
        self._executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in rows], bitmask.data_ptr(),
                                               self.words * 4, bitmask.shape[0])

    def _compiled(self, c: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            proto = self._cache.get(c)
            if proto is not None:
                self._cache.move_to_end(c)
                self.hits += 1
                return proto
        # Outside the lock: another constraint's compile need not wait for this one. Two threads
        # compiling the same constraint at once both succeed; one result is kept.
        proto = llguidance.LLMatcher(self._tokenizer, _grammar(c), log_level=0)
        if proto.is_error():
            raise InvalidConstraint(_message(c.kind, proto.get_error()))
        with self._lock:
            self.misses += 1
            self._cache[c] = proto
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return proto


def _message(kind: str, detail: str) -> str:
    detail = detail.strip()
    return f"invalid {kind}: {detail if len(detail) <= _MAX_MESSAGE else detail[:_MAX_MESSAGE] + '...'}"


def _grammar(c: Constraint) -> str:
    """The llguidance grammar text for c; raises InvalidConstraint for what fails before compiling."""
    try:
        return _grammar_text(c)
    except InvalidConstraint:
        raise
    except ValueError as e:  # the library's converters (schema options, GBNF syntax)
        raise InvalidConstraint(_message(c.kind, str(e))) from None


def _grammar_text(c: Constraint) -> str:
    if c.kind not in KINDS:
        raise InvalidConstraint(f"unknown constraint kind {c.kind!r}; known: {', '.join(KINDS)}")
    if c.kind == "choice":
        if not isinstance(c.value, tuple) or not c.value:
            raise InvalidConstraint("invalid choice: the list of choices is empty")
        if not all(isinstance(s, str) for s in c.value):
            raise InvalidConstraint("invalid choice: every choice must be a string")
        return llguidance.grammar_from("choice", json.dumps(list(c.value)))
    if not isinstance(c.value, str):
        raise InvalidConstraint(f"invalid {c.kind}: the value must be a string")
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
    # library; or Lark itself (a `start` rule or a %llguidance line), as vLLM's guidance backend takes.
    text = c.value if is_lark_syntax(c.value) else _GBNF_ESCAPE.sub(_unicode_escape, c.value)
    return llguidance.grammar_from("grammar", text)


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


class Grammars:
    """A process's GrammarCompiler, made at the first constrained request (preparing a 128k
    vocabulary takes a while; servers that never see one never pay it). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    def prepare(self) -> None:
        """Make the compiler now, before serving: about a second for a 128k vocabulary, most of it
        holding the GIL (586 ms at a time measured), so made later, on any thread, it would freeze
        every stream of the process."""
        self.compiler  # noqa: B018 - made on first access
