"""Admission and batching policy of the continuous-batching engine. Pure logic: no torch, no I/O.

Each step is one forward pass over at most `max_num_batched_tokens` tokens: every running decode
(one token each, never held back), then prompt chunks filling the rest of the budget. A sequence
waits in a FIFO queue until a KV slot is free, is admitted, has its prompt prefilled in one or more
chunks (a prompt longer than the budget is split over steps, oldest prompt first), then decodes one
token per step until the engine calls finish() or the client aborts. Only the chunk that completes a
prompt samples a token (the first completion token). Not thread-safe: only the engine thread calls
it (the engine forwards aborts to its thread).
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field

from service.engine.adapters import AdapterRegistry
from service.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, end) of one sequence, prefilled in this step."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_prompt(self) -> bool:
        """The chunk holds the prompt's last token: the step samples the first completion token."""
        return self.end == self.seq.num_prompt_tokens

    def token_ids(self) -> list[int]:
        return self.seq.request.prompt_token_ids[self.start : self.end]


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # running, with >= 1 completion token
    prefills: list[PrefillChunk] = field(default_factory=list)  # prompt chunks, oldest prompt first

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the runner's order: decodes, then the
        sequences whose prompt this step completes."""
        return self.decodes + [c.seq for c in self.prefills if c.completes_prompt]


class Scheduler:
    def __init__(self, max_running: int, max_num_batched_tokens: int, adapters: AdapterRegistry | None = None) -> None:
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
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: dict[int, Sequence] = {}  # slot -> sequence
        self._prefilling: list[Sequence] = []  # running, prompt not fully scheduled; admission order
        self._free_slots: list[int] = list(range(max_running))  # a min-heap: lowest slot first
        self._by_key: dict[str, Sequence] = {}  # every waiting or running sequence, by Sequence.key
        self._aborted: list[Sequence] = []
        self._waiting_prompt_tokens = 0
        self._num_paused = 0  # running sequences paused for back-pressure

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
            self._waiting.remove(seq)  # O(n), but aborts are rare next to steps
            self._waiting_prompt_tokens -= seq.num_prompt_tokens
            del self._by_key[key]
            seq.status = SequenceStatus.FINISHED
            self._aborted.append(seq)
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
        assert seq.status is SequenceStatus.RUNNING and seq.slot is not None, seq
        assert self._running.get(seq.slot) is seq, f"slot {seq.slot} is not held by {seq.request_id}"
        self._release(seq)
        self._check()

    def schedule(self) -> ScheduledBatch:
        for seq in [s for s in self._running.values() if s.aborted]:
            self._release(seq)
            self._aborted.append(seq)

        batch = ScheduledBatch()
        # Slot order keeps rows stable between steps, which keeps copies into static buffers simple.
        # A sequence decodes once its first token exists (seen or in flight) and until max_tokens
        # are sampled; the engine finishes it when it reads the last one.
        batch.decodes = [seq for slot in sorted(self._running) if _decodes(seq := self._running[slot])]
        budget = self.max_num_batched_tokens - len(batch.decodes)  # >= 1 whenever a prompt is unfinished

        # Prompts already started go on first, oldest first; FIFO admission after them: a long prompt
        # is not skipped over, it takes what the budget leaves and continues next step. A sequence
        # whose adapter has no free slot is skipped (it keeps its place), so it never blocks those
        # behind it that can run; the skipping is bounded (_may_pass).
        for seq in self._prefilling:
            if budget == 0:
                break
            budget -= self._add_chunk(batch, seq, budget)
        now = time.monotonic()
        blocked: list[Sequence] = []  # waiting sequences that cannot run now, in arrival order
        while self._waiting and self._free_slots and budget > 0:
            seq = self._waiting.popleft()
            if not self._may_pass(blocked, seq) or not self._admit_adapter(seq):
                blocked.append(seq)
                continue
            if seq.request.adapter:
                for waiter in blocked:
                    waiter.num_passed += 1
            self._waiting_prompt_tokens -= seq.num_prompt_tokens
            seq.slot = heapq.heappop(self._free_slots)
            seq.status = SequenceStatus.RUNNING
            seq.scheduled_at = now
            self._num_paused += seq.paused  # paused while it waited
            self._running[seq.slot] = seq
            self._prefilling.append(seq)
            budget -= self._add_chunk(batch, seq, budget)
        self._waiting.extendleft(reversed(blocked))
        self._prefilling = [seq for seq in self._prefilling if seq.num_unprefilled_tokens]
        self._check()
        return batch

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _add_chunk(batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Schedule the next chunk of seq's prompt within budget; returns its token count."""
        start = seq.num_prefilled_tokens
        end = min(seq.num_prompt_tokens, start + budget)
        batch.prefills.append(PrefillChunk(seq, start, end))
        seq.num_prefilled_tokens = end
        return end - start

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

    def _release(self, seq: Sequence) -> None:
        assert seq.slot is not None
        if seq.lora_slot:
            assert self.adapters is not None
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = 0
        if seq.num_unprefilled_tokens:
            self._prefilling.remove(seq)
        del self._running[seq.slot]
        self._num_paused -= seq.paused
        heapq.heappush(self._free_slots, seq.slot)
        del self._by_key[seq.key]
        seq.slot = None
        seq.status = SequenceStatus.FINISHED

    def _check(self) -> None:
        assert len(self._free_slots) + len(self._running) == self.max_running
        assert not set(self._free_slots) & set(self._running), "a slot is both free and used"
        assert len(set(self._free_slots)) == len(self._free_slots), "a slot is free twice"
        assert all(seq.slot == slot for slot, seq in self._running.items())
        assert all(self._running.get(seq.slot) is seq for seq in self._prefilling)
        assert self._num_paused == sum(seq.paused for seq in self._running.values())


def _decodes(seq: Sequence) -> bool:
    return bool(seq.completion_token_ids or seq.num_pending) and not seq.exhausted and not seq.paused
