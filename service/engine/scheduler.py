"""Admission and batching policy of the continuous-batching engine. Pure logic: no torch, no I/O.

Each step is one forward pass over at most `max_num_batched_tokens` tokens: every running decode
(one token each, never held back), then prompt chunks filling the rest of the budget. A sequence
waits in a FIFO queue until a row (slot) is free and the KV block pool has blocks for its first
chunk, is admitted, has its prompt prefilled in one or more chunks (a prompt longer than the budget
is split over steps, oldest prompt first), then decodes one token per step until the engine calls
finish() or the client aborts. Only the chunk that completes a prompt samples a token (the first
completion token).

KV memory is paged; the KV manager (service/engine/kv_manager.py) holds the books. A sequence holds
blocks for the positions it has scheduled and takes one more whenever a step crosses into a new
block; at admission it starts after the longest cached prefix of its prompt. When a running
sequence needs a block and none is free, the most recently admitted running sequence (a paused one
first) is preempted: it gives its blocks back and waits at the front of the queue to recompute its
KV, prompt and completion so far, then continues; its client sees only latency.

Speculative decoding (a proposer given): a decode whose proposer finds a draft becomes a verify row
of 1 + k tokens (service/engine/spec/), within the token budget and the blocks that are free (a
draft never preempts anyone); rows with a grammar, penalties or an adapter decode without drafts.
k follows the row's measured acceptance and the batch size (spec/adaptive.py). The engine tells
`verified` how many draft tokens the target kept: the rejected positions' KV is dropped by not
counting it (the blocks stay with the row for its next steps). Each step is one
immutable ScheduledStep (service/engine/scheduled_step.py). Not thread-safe: only the engine thread
calls it (the engine forwards aborts to its thread).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time

from service.engine.adapters import AdapterRegistry
from service.engine.block_pool import BlockPool, PoolStats
from service.engine.host_tier import KvCopies
from service.engine.kv_manager import KVManager
from service.engine.scheduled_step import PrefillChunk, ScheduledStep, VerifyRow
from service.engine.sequence import Sequence, SequenceStatus
from service.engine.spec.adaptive import AdaptiveK
from service.engine.spec.proposer import Proposer


class Scheduler:
    def __init__(self, max_running: int, max_num_batched_tokens: int, adapters: AdapterRegistry | None = None,
                 blocks: BlockPool | None = None, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 0, adaptive: AdaptiveK | None = None) -> None:
        """blocks: the KV block pool matching the runner's KV cache (ModelRunner.new_block_pool);
        None: an ample pool (8,192 tokens per row), for runners that hold no KV (tests).
        proposer: drafts of at most num_speculative_tokens tokens for decodes (None: no speculation);
        adaptive: how many each decode is offered per step (None: AdaptiveK's defaults)."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        # Every running sequence may decode in the same step, and decodes are never held back: a
        # smaller budget could not hold them, nor leave room for a prompt beside a full batch.
        if max_num_batched_tokens < max_running:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_running ({max_running})"
            )
        self.max_running = max_running
        self.max_num_batched_tokens = max_num_batched_tokens
        # A sequence with a LoRA adapter is admitted once its adapter has a device slot.
        self.adapters = adapters
        self.kv = KVManager(blocks if blocks is not None else BlockPool(1 + max_running * 512, 16), adapters)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: dict[int, Sequence] = {}  # slot -> sequence
        self._prefilling: list[Sequence] = []  # running, prompt not fully scheduled; admission order
        self._free_slots: list[int] = list(range(max_running))  # a min-heap: lowest slot first
        self._by_key: dict[str, Sequence] = {}  # every waiting or running sequence, by Sequence.key
        self._aborted: list[Sequence] = []
        self._aborted_running: list[Sequence] = []  # released at the next schedule()
        self._waiting_prompt_tokens = 0
        self._num_paused = 0  # running sequences paused for back-pressure
        self._admissions = itertools.count(1)
        self.proposer = proposer if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive or AdaptiveK(max(1, num_speculative_tokens))

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def waiting_prompt_tokens(self) -> int:
        return self._waiting_prompt_tokens

    @property
    def num_preemptions(self) -> int:
        return self.kv.num_preemptions

    def block_stats(self) -> PoolStats:
        """The KV blocks' counts with the preemptions. Any thread may call it (reads)."""
        return self.kv.stats()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (the engine thread, between steps); False while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def has_work(self) -> bool:
        return bool(self._waiting or self._aborted or len(self._running) > self._num_paused)

    # ---- mutations -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.key in self._by_key:
            raise ValueError(f"duplicate sequence key {seq.key!r}")
        if seq.status is not SequenceStatus.WAITING or seq.slot is not None:
            raise ValueError(f"request {seq.request_id!r} is not a fresh waiting sequence")
        if seq.num_prompt_tokens < 1:
            raise ValueError(f"request {seq.request_id!r} has an empty prompt")
        self._waiting.append(seq)
        self._by_key[seq.key] = seq
        self._waiting_prompt_tokens += seq.num_prompt_tokens

    def abort(self, key: str) -> Sequence | None:
        """Mark a request aborted. A waiting one leaves at once; a running one keeps its slot until
        the next schedule(), because the step in flight may still be writing its KV entries."""
        seq = self._by_key.get(key)
        if seq is None or seq.aborted:
            return seq
        seq.aborted = True
        if seq.status is SequenceStatus.WAITING:
            self._leave_waiting(seq)
            self._aborted.append(seq)
        else:
            self._aborted_running.append(seq)
        return seq

    def pause(self, key: str, paused: bool) -> None:
        """A paused sequence keeps its slot but is not decoded until it is resumed."""
        seq = self._by_key.get(key)
        if seq is None or seq.paused == paused:
            return
        seq.paused = paused
        if seq.status is SequenceStatus.RUNNING:
            self._num_paused += 1 if paused else -1

    def take_aborted(self) -> list[Sequence]:
        aborted, self._aborted = self._aborted, []
        return aborted

    def finish(self, seq: Sequence) -> None:
        """The engine read seq's last token. A preempted sequence may finish while it waits (a token
        of the step in flight when it was preempted)."""
        if seq.status is SequenceStatus.WAITING:
            self._leave_waiting(seq)
            return
        assert seq.status is SequenceStatus.RUNNING and seq.slot is not None, seq
        assert self._running.get(seq.slot) is seq, f"slot {seq.slot} is not held by {seq.request_id}"
        self._release(seq)

    def schedule(self) -> ScheduledStep:
        if self._aborted_running:
            for seq in self._aborted_running:
                if seq.status is SequenceStatus.RUNNING:  # not finished since its abort
                    self._release(seq)
                    self._aborted.append(seq)
            self._aborted_running = []

        kv = self.kv
        preempted_before = kv.num_preemptions
        # Slot order keeps rows stable between steps, which keeps copies into static buffers simple.
        # A sequence decodes once its first token exists (seen or in flight) and until max_tokens
        # are sampled; the engine finishes it when it reads the last one. One pass over the running
        # sequences (the step's per-sequence work is the engine thread's largest part at 256 rows).
        running = self._running
        block_size = kv.block_size
        decodes: list[Sequence] = []
        short = []  # decodes whose next position needs a new block
        for slot in sorted(running):
            seq = running[slot]
            pending = seq.num_pending
            done = len(seq.completion_token_ids)
            if ((done or pending) and seq.num_prefilled_tokens >= seq.prefill_len and not seq.paused
                    and done + pending < seq.request.sampling.max_tokens
                    and (seq.matcher is None or not seq.matcher.mask_pending)):  # its grammar mask is late
                decodes.append(seq)
                if seq.next_position() >= len(seq.block_ids) * block_size:
                    short.append(seq)
        # Their blocks, oldest admission first, so that a preemption takes the newest (which has
        # not been given its block yet). Usually none: a block lasts block_size steps.
        for seq in sorted(short, key=lambda s: s.admitted):
            if seq.status is SequenceStatus.RUNNING:
                self._reserve(seq, seq.next_position() + 1)
        if kv.num_preemptions != preempted_before:
            decodes = [s for s in decodes if s.status is SequenceStatus.RUNNING]
        verifies: list[VerifyRow] = []
        budget = self.max_num_batched_tokens - len(decodes)  # >= 1 whenever a prompt is unfinished
        speculative_k = None
        if self.proposer is not None and decodes:
            limit = self.adaptive.step_limit(len(decodes))
            speculative_k = 0
            if limit:
                decodes, verifies, speculative_k = self._speculate(
                    decodes, budget - 1 if self._prefilling or self._waiting else budget, limit)
                budget -= sum(len(v.draft) for v in verifies)
        prefills: list[PrefillChunk] = []

        # Prompts already started go on first, oldest first; FIFO admission after them: a long prompt
        # is not skipped over, it takes what the budget leaves and continues next step. A sequence
        # whose adapter has no free slot is skipped (it keeps its place), so it never blocks those
        # behind it that can run; the skipping is bounded (_may_pass).
        for seq in list(self._prefilling):
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING:  # not preempted by an older one this step
                budget -= self._add_chunk(prefills, seq, budget)
        now = time.monotonic()
        blocked: list[Sequence] = []  # waiting sequences that cannot run now, in arrival order
        # After a preemption this step admits nobody: the blocks just given back would let the preempted
        # one (first in line) in again at once, only to be preempted at its next block.
        while self._waiting and self._free_slots and budget > 0 and kv.num_preemptions == preempted_before:
            seq = self._waiting.popleft()
            if seq.num_pending:  # preempted with a token in flight: admitted once the engine read it
                blocked.append(seq)
                continue
            # A prompt whose first block a prefilling sequence computes now waits a step, with everything
            # behind it (admission stays FIFO), then takes that block from the prefix cache instead of
            # computing it again: the n samples of one prompt, a burst with one system prompt.
            if self._prefilling and kv.computes_first_block(seq, self._prefilling):
                self._waiting.appendleft(seq)
                break
            if not self._may_pass(blocked, seq) or not self._admit_adapter(seq):
                blocked.append(seq)
                continue
            seq.prefill_len = seq.num_tokens  # the prompt; after a preemption the completion so far too
            if not kv.admit(seq, budget, others_running=bool(running)):  # no preemption for a newcomer
                self._release_adapter(seq)
                self._waiting.appendleft(seq)  # FIFO: nothing behind it is admitted before it
                break
            if seq.request.adapter:
                for waiter in blocked:
                    waiter.num_passed += 1
            self._waiting_prompt_tokens -= seq.num_prompt_tokens
            seq.num_prefilled_tokens = seq.num_computed_tokens  # after its cached prefix
            seq.slot = heapq.heappop(self._free_slots)
            seq.status = SequenceStatus.RUNNING
            seq.scheduled_at = seq.scheduled_at or now
            seq.admitted = next(self._admissions)
            self._num_paused += seq.paused  # paused while it waited
            running[seq.slot] = seq
            self._prefilling.append(seq)
            budget -= self._add_chunk(prefills, seq, budget)  # its blocks are free (KVManager.admit)
        self._waiting.extendleft(reversed(blocked))
        self._prefilling = [seq for seq in self._prefilling if seq.num_unprefilled_tokens]
        if kv.num_preemptions != preempted_before:  # one preempted after its chunk or decode was added leaves
            decodes = [s for s in decodes if s.status is SequenceStatus.RUNNING]
            verifies = [v for v in verifies if v.seq.status is SequenceStatus.RUNNING]
            prefills = [c for c in prefills if c.seq.status is SequenceStatus.RUNNING]
        kv.scheduled(decodes, prefills, verifies)
        assert len(self._free_slots) + len(running) == self.max_running
        # A step that runs nothing leaves the copies for the next one (no block they touch is read before).
        copies = kv.take_copies() if decodes or prefills or verifies else KvCopies()
        return ScheduledStep(tuple(decodes), tuple(prefills), kv.take_table_updates(), tuple(verifies), copies,
                             speculative_k)

    def verified(self, seq: Sequence, num_draft_tokens: int, num_accepted: int) -> None:
        """The engine read seq's verify row: the target kept num_accepted of its draft tokens."""
        self.adaptive.observe(seq, num_draft_tokens, num_accepted)
        self.rejected(seq, num_draft_tokens - num_accepted)

    def rejected(self, seq: Sequence, num_rejected: int) -> None:
        """The last num_rejected positions computed for seq hold no token of seq's (a verify row's
        rejected draft tokens; a decode's void token, whose grammar mask was not ready): its KV
        there is dropped (the next steps compute those positions again)."""
        self.kv.roll_back(seq, num_rejected)

    # ---- internals -----------------------------------------------------------------------

    def _speculate(self, decodes: list[Sequence], budget: int, limit: int
                   ) -> tuple[list[Sequence], list[VerifyRow], int]:
        """Split decodes into plain ones and verify rows (those whose proposer found a draft that the
        budget, tokens beyond the decodes' own, and the free blocks hold), both in slot order; no
        draft is longer than limit or than its row's adaptive k. Also the most draft tokens a row was
        offered."""
        assert self.proposer is not None
        plain: list[Sequence] = []
        verifies: list[VerifyRow] = []
        offered = 0
        for seq in decodes:
            p = seq.request.sampling
            draft = None
            if not seq.num_pending and seq.matcher is None and not p.penalized and not seq.request.adapter:
                k = min(self.adaptive.row_k(seq, limit), budget, p.max_tokens - seq.num_completion_tokens - 1)
                if k > 0:
                    offered = max(offered, k)
                    draft = self.proposer.propose(seq, k)[:k]
            start = seq.next_position()
            if draft and self.kv.allocate(seq, start + 1 + len(draft)):
                verifies.append(VerifyRow(seq, start, tuple(draft)))
                budget -= len(draft)
            else:
                plain.append(seq)
        return plain, verifies, offered

    def _add_chunk(self, prefills: list[PrefillChunk], seq: Sequence, budget: int) -> int:
        """Schedule the next chunk of seq's prompt within budget and the blocks it needs; returns its
        token count (0 when seq itself was preempted for blocks)."""
        start = seq.num_prefilled_tokens
        end = min(seq.prefill_len, start + budget)
        if not self._reserve(seq, end):
            return 0
        prefills.append(PrefillChunk(seq, start, end))
        seq.num_prefilled_tokens = end
        return end - start

    def _reserve(self, seq: Sequence, num_positions: int) -> bool:
        """Blocks for seq's positions [0, num_positions), preempting the newest running sequences
        while none is free. False when seq itself was the newest and was preempted."""
        while not self.kv.allocate(seq, num_positions):
            # A paused one first (its client reads nothing: its blocks hold up the others), else the newest.
            victim = max(self._running.values(), key=lambda s: (s.paused, s.admitted))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """seq gives its row and blocks back and waits first in line to recompute its KV."""
        self._release(seq, preempted=True)
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)  # still in _by_key: _release keeps a preempted one there
        self._waiting_prompt_tokens += seq.num_prompt_tokens

    def _may_pass(self, blocked: list[Sequence], seq: Sequence) -> bool:
        """Whether `seq` may be admitted ahead of the blocked sequences before it.

        A base-model sequence always may: it holds no adapter slot, so it never lengthens their wait.
        One with an adapter may until the oldest blocked one has been passed `max_running` times:
        it keeps a slot held that the blocked one may be waiting for, so without the bound a steady
        stream of requests for the resident adapters would starve it.
        """
        return not seq.request.adapter or not blocked or blocked[0].num_passed < self.max_running

    def _admit_adapter(self, seq: Sequence) -> bool:
        name = seq.request.adapter
        if not name:
            return True
        assert self.adapters is not None, "the engine refuses adapter requests without a registry"
        slot = self.adapters.admit(name)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot:
            assert self.adapters is not None
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = 0

    def _leave_waiting(self, seq: Sequence) -> None:
        self._waiting.remove(seq)  # O(n), but aborts are rare next to steps
        self._waiting_prompt_tokens -= seq.num_prompt_tokens
        del self._by_key[seq.key]
        seq.status = SequenceStatus.FINISHED
        if self.proposer is not None:
            self.proposer.finished(seq)

    def _release(self, seq: Sequence, preempted: bool = False) -> None:
        assert seq.slot is not None
        self._release_adapter(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if preempted:
            self.kv.preempt(seq)
        else:
            self.kv.free(seq)
        del self._running[seq.slot]
        self._num_paused -= seq.paused
        heapq.heappush(self._free_slots, seq.slot)
        if not preempted:
            del self._by_key[seq.key]
            if self.proposer is not None:
                self.proposer.finished(seq)
        seq.slot = None
        seq.status = SequenceStatus.FINISHED

    def check(self) -> None:
        """The slot bookkeeping's invariants, and the KV manager's (tests; kept off the step path)."""
        assert len(self._free_slots) + len(self._running) == self.max_running
        assert not set(self._free_slots) & set(self._running), "a slot is both free and used"
        assert len(set(self._free_slots)) == len(self._free_slots), "a slot is free twice"
        assert all(seq.slot == slot for slot, seq in self._running.items())
        assert all(self._running.get(seq.slot) is seq for seq in self._prefilling)
        assert self._num_paused == sum(seq.paused for seq in self._running.values())
        self.kv.check(self._running.values())
