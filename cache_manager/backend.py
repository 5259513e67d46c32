"""Graph backends: how a bucket is captured, replayed and released, with its memory measured.

`CudaGraphBackend` is the real one. Tests use `cache_manager.testing.FakeGraphBackend`, which reports
chosen sizes, so budget and eviction decisions are tested without a GPU.
"""

from __future__ import annotations

import gc
import time
from typing import Protocol

import torch

from cache_manager.step import DecodeStep


class CapturedGraph(Protocol):
    """One captured bucket. Owns its memory pool; `replay()` returns the static output [size, ...]."""

    size: int
    nbytes: int  # measured at capture
    capture_ms: float

    def replay(self) -> torch.Tensor: ...


class GraphBackend(Protocol):
    """Captures and releases graphs. `capture` raises on failure (the cache turns that into back-off)."""

    def total_memory(self) -> int: ...

    def capture(self, step: DecodeStep, size: int) -> CapturedGraph: ...

    def release(self, graph: CapturedGraph) -> int:
        """Drop the graph and give its memory back to the device; returns bytes freed (measured)."""
        ...


class CudaGraph:
    """A torch.cuda.CUDAGraph with its own private pool and the static output it writes."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        pool: tuple,
        output: torch.Tensor,
        size: int,
        nbytes: int,
        capture_ms: float,
    ) -> None:
        self.graph: torch.cuda.CUDAGraph | None = graph
        # Keep the pool handle alive with the graph: DESIGN.md saw an allocator assert when a pool
        # outlived the graph that owned it and was captured into again.
        self.pool = pool
        self.output: torch.Tensor | None = output
        self.size = size
        self.nbytes = nbytes
        self.capture_ms = capture_ms

    def replay(self) -> torch.Tensor:
        assert self.graph is not None and self.output is not None, "replay of a released graph"
        self.graph.replay()
        return self.output

    def drop(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.output = None
        self.pool = None


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device for the whole process: cuBLAS keeps a workspace per stream, so a
    fresh stream per capture would leave a new workspace behind each time (memory no graph owns)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE_STREAMS[index]


def _measure(device: torch.device) -> tuple[int, int]:
    """(allocator reserved bytes, driver free bytes) after the device went idle."""
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_reserved(device), free


class CudaGraphBackend:
    """Captures `step.run(size)` into a CUDA graph with a private memory pool per graph.

    A private pool is what makes eviction real: deleting one graph of a shared pool frees nothing
    until every graph of that pool is gone. Bytes are the larger of the allocator's reserved delta
    (the pool) and the driver's free-memory delta (which also sees the instantiated graph itself).
    The caller pads the rows [n, size) before capture: warm-up executes the step for real.
    """

    def __init__(self, device: torch.device, warmup_iters: int = 2) -> None:
        assert device.type == "cuda", device
        self.device = device
        self.warmup_iters = warmup_iters

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def capture(self, step: DecodeStep, size: int) -> CudaGraph:
        device = self.device
        stream = _side_stream(device)
        # Warm-up on a side stream: lazy inits (cuBLAS handles, autotuning) must not be captured.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                step.run(size)
        torch.cuda.current_stream(device).wait_stream(stream)
        # torch.cuda.graph empties the cache on enter; do it first so the baseline is stable.
        gc.collect()
        torch.cuda.empty_cache()
        reserved0, free0 = _measure(device)
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        # Frozen gc: a collection during capture would walk every tensor and can free memory the
        # capture is about to record; the objects alive now are not garbage anyway.
        gc.freeze()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                output = step.run(size)
        except BaseException:
            # The traceback keeps this frame alive: drop the half-captured graph and its pool now so
            # the failure cleanup can return their memory.
            graph = pool = None
            raise
        finally:
            gc.unfreeze()
        reserved1, free1 = _measure(device)
        capture_ms = (time.perf_counter() - start) * 1000.0
        nbytes = max(reserved1 - reserved0, free0 - free1, 0)
        return CudaGraph(graph, pool, output, size, nbytes, capture_ms)

    def release(self, graph: CapturedGraph) -> int:
        assert isinstance(graph, CudaGraph)
        reserved0, free0 = _measure(self.device)
        graph.drop()
        gc.collect()
        torch.cuda.empty_cache()
        reserved1, free1 = _measure(self.device)
        return max(reserved0 - reserved1, free1 - free0, 0)

    @staticmethod
    def cleanup_after_failure() -> None:
        """Give back whatever a failed capture left in the allocator."""
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
