"""Every rank's graph memory through a real TCPStore: a rank that has not published reads as unknown
at once (no wait for its key), and a follower sets its key only when its bytes change."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from service.engine.rank_memory import MemoryPublisher, RankMemory, read_memory


class _CountingStore:
    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        self.store.set(key, value)


def _store() -> dist.TCPStore:
    # A long timeout: reading a rank that never published must not wait for it.
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


def test_a_rank_that_has_not_published_is_unknown_without_waiting() -> None:
    store = _store()
    MemoryPublisher(store, 1, torch.device("cpu")).publish(4096)
    started = time.monotonic()
    view = read_memory(store, 3, RankMemory(0, 4096))
    assert time.monotonic() - started < 5
    assert view == [RankMemory(0, 4096), RankMemory(1, 4096), RankMemory(2, None)]


def test_a_follower_publishes_only_when_its_bytes_change() -> None:
    store = _CountingStore(_store())
    publisher = MemoryPublisher(store, 1, torch.device("cpu"))
    for graph_bytes in (0, 0, 2048, 2048, 2048, 1024):
        publisher.publish(graph_bytes)
    assert store.sets == 3
    assert read_memory(store.store, 2, RankMemory(0, 1024))[1] == RankMemory(1, 1024)
