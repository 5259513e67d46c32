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
says why a device cannot, for a start-up error. `self_check` tries each route at start on the
model's own weights; a kernel of ours that fails gives its rows to cuBLAS (`Fp8Kernels`).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

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


def quantize_experts(weight: torch.Tensor, block: tuple[int, int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] -> (E4M3 [E, N, K], float32 scales): one per output channel
    [E, N], or one per `block` of (rows, columns) [E, ceil(N / rows), ceil(K / columns)] (the layout of
    block-quantized checkpoints, e.g. 128 x 128)."""
    w = weight.float()
    if block is None:
        scale = (w.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
        return (w / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    bn, bk = block
    e, n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    tiles = padded.view(e, padded.shape[1] // bn, bn, padded.shape[2] // bk, bk)
    scale = (tiles.abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=MIN_SCALE)  # [E, N / bn, K / bk]
    q = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:, :n, :k]
    return q.contiguous().to(FP8), scale


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


def dequantize_checkpoint(state: dict[str, torch.Tensor], block: tuple[int, int] | None = None
                          ) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every FP8 weight (one with a `<name>.weight_scale` beside it)
    dequantized to float32 and its scales dropped (and static `input_scale`s: activations are
    quantized per token); other tensors as they are. The model casts them to its dtype, and
    `--quantization fp8` quantizes them again with the same per-channel scales. A block-quantized
    checkpoint (`<name>.weight_scale_inv` [N / rows, K / columns], config.json's
    quantization_config.weight_block_size = `block`, as DeepSeek's and Qwen3's FP8 releases) is
    dequantized block by block."""
    out = _dequantize_blocks(state, block)
    scales = [k for k in out if k.endswith(".weight_scale")]
    if not scales:
        return out
    out = dict(out)
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


def _dequantize_blocks(state: dict[str, torch.Tensor], block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    scales = [k for k in state if k.endswith(".weight_scale_inv")]
    if not scales:
        return state
    if block is None:
        raise ValueError(f"{scales[0]}: a block-scaled FP8 weight, but config.json has no "
                         "quantization_config.weight_block_size")
    out = dict(state)
    for key in scales:
        name = key.removesuffix("_scale_inv")
        w, scale = out[name], out.pop(key)
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        if tuple(scale.shape) != (rows, cols):
            raise ValueError(f"{key}: {tuple(scale.shape)} scales for a weight of {tuple(w.shape)} in blocks of {block}")
        from service.model.kernels.moe import dequantize_experts

        out[name] = dequantize_experts(w[None], scale[None], block, torch.float32)[0]
        out.pop(key.removesuffix("weight_scale_inv") + "input_scale", None)
    return out


@dataclass(frozen=True)
class Fp8Kernels:
    """Which kernels of ours an FP8 model's products run, as its start-up self-check found them
    (`self_check`): the one-row GEMV, the decode-batch GEMM (cuBLAS where one is off) and the
    activation's per-token quantization (torch's where off)."""

    gemv: bool = True
    gemm: bool = OUR_GEMM
    quant: bool = True


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
               kernels: Fp8Kernels = Fp8Kernels()) -> torch.Tensor:
    """x [..., K] in bf16 / fp16, weight [N, K] E4M3 (rows contiguous), scale [N] float32 -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 1 and kernels.gemv:
        y = _product(x2, weight, bias, scale, "gemv")
    else:
        config = _gemm_config(x2.shape[0], weight.shape[0], weight.shape[1], x.device) if kernels.gemm else None
        y = _product(x2, weight, bias, scale, "gemm" if config else "cublas", kernels.quant, config)
    return y.view(*shape[:-1], weight.shape[0])


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
             route: str, quant_kernel: bool = True, config=None) -> torch.Tensor:  # noqa: ANN001 - Fp8GemmConfig
    """x [M, K] times the E4M3 weight by one route: "gemv" (one row, the activation in bf16), "gemm"
    (ours, up to 256 rows, in `config`: by default the one served for these rows) or "cublas" (any
    rows); both of the latter quantize the activation per token (our kernel, or torch's ops without
    `quant_kernel`)."""
    from service.model.kernels.fp8_gemm import fp8_gemm_triton
    from service.model.kernels.gemv import gemv_triton

    if route == "gemv":
        return gemv_triton(x, weight, bias, scale=scale)
    xq, xs = _quantize_tokens(x) if quant_kernel else quantize_tokens(x)
    if route == "gemm":
        return fp8_gemm_triton(xq, xs, weight, scale, bias, x.dtype,
                               config or _gemm_config(x.shape[0], weight.shape[0], weight.shape[1], x.device))
    # cuBLAS writes bf16 only with per-row scales (fp16 / float32 raise outside recent Hopper builds)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16).to(x.dtype)
    return y if bias is None else y + bias


CHECK_TOLERANCE = 5e-3  # relative norm against float32: bf16 rounding and the accumulation order only


def check_rows(n: int, k: int, device: torch.device) -> dict[int, list[str]]:
    """The self-check's row counts for a weight [n, k] and the routes each is checked by: the lone row
    (the GEMV, and our GEMM and cuBLAS, which serve it when the GEMV is off), one row count per tile
    configuration our GEMM serves up to 256 rows, the first left to cuBLAS there, and a prompt chunk."""
    from service.model.kernels.fp8_gemm import MAX_ROWS

    rows: dict[int, list[str]] = {1: ["gemv", "cublas"] + (["gemm"] if _gemm_config(1, n, k, device) else [])}
    seen: set = set()
    for m in range(2, MAX_ROWS + 2):
        config = _gemm_config(m, n, k, device) if m <= MAX_ROWS else None
        if config not in seen:
            seen.add(config)
            rows[m] = ["gemm"] if config is not None else ["cublas"]
    rows.setdefault(300, ["cublas"])
    return rows


def self_check(weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], dtype: torch.dtype
               ) -> Fp8Kernels:
    """Every route of `fp8_linear` on the model's own FP8 weights (one of each shape: (E4M3 [N, K],
    scales [N], bias or None)) with activations of `dtype`, against float32 of the dequantized
    operands, at `check_rows`; first the quantization kernel against torch's. A kernel of ours that
    fails (wrong values or an error) is logged (`fp8_kernel_disabled`) and cuBLAS (torch's
    quantization) serves in its place; cuBLAS failing raises: FP8 cannot be served on this device."""
    import structlog

    log = structlog.get_logger("graphserve.model")
    if not weights:
        return Fp8Kernels()
    start = time.perf_counter()
    failed: dict[str, str] = {}
    device = weights[0][0].device
    quant = all([_check("quant", failed, functools.partial(_check_quantization, k, device, dtype))
                 for k in sorted({q.shape[1] for q, _, _ in weights})])
    for q, scale, bias in weights:
        n, k = q.shape
        w = dequantize_rows(q, scale)
        gen = torch.Generator(device).manual_seed(n + k)
        for rows, routes in check_rows(n, k, device).items():
            x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
            xq, xs = quantize_tokens(x)
            for route in routes:
                if route in failed or (route == "gemm" and not OUR_GEMM):
                    continue
                ref = (x.float() if route == "gemv" else xq.float() * xs) @ w.t()
                if bias is not None:
                    ref += bias.float()
                _check(route, failed, functools.partial(_check_product, x, q, bias, scale, route, quant, ref,
                                                        f"[{n}, {k}] at {rows} rows"))
        del w
    if "cublas" in failed:
        raise RuntimeError(f"FP8 products through cuBLAS are wrong on this device ({failed['cublas']}); "
                           "serve without --quantization fp8")
    for route, reason in failed.items():
        log.warning("fp8_kernel_disabled", kernel=route, reason=reason, instead="torch" if route == "quant" else "cublas")
    kernels = Fp8Kernels(gemv="gemv" not in failed, gemm=OUR_GEMM and "gemm" not in failed, quant=quant)
    log.info("fp8_products", gemv=kernels.gemv, gemm=kernels.gemm, quant=kernels.quant, shapes=len(weights),
             seconds=round(time.perf_counter() - start, 3))
    return kernels


def _check_product(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, route: str,
                   quant: bool, ref: torch.Tensor, where: str) -> None:
    y = _product(x, q, bias, scale, route, quant).float()
    error = ((y - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    if not error < CHECK_TOLERANCE:  # NaN fails too
        raise AssertionError(f"{where}: relative error {error:.3g} over {CHECK_TOLERANCE}")


def _check(name: str, failed: dict[str, str], check) -> bool:  # noqa: ANN001 - a callable raising on a failure
    """Runs one check: False (and the reason in `failed`) when it fails; out of memory is not a verdict."""
    try:
        check()
        return True
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel of ours must never take the service down
        failed[name] = f"{type(e).__name__}: {e}"[:500]
        return False


def _check_quantization(k: int, device: torch.device, dtype: torch.dtype) -> None:
    """The per-token quantization kernel against torch's ops: the same scales, and the same E4M3 values
    but at a few halfway points (rounded the other way)."""
    from service.model.kernels import quant

    if quant.triton is None:
        return  # _quantize_tokens is torch's then
    x = torch.randn(64, k, device=device, generator=torch.Generator(device).manual_seed(k)).to(dtype)
    x[0] = 0  # an all-zero row keeps a positive scale
    q, s = quant.quantize_tokens_triton(x, FP8_MAX, MIN_SCALE)
    qr, sr = quantize_tokens(x)
    if not torch.allclose(s, sr, rtol=1e-6) or (q.float() != qr.float()).float().mean().item() > 1e-3:
        raise AssertionError(f"the quantization of [64, {k}] differs from torch's")


def _gemm_config(m: int, n: int, k: int, device: torch.device):  # noqa: ANN202 - Fp8GemmConfig | None
    """Our decode-sized GEMM's configuration for these rows, or None where cuBLAS serves them."""
    from service.model.kernels._triton import sm_count
    from service.model.kernels.fp8_gemm import fp8_gemm_config

    return fp8_gemm_config(m, n, k, sm_count(device))
