"""KV cache events: what enters and leaves the prefix cache, as vLLM publishes it
(vllm/distributed/kv_events.py: BlockStored, BlockRemoved, AllBlocksCleared).

A router that routes by cache contents (smg's KV-event policy) rebuilds each replica's set of
cached block hashes from these: `BlockStored` when full blocks are registered in the prefix cache
(one event per run of consecutive blocks of one sequence, with the hash of the block before the
run, their tokens and the adapter they were computed under), `BlockRemoved` when the pool reuses
a cached free block (evicted), `AllBlocksCleared` when the prefix cache is reset. Hashes are the
pool's chained digests (block_pool.block_hash); the wire carries their first 8 bytes. Each event
names its medium as vLLM does: "GPU" for the device pool, "CPU" for the host tier under it
(host_tier.py), so a block the pool evicts into the host tier is removed from "GPU" and stored on
"CPU", and one brought back is stored on "GPU" again (its host copy stays).

Pure bookkeeping (no torch): the block pool and the KV manager write a `KvEventLog` on the engine
thread; the engine takes it once per step and ships it with the step's events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEVICE, HOST = "GPU", "CPU"  # vLLM's media: the device pool, the host tier (host_tier.py)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None  # None: the first block of a sequence
    token_ids: tuple[int, ...]  # block_size tokens per block, in order
    block_size: int
    lora_name: str = ""  # the adapter the blocks were computed under ("": the base model)
    medium: str = DEVICE  # where they are stored: the device pool, or HOST (the host tier)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One engine step's KV events, in the order they happened."""

    events: tuple[KvEvent, ...]


class KvEventLog:
    """The events since the last `take`. Engine thread only."""

    def __init__(self) -> None:
        self._events: list[KvEvent] = []
        self._removed: list[bytes] = []  # evictions not yet closed into one BlockRemoved
        self._removed_from = DEVICE  # their medium

    def stored(self, event: BlockStored) -> None:
        self._close_removed()
        self._events.append(event)

    def removed(self, digest: bytes, medium: str = DEVICE) -> None:
        if medium != self._removed_from:
            self._close_removed()
            self._removed_from = medium
        self._removed.append(digest)

    def cleared(self) -> None:
        self._removed.clear()
        self._events = [AllBlocksCleared()]  # what came before no longer matters to anyone replaying

    def take(self) -> KvEventBatch | None:
        self._close_removed()
        if not self._events:
            return None
        events, self._events = self._events, []
        return KvEventBatch(tuple(events))

    def _close_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed), self._removed_from))
            self._removed = []


def to_wire(batch: KvEventBatch) -> tuple[tuple, ...]:
    """A batch as plain tuples, for the engine process's pipe: they pickle several times faster
    than the dataclasses, and the engine thread pays for the pickling."""
    out = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(("s", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_name, e.medium))
        elif isinstance(e, BlockRemoved):
            out.append(("r", e.block_hashes, e.medium))
        else:
            out.append(("c",))
    return tuple(out)


def from_wire(events: tuple[tuple, ...]) -> KvEventBatch:
    """The batch `to_wire` made."""
    return KvEventBatch(tuple(BlockStored(*e[1:]) if e[0] == "s" else BlockRemoved(*e[1:]) if e[0] == "r"
                              else AllBlocksCleared() for e in events))


def replay(events: Iterable[KvEvent], cached: set[bytes], medium: str = DEVICE) -> set[bytes]:
    """Apply the events of one medium to a set of cached block hashes (what a subscriber keeps of
    that medium); returns it."""
    for event in events:
        if isinstance(event, BlockStored):
            if event.medium == medium:
                cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            if event.medium == medium:
                cached.difference_update(event.block_hashes)
        else:
            cached.clear()
    return cached
