"""The model runner: the only code that touches the device.

It owns the KV cache, the static decode inputs and the graph cache, and turns a list of sequences
into one sampled token each, with one host sync per call (the token ids coming back to the CPU).
"""

from __future__ import annotations

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
        # Sampled tokens come back through one pinned buffer; waiting on an event (which releases
        # the GIL) instead of a blocking copy lets the event loop run while the GPU works.
        on_cuda = self.device.type == "cuda"
        self._host_tokens = torch.zeros(2 * max_running, dtype=torch.long, pin_memory=on_cuda)
        self._tokens_ready = torch.cuda.Event() if on_cuda else None

    @torch.inference_mode()
    def warmup(self) -> None:
        """One eager prefill and decode on the scratch slot, outside the graph cache (no stats)."""
        scratch = self.kv.scratch_slot
        bos = self.loaded.spec.bos_token_id or 0
        self.loaded.model.prefill(torch.tensor([bos], device=self.device), scratch, self.kv)
        self.decode_step.write_rows([bos], [1], [scratch])
        self.decode_step.run(1).argmax(dim=-1).tolist()

    @torch.inference_mode()
    def step(self, decodes: list[Sequence], prefills: list[Sequence]) -> list[int]:
        """One engine step: decode the running batch, prefill the admitted prompts. Returns one token
        per sequence (decodes first), with the step's single host sync."""
        sampled = []
        if decodes:
            sampled.append(self.decode(decodes))
        if prefills:
            sampled.append(self.prefill(prefills))
        if not sampled:
            return []
        tokens = torch.cat(sampled)
        if self._tokens_ready is None:
            return tokens.tolist()
        host = self._host_tokens[: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        self._tokens_ready.record()
        self._tokens_ready.synchronize()  # the step's one host sync
        return host.tolist()

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
        self.decode_step.write_rows(
            [s.last_token_id() for s in seqs], [s.next_position() for s in seqs], [s.slot for s in seqs]
        )
        logits = self.graphs.run(len(seqs))
        return self._sample(logits, seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        batch = SamplingBatch.build([(s.request.sampling, s.num_completion_tokens) for s in seqs], self.device)
        return sample(logits, batch)
