"""Every tensor-parallel rank's graph memory, shared through the group's store.

The graph memory budget is per rank and every rank holds the same graphs, but only rank 0's graph
cache measures its own. Ranks 1..N-1 publish what their mirror holds (and on CUDA the device's
free and total memory) to the TCPStore rank 0 hosts: once when they are ready, then after a graph
operation only when the bytes changed, so a step costs no store round trip. Rank 0 reads the keys
when the admin state is asked for; a rank that has not published yet reads as unknown, never as a
wait (a key is checked before it is read, and `get` only waits for a missing key).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("graphserve.ranks")


@dataclass(frozen=True)
class RankMemory:
    """One rank's graph memory as last published (rank 0: as its graph cache counts it now)."""

    rank: int
    graph_bytes: int | None  # None: the rank has not published yet
    device_free_bytes: int | None = None  # None: not measured (the CPU) or not published
    device_total_bytes: int | None = None


def device_memory(device: Any) -> tuple[int | None, int | None]:
    """(free, total) bytes of a CUDA device; (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def memory_key(rank: int) -> str:
    return f"graphserve/rank{rank}/memory"


class MemoryPublisher:
    """A follower rank's side: publishes its graph bytes (and device memory) when they change."""

    def __init__(self, store: Any, rank: int, device: Any) -> None:
        self.store = store
        self.rank = rank
        self.device = device
        self._published: int | None = None

    def publish(self, graph_bytes: int) -> None:
        if graph_bytes == self._published:
            return
        started = time.perf_counter()
        free, total = device_memory(self.device)
        value = {"graph_bytes": graph_bytes, "device_free_bytes": free, "device_total_bytes": total}
        try:
            self.store.set(memory_key(self.rank), json.dumps(value))
        except Exception as exc:  # noqa: BLE001 - a report, never worth a step: retried at the next change
            log.warning("rank_memory_publish_failed", rank=self.rank, error=repr(exc))
            return
        self._published = graph_bytes
        # What the publish cost this rank's engine thread (it runs between steps, after a graph operation).
        log.info("rank_memory_published", rank=self.rank, graph_bytes=graph_bytes,
                 ms=round((time.perf_counter() - started) * 1000.0, 3))


def read_memory(store: Any, world_size: int, own: RankMemory) -> list[RankMemory]:
    """Rank 0: its own entry, then each other rank's latest published one (unknown if none yet)."""
    ranks = [own]
    for rank in range(1, world_size):
        key = memory_key(rank)
        try:
            value = json.loads(store.get(key)) if store.check([key]) else None
        except Exception as exc:  # noqa: BLE001 - the admin state shows the rank as unknown
            log.warning("rank_memory_read_failed", rank=rank, error=repr(exc))
            value = None
        if value is None:
            ranks.append(RankMemory(rank, None))
        else:
            ranks.append(RankMemory(rank, value["graph_bytes"], value["device_free_bytes"],
                                    value["device_total_bytes"]))
    return ranks
