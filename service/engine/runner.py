"""The model runner: the only code that touches the device.

It owns the KV cache, the static decode inputs and the graph cache, and turns a list of sequences
into one sampled token each. `launch` queues a step without waiting; `collect` is the step's one
host sync (the token ids coming back to the CPU). The engine launches step t+1 before it collects
step t, so the host's work on step t overlaps the device's work on step t+1.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from cache_manager import Fingerprint, GraphCache, GraphCacheConfig
from service.engine.decode_step import ModelDecodeStep
from service.engine.sampler import SamplingBatch, sample
from service.engine.sequence import Sequence
from service.model.kv_cache import KVCache
from service.model.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_running: int, max_seq_len: int, graph_config: GraphCacheConfig) -> None:
        self.loaded = loaded
        self.device = loaded.device
        self.kv = KVCache(loaded.spec, max_running, max_seq_len, loaded.device, loaded.dtype)
        self.decode_step = ModelDecodeStep(loaded.model, self.kv, max_running, loaded.device)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        fingerprint = Fingerprint(
            model=loaded.name,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device_name=device_name,
            torch_version=torch.__version__,
            capture_sizes=graph_config.sizes,
            max_batch=max_running,
        )
        self.graphs = GraphCache(self.decode_step, graph_config, self.device, fingerprint)
        # Sampled tokens come back through pinned buffers; waiting on an event (which releases the
        # GIL) instead of a blocking copy lets other threads run while the GPU works.
        on_cuda = self.device.type == "cuda"
        self._host_tokens = torch.zeros((2, 2 * max_running), dtype=torch.long, pin_memory=on_cuda)
        self._tokens_ready = (torch.cuda.Event(), torch.cuda.Event()) if on_cuda else None
        self._turn = 0
        # The latest launch: each sequence's row in it and its sampled tokens (on device).
        self._previous: tuple[dict[str, int], torch.Tensor] = ({}, torch.zeros(0, dtype=torch.long))

    @torch.inference_mode()
    def warmup(self) -> None:
        """One eager prefill and decode on the scratch slot, outside the graph cache (no stats)."""
        scratch = self.kv.scratch_slot
        bos = self.loaded.spec.bos_token_id or 0
        self.loaded.model.prefill(torch.tensor([bos], device=self.device), scratch, self.kv)
        self.decode_step.write_rows([bos], [1], [scratch])
        self.decode_step.run(1).argmax(dim=-1).tolist()
        # Everything alive now (model, caches, modules) lives as long as the process: keep it out of
        # every collection, so a collection while serving or capturing walks only what requests made.
        gc.collect()
        gc.freeze()

    @torch.inference_mode()
    def step(self, decodes: list[Sequence], prefills: list[Sequence]) -> list[int]:
        """One engine step, launched and read back at once. Returns one token per sequence (decodes
        first)."""
        return self.collect(self.launch(decodes, prefills))

    @torch.inference_mode()
    def launch(self, decodes: list[Sequence], prefills: list[Sequence]) -> LaunchedStep:
        """Queue one engine step on the device without waiting for it: decode the running batch,
        prefill the admitted prompts. A decode whose input token is still pending (sampled by the
        previous launch, not yet read by the host) takes it from that launch's device tokens."""
        seqs = decodes + prefills
        assert seqs, "an empty step"
        sampled = []
        if decodes:
            sampled.append(self.decode(decodes))
        if prefills:
            sampled.append(self.prefill(prefills))
        tokens = sampled[0] if len(sampled) == 1 else torch.cat(sampled)
        self._previous = {seq.key: row for row, seq in enumerate(seqs)}, tokens
        if self._tokens_ready is None:
            return LaunchedStep(tokens, None, None)
        # Two pinned buffers and events in turn: the host reads launch t while launch t+1 is queued.
        self._turn ^= 1
        host = self._host_tokens[self._turn, : tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        ready = self._tokens_ready[self._turn]
        ready.record()
        return LaunchedStep(tokens, host, ready)

    def collect(self, launched: LaunchedStep) -> list[int]:
        """The launched step's tokens on the host: the step's one host sync."""
        if launched.ready is None:
            return launched.tokens.tolist()
        launched.ready.synchronize()  # releases the GIL while the device works
        return launched.host.tolist()

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """All admitted prompts in one packed forward pass (one host->device copy of their token ids);
        returns the first completion token of each (on device). The scheduler caps the packed length."""
        prompts = [seq.request.prompt_token_ids for seq in seqs]
        slots = [seq.slot for seq in seqs]
        assert all(slot is not None for slot in slots)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, pin_memory=self.device.type == "cuda")
        logits = self.loaded.model.prefill_packed(
            ids.to(self.device, non_blocking=True), [len(p) for p in prompts], slots, self.kv
        )
        return self._sample(logits, seqs)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode step for the running batch, through the graph cache; tokens on device."""
        rows, previous_tokens = self._previous
        # Pending input tokens come from the previous launch's row on the device, the others from the host.
        pending_rows = [rows[s.key] if s.num_pending else -1 for s in seqs]
        self.decode_step.write_rows(
            [0 if s.num_pending else s.last_token_id() for s in seqs],
            [s.next_position() for s in seqs],
            [s.slot for s in seqs],
            pending_rows,
            previous_tokens,
        )
        logits = self.graphs.run(len(seqs))
        return self._sample(logits, seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # The counter is the index of the token being sampled, pending ones included.
        params = [(s.request.sampling, s.num_completion_tokens + s.num_pending) for s in seqs]
        return sample(logits, SamplingBatch.build(params, self.device))


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens, and where and when they reach the host."""

    tokens: torch.Tensor  # [n] int64 on the device
    host: torch.Tensor | None  # pinned [n], filled when `ready` completes (None on CPU)
    ready: torch.cuda.Event | None
