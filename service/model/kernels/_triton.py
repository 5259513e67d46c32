"""Triton when importable, else None: kernel modules define their Triton kernels only if it is."""

from __future__ import annotations

try:  # an optional dependency, absent on CI
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (ImportError, or a broken install that fails at import)
    triton = None
    tl = None

__all__ = ["tl", "triton"]
