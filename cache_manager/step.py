"""The contract between the graph cache and the step it captures."""

from __future__ import annotations

from typing import Protocol

import torch


class DecodeStep(Protocol):
    """A graph-safe decode step over static input buffers sized for `max_batch` rows.

    The step owns its static inputs: they are allocated once and never move, so a graph captured at
    size S keeps reading the first S rows. The caller (engine) writes the real rows [0, n) before
    `GraphCache.run(n)`; the cache calls `set_padding_rows(n, S)` so padding rows only touch a
    scratch KV slot. `run(batch_size)` must do no host syncs or allocations that depend on data.
    """

    max_batch: int

    def set_padding_rows(self, start: int, stop: int) -> None:
        """Make rows [start, stop) of the static inputs safe (scratch slot, position 0)."""
        ...

    def run(self, batch_size: int) -> torch.Tensor:
        """Run rows [0, batch_size); returns a tensor whose first dim is batch_size."""
        ...

    def run_scratch(self, batch_size: int) -> torch.Tensor:
        """Run `batch_size` rows on private inputs that touch only the scratch KV slot: the warm-up
        before a capture, which runs beside serving steps and so must not use their inputs."""
        ...

    def input_addresses(self) -> tuple[int, ...]:
        """Data pointers of the static inputs, for the debug check that they never move."""
        ...
