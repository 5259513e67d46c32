"""The paged KV cache: key and value memory in blocks of `block_size` tokens, and the block table.

Each layer's keys (and values) are one tensor [num_blocks, KVH, block_size, D]; block 0 is the
null block, which no sequence owns: padding rows write into it and unused table entries point at
it. A sequence row (the scheduler's slot: a row of a step, a row of the table) reads its positions
through `block_table[slot]`: position p lives at (block_table[slot, p // block_size], :,
p % block_size). Row `scratch_slot` (the last) stays all null: warm-ups and padding rows use it.

The table lives on the device (graphs read it as a static input, never reallocated) with a host
mirror that `set_blocks` edits; `sync_table` copies the mirror over before a step that needs it,
from one of two pinned buffers in turn (the previous copy may still be queued). Which blocks a
sequence holds is the KV manager's business (service/engine/kv_manager.py): each step carries the
entries its allocations changed, which the runner writes here; this class owns the memory only.
`dtype` is the model's (what attention computes in); `cache_dtype` what the blocks store: the
model's dtype, or FP8 E4M3 with a scale per layer for keys and one for values (`scales`,
service/model/kv_quant.py), which every writer and reader of the cache applies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.model.kernels.decode_attention import gather_rows
from service.model.spec import ModelSpec

NULL_BLOCK = 0

# The step's rows' KV entries: (block [S], offset [S]) long, KVCache.write_index
WriteIndex = tuple[torch.Tensor, torch.Tensor]


class KVCache:
    def __init__(
        self, spec: ModelSpec, num_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
        block_size: int = 16, num_blocks: int | None = None, cache_dtype: torch.dtype | None = None,
    ) -> None:
        """num_slots sequence rows (plus the scratch row) of at most max_seq_len tokens each, over
        num_blocks blocks (the null block included). num_blocks None: a contiguous layout that gives
        every row its own blocks for max_seq_len tokens, fixed at construction (tests, benchmarks,
        the `LLM` reference paths); otherwise every row starts with no blocks (all null). cache_dtype
        None: the model's dtype."""
        assert num_slots >= 1 and max_seq_len >= 1 and block_size >= 1
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.scratch_slot = num_slots
        self.blocks_per_seq = -(-max_seq_len // block_size)
        contiguous = num_blocks is None
        if num_blocks is None:
            num_blocks = self.contiguous_blocks(num_slots, max_seq_len, block_size)
        assert num_blocks >= 2, "a pool needs the null block and at least one more"
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.cache_dtype = cache_dtype or dtype
        shape = (num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        # Zero-filled so attention over never-written positions (masked anyway) cannot produce NaN.
        self.k: list[torch.Tensor] = [torch.zeros(shape, device=device, dtype=self.cache_dtype)
                                      for _ in range(spec.num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, device=device, dtype=self.cache_dtype)
                                      for _ in range(spec.num_layers)]
        # Each layer's (k scale, v scale): what an FP8 cache's entries are multiplied by on reading
        # (unused otherwise). The kernels read them on the device: set_scales before any capture.
        self.scales = torch.ones(spec.num_layers, 2, dtype=torch.float32, device=device)
        rows = (num_slots + 1, self.blocks_per_seq)
        self.block_table = torch.zeros(rows, dtype=torch.int32, device=device)
        self._table_host = torch.zeros(rows, dtype=torch.int32)
        self._table_rows = self._table_host.numpy()  # the same memory: a slice write costs ~1 us, torch's ~10
        self._staging = torch.zeros((2, *rows), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._turn = 0
        self._dirty = False
        if contiguous:
            for slot in range(num_slots):
                first = 1 + slot * self.blocks_per_seq
                self.set_blocks(slot, 0, list(range(first, first + self.blocks_per_seq)))
            self.sync_table()

    def set_scales(self, scales: torch.Tensor) -> None:
        """Every layer's (k, v) scales, [num_layers, 2] (a checkpoint's, kv_quant.checkpoint_kv_scales)."""
        assert scales.shape == self.scales.shape, f"{tuple(scales.shape)} scales for {tuple(self.scales.shape)}"
        self.scales.copy_(scales)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs (keys and values of every layer) stored as `dtype` (the cache dtype),
        for sizing the pool before allocating."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * spec.num_kv_heads * block_size * spec.head_dim * elem

    # ---- the block table -----------------------------------------------------------------

    def set_blocks(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Row `slot`'s entries [first, first + len(blocks)) become `blocks` (host mirror; see sync_table)."""
        assert 0 <= slot < self.num_slots, f"slot {slot} is not a sequence row"
        assert first + len(blocks) <= self.blocks_per_seq, "more blocks than max_seq_len needs"
        if blocks:
            self._table_rows[slot, first: first + len(blocks)] = blocks
            self._dirty = True

    def clear_row(self, slot: int) -> None:
        """Row `slot` back to all null (its sequence left; nothing may read its old blocks through it)."""
        self._table_host[slot].zero_()
        self._dirty = True

    def row(self, slot: int) -> list[int]:
        """Row `slot` of the host mirror (tests, debugging)."""
        return self._table_host[slot].tolist()

    def sync_table(self) -> None:
        """Copy the host mirror to the device table if it changed since the last copy (no host sync)."""
        if not self._dirty:
            return
        self._turn ^= 1
        staging = self._staging[self._turn]
        staging.copy_(self._table_host)
        self.block_table.copy_(staging, non_blocking=True)
        self._dirty = False

    # ---- addressing ----------------------------------------------------------------------

    def write_index(self, slot_ids: torch.Tensor, positions: torch.Tensor) -> WriteIndex:
        """(block, offset) [N] long of each row's KV entry at (slot, position). Graph-safe (a device gather)."""
        bs = self.block_size
        blocks = self.block_table[slot_ids, torch.div(positions, bs, rounding_mode="floor")].long()
        return blocks, positions % bs

    def slot_view(self, cache: torch.Tensor) -> torch.Tensor:
        """Every row's positions [0, blocks_per_seq * block_size) as [num_slots + 1, KVH, T, D] (a copy,
        tests and debugging; the scratch row reads the null block)."""
        return gather_rows(cache, self.block_table, torch.arange(self.num_slots + 1, device=cache.device))

    @staticmethod
    def contiguous_blocks(num_slots: int, max_seq_len: int, block_size: int) -> int:
        """Blocks (the null block included) for every row at max_seq_len: the contiguous layout's pool."""
        return 1 + num_slots * -(-max_seq_len // block_size)
