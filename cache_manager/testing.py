"""Test doubles: a fake graph backend that reports chosen sizes, for CPU tests of budget decisions.

Not used in production. It replays by running the step eagerly, so outputs stay correct.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from cache_manager.step import DecodeStep


class FakeGraph:
    def __init__(self, step: DecodeStep, size: int, nbytes: int, capture_ms: float) -> None:
        self.step = step
        self.size = size
        self.key = graph_key(step, size)
        self.nbytes = nbytes
        self.capture_ms = capture_ms
        self.replays = 0

    def replay(self) -> torch.Tensor:
        self.replays += 1
        return self.step.run(self.size)


class FakeGraphBackend:
    """Captures at once on the capture thread; a graph of size s "uses" bytes_for(s) bytes; sizes in
    `fail_sizes` raise. With `gate` set, each capture first waits for the gate (tests hold a capture
    in flight that way); `threads` records which thread captured. Graphs are recorded by size, those
    of a named step (a LoRA step: CountingStep(name="lora")) as "name:size"."""

    def __init__(
        self,
        bytes_for: Callable[[int], int] | dict[int, int] = lambda s: 1000 * s,
        total: int = 10**9,
        fail_sizes: set[int] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.bytes_for = bytes_for.__getitem__ if isinstance(bytes_for, dict) else bytes_for
        self.total = total
        self.fail_sizes = set(fail_sizes or ())
        self.gate = gate
        self.captured: list[int | str] = []  # capture order
        self.released: list[int | str] = []
        self.live: dict[int | str, int] = {}  # size (or "name:size") -> bytes held now
        self.peak_bytes = 0  # the most ever held at once, captures in flight included
        self.threads: set[str] = set()
        self.started = threading.Event()  # set when a capture began (before the gate)

    def total_memory(self) -> int:
        return self.total

    def bind_thread(self) -> None:
        pass

    def capture(self, step: DecodeStep, size: int) -> FakeGraph:
        self.threads.add(threading.current_thread().name)
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30), "fake capture gate never opened"
        step.run_scratch(size)
        if size in self.fail_sizes:
            raise torch.OutOfMemoryError(f"fake: out of memory capturing {size}")
        self.captured.append(graph_key(step, size))
        nbytes = self.bytes_for(size)
        self.live[graph_key(step, size)] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return FakeGraph(step, size, nbytes, capture_ms=1.0)

    def fence(self) -> object:
        return None

    def release(self, graph: FakeGraph, after: object = None) -> int:
        self.released.append(graph.key)
        return self.live.pop(graph.key)

    def cleanup_after_failure(self) -> None:
        pass

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())


def graph_key(step: DecodeStep, size: int) -> int | str:
    name = getattr(step, "name", "")
    return f"{name}:{size}" if name else size


class CountingStep:
    """A DecodeStep on CPU: output row i is input row i times 2; records padding calls. `name` tells
    its graphs apart in FakeGraphBackend's records (e.g. "lora")."""

    def __init__(self, max_batch: int, width: int = 4, name: str = "") -> None:
        self.max_batch = max_batch
        self.name = name
        self.inputs = torch.zeros(max_batch, width)
        self.padding_calls: list[tuple[int, int]] = []
        self.runs: list[int] = []
        self.scratch_runs: list[int] = []

    def set_padding_rows(self, start: int, stop: int) -> None:
        self.padding_calls.append((start, stop))
        self.inputs[start:stop] = 0

    def run(self, batch_size: int) -> torch.Tensor:
        self.runs.append(batch_size)
        return self.inputs[:batch_size] * 2

    def run_scratch(self, batch_size: int) -> torch.Tensor:
        self.scratch_runs.append(batch_size)
        return torch.zeros(batch_size, self.inputs.shape[1])

    def input_addresses(self) -> tuple[int, ...]:
        return (self.inputs.data_ptr(),)


def full_sizes(keys: dict | tuple) -> dict | tuple:
    """The base FULL graphs' sizes of a snapshot's table keyed by BatchDescriptor (dict) or of its queue (tuple)."""
    if isinstance(keys, dict):
        return {k.padded_size: v for k, v in keys.items() if k.mode.value == "full" and not k.lora}
    return tuple(k.padded_size for k in keys if k.mode.value == "full" and not k.lora)
