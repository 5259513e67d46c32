"""Graphs of a tensor-parallel rank > 0: the same descriptors as rank 0's cache, by rank 0's word.

With tensor parallelism every rank holds its own graphs (the all-reduces are captured inside), and
their collectives only meet when every rank captures, replays and releases the same descriptors in
the same order. Rank 0's GraphCache decides all of it (inline capture, see capturer.py) and sends
each decision as a `GraphOp`, in a message of its own when it runs them (between steps) or with a
step's inputs; the other ranks apply them in order with a `GraphMirror`, which keeps no stats, no
budget and makes no decision.
"""

from __future__ import annotations

from typing import NamedTuple

import structlog
import torch

from cache_manager.backend import CapturedGraph, GraphBackend, replay_rows
from cache_manager.sizes import BatchDescriptor, GraphFamily
from cache_manager.step import DecodeStep

log = structlog.get_logger("cache_manager")

CAPTURE, RELEASE = "capture", "release"


class GraphOp(NamedTuple):
    """One graph operation every rank runs at the same point in the step sequence."""

    action: str  # CAPTURE or RELEASE
    key: BatchDescriptor


class GraphMirror:
    """A follower rank's graphs, keyed by descriptor: captured, released and replayed as rank 0 says.

    Captures use the same backend and step objects as a GraphCache would (warm-up on scratch inputs,
    then record), so the warm-up collectives of all ranks meet in the same order. A capture that
    fails here leaves the descriptor without a graph: its steps run eagerly on this rank (the same
    collectives, launched one by one) while rank 0 replays.
    """

    def __init__(self, steps: dict[GraphFamily, DecodeStep], backend: GraphBackend | None) -> None:
        self.steps = steps
        self.backend = backend
        self.graphs: dict[BatchDescriptor, CapturedGraph] = {}

    @property
    def held_bytes(self) -> int:
        return sum(g.nbytes for g in self.graphs.values())

    def apply(self, ops: list[GraphOp]) -> None:
        """Run rank 0's graph operations of this point, in its order."""
        for op in ops:
            assert self.backend is not None, f"{op.action} {op.key} on a rank without a graph backend"
            if op.action == CAPTURE:
                self._capture(op.key)
            else:
                self._release(op.key)

    def run(self, requested: BatchDescriptor, key: BatchDescriptor | None) -> torch.Tensor:
        """The step of `requested`'s family over its rows (FULL) or tokens (PIECEWISE) [0, n): replayed
        from `key`'s graph (rank 0 replays the same one), or eager when rank 0 runs it eagerly or
        this rank holds no graph."""
        step, n = self.steps[requested.family], requested.padded_size
        graph = self.graphs.get(key) if key is not None else None
        if graph is None:
            return step.run(n)
        return replay_rows(graph, step, n)

    def close(self) -> None:
        for key in list(self.graphs):
            self._release(key)

    def _capture(self, key: BatchDescriptor) -> None:
        if key in self.graphs:  # rank 0's earlier capture of it failed there, not here: replace it
            self._release(key)
        try:
            self.graphs[key] = self.backend.capture(self.steps[key.family], key.padded_size)
        except Exception as exc:  # noqa: BLE001 - eager on this rank until rank 0 captures it again
            log.warning("graph_capture_failed", bucket=str(key), reason=f"{type(exc).__name__}: {exc}", follower=True)
            self.backend.cleanup_after_failure()

    def _release(self, key: BatchDescriptor) -> None:
        graph = self.graphs.pop(key, None)
        if graph is not None:  # None: its capture failed on this rank
            self.backend.release(graph, self.backend.fence())
