"""Fused GPU kernels for the decode fast path, each with a torch reference that is the CPU path.

Triton is optional: it is imported lazily and only on CUDA. `FastPath.build` self-checks every
Triton kernel once against its torch reference on small random inputs; any exception or mismatch
disables that kernel (event `fast_path_disabled`) and the model keeps the torch path. The service
never fails because of the fast path.
"""

from service.model.kernels.fast_path import FastPath

__all__ = ["FastPath"]
