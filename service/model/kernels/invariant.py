"""The kernels of the batch-invariant mode: a row's result never depends on the other rows of its step.

Decided once when the model is built (`InvariantKernels.build`), like the fast path:

    GEMMs      every linear layer and the LM head through a matmul whose reduction never depends on
               M (service.model.kernels.matmul): Triton on CUDA, fixed-size row blocks on CPU
    attention  every row, decode or prompt token, through the per-row decode kernel with a split of
               the KV range fixed by the cache length (not by the batch, as the default heuristic does)
    norms      the Triton RMSNorm already reduces each row in one program, in one order; on CPU the
               torch reduction of a row does not depend on the number of rows
    sampling   greedy is an argmax per row: already invariant

On CUDA the mode needs its Triton kernels: when one is missing or fails its self-check the model
does not load (ModelLoadError, saying why), rather than serve without the guarantee asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from service.model.attention import DecodeAttention
from service.model.kernels._triton import triton
from service.model.kernels.decode_attention import decode_attention_torch, decode_attention_triton, fixed_split_len
from service.model.kernels.fast_path import FAST_DTYPES, FastPath, check_attention, check_matmul
from service.model.kernels.matmul import matmul_blocked_torch, matmul_triton
from service.model.spec import ModelLoadError

# (x [M, K], weight [N, K], bias [N] | None) -> [M, N]
Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def decode_attention_fixed_split(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, slot_ids: torch.Tensor,
    positions: torch.Tensor, kv_scale: torch.Tensor | None = None, window: int = 0, scale: float | None = None,
) -> torch.Tensor:
    """The Triton decode kernel with its KV split fixed by the table's span (fixed_split_len)."""
    span = block_table.shape[1] * k_cache.shape[2]
    return decode_attention_triton(q, k_cache, v_cache, block_table, slot_ids, positions, kv_scale,
                                   split_len=fixed_split_len(span), window=window, scale=scale)


@dataclass(frozen=True)
class InvariantKernels:
    matmul: Matmul
    attention: DecodeAttention
    backend: str  # "triton" | "torch", for the start-up log
    # Rows per attention call on prompt chunks: bounds the torch kernel's gathered slots
    # ([rows, KVH, T, D]) and the Triton kernel's split buffers ([rows, H, splits, D] float32).
    rows_per_call: int = 64

    @classmethod
    def build(
        cls, device: torch.device | str, dtype: torch.dtype, fast: FastPath, weights: set[tuple[int, int, bool]],
        heads: tuple[int, int, int], kv_dtype: torch.dtype | None = None,
    ) -> InvariantKernels:
        """weights: (N, K, has bias) of every linear layer and the LM head; heads: (num_heads,
        num_kv_heads, head_dim); kv_dtype: what the KV cache stores (None: dtype). On CUDA each weight
        shape's matmul and the attention with its fixed split are compiled and self-checked here
        (against torch, and row by row across the batch)."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(matmul_blocked_torch, decode_attention_torch, "torch")
        refuse = "--batch-invariant on cuda needs its Triton kernels: {}; run without --batch-invariant"
        if dtype not in FAST_DTYPES:
            raise ModelLoadError(refuse.format(f"dtype {dtype} is not supported (use --dtype bfloat16 or float16)"))
        if triton is None:
            raise ModelLoadError(refuse.format("triton is not importable"))
        if not (fast.attention and fast.norm):
            raise ModelLoadError(refuse.format(f"a fast-path kernel failed its self-check ({fast}; see the "
                                               "fast_path_disabled log)"))
        checks = {f"matmul [{n}, {k}]": partial(check_matmul, device, dtype, n, k, bias)
                  for n, k, bias in sorted(weights)}
        checks["attention"] = partial(check_attention, device, dtype, *heads, batch=5, max_seq_len=600,
                                      split_len=fixed_split_len(600), kv_dtype=kv_dtype)
        for name, check in checks.items():
            try:
                with torch.cuda.device(device), torch.inference_mode():
                    check()
            except Exception as e:  # noqa: BLE001  (reported as the reason the model cannot load)
                raise ModelLoadError(refuse.format(f"{name} failed its self-check: {type(e).__name__}: {e}"[:500])) from e
        return cls(matmul_triton, decode_attention_fixed_split, "triton", rows_per_call=256)
