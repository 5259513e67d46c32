"""Allowed capture sizes, padding (n -> bucket) and the hashable batch descriptor."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass


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


@dataclass(frozen=True, order=True)
class BatchDescriptor:
    """Key of one captured graph: everything that changes the captured kernels.

    `mode` is the kind of graph (FULL: the whole uniform-decode step, `padded_size` rows;
    PIECEWISE: the pieces between attention calls, `padded_size` tokens). Two steps share a graph
    exactly when their descriptors are equal. A LoRA set (or any other kernel-changing input) is
    added here as a new field, never as a side table. Written "full:8" / "piecewise:128".
    """

    mode: CudaGraphMode
    padded_size: int

    def __str__(self) -> str:
        return f"{self.mode.value}:{self.padded_size}"

    @classmethod
    def parse(cls, text: str) -> BatchDescriptor:
        """ "piecewise:128", "full:8", or a bare "8" (FULL: stats files of format 1)."""
        kind, _, size = text.rpartition(":")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"{text!r} is not a graph key such as 'full:8' or 'piecewise:128'")
        mode = CudaGraphMode.parse(kind or "full")
        if mode not in (CudaGraphMode.FULL, CudaGraphMode.PIECEWISE):
            raise ValueError(f"{text!r}: a graph is of kind full or piecewise")
        return cls(mode, int(size))


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
    """Powers of two from 1 to 512 tokens, capped at max_tokens (max_tokens itself when below 512).

    Piecewise graphs pay off where a step is launch-bound (a few hundred tokens at 1B); above the
    largest size a step runs eagerly, where launches are a small part of its time. Padding a step to
    the next power of two costs at most twice its tokens in the pieces (attention runs unpadded)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = {s for s in (1 << i for i in range(10)) if s <= max_tokens}
    if max_tokens < 512:
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
