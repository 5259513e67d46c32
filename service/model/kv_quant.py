"""FP8 KV cache (`--kv-cache-dtype fp8`): keys and values stored in E4M3, half the bytes of bf16, so
the same --kv-cache-memory holds twice the blocks.

Each layer has one scale for its keys and one for its values (float32): a write stores x / scale,
clamped to E4M3's ±448 and rounded to E4M3; a read upcasts and multiplies by the scale. The scales
live on the device as KVCache.scales [layers, 2] (k, v), and every kernel takes a layer's pair by
pointer, so CUDA graphs read their current values and no kernel compiles per value. They are 1.0
(as vLLM's are when a checkpoint carries none) unless the checkpoint holds calibrated ones, under
the names vLLM reads: `model.layers.N.self_attn.k_scale` / `v_scale`, ModelOpt's
`self_attn.k_proj.k_scale` / `v_proj.v_scale`, llm-compressor's `self_attn.k_proj.output_scale` /
`v_proj.output_scale`, or the deprecated `self_attn.kv_scale` for both. With `auto` (the model's
dtype) a checkpoint's scales are read and unused.

The torch paths (CPU, reference) convert on every read and write; the Triton kernels load E4M3 and
convert in registers, which needs Triton's e4m3 type: compute capability 8.9+ (`unsupported_reason`).
"""

from __future__ import annotations

import re

import torch

from service.config import KV_CACHE_DTYPES
from service.model import fp8
from service.model.fp8 import FP8, FP8_MAX

# model.layers.N.self_attn.<name>, each name the scale of k, v, or both
_SCALE_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.(.+)")
_SCALE_NAMES = {
    "k_scale": (0,), "k_proj.k_scale": (0,), "k_proj.output_scale": (0,),
    "v_scale": (1,), "v_proj.v_scale": (1,), "v_proj.output_scale": (1,),
    "kv_scale": (0, 1),
}


def cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype `name` -> the dtype the cache stores: auto is the model's `dtype`."""
    assert name in KV_CACHE_DTYPES, name
    return FP8 if name == "fp8" else dtype


def unsupported_reason(device: torch.device) -> str | None:
    """None when `device` serves an FP8 KV cache, else what it lacks. A CPU does (the torch paths);
    a GPU needs what FP8 weights need (the Triton kernels' E4M3 loads)."""
    return None if device.type != "cuda" else fp8.unsupported_reason(device)


def store_kv(k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor | None,
             cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v in the model's dtype -> what a cache of `cache_dtype` holds: themselves, or E4M3 of
    x / scale clamped to ±448 (scale: the layer's (k, v) float32 [2]). Graph-safe: device ops only."""
    if cache_dtype != FP8:
        return k, v
    assert scale is not None, "an FP8 KV cache needs its layer's scales"
    return tuple((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8) for x, s in ((k, scale[0]), (v, scale[1])))


def load_kv(k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor | None,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache holds -> `dtype`: themselves, or E4M3 upcast times the layer's (k, v) scale."""
    if k.dtype != FP8:
        return k, v
    assert scale is not None, "an FP8 KV cache needs its layer's scales"
    return k.to(dtype) * scale[0], v.to(dtype) * scale[1]


def checkpoint_kv_scales(
    state: dict[str, torch.Tensor], num_layers: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(the checkpoint's tensors without its KV scales, those scales as float32 [num_layers, 2] (k, v),
    1.0 where a layer has none; None when the checkpoint has none at all). ValueError for a scale
    that is not one positive finite number per tensor (per-head scales are not served)."""
    found: dict[str, tuple[int, tuple[int, ...]]] = {}
    for key in state:
        m = _SCALE_KEY.fullmatch(key)
        if m and m[2] in _SCALE_NAMES:
            found[key] = (int(m[1]), _SCALE_NAMES[m[2]])
    if not found:
        return state, None
    scales = torch.ones(num_layers, 2, dtype=torch.float32)
    out = {k: t for k, t in state.items() if k not in found}
    for key, (layer, columns) in found.items():
        t = state[key]
        if layer >= num_layers:
            raise ValueError(f"{key}: the model has {num_layers} layers")
        if t.numel() != 1:
            raise ValueError(f"{key} holds {t.numel()} values: KV scales are served one per tensor")
        value = float(t.float().reshape(()))
        if not 0 < value < float("inf"):
            raise ValueError(f"{key} is {value}: a KV scale must be a positive finite number")
        scales[layer, list(columns)] = value
    return out, scales
