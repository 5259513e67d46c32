"""The gRPC process's side of KV events: numbers each engine step's batch, keeps a bounded history
for subscribers that resume, a mirror of the cached blocks for those that cannot, and one bounded
queue per subscriber.

The engine never waits for anyone: its batches reach `publish` on the event loop with the step's
other events (engine_process.py), and `publish` only appends. A subscriber whose queue holds
`buffer` live batches it has not taken (its client reads too slowly) is dropped: its stream ends and it
resubscribes from the last sequence number it applied.

Sequence numbers grow by one per batch from the hub's start time in microseconds since the epoch,
so a later life of the server numbers above an earlier one. `subscribe(start)` serves:
- start in the history: the batches from `start` on (smg's subscriber skips the one it applied);
- start 0 ("from the current state"), older than the history (it fell too far behind, or saw an
  earlier life of this server), or newer than the last batch: a snapshot of the cached blocks, as the protocol's relay
  snapshot: chunks numbered consecutively up to the last batch, the first opening with
  AllBlocksCleared, then a BlockStored per run of blocks stored together, in the order stored
  (parents before children). Live batches follow with no gap and no duplicate.
Protobuf-free: the vLLM servicer turns `KvBatch`es into messages (once each, `wire`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from service.engine.kv_events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

SNAPSHOT_CHUNK_BLOCKS = 2048  # blocks per snapshot chunk: about 150 KB with 16-token blocks


@dataclass(frozen=True)
class Snapshot:
    index: int
    count: int
    blocks: int  # in the whole snapshot


@dataclass
class KvBatch:
    sequence_number: int
    timestamp: float
    events: tuple[KvEvent, ...]
    snapshot: Snapshot | None = None
    wire: Any = field(default=None, compare=False)  # its message, made once for every subscriber


class Subscription:
    """One subscriber's queue. `next` waits for a batch; None: the subscription was dropped."""

    def __init__(self, hub: KvEventHub, first: list[KvBatch]) -> None:
        self._hub = hub
        self._queue: collections.deque[KvBatch] = collections.deque(first)
        self._limit = hub.buffer + len(first)  # its replay, then `buffer` live batches untaken at most
        self._ready = asyncio.Event()
        self.snapshot = bool(first) and first[0].snapshot is not None  # it starts with one, not a replay
        self.dropped = False  # it fell behind
        self.ended = False  # the server is shutting down

    @property
    def pending(self) -> int:
        return len(self._queue)

    def offer(self, batch: KvBatch) -> bool:
        """Queue a live batch; False (and dropped) when the subscriber has too many untaken."""
        if len(self._queue) >= self._limit:
            self.dropped = True
            self._ready.set()
            return False
        self._queue.append(batch)
        self._ready.set()
        return True

    async def next(self) -> KvBatch | None:
        """The next batch; None once dropped or ended."""
        while not self._queue and not (self.dropped or self.ended):
            self._ready.clear()
            await self._ready.wait()
        if self.dropped or self.ended:
            return None
        return self._queue.popleft()

    def end(self) -> None:
        self.ended = True
        self._ready.set()

    def close(self) -> None:
        self._hub.subscribers.discard(self)


class KvEventHub:
    def __init__(self, history: int = 4096, buffer: int = 1024) -> None:
        self.history: collections.deque[KvBatch] = collections.deque(maxlen=history)
        self.buffer = buffer
        self.last_sequence = time.time_ns() // 1000  # the first batch is numbered one above
        self.subscribers: set[Subscription] = set()
        self.num_dropped = 0
        # (medium, hash) -> (the BlockStored that stored it, its index there), in the order stored
        self._cached: dict[tuple[str, bytes], tuple[BlockStored, int]] = {}

    @property
    def cached_hashes(self) -> set[bytes]:
        """The hashes cached in the device pool."""
        return self.cached_on(DEVICE)

    def cached_on(self, medium: str) -> set[bytes]:
        return {digest for m, digest in self._cached if m == medium}

    def publish(self, batch: KvEventBatch) -> None:
        """An engine step's events (on the event loop): numbered, kept, queued for each subscriber."""
        self.last_sequence += 1
        numbered = KvBatch(self.last_sequence, time.time(), batch.events)
        self.history.append(numbered)
        self._apply(batch.events)
        for sub in list(self.subscribers):
            if not sub.offer(numbered):
                self.subscribers.discard(sub)
                self.num_dropped += 1

    def end_all(self) -> None:
        """End every subscription (the server drains)."""
        for sub in list(self.subscribers):
            sub.end()
        self.subscribers.clear()

    def subscribe(self, start: int) -> Subscription:
        """From sequence number `start` on (see the module's docstring)."""
        oldest = self.history[0].sequence_number if self.history else self.last_sequence + 1
        if 0 < start and oldest <= start <= self.last_sequence:
            first = [b for b in self.history if b.sequence_number >= start]
        else:
            first = self.snapshot()
        sub = Subscription(self, first)
        self.subscribers.add(sub)
        return sub

    def snapshot(self) -> list[KvBatch]:
        """The cached blocks as numbered chunks ending at the last sequence number."""
        blocks = len(self._cached)
        # At most one chunk per sequence number up to the last one.
        per_chunk = max(SNAPSHOT_CHUNK_BLOCKS, -(-blocks // self.last_sequence))
        chunks: list[list[KvEvent]] = [[AllBlocksCleared()]]
        room = per_chunk
        for run in self._runs():  # whole runs, split where a chunk is full
            while run.block_hashes:
                if not room:
                    chunks.append([])
                    room = per_chunk
                head, run = _split(run, room)
                chunks[-1].append(head)
                room -= len(head.block_hashes)
        count = len(chunks)
        now = time.time()
        first = self.last_sequence - count + 1
        return [KvBatch(first + i, now, tuple(events), Snapshot(i, count, blocks)) for i, events in enumerate(chunks)]

    def _apply(self, events: tuple[KvEvent, ...]) -> None:
        cached = self._cached
        for event in events:
            if isinstance(event, BlockStored):
                for i, digest in enumerate(event.block_hashes):
                    cached.setdefault((event.medium, digest), (event, i))
            elif isinstance(event, BlockRemoved):
                for digest in event.block_hashes:
                    cached.pop((event.medium, digest), None)
            else:
                cached.clear()

    def _runs(self) -> list[BlockStored]:
        """The cached blocks as BlockStored events: consecutive blocks of one store stay one run."""
        runs: list[BlockStored] = []
        event, start, end = None, 0, 0
        for stored, i in self._cached.values():
            if stored is event and i == end:
                end += 1
                continue
            if event is not None:
                runs.append(_part(event, start, end))
            event, start, end = stored, i, i + 1
        if event is not None:
            runs.append(_part(event, start, end))
        return runs


def _part(event: BlockStored, start: int, end: int) -> BlockStored:
    """Blocks [start, end) of a store, with the hash before them as their parent."""
    bs = event.block_size
    parent = event.block_hashes[start - 1] if start else event.parent_block_hash
    return BlockStored(event.block_hashes[start:end], parent, event.token_ids[start * bs:end * bs], bs,
                       event.lora_name, event.medium)


def _split(run: BlockStored, n: int) -> tuple[BlockStored, BlockStored]:
    """The first n blocks of a run, and the rest."""
    head = _part(run, 0, min(n, len(run.block_hashes)))
    rest = _part(run, len(head.block_hashes), len(run.block_hashes))
    return head, rest
