"""The host tier under the prefix cache: where cached blocks go when the device pool reuses them.

Pure bookkeeping (no torch), like the block pool that drives it. The tier has `num_slots` host
blocks (service/model/host_kv.py owns their memory). When the pool evicts a full, hashed block,
`offload` gives it a host slot (the least recently used entry makes room) and records the copy
device block -> host slot; when a prompt's prefix misses the device pool, `has` finds the next
blocks here, `pin` keeps each while the pool allocates its device block, and `load` records the
copy host slot -> that block. A loaded block
keeps its host copy (a later eviction from the device then costs no copy).

Copies are not made here: the scheduled step carries them (`take_copies`) and the runner runs them
before its forward, every copy out before every copy in (a device block evicted and reused within
one step is read before it is overwritten). An entry a pending copy reads is pinned until the
copies are taken: no offload in the meantime reuses its slot.

With an event log (kv_events.py), a block stored here is a BlockStored on "CPU" (its tokens,
parent and adapter, which `remember` kept while it was cached), one evicted from here a
BlockRemoved on "CPU", as vLLM's offloading connector reports its CPU medium.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from service.engine.kv_events import HOST, BlockStored, KvEventLog

# A cached block as its BlockStored names it: (parent hash or None, its tokens, its adapter)
BlockInfo = tuple[bytes | None, tuple[int, ...], str]


@dataclass(frozen=True)
class KvCopies:
    """A step's copies between the device pool and the host tier, run before its forward."""

    to_host: tuple[tuple[int, int], ...] = ()  # (device block, host slot), first
    to_device: tuple[tuple[int, int], ...] = ()  # (host slot, device block), after

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device)


@dataclass(frozen=True)
class HostTierStats:
    num_slots: int
    bytes_per_block: int
    cached: int  # blocks held now
    stored: int  # blocks copied in since start
    hits: int  # blocks copied back to the device instead of computed
    evictions: int  # blocks dropped to make room

    @property
    def bytes_used(self) -> int:
        return self.cached * self.bytes_per_block


class HostTier:
    def __init__(self, num_slots: int, block_size: int, bytes_per_block: int = 0) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[bytes] = set()
        self._info: dict[bytes, BlockInfo] = {}  # events only: device-cached and host blocks
        self.on_device: Callable[[bytes], bool] = lambda digest: False  # the pool's: cached there now
        self._to_host: list[tuple[int, int]] = []
        self._to_device: list[tuple[int, int]] = []
        self.events: KvEventLog | None = None
        self.num_stored = 0
        self.num_hits = 0
        self.num_evictions = 0

    def stats(self) -> HostTierStats:
        return HostTierStats(self.num_slots, self.bytes_per_block, len(self._slots), self.num_stored, self.num_hits,
                             self.num_evictions)

    def has(self, digest: bytes) -> bool:
        return digest in self._slots

    def remember(self, digest: bytes, info: BlockInfo) -> None:
        """What a BlockStored on this tier says of a block the device pool cached (events only)."""
        self._info[digest] = info

    def info(self, digest: bytes) -> BlockInfo | None:
        return self._info.get(digest)

    def offload(self, block: int, digest: bytes) -> None:
        """The device pool evicts `block`, cached under `digest`: keep a copy here, if room can be made."""
        if digest in self._slots:  # loaded from here earlier: the copy is still here
            self._slots.move_to_end(digest)
            return
        if not self._free and not self._evict_one():
            self._info.pop(digest, None)  # every entry is read by a pending copy: not kept
            return
        slot = self._free.pop()
        self._slots[digest] = slot
        self._to_host.append((block, slot))
        self.num_stored += 1
        if self.events is not None:
            parent, tokens, adapter = self._info.get(digest, (None, (), ""))
            self.events.stored(BlockStored((digest,), parent, tokens, self.block_size, adapter, HOST))

    def pin(self, digest: bytes) -> None:
        """Keep the entry of `digest` until the copies are taken (it is about to be loaded)."""
        self._slots.move_to_end(digest)
        self._pinned.add(digest)

    def load(self, digest: bytes, block: int) -> None:
        """Copy the (pinned) entry of `digest` to the device's `block`, newly allocated, before the next step."""
        assert digest in self._pinned, "a block loaded without being pinned first"
        self._to_device.append((self._slots[digest], block))
        self.num_hits += 1

    def take_copies(self) -> KvCopies:
        """The copies recorded since the last call (the step that carries them runs them)."""
        copies = KvCopies(tuple(self._to_host), tuple(self._to_device))
        self._to_host.clear()
        self._to_device.clear()
        self._pinned.clear()
        return copies

    def clear(self) -> None:
        """Forget every entry (the prefix cache is reset; the caller records AllBlocksCleared)."""
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._info.clear()
        self._to_host.clear()
        self._to_device.clear()
        self._pinned.clear()

    def cached_hashes(self) -> set[bytes]:
        return set(self._slots)

    def check(self) -> None:
        """Invariants (tests): each slot either free or one entry's."""
        used = list(self._slots.values())
        assert len(set(used)) == len(used) and not set(used) & set(self._free)
        assert len(used) + len(self._free) == self.num_slots
        assert self._pinned <= set(self._slots)

    def _evict_one(self) -> bool:
        for digest in self._slots:  # least recently used first
            if digest not in self._pinned:
                self._free.append(self._slots.pop(digest))
                if not self.on_device(digest):
                    self._info.pop(digest, None)
                self.num_evictions += 1
                if self.events is not None:
                    self.events.removed(digest, HOST)
                return True
        return False
