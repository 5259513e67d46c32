"""The KV block pool: which blocks are free, who holds each, and the prefix cache over full blocks.

Pure bookkeeping (no torch), like the scheduler that drives it. Block 0 is the null block
(service/model/kv_cache.py) and is never handed out. A block is held by one or more sequences
(`refs`); one whose count drops to 0 goes to the back of the free queue. With prefix caching, a
full block is registered under the chained hash of (its parent's hash, its tokens, its adapter):
a later prompt that starts with the same blocks takes them (`lookup`) instead of computing them
again. A registered block keeps its hash while free and can be hit until `allocate` reuses it,
which takes the front of the free queue: the least recently freed block, so cached blocks are
evicted LRU and only when free.

With a host tier (host_tier.py), an evicted cached block is copied there instead of lost, and a
lookup that misses the pool goes on in the host tier: each block found there is allocated here,
registered, and copied back before the next step (`take_copies`) instead of computed again.

With an event log (`events`, set where KV events are published: kv_events.py), each eviction and reset
is recorded there; the KV manager records the stores, which know their tokens (`stored`).

Hashes are blake2b digests over the parent digest, the adapter key and the token ids, so a hit
means the same tokens after the same prefix under the same adapter (a collision is as unlikely as
blake2b-128's), and the chain makes a block's hash depend on everything before it.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from service.engine.host_tier import HostTier, HostTierStats, KvCopies
from service.engine.kv_events import BlockStored, KvEventLog

NULL_BLOCK = 0
ROOT = b""  # the parent hash of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int], adapter: str = "") -> bytes:
    """The chained hash of one full block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(adapter.encode() + b"\0")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, adapter: str = "", parent: bytes = ROOT,
                 first: int = 0) -> list[bytes]:
    """Hashes of the full blocks of tokens[first * block_size:] (those before are hashed as `parent`)."""
    out = []
    for start in range(first * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start: start + block_size], adapter)
        out.append(parent)
    return out


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int  # usable blocks (the null block excluded)
    block_size: int
    used: int  # held by at least one sequence
    free: int  # held by none (cached ones included: they are reused when needed)
    cached: int  # registered under a hash (held or free)
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    prefix_caching: bool = True
    preemptions: int = 0  # the scheduler's count (running requests that gave their blocks back)
    host: HostTierStats | None = None  # the host tier under the prefix cache, when there is one

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 host: HostTier | None = None) -> None:
        """num_blocks counts the null block (the KV cache's first dimension). host: a host tier that
        keeps evicted cached blocks (prefix caching only)."""
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (the null block and one), got {num_blocks}")
        self.num_blocks = num_blocks - 1
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._events: KvEventLog | None = None  # evictions and resets, for KV event subscribers
        self.host = host if prefix_caching else None
        if self.host is not None:
            self.host.on_device = self._by_hash.__contains__

    @property
    def events(self) -> KvEventLog | None:
        return self._events

    @events.setter
    def events(self, log: KvEventLog | None) -> None:
        self._events = log
        if self.host is not None:
            self.host.events = log

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.block_size, self.num_blocks - len(self._free), len(self._free),
                         len(self._hash_of), self.prefix_queries, self.prefix_hits, self.prefix_caching,
                         host=None if self.host is None else self.host.stats())

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, each held once; None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            digest = self._hash_of.pop(block, None)
            if digest is not None:  # evicted from the prefix cache (into the host tier, if any)
                del self._by_hash[digest]
                if self._events is not None:
                    self._events.removed(digest)
                if self.host is not None:
                    self.host.offload(block, digest)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each block. The last blocks of a sequence go to the free queue first, so a
        shared prefix outlives the sequence's own tail."""
        for block in reversed(blocks):
            assert self._refs[block] > 0, f"block {block} freed more often than held"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (at most max_blocks), each now held once
        more: a block the device pool has, else one the host tier has, copied back into a new block."""
        hit: list[int] = []
        loaded: list[bytes] = []  # the digests copied back, for one BlockStored
        for digest in hashes[:max_blocks] if self.prefix_caching else ():
            block = self._by_hash.get(digest)
            if block is None:
                block = self._load(digest)
                if block is None:
                    break
                loaded.append(digest)
            elif self._refs[block] == 0:
                del self._free[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
            hit.append(block)
        if loaded and self._events is not None:
            infos = [self.host.info(d) or (None, (), "") for d in loaded]
            self._events.stored(BlockStored(tuple(loaded), infos[0][0], sum((i[1] for i in infos), ()),
                                            self.block_size, infos[0][2]))
        return hit

    def _load(self, digest: bytes) -> int | None:
        """A new block (held once, registered) for the host tier's copy of `digest`, which the next step
        copies back; None when the host tier lacks it or no block is free."""
        if self.host is None or not self.host.has(digest) or not self._free:
            return None
        self.host.pin(digest)  # the allocation may evict a block into the host tier: not this one
        block = self.allocate(1)[0]
        self.host.load(digest, block)
        self._by_hash[digest] = block
        self._hash_of[block] = digest
        return block

    def stored(self, event: BlockStored) -> None:
        """Blocks entered the prefix cache (the KV manager knows their tokens): the event, and what the
        host tier's BlockStored will say of each should it take them."""
        self._events.stored(event)
        if self.host is not None:
            bs = self.block_size
            for i, digest in enumerate(event.block_hashes):
                parent = event.block_hashes[i - 1] if i else event.parent_block_hash
                self.host.remember(digest, (parent, event.token_ids[i * bs:(i + 1) * bs], event.lora_name))

    def take_copies(self) -> KvCopies:
        """The copies between the device pool and the host tier since the last call (for the next step)."""
        return self.host.take_copies() if self.host is not None else KvCopies()

    def count_query(self, tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += tokens
        self.prefix_hits += hit_tokens

    def register(self, block: int, digest: bytes) -> bool:
        """A held, full block's hash: later prompts with the same prefix may take it. The first block
        registered under a hash keeps it (an identical block computed meanwhile stays private).
        Returns whether the hash entered the cache now."""
        if not self.prefix_caching or digest in self._by_hash or block in self._hash_of:
            return False
        assert self._refs[block] > 0, f"block {block} registered while free"
        self._by_hash[digest] = block
        self._hash_of[block] = digest
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held, as vLLM refuses, so
        that a running sequence never holds a block the cache no longer knows."""
        if len(self._free) != self.num_blocks:
            return False
        self._by_hash.clear()
        self._hash_of.clear()
        if self.host is not None:
            self.host.clear()
        if self._events is not None:
            self._events.cleared()
        return True

    def cached_hashes(self) -> set[bytes]:
        """The hashes in the prefix cache now (what KV event subscribers should hold; tests)."""
        return set(self._by_hash)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """Invariants (tests): no block both free and held, counts never negative, hashes both ways."""
        assert NULL_BLOCK not in self._free and self._refs[NULL_BLOCK] == 0
        for block in range(1, self.num_blocks + 1):
            assert self._refs[block] >= 0
            assert (self._refs[block] == 0) == (block in self._free), f"block {block}: refs {self._refs[block]}"
        assert all(self._by_hash[d] == b for b, d in self._hash_of.items())
        assert len(self._by_hash) == len(self._hash_of)
        if self.host is not None:
            self.host.check()
