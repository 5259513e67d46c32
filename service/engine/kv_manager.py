"""The KV manager: the blocks each sequence holds, their prefix hashes, what a preemption gives back.

Pure bookkeeping (no torch), like the scheduler that asks it. It owns the block pool
(service/engine/block_pool.py: free blocks, holds, the prefix cache) and is the one writer of a
sequence's KV state: its blocks (`block_ids`, positions [0, len * block_size)), the chained hashes
of its full blocks and how many of them it registered, the positions scheduled so far
(`num_computed_tokens`), what its first admission found cached, and its preemptions. The scheduler
decides who runs and who is preempted; this class finds, allocates and frees the blocks.

Prefix caching: at admission the longest cached prefix of a sequence's tokens (full blocks, never
the last token: its logits give the next token) is taken instead of computed; a full block is
registered once the steps launched so far compute it and its tokens are known, and stays findable
after its holder frees it until the pool reuses it (LRU).

Every allocation also records which block-table entries it changed: the scheduled step carries
them (`take_table_updates`) to the runner, which writes them into its persistent table in place,
so nothing compares a sequence's blocks with its table row per step.

KV events (kv_events.py), once `publish_events` started the log: each run of a sequence's blocks
registered together is one BlockStored (its tokens, the hash before it, its adapter), the pool
records evictions and resets; `take_events` hands them over once per step. Not thread-safe: the engine
thread alone calls it (`stats` aside, which only reads).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Iterable
from typing import Protocol

from service.engine.block_pool import NULL_BLOCK, ROOT, BlockPool, PoolStats, chain_hashes
from service.engine.host_tier import KvCopies
from service.engine.kv_events import BlockStored, KvEventBatch, KvEventLog
from service.engine.scheduled_step import PrefillChunk, TableUpdate, VerifyRow
from service.engine.sequence import Sequence


class AdapterKeys(Protocol):
    def cache_key(self, name: str) -> str:
        """The prefix-cache key of adapter `name`: a new one when other weights are loaded under it."""
        ...


class KVManager:
    def __init__(self, pool: BlockPool, adapters: AdapterKeys | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.adapters = adapters  # blocks computed under an adapter are cached under its key
        self.num_preemptions = 0
        self._holders: dict[Sequence, None] = {}  # admitted and not freed since, in admission order
        self._unwritten: dict[Sequence, int] = {}  # holder -> its first block-table entry not written yet

    # ---- queries ---------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """The pool's counts with the preemptions. Any thread may call it (reads)."""
        return dataclasses.replace(self.pool.stats(), preemptions=self.num_preemptions)

    def publish_events(self) -> None:
        """Record KV events from now on (`take_events` must then be called, once per step)."""
        if self.pool.events is None:
            self.pool.events = KvEventLog()

    def take_events(self) -> KvEventBatch | None:
        """The KV events since the last call (None: none, or not recording)."""
        return None if self.pool.events is None else self.pool.events.take()

    def take_copies(self) -> KvCopies:
        """The copies between the device pool and its host tier that the next step runs first."""
        return self.pool.take_copies()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (between steps); False while sequences hold blocks."""
        return self.pool.reset_prefix_cache()

    def adapter_key(self, seq: Sequence) -> str:
        """What the hashes of seq's blocks include besides their tokens (its adapter's cache key)."""
        name = seq.request.adapter
        return self.adapters.cache_key(name) if name and self.adapters is not None else name or ""

    def computes_first_block(self, seq: Sequence, prefilling: Iterable[Sequence]) -> bool:
        """Whether a prefilling sequence computes seq's first full block now (its KV not in the
        prefix cache yet): seq would take it from the cache a step later instead of computing it."""
        if not self.pool.prefix_caching or seq.num_tokens <= self.block_size or seq.needs_prompt_logits:
            return False
        self._extend_hashes(seq, self.block_size)
        first = seq.block_hashes[:1]
        return any(p.num_registered_blocks == 0 and p.block_hashes[:1] == first for p in prefilling)

    # ---- a sequence's blocks ---------------------------------------------------------------

    def admit(self, seq: Sequence, budget: int, others_running: bool) -> bool:
        """Take the cached prefix of seq's first seq.prefill_len tokens and check that the blocks of
        its first chunk (at most `budget` tokens after the prefix) are free: a newcomer preempts
        nobody. On success seq holds the cached blocks and its computed positions end after them
        (its prefill starts there); else it holds nothing."""
        bs = self.block_size
        self._extend_hashes(seq, seq.prefill_len)
        # At least the last token is computed: it gives the logits the next token is sampled from.
        cached = [] if seq.needs_prompt_logits else self.pool.lookup(seq.block_hashes, (seq.prefill_len - 1) // bs)
        start = len(cached) * bs
        end = min(seq.prefill_len, start + budget)
        # A newcomer leaves a few blocks free for the running ones' next decodes (1% of the pool), or
        # it would be preempted as soon as one of them crosses into a new block.
        watermark = -(-self.pool.num_blocks // 100) if others_running else 0
        if -(-end // bs) - len(cached) + watermark > self.pool.num_free:
            self.pool.free(cached)
            return False
        if not seq.num_preemptions:
            self.pool.count_query(seq.prefill_len, start)
            seq.num_cached_tokens = start
        seq.block_ids = cached
        seq.num_registered_blocks = len(cached)
        seq.num_computed_tokens = start
        self._holders[seq] = None
        self._unwritten[seq] = 0  # a new table row (its slot may have held another sequence)
        return True

    def allocate(self, seq: Sequence, num_positions: int) -> bool:
        """Blocks for seq's positions [0, num_positions); False, with nothing taken, when too few are free."""
        have = len(seq.block_ids)
        need = -(-num_positions // self.block_size) - have
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        seq.block_ids += got
        self._unwritten.setdefault(seq, have)
        return True

    def scheduled(self, decodes: Iterable[Sequence], chunks: Iterable[PrefillChunk],
                  verifies: Iterable[VerifyRow] = ()) -> None:
        """A step computes each decode's next position and each chunk's tokens: their computed
        positions advance, and the full blocks whose tokens are known go to the prefix cache (a
        decode completes one every block_size steps: the cheap test first). A verify row computes
        its draft's positions too, but only known tokens' blocks are registered (a draft's tokens
        are not known until the target accepts them; roll_back then drops the rejected ones)."""
        bs = self.block_size
        caching = self.pool.prefix_caching
        for seq in decodes:
            seq.num_computed_tokens = computed = seq.next_position() + 1
            if caching and computed // bs > seq.num_registered_blocks:
                self._register_full_blocks(seq)
        for chunk in chunks:
            chunk.seq.num_computed_tokens = chunk.end
            self._register_full_blocks(chunk.seq)
        for row in verifies:
            row.seq.num_computed_tokens = row.start + row.num_tokens
            self._register_full_blocks(row.seq)

    def roll_back(self, seq: Sequence, num_positions: int) -> None:
        """seq's last num_positions computed positions hold rejected draft tokens: they no longer
        count as computed (the next steps overwrite them; the blocks stay held, no copy)."""
        assert 0 <= num_positions <= seq.num_computed_tokens, (seq.request_id, num_positions)
        seq.num_computed_tokens -= num_positions

    def take_table_updates(self) -> tuple[TableUpdate, ...]:
        """The block-table entries that admissions and allocations changed since the last call, per
        sequence that holds them: (its slot, first entry, blocks)."""
        if not self._unwritten:
            return ()
        updates = []
        for seq, first in self._unwritten.items():
            assert seq.slot is not None, f"{seq.request_id} holds blocks but no row"
            if len(seq.block_ids) > first:
                updates.append((seq.slot, first, tuple(seq.block_ids[first:])))
        self._unwritten.clear()
        return tuple(updates)

    def free(self, seq: Sequence) -> None:
        """seq gives its blocks back. Its full blocks stay findable in the prefix cache once free (a
        preempted sequence's own recompute hits them while they last)."""
        self._register_full_blocks(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        del self._holders[seq]
        self._unwritten.pop(seq, None)

    def preempt(self, seq: Sequence) -> None:
        """seq gives its blocks back to recompute its KV later (the scheduler chose it)."""
        self.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    # ---- internals -------------------------------------------------------------------------

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """seq.block_hashes cover the full blocks of its first num_tokens known tokens."""
        full = num_tokens // self.block_size
        have = len(seq.block_hashes)
        if self.pool.prefix_caching and have < full:
            seq.block_hashes += chain_hashes(seq.token_ids(0, full * self.block_size), self.block_size,
                                             self.adapter_key(seq), seq.block_hashes[-1] if have else ROOT, have)

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose KV launched steps compute and whose tokens are known."""
        if not self.pool.prefix_caching:
            return
        full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_ids))
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, full * self.block_size)
        first = seq.num_registered_blocks
        registered = [self.pool.register(seq.block_ids[i], seq.block_hashes[i]) for i in range(first, full)]
        seq.num_registered_blocks = full
        if self.pool.events is not None:
            self._record_stored(seq, first, registered)

    def _record_stored(self, seq: Sequence, first: int, registered: list[bool]) -> None:
        """One BlockStored per run of blocks (from block `first` on) that entered the cache."""
        bs = self.block_size
        hashes = seq.block_hashes
        lora = seq.request.adapter or ""
        start = None
        for i, entered in enumerate([*registered, False], first):
            if entered and start is None:
                start = i
            elif not entered and start is not None:
                self.pool.stored(BlockStored(tuple(hashes[start:i]), hashes[start - 1] if start else None,
                                             _tokens(seq, start * bs, i * bs), bs, lora))
                start = None

    def check(self, running: Collection[Sequence]) -> None:
        """Invariants (tests; O(blocks)): the pool's; the running sequences are the holders, each
        holding blocks for its computed positions, each block once, never the null block; every
        block's refs count its holders."""
        self.pool.check()
        assert set(self._holders) == set(running), "a running sequence holds no blocks, or one holds them after it left"
        held: collections.Counter[int] = collections.Counter()
        for seq in self._holders:
            blocks = seq.block_ids
            assert len(set(blocks)) == len(blocks) and NULL_BLOCK not in blocks, (seq.request_id, blocks)
            assert seq.num_computed_tokens <= len(blocks) * self.block_size, seq.request_id
            assert seq.num_registered_blocks <= len(blocks), seq.request_id
            held.update(blocks)
        for block in range(1, self.pool.num_blocks + 1):
            assert self.pool.refs(block) == held[block], f"block {block}: refs {self.pool.refs(block)}, held {held[block]}"


def _tokens(seq: Sequence, start: int, end: int) -> tuple[int, ...]:
    """seq's tokens [start, end) without copying its whole prompt and completion (a decode's block
    lies in its completion)."""
    prompt, n = seq.request.prompt_token_ids, seq.num_prompt_tokens
    if end <= n:
        return tuple(prompt[start:end])
    if start >= n:
        return tuple(seq.completion_token_ids[start - n:end - n])
    return tuple(prompt[start:]) + tuple(seq.completion_token_ids[:end - n])
