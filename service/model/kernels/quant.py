"""Per-token FP8 quantization of activations in one kernel (service.model.fp8.quantize_tokens is
the torch reference): a program per row loads it once, takes its largest magnitude, and writes the
E4M3 row and its scale. The torch version is six elementwise kernels per projection, which cost an
FP8 decode step at batch 64 more than the FP8 GEMMs saved."""

from __future__ import annotations

import torch

from service.model.kernels._triton import next_pow2, tl, triton


def quantize_tokens_triton(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (E4M3 [M, K], float32 scales [M, 1]), each row's scale its largest
    magnitude over fp8_max, at least min_scale (service.model.fp8's constants)."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    block = max(16, next_pow2(k))
    _quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), FP8_MAX=fp8_max, MIN_SCALE=min_scale, BLOCK=block,
                             num_warps=8 if block >= 4096 else 4)
    return q, scale


if triton is not None:

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, MIN_SCALE)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row.to(tl.int64) * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
