"""LoRA adapters beside the model: PEFT files in (service.model.lora_files), fixed device slots,
batched per-token products.

Every fused projection (qkv_proj, o_proj, gate_up_proj, down_proj) of every layer gets a
`LoraProjection` hook that adds, for each token row, `(x @ A[slot]^T) @ B[slot]^T` to the base
output, where `slot` is that row's adapter slot. Slot 0 is "no adapter" and stays zero, so base rows
in a mixed batch get exactly nothing added. The buffers are allocated once (`max_loras + 1` slots,
zero-padded to the max rank, alpha/r folded into B at load), so loading or swapping an adapter is a
copy into a slot, never a reallocation: a captured graph keeps reading the same addresses.

q/k/v (gate/up) share one fused output; each sub-projection owns a block of rank columns of the
fused module's A and the rows of its output range in B (block-diagonal), so one shrink and one
expand serve all three. The hook only runs inside `lora_tokens(slots)` on the calling thread: base
steps (and base graphs) never run a LoRA kernel, and the capture thread and the engine thread each
decide for themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# The adapter files (read and checked as untrusted input) live in lora_files; re-exported here.
from service.model.lora_files import (  # noqa: F401
    CONFIG_FILE,
    FUSED,
    OWNER,
    TARGETS,
    WEIGHTS_FILE,
    LoraAdapter,
    LoraError,
    LoraPathError,
    read_adapter,
    shapes,
)
from service.model.spec import ModelLoadError, ModelSpec

# "stacked": one GEMM against every slot's A, a select, one GEMM against every slot's B (cost grows
# with max_loras * rank, independent of the batch); "gather": per-token gathered A/B and bmm (cost
# grows with the batch). bench/lora_bench.py measures both.
LORA_KERNELS = ("stacked", "gather")


# ---- the per-thread batch the hooks read -----------------------------------------------------------

_local = threading.local()


@dataclass(frozen=True)
class LoraTokens:
    slots: torch.Tensor  # [N] int64, each row's adapter slot (0: none)
    others: torch.Tensor  # [N, num_slots] bool: True at every slot that is not the row's


@contextmanager
def lora_tokens(slots: torch.Tensor, lora: LoraSlots) -> Iterator[None]:
    """Within this block (on this thread) every hooked projection adds the rows' adapters.
    Graph-safe: builds the slot selection on the device, no host sync."""
    others = slots[:, None] != lora.slot_range[None, :]
    previous = getattr(_local, "tokens", None)
    _local.tokens = LoraTokens(slots, others)
    try:
        yield
    finally:
        _local.tokens = previous


class LoraProjection:
    """The hook on one fused projection of one layer: y += per-row LoRA of x."""

    __slots__ = ("lora", "a", "b")

    def __init__(self, lora: LoraSlots, a: torch.Tensor, b: torch.Tensor) -> None:
        self.lora, self.a, self.b = lora, a, b  # a: [S, R, in], b: [out, S, R]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tokens: LoraTokens | None = getattr(_local, "tokens", None)
        if tokens is None:
            return y
        return add_lora(y, x, tokens, self.a, self.b, self.lora.kernel)


def add_lora(y: torch.Tensor, x: torch.Tensor, tokens: LoraTokens, a: torch.Tensor, b: torch.Tensor,
             kernel: str) -> torch.Tensor:
    """y [N, out] += per-row LoRA of x [N, in], in place: row n gets (x[n] @ a[s]^T) @ b[:, s]^T with
    s = tokens.slots[n]. "gather" reads only each row's own slot. "stacked" is three kernels: the
    shrink against every slot, a select that sets every other slot's columns of the row to exactly
    zero (a select, not a multiply by a 0/1 mask: 0 x NaN is NaN), and the expand accumulated into y
    by the GEMM itself. That expand still multiplies those zeros by the other slots' B, so it keeps
    rows apart only because every slot holds finite values: read_adapter refuses an adapter with a
    non-finite value in the very tensors that LoraSlots.load copies (tests/unit/test_adapters.py)."""
    num_slots, rank, n_in = a.shape
    n = x.shape[0]
    if kernel == "gather":
        h = torch.bmm(a[tokens.slots], x[:, :, None])  # [N, R, 1]
        return y.add_(torch.bmm(b.permute(1, 0, 2)[tokens.slots], h)[:, :, 0])
    h = torch.mm(x, a.view(num_slots * rank, n_in).T).view(n, num_slots, rank)
    h.masked_fill_(tokens.others[:, :, None], 0)
    return y.addmm_(h.view(n, num_slots * rank), b.view(b.shape[0], num_slots * rank).T)


class LoraSlots:
    """The device buffers of `max_loras` adapter slots (slot 0: no adapter) and the hooks that read them.

    Owned by the runner; `load(slot, adapter)` and `clear(slot)` run on the engine thread between
    steps. The copies are queued on the current stream, after any step already launched. Every slot
    holds finite values only (zeros, or a LoraAdapter, which read_adapter checked), which is what
    keeps the stacked kernel's rows apart."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, kernel: str = "stacked") -> None:
        if kernel not in LORA_KERNELS:
            raise ValueError(f"unknown LoRA kernel {kernel!r}; allowed: {LORA_KERNELS}")
        spec: ModelSpec = model.spec
        if spec.is_moe:
            raise ModelLoadError(f"LoRA adapters are not served on mixture-of-experts models ({spec.architecture}: "
                                 "its expert layers have no gate_up_proj / down_proj to adapt); serve it without "
                                 "--max-loras and --lora-modules")
        self.max_loras, self.max_rank, self.kernel = max_loras, max_rank, kernel
        self.dtype = model.dtype
        device = model.inv_freq.device
        self.device = device
        self.slot_range = torch.arange(max_loras + 1, device=device)
        dims = shapes(spec)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            for fused, parts in FUSED.items():
                n_in, n_out = dims[parts[0]][0], sum(dims[p][1] for p in parts)
                rank = len(parts) * max_rank
                a = torch.zeros(max_loras + 1, rank, n_in, device=device, dtype=self.dtype)
                b = torch.zeros(n_out, max_loras + 1, rank, device=device, dtype=self.dtype)
                self.a[(i, fused)], self.b[(i, fused)] = a, b
                getattr(getattr(layer, OWNER[fused]), fused).lora = LoraProjection(self, a, b)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        assert 1 <= slot <= self.max_loras, slot
        assert adapter.a and next(iter(adapter.a.values())).shape[0] % self.max_rank == 0
        non_blocking = self.device.type == "cuda"
        for key, a in self.a.items():
            if key in adapter.a:
                a[slot].copy_(adapter.a[key], non_blocking=non_blocking)
                self.b[key][:, slot].copy_(adapter.b[key], non_blocking=non_blocking)
            else:
                a[slot].zero_()
                self.b[key][:, slot].zero_()

    def clear(self, slot: int) -> None:
        assert 1 <= slot <= self.max_loras, slot
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][:, slot].zero_()
