"""Graph backends: how a bucket is captured, replayed and released, with its memory measured.

`CudaGraphBackend` is the real one. Tests use `cache_manager.testing.FakeGraphBackend`, which reports
chosen sizes, so budget and eviction decisions are tested without a GPU.
"""

from __future__ import annotations

import gc
import threading
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


def replay_rows(graph: CapturedGraph, step: DecodeStep, n: int) -> torch.Tensor:
    """Rows [0, n) of `graph`'s replay; when n is below the graph's size the step first points the
    padding rows at the scratch slot (step.set_padding_rows)."""
    if n < graph.size:
        step.set_padding_rows(n, graph.size)
    return graph.replay()[:n]


class GraphBackend(Protocol):
    """Captures and releases graphs on the capture thread (capturer.py; inline capture: on the engine
    thread); `fence` runs on the engine thread.

    `capture` raises on failure (the cache turns that into back-off)."""

    def total_memory(self) -> int: ...

    def bind_thread(self) -> None:
        """Called once on the capture thread before its first job (device and mode are per thread)."""
        ...

    def capture(self, step: DecodeStep, size: int) -> CapturedGraph: ...

    def fence(self) -> object:
        """On the engine thread, when a graph is taken out of service: a marker that follows its last
        replay on the device. `release` waits for it before freeing the graph's memory."""
        ...

    def release(self, graph: CapturedGraph, after: object = None) -> int:
        """Drop the graph and give its memory back to the device; returns bytes freed (measured)."""
        ...

    def cleanup_after_failure(self) -> None:
        """Give back whatever a failed capture left behind."""
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


_SIDE_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}
_DEVICE_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _device_lock(device: torch.device) -> threading.Lock:
    """One lock per device for every backend in the process (each graph cache runs a capture thread,
    and a process may hold several: LLM objects, tests): captures share the side stream and the
    scratch inputs, and a capture's bytes are a free-memory drop that another capture at the same
    time would blur. So captures and releases on one device take turns; the engine thread never
    takes this lock."""
    index = device.index  # CudaGraphBackend gives every device an explicit index
    with _LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(index, threading.Lock())


def _side_stream(device: torch.device, purpose: str = "capture") -> torch.cuda.Stream:
    """The capture thread's streams of a device, one per purpose for the whole process: cuBLAS keeps a
    workspace per stream, so a fresh stream per capture would leave a new workspace behind each time
    (memory no graph owns). PyTorch makes them non-blocking, so the engine's work on the default
    stream never joins a capture.

    Warm-up ("warmup") and recording ("capture") use different streams, hence different cuBLAS
    workspaces: a captured GEMM keeps the workspace it was recorded with, and its replays on the
    engine's stream must never run beside an eager GEMM using that same workspace (split-K kernels
    keep counters there; two at once can spin forever). Only recording, which executes nothing, uses
    the capture stream's workspace."""
    index = device.index  # CudaGraphBackend gives every device an explicit index
    key = (index, purpose)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE_STREAMS[key]


_primed = threading.local()


def _prime_blas_workspace(device: torch.device) -> None:
    """Makes cuBLAS and cuBLASLt allocate this thread's workspaces for the current (capture) stream
    now, outside a capture: allocated inside one they would live in that graph's private pool and
    dangle once the graph is evicted, while later captures on this stream kept using them. (The
    warm-up, which used to allocate them, runs on a stream of its own.)"""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    done = getattr(_primed, "keys", None)
    if done is None:
        done = _primed.keys = set()
    if key not in done:
        # Tiny shapes: no split-K, nothing kept in the workspace. cuBLAS (mm) and cuBLASLt (a bf16
        # linear with bias) each have a workspace per handle and stream.
        a = torch.ones(16, 16, device=device)
        torch.mm(a, a)
        b = a.to(torch.bfloat16)
        torch.nn.functional.linear(b, b, b[0])
        done.add(key)


def pool_bytes(device: torch.device, pool: tuple) -> int:
    """Bytes the caching allocator holds in segments of one private pool.

    Exact while the engine keeps allocating on other streams, unlike a reserved-memory delta."""
    index = device.index  # CudaGraphBackend gives every device an explicit index
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == tuple(pool)
    )


class PiecewiseGraph:
    """The pieces of one token bucket: CUDA graphs sharing one private pool, replayed in order with
    the step's eager attention between them (`between[i]` after graph i)."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph], between: list, pool: tuple, output: torch.Tensor,
                 size: int, nbytes: int, capture_ms: float) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] | None = graphs
        self.between = between
        self.pool = pool  # alive as long as the graphs (see CudaGraph)
        self.output: torch.Tensor | None = output
        self.size = size
        self.nbytes = nbytes
        self.capture_ms = capture_ms

    def replay(self) -> torch.Tensor:
        assert self.graphs is not None and self.output is not None, "replay of a released graph"
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.between):
                self.between[i]()
        return self.output

    def drop(self) -> None:
        for graph in self.graphs or ():
            graph.reset()
        self.graphs = None
        self.between = []
        self.output = None
        self.pool = None


class _NoAutomaticGc:
    """Automatic collection off while recording: a collection walks every object and could free a
    tensor the capture is about to record. Nothing is collected on entry (gc.freeze() after load
    keeps the long-lived objects out of every generation anyway)."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


