"""Triton when importable, else None: kernel modules define their Triton kernels only if it is.
Also the launch helpers the kernel modules share."""

from __future__ import annotations

import os

import torch

try:  # an optional dependency, absent on CI
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (ImportError, or a broken install that fails at import)
    triton = None
    tl = None

__all__ = ["cdiv", "interpreting", "next_pow2", "sm_count", "tl", "triton"]

_num_sms: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (cached); 8 under the CPU interpreter (any value does;
    a small one exercises the splits)."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms:
        _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms[idx]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch arithmetic (usable without triton, unlike triton.cdiv)."""
    return -(-a // b)
