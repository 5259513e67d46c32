"""Static KV cache: every tensor is allocated once so decode steps keep fixed addresses and shapes."""

from __future__ import annotations

import torch

from service.model.spec import ModelSpec


class KVCache:
    """Static KV cache allocated once: one slot per running sequence plus one scratch slot that
    padding rows of a decode batch write into (so padding never touches a live sequence's KV).

    Slot s holds positions [0, max_seq_len) of one sequence. The scheduler owns which slot is free;
    this class only owns the memory. dtype must equal the model's dtype.
    """

    def __init__(
        self, spec: ModelSpec, num_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        assert num_slots >= 1 and max_seq_len >= 1
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.scratch_slot = num_slots
        shape = (num_slots + 1, spec.num_kv_heads, max_seq_len, spec.head_dim)
        # Zero-filled so attention over never-written positions (masked anyway) cannot produce NaN.
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)
        ]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_slot(spec: ModelSpec, max_seq_len: int, dtype: torch.dtype) -> int:
        """Bytes one slot costs, for sizing num_slots against a memory budget before allocating."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * spec.num_kv_heads * max_seq_len * spec.head_dim * elem
