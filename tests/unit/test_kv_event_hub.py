"""The KV event hub: consecutive sequence numbers, resuming from one in the history, a snapshot for
a subscriber without a usable cursor (it rebuilds the same cached set), a slow subscriber dropped
while publishing goes on, every subscription ended at drain."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.block_pool import chain_hashes
from service.engine.kv_events import HOST, AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, replay
from service.server.kv_event_hub import KvBatch, KvEventHub, Subscription

BS = 2


def stored(tokens: list[int], first: int = 0, parent: bytes | None = None) -> BlockStored:
    hashes = chain_hashes(tokens, BS)[first:]
    return BlockStored(tuple(hashes), parent, tuple(tokens[first * BS:]), BS)


def take_ready(sub: Subscription) -> list[KvBatch]:
    """What the subscription holds now (without waiting)."""

    async def drain() -> list[KvBatch]:
        out = []
        while sub._queue:
            out.append(await sub.next())
        return out

    return asyncio.run(drain())


def apply(batches: list[KvBatch], cached: set[bytes]) -> set[bytes]:
    for batch in batches:
        replay(batch.events, cached)
    return cached


def test_batches_are_numbered_consecutively_and_a_resume_replays_from_its_number() -> None:
    hub = KvEventHub(history=8, buffer=8)
    base = hub.last_sequence
    for i in range(5):
        hub.publish(KvEventBatch((stored([i, i]),)))
    assert [b.sequence_number for b in hub.history] == [base + 1 + i for i in range(5)]
    resumed = take_ready(hub.subscribe(base + 3))
    assert [b.sequence_number for b in resumed] == [base + 3, base + 4, base + 5]
    assert all(b.snapshot is None for b in resumed)


def test_a_cursor_the_history_no_longer_holds_gets_a_snapshot_ending_at_the_last_number() -> None:
    hub = KvEventHub(history=2, buffer=8)
    base = hub.last_sequence
    a = stored([1, 1, 2, 2, 3, 3])
    hub.publish(KvEventBatch((a,)))
    hub.publish(KvEventBatch((BlockRemoved((a.block_hashes[2],)),)))
    hub.publish(KvEventBatch((stored([7, 7, 8, 8]),)))
    for start in (0, base + 1, base + 99):  # from the current state; too old; from another life
        batches = take_ready(hub.subscribe(start))
        assert batches[-1].sequence_number == hub.last_sequence and batches[0].events[0] == AllBlocksCleared()
        assert {b.snapshot.count for b in batches} == {len(batches)}
        assert apply(batches, {b"stale"}) == hub.cached_hashes
    first = take_ready(hub.subscribe(0))[0].events
    assert first[1] == BlockStored(a.block_hashes[:2], None, (1, 1, 2, 2), BS)  # parents first, one run


def test_a_snapshot_keeps_each_block_on_its_medium() -> None:
    """A block evicted from the device pool into the host tier, another on both: a subscriber that
    starts from a snapshot holds the same per-medium sets as one that saw every event."""
    hub = KvEventHub(history=1, buffer=8)
    a = stored([1, 1, 2, 2])
    events = [a, BlockRemoved(a.block_hashes[1:]),
              BlockStored(a.block_hashes[1:], a.block_hashes[0], (2, 2), BS, "", HOST),
              BlockStored(a.block_hashes[:1], None, (1, 1), BS, "", HOST)]
    for event in events:
        hub.publish(KvEventBatch((event,)))
    batches = take_ready(hub.subscribe(0))
    assert apply(batches, set()) == {a.block_hashes[0]} == hub.cached_hashes
    assert replay([e for b in batches for e in b.events], set(), HOST) == set(a.block_hashes) == hub.cached_on(HOST)


def test_a_live_subscriber_gets_each_batch_once_after_its_replay() -> None:
    hub = KvEventHub(history=8, buffer=8)
    sub = hub.subscribe(0)
    hub.publish(KvEventBatch((stored([4, 4]),)))
    got = take_ready(sub)
    assert [b.snapshot is not None for b in got] == [True, False]
    assert got[1].sequence_number == got[0].sequence_number + 1


def test_a_slow_subscriber_is_dropped_and_the_others_keep_every_batch() -> None:
    hub = KvEventHub(history=64, buffer=3)
    slow, fast = hub.subscribe(0), hub.subscribe(0)
    received = take_ready(fast)
    for i in range(10):
        hub.publish(KvEventBatch((stored([i, i]),)))
        received += take_ready(fast)
    assert slow.dropped and slow not in hub.subscribers and hub.num_dropped == 1
    assert asyncio.run(slow.next()) is None
    assert apply(received, set()) == hub.cached_hashes
    # It resumes from the last number it applied (the snapshot's and its first buffered ones).
    resumed = take_ready(hub.subscribe(hub.history[0].sequence_number + 2))
    assert resumed[-1].sequence_number == hub.last_sequence


def test_draining_ends_every_subscription() -> None:
    hub = KvEventHub()
    sub = hub.subscribe(0)
    take_ready(sub)
    hub.end_all()
    assert asyncio.run(sub.next()) is None and sub.ended and not hub.subscribers


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("srrc"), st.integers(0, 5), st.integers(1, 4)), max_size=30),
       history=st.integers(1, 6))
def test_any_resume_point_rebuilds_the_published_set(ops: list[tuple[str, int, int]], history: int) -> None:
    """A subscriber that applied batches up to any number, then resubscribes from it (history or
    snapshot), ends with the set a subscriber that saw everything holds."""
    hub = KvEventHub(history=history, buffer=100)
    hub.publish(KvEventBatch((AllBlocksCleared(),)))
    seen: list[KvBatch] = list(hub.history)
    for kind, key, n in ops:
        tokens = [key] * (2 * BS) + list(range(n * BS))
        if kind == "s":
            event = stored(tokens)
        elif kind == "r":
            event = BlockRemoved(tuple(chain_hashes(tokens, BS)[-n:]))
        else:
            event = AllBlocksCleared()
        hub.publish(KvEventBatch((event,)))
        seen.append(hub.history[-1])
    full = apply(seen, set())
    assert full == hub.cached_hashes
    for cut, batch in enumerate(seen):
        resumed = take_ready(hub.subscribe(batch.sequence_number))
        kept = apply(seen[:cut + 1], set())
        if resumed and resumed[0].snapshot is None:
            assert resumed[0].sequence_number == batch.sequence_number
            resumed = resumed[1:]  # the one it applied: smg's subscriber skips it
        assert apply(resumed, kept) == full
