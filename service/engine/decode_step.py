"""The decode step in the shape CUDA graphs need: static inputs sized for the max batch.

`ModelDecodeStep` implements `cache_manager.DecodeStep`. The graph cache captures `run(size)`,
which reads the first `size` rows of the static buffers; the engine writes the real rows before
each step and the cache manager makes the padding rows safe.
"""

from __future__ import annotations

import torch

from service.model.kv_cache import KVCache
from service.model.llama import LlamaForCausalLM
from service.model.lora import LoraSlots, lora_tokens


def fed_back(ids: torch.Tensor, pending_rows: torch.Tensor, previous_tokens: torch.Tensor) -> torch.Tensor:
    """ids, except where pending_rows[i] >= 0: there the previous launch's token at that row (all on
    the device: the host never waits for a token it has not read yet)."""
    return torch.where(pending_rows >= 0, previous_tokens[pending_rows.clamp(min=0)], ids)


class ModelDecodeStep:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, max_batch: int, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.max_batch = max_batch
        self.device = device
        # Static inputs: a captured graph holds views of these; they are never reallocated.
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_ids = torch.full((max_batch,), kv.scratch_slot, dtype=torch.long, device=device)
        # Each row's LoRA adapter slot (0: none); read only by LoraDecodeStep's graphs.
        self.lora_slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        # The capture thread's warm-up inputs: never written, so a warm-up beside serving steps only
        # touches the scratch slot (token 0 at position 0).
        self._scratch_inputs = (
            torch.zeros(max_batch, dtype=torch.long, device=device),
            torch.zeros(max_batch, dtype=torch.long, device=device),
            torch.full((max_batch,), kv.scratch_slot, dtype=torch.long, device=device),
        )
        # One copy per step for all inputs, from one of two pinned buffers in turn: the engine writes
        # step t+1's rows while step t's copy may still be queued behind the device's work.
        self._host = torch.zeros((2, 5 * max_batch), dtype=torch.long, pin_memory=device.type == "cuda")
        self._turn = 0

    def write_rows(
        self,
        token_ids: list[int],
        positions: list[int],
        slot_ids: list[int],
        pending_rows: list[int] | None = None,
        previous_tokens: torch.Tensor | None = None,
        lora_slots: list[int] | None = None,
    ) -> None:
        """Copy the real rows [0, n) into the static inputs. A row whose `pending_rows` entry is >= 0
        takes its token id from `previous_tokens` (on the device) at that index instead. `lora_slots`
        (each row's adapter slot) go in the same copy."""
        n = len(token_ids)
        assert n == len(positions) == len(slot_ids) <= self.max_batch
        pending = pending_rows is not None and max(pending_rows, default=-1) >= 0
        self._turn ^= 1
        rows = [token_ids, positions, slot_ids, pending_rows] if pending else [token_ids, positions, slot_ids]
        if lora_slots is not None:
            assert len(lora_slots) == n
            rows.append(lora_slots)
        host = self._host[self._turn, : len(rows) * n].view(len(rows), n)  # contiguous: one plain pinned copy
        host.copy_(torch.tensor(rows, dtype=torch.long))
        device_rows = host.to(self.device, non_blocking=True)
        if pending:
            assert previous_tokens is not None
            self.input_ids[:n].copy_(fed_back(device_rows[0], device_rows[3], previous_tokens))
        else:
            self.input_ids[:n].copy_(device_rows[0])
        self.positions[:n].copy_(device_rows[1])
        self.slot_ids[:n].copy_(device_rows[2])
        if lora_slots is not None:
            self.lora_slots[:n].copy_(device_rows[-1])

    def set_padding_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) write only into the scratch KV slot, at position 0."""
        pad_rows(self.input_ids, self.positions, self.slot_ids, self.kv.scratch_slot, start, stop)

    def run(self, batch_size: int) -> torch.Tensor:
        """Float32 logits [batch_size, vocab] for rows [0, batch_size) of the static inputs."""
        return self.model.decode(
            self.input_ids[:batch_size], self.positions[:batch_size], self.slot_ids[:batch_size], self.kv
        )

    def run_scratch(self, batch_size: int) -> torch.Tensor:
        """Like `run`, on private inputs that write only the scratch KV slot (the capture warm-up)."""
        ids, positions, slots = (t[:batch_size] for t in self._scratch_inputs)
        return self.model.decode(ids, positions, slots, self.kv)

    def input_addresses(self) -> tuple[int, ...]:
        """Data pointers of the static inputs, for the debug check that they never move."""
        return (self.input_ids.data_ptr(), self.positions.data_ptr(), self.slot_ids.data_ptr())


def pad_rows(
    input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, scratch_slot: int, start: int, stop: int
) -> None:
    """Static input rows [start, stop) read token 0 at position 0 and write only the scratch KV slot."""
    if stop <= start:
        return
    input_ids[start:stop].zero_()
    positions[start:stop].zero_()
    slot_ids[start:stop].fill_(scratch_slot)
class LoraDecodeStep:
    """The decode step with LoRA: the same static inputs as `base` plus its per-row adapter slots
    (`base.lora_slots`, a static input too), so swapping the adapter in a slot needs no recapture.
    The graph cache captures this step for its LoRA family: batches with any adapter row replay these
    graphs, base-only batches keep the base graphs, which run no LoRA kernel."""

    def __init__(self, base: ModelDecodeStep, lora: LoraSlots) -> None:
        self.base, self.lora = base, lora
        self.max_batch = base.max_batch
        self._scratch_slots = torch.zeros(base.max_batch, dtype=torch.long, device=base.device)  # never written

    def set_padding_rows(self, start: int, stop: int) -> None:
        self.base.set_padding_rows(start, stop)
        if stop > start:
            self.base.lora_slots[start:stop].zero_()

    def run(self, batch_size: int) -> torch.Tensor:
        with lora_tokens(self.base.lora_slots[:batch_size], self.lora):
            return self.base.run(batch_size)

    def run_scratch(self, batch_size: int) -> torch.Tensor:
        with lora_tokens(self._scratch_slots[:batch_size], self.lora):
            return self.base.run_scratch(batch_size)

    def input_addresses(self) -> tuple[int, ...]:
        return (*self.base.input_addresses(), self.base.lora_slots.data_ptr())
