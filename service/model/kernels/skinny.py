"""Decode-sized GEMMs through Triton where it beats cuBLAS on this GPU, tuned when the model is built.

At decode a linear layer's M is the batch (1 to 64) and its cost is reading the weight once. On an
H200, cuBLAS runs qkv and o_proj of the 1B shape with one kernel shape at ~1.8 TB/s and splits
down_proj's K with a second, reduce kernel (bench/NOTES.md, "Decode kernel budget"). Two Triton
kernels stream a weight in one kernel with no split-K:
- for M <= 4, a GEMV on the CUDA cores (`gemv_triton`): each program reads BLOCK_N whole rows of the
  weight in BLOCK_K-wide loads and multiplies the M rows of x into them (no tensor-core tile that
  pads M to 16);
- for any M, the tensor-core matmul of service.model.kernels.matmul, given tiles for small M.
Which one is faster depends on the weight's shape, on M and on the GPU, so `tune_skinny` measures
them against cuBLAS on the device: every weight shape, every M bucket (1, 2, 4, ..., 64), a few
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

from service.model.kernels._triton import next_pow2, tl, triton
from service.model.kernels.matmul import MatmulConfig, matmul_triton

log = structlog.get_logger("graphserve.model")

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a call of M rows uses the choice of the smallest bucket >= M
MARGIN = 0.97  # Triton must take under 97% of cuBLAS's time: a tie is not worth a second code path
_WEIGHT_BYTES_TIMED = 256 << 20  # copies of a weight per timed graph: several times an H200's 50 MB L2
_REPLAYS = 5
# (device index, dtype, N, K, has bias) -> its row of choices: a process tunes each weight shape once
# (tensor-parallel ranks and LoRA reloads build models of shapes already timed).
_tuned: dict[tuple[int, torch.dtype, int, int, bool], list[Choice]] = {}


@dataclass(frozen=True)
class GemvConfig:
    """The CUDA-core kernel: `rows` (a power of two >= M) rows of x against BLOCK_N weight rows a program."""

    rows: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


Tile = MatmulConfig | GemvConfig


def candidates(m_bucket: int) -> list[Tile]:
    """Configurations tried for a bucket. GEMV for M <= 4: narrow BLOCK_N (many programs even for a
    2048-row weight), wide BLOCK_K (many loads in flight a thread). Tensor-core tiles: one BLOCK_M
    covering the bucket (16 is tl.dot's least), narrow BLOCK_N, long BLOCK_K."""
    bm = max(16, m_bucket)
    gemv = []
    if m_bucket <= 4:
        gemv = [GemvConfig(m_bucket, bn, bk, warps, stages)
                for bn, bk, warps, stages in ((4, 1024, 4, 2), (8, 512, 4, 3), (8, 1024, 4, 2), (16, 512, 8, 2),
                                              (8, 2048, 8, 1))]
    if bm == 16:
        return gemv + [MatmulConfig(16, 16, 256, 4, 4), MatmulConfig(16, 16, 512, 4, 3),
                       MatmulConfig(16, 16, 1024, 4, 2), MatmulConfig(16, 32, 256, 4, 4),
                       MatmulConfig(16, 32, 512, 8, 3), MatmulConfig(16, 64, 128, 4, 4), MatmulConfig(16, 64, 256, 8, 3)]
    return [MatmulConfig(bm, 32, 128, 4, 4), MatmulConfig(bm, 64, 128, 4, 3), MatmulConfig(bm, 32, 256, 8, 3)]


def run_tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    if isinstance(tile, GemvConfig):
        return gemv_triton(x, weight, bias, tile)
    return matmul_triton(x, weight, bias, tile)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, c: GemvConfig) -> torch.Tensor:
    """x [M, K] with M <= c.rows (rows contiguous) -> [M, N] in x's dtype, float32 sums."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and weight.stride(1) == 1 and x.shape[0] <= c.rows
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    _gemv_kernel[(triton.cdiv(n, c.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ROWS=next_pow2(c.rows), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return y


@dataclass
class Choice:
    """One (weight shape, M bucket): the configuration used (None: cuBLAS) and what was measured."""

    config: Tile | None
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
                    return run_tile(x, weight, bias, config)
        return F.linear(x, weight, bias)

    def summary(self) -> dict[str, str]:
        """Per weight shape and M bucket: the best Triton time / cuBLAS's in us, `*` where Triton is used."""
        out = {}
        for (n, k, bias), row in sorted(self.table.items()):
            cells = [f"{b}:{'-' if c.triton_us is None else f'{c.triton_us:.1f}'}/{c.cublas_us:.1f}"
                     f"{'*' if c.config is not None else ''}" for b, c in zip(M_BUCKETS, row)]
            out[f"{n}x{k}{'+b' if bias else ''}"] = " ".join(cells)
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


def check_config(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: Tile) -> None:
    """Raises unless the Triton matmul with `config` is within 2% (of the largest value) of a float32 GEMM."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    ours = run_tile(x, w, b, config).float()
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
                us = _graph_us([partial(run_tile, x, w, b, config) for w in ws], stream)
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


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        r_mask = offs_r < M
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_r[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_r[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])
