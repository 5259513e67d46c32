"""Allowed capture sizes, padding (n -> bucket) and the hashable batch descriptor with its family."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import NamedTuple


class CudaGraphMode(str, enum.Enum):
    """How steps run. NONE: always eager. FULL: uniform-decode steps replay one graph of the whole
    step per batch size. PIECEWISE: every step replays per-layer pieces (keyed by padded token count)
    with attention eager between them. FULL_AND_PIECEWISE: FULL for uniform decode, PIECEWISE for
    any other step (prefill and mixed)."""

    NONE = "none"
    FULL = "full"
    PIECEWISE = "piecewise"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @classmethod
    def parse(cls, value: str | CudaGraphMode) -> CudaGraphMode:
        try:
            return cls(value.lower() if isinstance(value, str) else value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown cuda graph mode {value!r}; allowed: {allowed} (any case)") from None

    @property
    def has_full(self) -> bool:
        return self in (CudaGraphMode.FULL, CudaGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE)

    @property
    def kinds(self) -> tuple[CudaGraphMode, ...]:
        """The kinds of graph this mode keeps: FULL and/or PIECEWISE."""
        return tuple(k for k, on in ((CudaGraphMode.FULL, self.has_full),
                                     (CudaGraphMode.PIECEWISE, self.has_piecewise)) if on)


class GraphFamily(NamedTuple):
    """A graph key without its size: which step records (and eagerly runs) its graphs.

    `mode` is the kind of graph (FULL: a whole uniform-decode step; PIECEWISE: the pieces between
    attention calls); `lora`: captured with the LoRA products of the adapter slots (steps with any
    adapter row); `query_tokens`: tokens a row brings to a uniform step (1 for decode; 1 + k for a
    speculative verify step). Written "full", "piecewise+lora", "full+q4": the kind as operators name it.
    """

    mode: CudaGraphMode
    lora: bool = False
    query_tokens: int = 1

    def __str__(self) -> str:
        return self.mode.value + ("+lora" if self.lora else "") + (f"+q{self.query_tokens}" if self.query_tokens != 1 else "")

    def at(self, size: int) -> BatchDescriptor:
        return BatchDescriptor(self.mode, size, self.lora, self.query_tokens)

    @classmethod
    def parse(cls, text: str | CudaGraphMode | GraphFamily) -> GraphFamily:
        """ "full", "piecewise+lora", "full+q4" (any case); a mode alone is its base family."""
        if isinstance(text, GraphFamily):
            return text
        if isinstance(text, CudaGraphMode):
            return cls(text)
        mode, *extras = text.strip().lower().split("+")
        lora, query_tokens = False, 1
        for extra in extras:
            if extra == "lora" and not lora:
                lora = True
            elif extra.startswith("q") and extra[1:].isdigit() and int(extra[1:]) > 1 and query_tokens == 1:
                query_tokens = int(extra[1:])
            else:
                raise ValueError(f"{text!r} is not a graph kind such as 'full', 'piecewise' or 'full+lora'")
        parsed = CudaGraphMode.parse(mode)
        if parsed not in (CudaGraphMode.FULL, CudaGraphMode.PIECEWISE):
            raise ValueError(f"{text!r}: a graph is of kind full or piecewise")
        return cls(parsed, lora, query_tokens)


@dataclass(frozen=True, order=True)
class BatchDescriptor:
    """Key of one captured graph: everything that changes the captured kernels.

    `mode` is the kind of graph (FULL: the whole uniform-decode step, `padded_size` rows;
    PIECEWISE: the pieces between attention calls, `padded_size` tokens); `lora`: with the adapter
    slots' products; `query_tokens`: tokens per row of a uniform step (speculative verify steps
    have 1 + k). Two steps share a graph exactly when their descriptors are equal; anything else
    that changes the kernels is added here as a new field, never as a side table. Written "full:8",
    "piecewise:128", "full+lora:8" (the family, then the size).
    """

    mode: CudaGraphMode
    padded_size: int
    lora: bool = False
    query_tokens: int = 1

    @property
    def family(self) -> GraphFamily:
        return GraphFamily(self.mode, self.lora, self.query_tokens)

    def __str__(self) -> str:
        return f"{self.family}:{self.padded_size}"

    @classmethod
    def parse(cls, text: str) -> BatchDescriptor:
        """ "piecewise:128", "full+lora:8", or a bare "8" (FULL: stats files of format 1)."""
        kind, _, size = text.rpartition(":")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"{text!r} is not a graph key such as 'full:8' or 'piecewise:128'")
        return GraphFamily.parse(kind or "full").at(int(size))


def family_order(family: GraphFamily) -> tuple:
    """Base families first, then LoRA ones; FULL before PIECEWISE within each."""
    return family.lora, family.query_tokens, family.mode


FULL = CudaGraphMode.FULL
PIECEWISE = CudaGraphMode.PIECEWISE


def default_capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to max_batch (max_batch itself always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch}
    sizes.update(range(16, max_batch + 1, 8))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


def default_piecewise_sizes(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from 1 to 2,048 tokens, capped at max_tokens (max_tokens itself when below).

    Piecewise graphs pay off most where a step is launch-bound: on an H200 at 1B, 3.5x for a
    128-token step and still 1.45x at 2,048 tokens. Above the largest size a step runs eagerly.
    Padding to the next power of two costs at most twice a step's tokens in the pieces (attention
    runs unpadded)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    largest = 2048
    sizes = {s for s in (1 << i for i in range(12)) if s <= max_tokens}
    if max_tokens < largest:
        sizes.add(max_tokens)
    return tuple(sorted(sizes))


def validate_capture_sizes(sizes: tuple[int, ...] | list[int], max_batch: int) -> tuple[int, ...]:
    """Sorted, unique, each in [1, max_batch] (the largest step any graph serves); ValueError naming
    the offending value otherwise."""
    if not sizes:
        raise ValueError("capture_sizes is empty; give at least one size (or use mode none)")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"capture size {s!r} is not an integer")
        if not 1 <= s <= max_batch:
            raise ValueError(f"capture size {s} is outside [1, {max_batch}] (the largest step a graph serves)")
    return tuple(sorted(set(sizes)))


def parse_capture_sizes(text: str, max_batch: int) -> tuple[int, ...]:
    """Parse "1,2,4,8,16" (spaces allowed); sorted and unique, each in [1, max_batch]."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"capture sizes {text!r}: expected a comma-separated list such as '1,2,4,8'")
    sizes: list[int] = []
    for p in parts:
        try:
            sizes.append(int(p))
        except ValueError:
            raise ValueError(f"capture sizes {text!r}: {p!r} is not an integer") from None
    return validate_capture_sizes(sizes, max_batch)


class PaddingTable:
    """Maps a batch of n rows to the smallest allowed size >= n; None above the largest (eager)."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        assert sizes and list(sizes) == sorted(set(sizes)), sizes
        self.sizes = sizes

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, n: int) -> int | None:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def check_allowed(self, sizes: list[int] | tuple[int, ...]) -> None:
        """ValueError naming the allowed sizes when any of `sizes` is not one of them."""
        bad = [s for s in sizes if s not in self.sizes]
        if bad:
            raise ValueError(f"sizes {bad} are not capture sizes; allowed: {list(self.sizes)}")