class CudaGraphBackend:
    """Captures `step.run(size)` into a CUDA graph with a private memory pool per graph, on the
    capture thread, while the engine thread keeps serving on the default stream.

    - Warm-up (lazy cuBLAS handles, Triton compiles) runs `step.run_scratch(size)`: private inputs
      that only touch the scratch KV slot, so it never reads or writes what a serving step uses.
    - Recording uses `capture_error_mode="thread_local"` on the side stream: the engine thread's
      syncs and allocations stay legal; recording executes nothing, so the static inputs it reads
      may change under it. `torch.cuda.graph` is not used: on entry it synchronizes the device and
      empties the allocator's cache, which is what used to stall every stream.
    - Bytes are the larger of the private pool's segments (`pool_bytes`, exact while the engine
      allocates beside it) and the driver's free-memory drop (which also sees the instantiated
      graph). A private pool is what makes eviction real: deleting one graph of a shared pool frees
      nothing until every graph of it is gone.
    - `synchronize` (inline capture, tensor parallelism): the device finishes the steps queued before
      the warm-up starts, so the warm-up's collectives never run beside a step's.
    """

    def __init__(self, device: torch.device, warmup_iters: int = 1, synchronize: bool = False) -> None:
        assert device.type == "cuda", device
        # An explicit index: the capture thread binds to it (a bare "cuda" means the current device here).
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.warmup_iters = warmup_iters
        self.synchronize = synchronize

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def capture(self, step: DecodeStep, size: int) -> CudaGraph | PiecewiseGraph:
        """A step with `segments` (PIECEWISE) is recorded piece by piece into one pool, attention
        left out; any other step as one graph."""
        with _device_lock(self.device):
            return self._capture(step, size)

    def _capture(self, step: DecodeStep, size: int) -> CudaGraph | PiecewiseGraph:
        device = self.device
        stream = _side_stream(device)
        if self.synchronize:
            torch.cuda.synchronize(device)
        warmup = _side_stream(device, "warmup")
        with torch.inference_mode(), torch.cuda.stream(warmup):
            for _ in range(self.warmup_iters):
                step.run_scratch(size)
        warmup.synchronize()  # waits for the warm-up only; the engine's stream runs on
        with torch.inference_mode(), torch.cuda.stream(stream):
            _prime_blas_workspace(device)
            pool = torch.cuda.graph_pool_handle()
            free0 = torch.cuda.mem_get_info(device)[0]  # no device sync: the engine keeps running
            start = time.perf_counter()
            segments = step.segments(size) if hasattr(step, "segments") else None
            graphs: list[torch.cuda.CUDAGraph] = []
            try:
                with _NoAutomaticGc():
                    for record in segments.pieces if segments is not None else [lambda: step.run(size)]:
                        graph = torch.cuda.CUDAGraph()
                        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                        try:
                            output = record()
                        finally:
                            graph.capture_end()
                        graphs.append(graph)
            except BaseException:
                # The traceback keeps this frame alive: drop the half-captured graphs and their pool now
                # so the failure cleanup can return their memory.
                graph = pool = segments = None
                graphs.clear()
                raise
            capture_ms = (time.perf_counter() - start) * 1000.0
        # The pool holds the graph's tensors; the driver's free-memory drop also sees the instantiated
        # graph (and, rarely, a segment the engine allocated meanwhile: an over-estimate is safe).
        nbytes = max(pool_bytes(device, pool), free0 - torch.cuda.mem_get_info(device)[0])
        if segments is not None:
            return PiecewiseGraph(graphs, segments.between, pool, segments.output(), size, nbytes, capture_ms)
        return CudaGraph(graphs[0], pool, output, size, nbytes, capture_ms)

    def fence(self) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release(self, graph: CapturedGraph, after: object = None) -> int:
        assert isinstance(graph, (CudaGraph, PiecewiseGraph))
        if after is not None:
            after.synchronize()  # the last replay (and the reads of its output) finished
        with _device_lock(self.device):
            return self._release(graph)

    def _release(self, graph: CapturedGraph) -> int:
        pool = graph.pool
        before, free0 = pool_bytes(self.device, pool), torch.cuda.mem_get_info(self.device)[0]
        graph.drop()
        # Gives the pool (and the engine's unused cached blocks, which it re-takes as it needs them)
        # back to the driver. The pool's own delta is exact; the driver's also sees the graph itself.
        torch.cuda.empty_cache()
        pool_freed = before - pool_bytes(self.device, pool)
        return max(pool_freed, min(torch.cuda.mem_get_info(self.device)[0] - free0, graph.nbytes), 0)

    def cleanup_after_failure(self) -> None:
        with _device_lock(self.device):
            _side_stream(self.device, "warmup").synchronize()
            _side_stream(self.device).synchronize()
            torch.cuda.empty_cache()
