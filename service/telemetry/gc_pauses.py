"""The garbage collector's pauses: kept short, and logged when one is long.

A full collection walks every object the process tracks. After start-up the gRPC process tracks
hundreds of thousands (torch, transformers, grpc, protobuf, the tokenizer, the grammar compiler):
one full collection took ~375 ms on the 2-core CPU machine. Meanwhile its event loop reads nothing,
the engine's pipe fills, the engine's next step waits on its write, and every stream sees the gap
at once. `freeze_startup_heap` moves what start-up made into the permanent generation, which
collections skip (the same collection then took ~40 ms); `watch_gc_pauses` logs a `gc_pause` event
for each collection longer than a threshold, so a pause that streams felt has a name in the log.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("graphserve.gc")

GcCallback = Callable[[str, dict[str, Any]], None]


def freeze_startup_heap() -> int:
    """Collect once, then keep every object alive now out of all later collections; returns how many
    objects that froze. Call it when start-up is done: what it made lives as long as the process."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def watch_gc_pauses(process: str, threshold_s: float = 0.05) -> GcCallback:
    """Log `gc_pause` (process, generation, ms, collected) for each collection over threshold_s in
    this process, whatever thread it interrupted. Returns the callback (gc.callbacks.remove undoes it)."""
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        seconds = time.perf_counter() - started[0]
        if seconds > threshold_s:
            log.warning("gc_pause", process=process, generation=info["generation"], ms=round(seconds * 1000, 1),
                        collected=info["collected"], frozen=gc.get_freeze_count())

    gc.callbacks.append(on_gc)
    return on_gc
