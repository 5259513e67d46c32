"""Allowed capture sizes, padding (n -> bucket) and the hashable batch descriptor."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass


class CudaGraphMode(str, enum.Enum):
    """How the decode step runs: NONE is always eager, FULL captures the whole step per bucket."""

    NONE = "none"
    FULL = "full"

    @classmethod
    def parse(cls, value: str | CudaGraphMode) -> CudaGraphMode:
        try:
            return cls(value.lower() if isinstance(value, str) else value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown cuda graph mode {value!r}; allowed: {allowed}") from None


@dataclass(frozen=True)
class BatchDescriptor:
    """Key of one captured graph: everything that changes the captured kernels.

    Two requests share a graph exactly when their descriptors are equal. A LoRA set (or any other
    kernel-changing input) is added here as a new field, never as a side table.
    """

    mode: CudaGraphMode
    padded_size: int
    lora: bool = False  # captured with the LoRA products (any adapter row); base batches never run them


def default_capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to max_batch (max_batch itself always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch}
    sizes.update(range(16, max_batch + 1, 8))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


def validate_capture_sizes(sizes: tuple[int, ...] | list[int], max_batch: int) -> tuple[int, ...]:
    """Sorted, unique, each in [1, max_batch]; ValueError naming the offending value otherwise."""
    if not sizes:
        raise ValueError("capture_sizes is empty; give at least one size (or use mode none)")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"capture size {s!r} is not an integer")
        if not 1 <= s <= max_batch:
            raise ValueError(f"capture size {s} is outside [1, max_batch={max_batch}]")
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
