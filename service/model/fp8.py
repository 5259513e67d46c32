"""FP8 weights (`--quantization fp8`): the decoder layers' projections in FP8 E4M3, one scale per
output channel; embeddings, norms and the LM head stay in the model's dtype.

A bf16 / float32 checkpoint is quantized at load: each weight row (output channel) is scaled so
its largest magnitude maps to E4M3's largest finite value (448), then rounded to E4M3. A
checkpoint already in FP8 (the layout vLLM and llm-compressor write: `<name>.weight` in
float8_e4m3fn beside `<name>.weight_scale`, one scale per output channel ([N] or [N, 1]) or one
per tensor) is taken as it is, its scales broadcast to one per channel.

The product `fp8_linear`: a one-row input (the batch-1 decode step) through the GEMV of
service.model.kernels.gemv, which reads the FP8 weight (half the bytes of bf16), dequantizes it in
registers and applies the row scales at the end (the activation stays in bf16); more rows through
the FP8 tensor cores, the activation quantized per token on the fly (one scale per row, no
calibration): up to 256 rows (decode) through service.model.kernels.fp8_gemm, which spreads a
weight over every SM, more (prompt chunks) through cuBLAS (`torch._scaled_mm`). All are graph-safe.
FP8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper): `unsupported_reason`
says why a device cannot, for a start-up error.
"""

from __future__ import annotations

import os

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# GRAPHSERVE_FP8_GEMM=cublas: every multi-row product through cuBLAS (the operator's switch and the
# benchmarks' A/B); read once, not per product
OUR_GEMM = os.environ.get("GRAPHSERVE_FP8_GEMM", "ours") != "cublas"
MIN_SCALE = 1e-12  # an all-zero row keeps a positive scale (its values stay 0)


def unsupported_reason(device: torch.device) -> str | None:
    """None when `device` runs FP8 products, else what it lacks."""
    if device.type != "cuda":
        return f"FP8 needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper); this is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 needs compute capability 8.9+ (Ada, Hopper); {torch.cuda.get_device_name(device)} has "
                f"{major}.{minor}")
    return None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (E4M3 [N, K], float32 scales [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(E4M3 [N, K], scales [N]) -> float32 [N, K]."""
    return q.float() * scale.float()[:, None]


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (E4M3 [M, K], float32 scales [M, 1]): one dynamic scale per token, as
    quantize_rows gives a weight's rows theirs."""
    q, scale = quantize_rows(x)
    return q, scale[:, None]


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_tokens in one Triton kernel where there is Triton (the GPUs that run FP8 products)."""
    from service.model.kernels import quant

    if quant.triton is None:
        return quantize_tokens(x)
    return quant.quantize_tokens_triton(x if x.stride(1) == 1 else x.contiguous(), FP8_MAX, MIN_SCALE)


def checkpoint_scales(weight_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's `weight_scale` (per channel [N] / [N, 1], or per tensor [] / [1]) -> float32 [rows]."""
    s = weight_scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"weight_scale holds {s.numel()} scales for a weight of {rows} rows: expected one per "
                         "output channel or one per tensor")
    return s.contiguous()


def dequantize_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every FP8 weight (one with a `<name>.weight_scale` beside it)
    dequantized to float32 and its scales dropped (and static `input_scale`s: activations are
    quantized per token); other tensors as they are. The model casts them to its dtype, and
    `--quantization fp8` quantizes them again with the same per-channel scales."""
    scales = [k for k in state if k.endswith(".weight_scale")]
    if not scales:
        return state
    out = dict(state)
    for key in scales:
        name = key.removesuffix("_scale")
        if name not in out:
            raise ValueError(f"{key} has no weight {name} beside it")
        w = out[name]
        try:
            out[name] = dequantize_rows(w, checkpoint_scales(out.pop(key), w.shape[0]))
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        out.pop(key.removesuffix("weight_scale") + "input_scale", None)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] in bf16 / fp16, weight [N, K] E4M3 (rows contiguous), scale [N] float32 -> [..., N] in x's dtype."""
    from service.model.kernels.fp8_gemm import fp8_gemm_triton
    from service.model.kernels.gemv import gemv_triton

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 1:
        y = gemv_triton(x2, weight, bias, scale=scale)
    else:
        xq, xs = _quantize_tokens(x2)
        config = _gemm_config(x2.shape[0], weight.shape[0], weight.shape[1], x.device)
        if config is not None:
            y = fp8_gemm_triton(xq, xs, weight, scale, bias, x.dtype, config)
        else:  # cuBLAS writes bf16 only with per-row scales (fp16 / float32 raise outside recent Hopper builds)
            y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
            y = y.to(x.dtype)
            if bias is not None:
                y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


def _gemm_config(m: int, n: int, k: int, device: torch.device):  # noqa: ANN202 - Fp8GemmConfig | None
    """Our decode-sized GEMM's configuration for these rows, or None for cuBLAS (prompt chunks, or
    OUR_GEMM off)."""
    from service.model.kernels._triton import sm_count
    from service.model.kernels.fp8_gemm import fp8_gemm_config

    return fp8_gemm_config(m, n, k, sm_count(device)) if OUR_GEMM else None
