"""The host tier's memory: KV blocks kept in host memory below the device's paged KV cache.

One tensor [num_slots, 2, num_layers, KVH, block_size, D] in the cache's dtype (a slot holds one
block's keys and values of every layer, contiguous), pinned on CUDA. An FP8 cache's scales are per
layer and fixed at start (kv_quant.py), so a block's bytes are all there is to copy. Which block
goes to which slot is the host tier's business (service/engine/host_tier.py); `run` makes a step's
copies: every copy out first, then every copy in.

CUDA: the copies go on a side stream that waits for the work queued so far (the step before
wrote those blocks), and the step's stream waits for them with an event; the host never waits.
CPU: plain indexed copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.model.kv_cache import KVCache

Copies = Sequence[tuple[int, int]]  # (from, to) pairs: (device block, host slot) out, (host slot, device block) in


class HostKV:
    def __init__(self, kv: KVCache, num_slots: int) -> None:
        self.kv = kv
        self.num_slots = num_slots
        on_cuda = kv.device.type == "cuda"
        shape = (num_slots, 2, len(kv.k), *kv.k[0].shape[1:])
        self.blocks = torch.zeros(shape, dtype=kv.cache_dtype, pin_memory=on_cuda)
        self._stream = torch.cuda.Stream(kv.device) if on_cuda else None
        self._done = torch.cuda.Event() if on_cuda else None

    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def run(self, to_host: Copies = (), to_device: Copies = ()) -> None:
        """A step's copies, before its forward: every (device block, host slot) of to_host, then every
        (host slot, device block) of to_device (queued on CUDA; done on return on the CPU)."""
        if not to_host and not to_device:
            return
        if self._stream is None:
            self._copy(to_host, to_device)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self._stream):
            self._copy(to_host, to_device)
            self._done.record(self._stream)
        torch.cuda.current_stream(self.kv.device).wait_event(self._done)

    def _copy(self, to_host: Copies, to_device: Copies) -> None:
        kv, device = self.kv, self.kv.device
        if to_host:
            blocks = torch.tensor([b for b, _ in to_host], device=device)
            # [n, 2, L, KVH, bs, D]: gathered on the device, then one contiguous copy per block
            out = torch.stack([torch.stack([k.index_select(0, blocks) for k in kv.k], 1),
                               torch.stack([v.index_select(0, blocks) for v in kv.v], 1)], 1)
            if device.type == "cuda":
                for i, (_, slot) in enumerate(to_host):
                    self.blocks[slot].copy_(out[i], non_blocking=True)
            else:
                self.blocks[[s for _, s in to_host]] = out
        if to_device:
            blocks = torch.tensor([b for _, b in to_device], device=device)
            if device.type == "cuda":
                back = torch.empty((len(blocks), *self.blocks.shape[1:]), dtype=self.blocks.dtype, device=device)
                for i, (slot, _) in enumerate(to_device):
                    back[i].copy_(self.blocks[slot], non_blocking=True)
            else:
                back = self.blocks[[s for s, _ in to_device]]
            for layer, (k, v) in enumerate(zip(kv.k, kv.v, strict=True)):
                k.index_copy_(0, blocks, back[:, 0, layer])
                v.index_copy_(0, blocks, back[:, 1, layer])
