"""Decode-sized GEMMs through Triton where it beats cuBLAS on this GPU, tuned when the model is built.

At decode a linear layer's M is the batch (1 to 64) and its cost is reading the weight once. On an
H200, cuBLAS runs qkv and o_proj of the 1B shape with one kernel shape at ~1.8 TB/s and splits
down_proj's K with a second, reduce kernel (bench/NOTES.md, "Decode kernel budget"). The Triton
matmul of service.model.kernels.matmul, given tiles for small M, streams a weight in one kernel with
no split-K. Which one is faster depends on the weight's shape, on M and on the GPU, so `tune_skinny`
measures both on the device: every weight shape, every M bucket (1, 2, 4, ..., 64), a few tile
configurations, each replayed in a CUDA graph over copies of the weight that do not fit in L2 (a
weight read from L2 would flatter the small ones). A configuration is kept only where it was checked
against cuBLAS and was faster by a margin; every other call (prompts, M > 64, other shapes) is cuBLAS.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import structlog
import torch
import torch.nn.functional as F

from service.model.kernels.matmul import MatmulConfig, matmul_triton

log = structlog.get_logger("graphserve.model")

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a call of M rows uses the choice of the smallest bucket >= M
MARGIN = 0.97  # Triton must take under 97% of cuBLAS's time: a tie is not worth a second code path
_WEIGHT_BYTES_TIMED = 256 << 20  # copies of a weight per timed graph: several times an H200's 50 MB L2
_REPLAYS = 5
# (device index, dtype, N, K, has bias) -> its row of choices: a process tunes each weight shape once
# (tensor-parallel ranks and LoRA reloads build models of shapes already timed).
_tuned: dict[tuple[int, torch.dtype, int, int, bool], list[Choice]] = {}


def candidates(m_bucket: int) -> list[MatmulConfig]:
    """Tile configurations tried for a bucket: one BLOCK_M covering the bucket (16 is tl.dot's least),
    narrow BLOCK_N so that even a 2048-wide weight gives every SM a program, long BLOCK_K so each
    program keeps enough bytes in flight."""
    bm = max(16, m_bucket)
    if bm == 16:
        return [MatmulConfig(16, 16, 256, 4, 4), MatmulConfig(16, 16, 512, 4, 3),
                MatmulConfig(16, 32, 256, 4, 4), MatmulConfig(16, 64, 128, 4, 4)]
    return [MatmulConfig(bm, 32, 128, 4, 4), MatmulConfig(bm, 64, 128, 4, 3)]


@dataclass
class Choice:
    """One (weight shape, M bucket): the configuration used (None: cuBLAS) and what was measured."""

    config: MatmulConfig | None
    cublas_us: float
    triton_us: float | None  # the best configuration's time; None if none ran


@dataclass
class SkinnyMatmul:
    """(x [M, K], weight [N, K], bias) -> [M, N]: the tuned Triton matmul for (N, K, bias) at M's bucket,
    else F.linear. Drop-in for Linear.matmul; Python-side only, so it records into CUDA graphs as is."""

    table: dict[tuple[int, int, bool], list[Choice]] = field(default_factory=dict)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if x.dim() == 2 and 0 < m <= M_BUCKETS[-1]:
            row = self.table.get((weight.shape[0], weight.shape[1], bias is not None))
            if row is not None:
                config = row[bucket_index(m)].config
                if config is not None:
                    return matmul_triton(x, weight, bias, config)
        return F.linear(x, weight, bias)

    def summary(self) -> dict[str, str]:
        """Per weight shape: the buckets that use Triton, with the time against cuBLAS (for the log)."""
        out = {}
        for (n, k, bias), row in sorted(self.table.items()):
            used = [f"{b}:{c.triton_us:.1f}/{c.cublas_us:.1f}us" for b, c in zip(M_BUCKETS, row)
                    if c.config is not None and c.triton_us is not None]
            out[f"{n}x{k}{'+b' if bias else ''}"] = " ".join(used) or "cublas"
        return out


def bucket_index(m: int) -> int:
    """The index in M_BUCKETS of the bucket a call of m rows uses."""
    for i, b in enumerate(M_BUCKETS):
        if m <= b:
            return i
    raise ValueError(m)


def _graph_us(calls: list[Callable[[], torch.Tensor]], stream: torch.cuda.Stream) -> float:
    """Microseconds per call, from CUDA-graph replays of all the calls (no launch gaps, as served)."""
    with torch.cuda.stream(stream):
        for call in calls:  # compiles, and lets cuBLAS allocate its workspace outside the capture
            call()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (_REPLAYS * len(calls))


def check_config(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: MatmulConfig) -> None:
    """Raises unless the Triton matmul with `config` is within 2% (of the largest value) of a float32 GEMM."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    ours = matmul_triton(x, w, b, config).float()
    scale = ref.abs().max().item() + 1e-6
    err = (ours - ref).abs().max().item()
    if not err <= 2e-2 * scale:
        raise AssertionError(f"max abs diff {err:.3g} against a largest value of {scale:.3g}")


def _tune_shape(device: torch.device, dtype: torch.dtype, n: int, k: int, has_bias: bool,
                gen: torch.Generator, stream: torch.cuda.Stream) -> list[Choice]:
    copies = min(64, max(1, math.ceil(_WEIGHT_BYTES_TIMED / (n * k * dtype.itemsize))))
    ws = [(torch.randn(n, k, device=device, dtype=torch.float32, generator=gen) / k**0.5).to(dtype)
          for _ in range(copies)]
    b = torch.randn(n, device=device, dtype=dtype, generator=gen) if has_bias else None
    row = []
    for m in M_BUCKETS:
        x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        cublas = _graph_us([partial(F.linear, x, w, b) for w in ws], stream)
        best, best_us = None, None
        for config in candidates(m):
            try:
                check_config(x, ws[0], b, config)
                us = _graph_us([partial(matmul_triton, x, w, b, config) for w in ws], stream)
            except Exception as e:  # noqa: BLE001  (a configuration that fails is not used)
                log.warning("skinny_matmul_config_failed", shape=[n, k], m=m, config=str(config),
                            reason=f"{type(e).__name__}: {e}"[:300])
                continue
            if best_us is None or us < best_us:
                best, best_us = config, us
        use = best if best_us is not None and best_us < MARGIN * cublas else None
        row.append(Choice(use, cublas, best_us))
    return row


def tune_skinny(device: torch.device, dtype: torch.dtype, shapes: set[tuple[int, int, bool]]) -> SkinnyMatmul:
    """Times cuBLAS and the candidates for every (N, K, has bias) and M bucket on `device` (each shape
    once per process)."""
    started = time.perf_counter()
    device = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    table: dict[tuple[int, int, bool], list[Choice]] = {}
    gen = torch.Generator(device).manual_seed(0)
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.inference_mode():
        for n, k, has_bias in sorted(shapes):
            key = (device.index, dtype, n, k, has_bias)
            if key in _tuned:
                table[(n, k, has_bias)] = _tuned[key]
                continue
            try:
                row = _tune_shape(device, dtype, n, k, has_bias, gen, stream)
            except Exception as e:  # noqa: BLE001  (the fast path must never take the service down)
                log.warning("skinny_matmul_tuning_failed", shape=[n, k], reason=f"{type(e).__name__}: {e}"[:300])
                row = [Choice(None, 0.0, None) for _ in M_BUCKETS]
            table[(n, k, has_bias)] = _tuned[key] = row
    torch.cuda.empty_cache()  # the timing copies: give the memory back before the KV cache is sized
    skinny = SkinnyMatmul(table)
    log.info("skinny_matmul_tuned", seconds=round(time.perf_counter() - started, 2), **skinny.summary())
    return skinny
