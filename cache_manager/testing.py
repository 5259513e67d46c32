"""Test doubles: a fake graph backend that reports chosen sizes, for CPU tests of budget decisions.

Not used in production. It replays by running the step eagerly, so outputs stay correct.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cache_manager.step import DecodeStep


class FakeGraph:
    def __init__(self, step: DecodeStep, size: int, nbytes: int, capture_ms: float) -> None:
        self.step = step
        self.size = size
        self.nbytes = nbytes
        self.capture_ms = capture_ms
        self.replays = 0

    def replay(self) -> torch.Tensor:
        self.replays += 1
        return self.step.run(self.size)


class FakeGraphBackend:
    """Captures instantly; a graph of size s "uses" bytes_for(s) bytes; sizes in `fail_sizes` raise."""

    def __init__(
        self,
        bytes_for: Callable[[int], int] | dict[int, int] = lambda s: 1000 * s,
        total: int = 10**9,
        fail_sizes: set[int] | None = None,
    ) -> None:
        self.bytes_for = bytes_for.__getitem__ if isinstance(bytes_for, dict) else bytes_for
        self.total = total
        self.fail_sizes = set(fail_sizes or ())
        self.captured: list[int] = []  # capture order
        self.released: list[int] = []
        self.live: dict[int, int] = {}  # size -> bytes held now

    def total_memory(self) -> int:
        return self.total

    def capture(self, step: DecodeStep, size: int) -> FakeGraph:
        if size in self.fail_sizes:
            raise torch.OutOfMemoryError(f"fake: out of memory capturing {size}")
        self.captured.append(size)
        nbytes = self.bytes_for(size)
        self.live[size] = nbytes
        return FakeGraph(step, size, nbytes, capture_ms=1.0)

    def release(self, graph: FakeGraph) -> int:
        self.released.append(graph.size)
        return self.live.pop(graph.size)

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())


class CountingStep:
    """A DecodeStep on CPU: output row i is input row i times 2; records padding calls."""

    def __init__(self, max_batch: int, width: int = 4) -> None:
        self.max_batch = max_batch
        self.inputs = torch.zeros(max_batch, width)
        self.padding_calls: list[tuple[int, int]] = []
        self.runs: list[int] = []

    def set_padding_rows(self, start: int, stop: int) -> None:
        self.padding_calls.append((start, stop))
        self.inputs[start:stop] = 0

    def run(self, batch_size: int) -> torch.Tensor:
        self.runs.append(batch_size)
        return self.inputs[:batch_size] * 2

    def input_addresses(self) -> tuple[int, ...]:
        return (self.inputs.data_ptr(),)
