"""The model runner: one device's step, the only code that touches the device.

It owns the paged KV cache (and its block table, which each step's updates from the KV manager
edit in place), the persistent input batch (service/engine/input_batch.py), the static decode
inputs and the graph cache, and turns a scheduled step (service/engine/scheduled_step.py: decodes
and prompt chunks; speculative verify rows, which run as chunks whose every row is sampled) into one
forward pass and the sampled tokens (one per sampling sequence, 1 + k per verify row). The graph
cache's dispatcher decides how the step runs: a uniform-decode step (every row one decode token)
replays a full decode graph; a step with any prompt chunk runs the forward split at attention
(service.model.pieces), replayed from piecewise graphs; a step with adapter rows replays the LoRA
graphs of the same cache. With tensor parallelism every rank runs the same `forward`, and
the runner's role (service/engine/roles.py) is what differs: the leader (rank 0) plans the step's
graphs and sends the step to the other ranks, a follower replays what the leader planned.
`launch` queues a step without waiting; `collect` is the step's one host sync (the token ids
coming back to the CPU). The engine launches step t+1 before it collects step t, so the host's
work on step t overlaps the device's work on step t+1.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache_manager import EngineHooks, Fingerprint, GraphBackend, GraphCache, GraphCacheConfig, GraphFamily, RankOrder
from cache_manager.sizes import FULL, PIECEWISE
from service.engine.block_pool import BlockPool
from service.engine.decode_step import LoraDecodeStep, ModelDecodeStep, fed_back
from service.engine.host_tier import HostTier
from service.engine.input_batch import InputBatch, slot_of
from service.engine.mask_fill import MaskFiller
from service.engine.piecewise_step import LoraPiecewiseStep, PiecewiseStep
from service.engine.rank_memory import RankMemory
from service.engine.ranks import Ranks
from service.engine.request import MAX_LOGPROBS, StepTokens, TokenLogprobs
from service.engine.roles import Follower, OneDevice, TensorParallelLeader
from service.engine.sampler import (
    Sampled,
    SampleRow,
    SamplingBatch,
    TokenHistory,
    sample,
    token_logprobs,
    unpack_logprobs,
)
from service.engine.scheduled_step import ScheduledStep
from service.engine.sequence import Sequence
from service.engine.step_channel import StepInputs
from service.model.device_copy import to_device
from service.model.host_kv import HostKV
from service.model.kernels.sampling import warm_up as warm_sampling_kernels
from service.model.kv_cache import KVCache
from service.model.loader import LoadedModel
from service.model.lora import LoraSlots
from service.model.pieces import PiecewiseForward
from service.model.step_batch import ChunkSpec, StepBatch, build_step_batch

_LOGPROB_SLICE = 256  # prompt rows per LM-head call for prompt logprobs: [256, V] float32 logits at a time


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_running: int, max_seq_len: int, graph_config: GraphCacheConfig,
                 graph_backend: GraphBackend | None = None, max_loras: int = 0, max_lora_rank: int = 16,
                 lora_kernel: str = "stacked", block_size: int = 16, num_blocks: int | None = None,
                 masks: MaskFiller | None = None, ranks: Ranks | None = None, hooks: EngineHooks | None = None,
                 host_cache_bytes: int = 0) -> None:
        """graph_backend: None for the CUDA one on a GPU (tests give a fake one to run graphs' logic on a CPU).
        max_loras > 0: adapter slots (service.model.lora), and LoRA graph families for steps with adapter rows.
        num_blocks: KV blocks of block_size tokens (the null block included; kv_sizing.py sizes it);
        None: enough for every row at max_seq_len.
        masks: fills the grammar masks of constrained rows (None: no constrained request is served).
        ranks: tensor parallelism, rank 0 of N > 1: the other ranks, which every step (and its graph
        operations) goes to. hooks: the graph cache's line to the engine that will drive it.
        host_cache_bytes > 0: a host tier of that many bytes under the prefix cache (host_kv.py)."""
        self.loaded = loaded
        self.device = loaded.device
        self.tp = loaded.model.tp
        # The model's spec: with tensor parallelism, this rank's share of the KV heads.
        # Every rank's cache holds its KV heads in the loaded KV dtype, read with the checkpoint's
        # per-layer scales (the same on every rank) when it has them.
        self.kv = KVCache(loaded.model.spec, max_running, max_seq_len, loaded.device, loaded.dtype, block_size,
                          num_blocks or KVCache.contiguous_blocks(max_running, max_seq_len, block_size),
                          cache_dtype=loaded.kv_cache_dtype)
        if loaded.kv_scales is not None:
            self.kv.set_scales(loaded.kv_scales)
        assert not (host_cache_bytes and ranks is not None), "the host tier is not served with tensor parallelism"
        self.kv_block_bytes = KVCache.bytes_per_block(loaded.model.spec, block_size, self.kv.cache_dtype)
        host_slots = host_cache_bytes // self.kv_block_bytes
        self.host_kv = HostKV(self.kv, host_slots) if host_slots else None
        self.decode_step = ModelDecodeStep(loaded.model, self.kv, max_running, loaded.device)
        self.pieces = PiecewiseForward(loaded.model, self.kv)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        fingerprint = Fingerprint(
            # Other kernels, other graph sizes: the batch-invariant mode keeps its own statistics.
            model=loaded.name + ("+batch-invariant" if loaded.model.batch_invariant else ""),
            dtype=stats_dtype(loaded),
            device_name=device_name,
            torch_version=torch.__version__,
            capture_sizes=graph_config.sizes,
            max_batch=max_running,
        )
        # Any step with a prompt chunk (and every step in mode piecewise) runs as pieces split at
        # attention; the graph cache replays them per token-count bucket when the mode has PIECEWISE.
        self.piecewise_step = (
            PiecewiseStep(self.pieces, self.kv, graph_config.max_tokens, self.device) if graph_config.max_tokens else None
        )
        steps = {GraphFamily(FULL): self.decode_step}
        if self.piecewise_step is not None:
            steps[GraphFamily(PIECEWISE)] = self.piecewise_step
        # Adapters: fixed slot buffers, and LoRA families of graphs over the LoRA steps in the same
        # cache, so that base-only batches keep graphs without LoRA kernels (see LoraDecodeStep).
        self.lora: LoraSlots | None = None
        lora_fingerprint = None
        if max_loras > 0:
            assert ranks is None, "adapters are not served with tensor parallelism"
            self.lora = LoraSlots(loaded.model, max_loras, max_lora_rank, lora_kernel)
            self.pieces.lora = self.lora
            self.lora_step = LoraDecodeStep(self.decode_step, self.lora)
            steps[GraphFamily(FULL, lora=True)] = self.lora_step
            if self.piecewise_step is not None:
                steps[GraphFamily(PIECEWISE, lora=True)] = LoraPiecewiseStep(self.piecewise_step, self.lora)
            # What the LoRA graphs' own stats file (`<stats>.lora`) was keyed by before they joined this cache.
            lora_fingerprint = dataclasses.replace(fingerprint, model=f"{loaded.name}+lora:{max_loras}x{max_lora_rank}")
        hooks = hooks if hooks is not None else EngineHooks()
        leader = TensorParallelLeader(ranks, self.tp) if ranks is not None else None
        self.role: OneDevice = leader or OneDevice()  # or follow()
        # Rank 0 of N > 1: captures run between steps, in an order the other ranks hear of (roles.py).
        order = None if leader is None else RankOrder(leader.publish_ops, hooks.busy)
        self.graphs = GraphCache(steps, graph_config, self.device, fingerprint, graph_backend, hooks=hooks, order=order,
                                 lora_fingerprint=lora_fingerprint)
        # Sampled tokens come back through pinned buffers; waiting on an event (which releases the
        # GIL) instead of a blocking copy lets other threads run while the GPU works.
        on_cuda = self.device.type == "cuda"
        self._host_tokens = torch.zeros((2, 2 * max_running), dtype=torch.long, pin_memory=on_cuda)
        self._eos_ids = tuple(loaded.spec.eos_token_ids)
        # The penalties' token counts, made at the first request with a penalty (KV slots + scratch rows).
        self._history: TokenHistory | None = None
        self._history_rows = self.kv.scratch_slot + 1
        # Structured outputs: the constrained rows' masks, filled on the host per step (made at the
        # first constrained request); the rows whose fill failed, for the engine to end.
        self.masks = masks
        self._bitmask: torch.Tensor | None = None
        self._failed_constraints: list[tuple[Sequence, str]] = []
        self._sat_out: list[Sequence] = []
        self._tokens_ready = (torch.cuda.Event(), torch.cuda.Event()) if on_cuda else None
        self._turn = 0
        # The latest launch's sampled tokens (on device), which the next one's pending rows feed back,
        # and the persistent batch that builds each launch's inputs (it keeps that launch's rows).
        self._previous_tokens = torch.zeros(0, dtype=torch.long)
        self.input_batch = InputBatch(adapters=self.lora is not None)

    def new_block_pool(self, prefix_caching: bool = True) -> BlockPool:
        """The scheduler's block pool over this runner's KV cache (and its host tier, if any)."""
        host = None
        if self.host_kv is not None:
            host = HostTier(self.host_kv.num_slots, self.kv.block_size, self.kv_block_bytes)
        return BlockPool(self.kv.num_blocks, self.kv.block_size, prefix_caching, host)

    @property
    def ranks(self) -> Ranks | None:
        """The other tensor-parallel ranks (the leader's), else None."""
        return self.role.ranks

    def follow(self) -> Follower:
        """Ranks > 0: hold the graphs rank 0's cache captures and releases; decide nothing."""
        self.role = Follower(self.graphs)
        return self.role

    def rank_memory(self) -> list[RankMemory]:
        """Tensor parallelism (rank 0): every rank's graph memory, rank 0 first; empty on one rank.
        Safe off the engine thread (a device memory query and store reads)."""
        return self.role.rank_memory(self.graphs, self.device)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One eager step with a prompt chunk and one decode on the scratch slot, outside the graph
        cache (no stats); the sampling kernels compiled."""
        scratch = self.kv.scratch_slot
        bos = self.loaded.spec.bos_token_id or 0
        self.pieces.forward(build_step_batch(
            [], [], [ChunkSpec(scratch, 0, 1)], [bos], self.kv.max_seq_len, scratch, self.device
        ))
        self.decode_step.write_rows([bos], [1], [scratch])
        self.decode_step.run(1).argmax(dim=-1).tolist()
        if self.lora is not None:  # the LoRA products once, on slot 0 (all zero)
            self.lora_step.run_scratch(1).argmax(dim=-1).tolist()
        warm_sampling_kernels(self.loaded.spec.vocab_size, self.device)  # not at the first grammar's step
        # Everything alive now (model, caches, modules) lives as long as the process: keep it out of
        # every collection, so a collection while serving or capturing walks only what requests made.
        gc.collect()
        gc.freeze()

    @torch.inference_mode()
    def step(self, step: ScheduledStep) -> list[int]:
        """One engine step, launched and read back at once. Returns one token per sampling sequence
        (decodes, then the sequences whose prompt a chunk completes)."""
        return self.collect(self.launch(step)).token_ids

    @torch.inference_mode()
    def launch(self, step: ScheduledStep, before_sampling: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue one engine step on the device without waiting for it: one forward pass over the
        running decodes and the prompt chunks, then the sampling. A decode whose input token is still
        pending (sampled by the previous launch, not yet read by the host) takes it from that launch's
        device tokens. before_sampling runs between the two, while the device computes the forward
        pass (the engine reads the previous step there when grammar masks need its tokens)."""
        assert not step.empty, "an empty step"
        try:
            tokens, logprobs, prompt = self.mixed(step, before_sampling)
            self.role.sampled(tokens)
        except Exception as exc:
            self.input_batch.reset()  # its rows were not launched
            error = self.role.explain(exc)
            if error is exc:
                raise
            raise error from exc
        self._previous_tokens = tokens
        logprob_ks = [s.request.sampling.logprobs for s in sampled_rows(step)[0]] if logprobs is not None else None
        if self._tokens_ready is None:
            return LaunchedStep(tokens, None, None, logprobs, logprob_ks, prompt)
        # Two pinned buffers and events in turn: the host reads launch t while launch t+1 is queued.
        self._turn ^= 1
        if tokens.shape[0] > self._host_tokens.shape[1]:  # verify rows: 1 + k tokens each (a launch in
            # flight keeps its view of the old buffer alive)
            self._host_tokens = torch.zeros((2, 2 * tokens.shape[0]), dtype=torch.long, pin_memory=True)
        host = self._host_tokens[self._turn, : tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:  # rare enough for a pinned buffer of its own per step
            logprobs = _to_pinned(logprobs)
        if prompt is not None:
            prompt = dataclasses.replace(prompt, packed=_to_pinned(prompt.packed))
        ready = self._tokens_ready[self._turn]
        ready.record()
        return LaunchedStep(tokens, host, ready, logprobs, logprob_ks, prompt)

    def collect(self, launched: LaunchedStep) -> StepTokens:
        """The launched step's tokens (and log-probabilities) on the host: the step's one host sync."""
        if launched.ready is None:
            ids = launched.tokens.tolist()
        else:
            launched.ready.synchronize()  # releases the GIL while the device works
            ids = launched.host.tolist()
        logprobs = None
        if launched.logprobs is not None:
            ks = launched.logprob_ks
            rows = iter(unpack_logprobs(launched.logprobs.tolist(), [k for k in ks if k is not None]))
            logprobs = [None if k is None else next(rows) for k in ks]
        return StepTokens(ids, logprobs, () if launched.prompt is None else launched.prompt.unpack())

    def mixed(self, step: ScheduledStep, before_sampling: Callable[[], None] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, PromptLogprobs | None]:
        """The step's decodes and prompt chunks (or decodes alone) in one forward pass (one host->device
        copy of its rows); returns a token for each of step.sampling (on device), the packed
        log-probabilities of those that asked for them (sampler.Sampled), and the prompt logprobs the
        chunks computed."""
        inputs = self.input_batch.build(step)
        sampling, offsets = sampled_rows(step)
        prompt = None
        if inputs.logprob_targets is not None:
            prompt = PromptLogprobs([(c.seq.key, c.start, spec.logprob_rows, c.seq.request.sampling.prompt_logprobs)
                                     for c, spec in zip(step.prefills, inputs.chunks[len(step.verifies):])
                                     if spec.logprob_rows])
        if step.kv_copies:
            self.host_kv.run(step.kv_copies.to_host, step.kv_copies.to_device)
        logits, packed = self.forward(inputs, self._previous_tokens)
        if prompt is not None:
            prompt.packed = packed
        # Before before_sampling: reading the step in flight may finish some of these sequences
        # (their slots then go back), whose rows still sample here (the token is surplus).
        rows = None if all(s.request.sampling.plain_greedy for s in sampling) else self._sample_rows(sampling, offsets)
        if before_sampling is not None:
            before_sampling()
        if not sampling:  # every chunk leaves part of its prompt for a later step
            return torch.zeros(0, dtype=torch.long, device=self.device), None, prompt
        sampled = self._sample(logits, sampling, rows, len(step.decodes))
        return sampled.tokens, sampled.logprobs, prompt

    def forward(self, inputs: StepInputs, previous_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward pass -> float32 logits of its sampling rows, and the packed prompt logprobs
        of the chunks' ChunkSpec.logprob_rows (rank 0; None when none are asked). The graph cache's
        dispatcher plans it: FULL (the decode step's inputs, replayed or eager), PIECEWISE (the
        pieces' inputs, replayed or eager), or an eager forward outside the cache; steps with
        adapter rows get the LoRA family of each. Every tensor-parallel rank runs this for the same
        inputs (the role plans the graphs)."""
        for slot, first, blocks in inputs.table_updates:
            self.kv.set_blocks(slot, first, blocks)
        self.kv.sync_table()
        plan = self.role.plan(self.graphs, inputs)
        # A uniform verify step gets a FULL family of its own once a verify step (multi-query
        # decode attention) is registered in the cache; until then it runs as pieces, like a prefill.
        assert plan.requested is None or plan.requested.query_tokens == 1, "no FULL verify step registered"
        if plan.kind is FULL:
            self.decode_step.write_rows(inputs.token_ids, inputs.positions, inputs.slots, inputs.pending_rows,
                                        previous_tokens, lora_slots=inputs.lora_slots)
            return self.role.replay(self.graphs, plan), None
        batch = build_step_batch(
            inputs.positions,
            inputs.slots,
            inputs.chunks,
            inputs.token_ids,
            self.kv.max_seq_len,
            self.kv.scratch_slot,
            self.device,
            pending_rows=inputs.pending_rows,
            lora_slots=inputs.lora_slots,
        )
        if batch.pending_rows is not None:
            d = len(inputs.positions)
            batch.input_ids[:d] = fed_back(batch.input_ids[:d], batch.pending_rows, previous_tokens)
        if plan.kind is PIECEWISE:
            self.graphs.steps[plan.requested.family].write(batch)  # the LoRA pieces' with adapter rows
            hidden = self.role.replay(self.graphs, plan)  # or eager above the largest
        else:
            hidden = self.pieces.hidden(batch)
        logits = self.loaded.model.logits(hidden[batch.sample_rows])
        return logits, self._prompt_logprobs(hidden, batch, inputs)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the rows asked for prompt logprobs, a slice at a time (a 2,048-token chunk's
        whole [rows, V] would take GBs); every tensor-parallel rank computes them (the LM head's
        gather is collective), rank 0 alone reduces them to packed log-probabilities."""
        if batch.logprob_rows is None:
            return None
        n = sum(c.logprob_rows for c in inputs.chunks)
        targets = None if inputs.logprob_targets is None else to_device(
            torch.tensor(inputs.logprob_targets, dtype=torch.long), self.device)
        packed = []
        for start in range(0, n, _LOGPROB_SLICE):
            rows = batch.logprob_rows[start: start + _LOGPROB_SLICE]
            logits = self.loaded.model.logits(hidden[rows])
            if targets is not None:
                packed.append(token_logprobs(logits, targets[start: start + _LOGPROB_SLICE], MAX_LOGPROBS))
        return torch.cat(packed) if packed else None

    def _sample_rows(self, seqs: tuple[Sequence, ...], offsets: tuple[int, ...] | None = None) -> list[SampleRow]:
        """offsets: per row, how many tokens after the sequence's next one it samples (a verify row's
        j-th row samples the token after its j-th draft token); None: all 0."""
        rows = []
        for i, seq in enumerate(seqs):
            request = seq.request
            # The index of the token sampled now (a seeded row draws as it would without speculation).
            counter = seq.num_completion_tokens + seq.num_pending + (offsets[i] if offsets else 0)
            banned = ()
            p = request.sampling
            if counter < p.min_tokens:
                banned = p.stop_token_ids + (() if p.ignore_eos else self._eos_ids)
            if request.sampling.penalized:
                self._track_history(seq)
            rows.append(SampleRow(request.sampling, counter, slot_of(seq), banned))
        return rows

    def _sample(self, logits: torch.Tensor, seqs: tuple[Sequence, ...], rows: list[SampleRow] | None,
                num_decodes: int) -> Sampled:
        """rows None: every row is plain greedy (SamplingBatch.greedy). The first num_decodes rows are
        decodes (ScheduledStep.sampling's order)."""
        batch = SamplingBatch.greedy() if rows is None else SamplingBatch.build(rows, self.device)
        constrained = [b for b, seq in enumerate(seqs) if seq.matcher is not None]
        if constrained:
            batch.bitmask = self._masks(seqs, constrained, num_decodes)
        return sample(logits, batch, self._history)

    def _masks(self, seqs: tuple[Sequence, ...], constrained: list[int],
               num_decodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The constrained rows and their grammar masks (copied to the device without a wait: the
        engine reads the step in flight before it samples a step with constrained rows, so every
        earlier step, and the copy from this buffer it made, is complete when it is refilled). A row
        whose mask failed allows every token and is reported by take_failed_constraints; a decode
        whose mask was not ready in time sits the step out (take_sat_out): its token is void."""
        from service.engine.structured import allocate_bitmask

        assert self.masks is not None, "a constrained request on a runner without a mask filler"
        if self._bitmask is None:
            self._bitmask = allocate_bitmask(self._host_tokens.shape[1], self.loaded.spec.vocab_size,
                                             pin=self.device.type == "cuda")
        masks = self._bitmask[: len(constrained)]
        failed, sat_out = self.masks.fill([seqs[b].matcher for b in constrained], masks,
                                          [b < num_decodes for b in constrained])
        self._failed_constraints += [(seqs[constrained[i]], why) for i, why in failed.items()]
        for i in sat_out:
            seq = seqs[constrained[i]]
            self._sat_out.append(seq)
            if self._history is not None and seq.request.sampling.penalized:
                self._history.forget(slot_of(seq))  # its void token is counted there
        return to_device(torch.tensor(constrained, dtype=torch.int64), self.device), masks

    def take_sat_out(self) -> list[Sequence]:
        """The decodes whose grammar mask was not ready in the launches since the last call: their
        tokens are void, and each computes the same position again at its next step."""
        sat_out, self._sat_out = self._sat_out, []
        return sat_out

    def take_failed_constraints(self) -> list[tuple[Sequence, str]]:
        """The sequences whose grammar mask failed in the launches since the last call, and why."""
        failed, self._failed_constraints = self._failed_constraints, []
        return failed

    def _track_history(self, seq: Sequence) -> None:
        """Make the sequence's history row describe it (once per admission: a new slot, or the same
        slot after a preemption, starts again from what the host knows, which is everything then)."""
        if self._history is None:
            self._history = TokenHistory(self._history_rows, self.loaded.spec.vocab_size, self.device)
        owner = (seq.key, seq.admitted)
        slot = slot_of(seq)
        if self._history.owner[slot] != owner:
            assert not seq.num_pending, "a sequence's first sampling after admission has no token in flight"
            self._history.reset(slot, owner, seq.request.prompt_token_ids, seq.completion_token_ids)


def sampled_rows(step: ScheduledStep) -> tuple[tuple[Sequence, ...], tuple[int, ...] | None]:
    """The sequence of each sampled row of the step (a verify row's once per token) and, with verify
    rows, each row's offset in its row (None without)."""
    if not step.verifies:
        return step.sampling, None
    seqs: list[Sequence] = []
    offsets: list[int] = []
    widths = {v.seq: v.num_tokens for v in step.verifies}
    for seq in step.sampling:
        n = widths.get(seq, 1)
        seqs += [seq] * n
        offsets += range(n)
    return tuple(seqs), tuple(offsets)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens, and where and when they reach the host."""

    tokens: torch.Tensor  # [n] int64 on the device
    host: torch.Tensor | None  # pinned [n], filled when `ready` completes (None on CPU)
    ready: torch.cuda.Event | None
    logprobs: torch.Tensor | None = None  # packed (sampler.Sampled), pinned on CUDA
    logprob_ks: list[int | None] | None = None  # per sampling row: its top-k count, None for none
    prompt: PromptLogprobs | None = None


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs: per chunk that asked, (sequence key, first position, rows, top k),
    and their packed rows (sampler.token_logprobs, MAX_LOGPROBS wide), pinned on CUDA."""

    chunks: list[tuple[str, int, int, int]]
    packed: torch.Tensor | None = None

    def unpack(self) -> tuple[tuple[str, int, list[TokenLogprobs]], ...]:
        assert self.packed is not None
        rows = self.packed.tolist()
        out, at = [], 0
        for key, start, n, k in self.chunks:
            out.append((key, start, unpack_logprobs(rows[at: at + n], [k] * n)))
            at += n
        return tuple(out)


def stats_dtype(loaded: LoadedModel) -> str:
    """The fingerprint's dtype: the model's, and what its weights and KV cache store when that differs
    (FP8 weights or KV make other graphs, of other sizes: their statistics are kept apart). A
    plain run's stays the model's dtype alone, so the stats files written before still match."""
    name = str(loaded.dtype).removeprefix("torch.")
    if loaded.model.fp8:
        name += "+fp8-weights"
    if loaded.kv_cache_dtype != loaded.dtype:
        name += "+kv-" + str(loaded.kv_cache_dtype).removeprefix("torch.")
    return name
