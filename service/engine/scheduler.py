"""Admission and batching policy of the continuous-batching engine. Pure logic: no torch, no I/O.

A sequence waits in a FIFO queue until a KV slot is free, is admitted (prefill) within a per-step
prompt-token budget, then decodes one token per step until the engine calls finish() or the client
aborts. Not thread-safe: only the engine thread calls it (the engine forwards aborts to its thread).
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field

from service.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[Sequence] = field(default_factory=list)  # admitted this step: run the prompt
    decodes: list[Sequence] = field(default_factory=list)  # running, with >= 1 completion token

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, max_running: int, max_prefill_tokens: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: dict[int, Sequence] = {}  # slot -> sequence
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

        budget_used = 0
        now = time.monotonic()
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            # Strict FIFO: a long prompt is not skipped over, and it is admitted alone when it
            # exceeds the whole budget, so it never starves.
            if batch.prefills and budget_used + seq.num_prompt_tokens > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            self._waiting_prompt_tokens -= seq.num_prompt_tokens
            seq.slot = heapq.heappop(self._free_slots)
            seq.status = SequenceStatus.RUNNING
            seq.scheduled_at = now
            self._num_paused += seq.paused  # paused while it waited
            self._running[seq.slot] = seq
            budget_used += seq.num_prompt_tokens
            batch.prefills.append(seq)
        self._check()
        return batch

    # ---- internals -----------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        assert seq.slot is not None
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
        assert self._num_paused == sum(seq.paused for seq in self._running.values())


def _decodes(seq: Sequence) -> bool:
    return bool(seq.completion_token_ids or seq.num_pending) and not seq.exhausted and not seq.paused
