"""What a runner's rank does beside the step itself: one device, the tensor-parallel leader, a follower.

Every rank runs the same `ModelRunner.forward` for a step; the role decides the two points where
the ranks must agree: which graph operations run before the step and which graph it replays
(`plan`, `replay`), and, for the leader alone, what the other ranks hear of the step (its inputs
before the forward, its sampled tokens after). On one device the graph cache decides and nothing
is sent. The tensor-parallel leader (rank 0) plans with its cache, sends the plan with the step's
inputs (service/engine/step_channel.py) and broadcasts the sampled tokens. A follower (rank > 0)
decides nothing: its GraphMirror applies the leader's operations and replays the leader's graph;
its loop, which receives the steps, is the rank process's (service/engine/rank_main.py).
"""

from __future__ import annotations

import torch

from cache_manager import GraphCache, StepPlan
from cache_manager.mirror import GraphMirror, GraphOp
from service.engine.rank_memory import RankMemory, device_memory
from service.engine.ranks import Ranks
from service.engine.step_channel import StepInputs
from service.model.parallel import TensorParallel


class OneDevice:
    """One rank: the graph cache's dispatcher decides and the cache replays; nothing is shared. The
    other roles change only what they must."""

    ranks: Ranks | None = None  # the other tensor-parallel ranks (the leader's)

    def plan(self, graphs: GraphCache, inputs: StepInputs) -> StepPlan:
        """Before the step's forward: the graph operations every rank runs now, and the plan of the
        step (its family and the graph that replays it, or eager)."""
        return graphs.plan_step(*_shape(inputs))

    def replay(self, graphs: GraphCache, plan: StepPlan) -> torch.Tensor:
        """The step's graph (or its eager run), once its inputs are written."""
        return graphs.execute(plan)

    def sampled(self, tokens: torch.Tensor) -> None:
        """After the step sampled `tokens` (on the device)."""

    def explain(self, exc: Exception) -> BaseException:
        """The error a failed step reports."""
        return exc

    def rank_memory(self, graphs: GraphCache, device: torch.device) -> list[RankMemory]:
        """Every rank's graph memory, rank 0 first; empty on one device."""
        return []


class TensorParallelLeader(OneDevice):
    """Rank 0 of N > 1: its graph cache plans every step; the step's inputs go to the other ranks
    with the planned graph, and the sampled tokens follow (the other ranks may feed them back next
    step). Graph operations go out in a message of their own when the cache runs them (`publish_ops`,
    the cache's RankOrder calls it): between steps, while the engine is idle (or, with no engine to
    ask, with the next step's inputs)."""

    def __init__(self, ranks: Ranks, tp: TensorParallel) -> None:
        self.ranks = ranks
        self.tp = tp

    def publish_ops(self, ops: list[GraphOp]) -> None:
        self.ranks.send(StepInputs.only_ops(ops))

    def plan(self, graphs: GraphCache, inputs: StepInputs) -> StepPlan:
        plan = graphs.plan_step(*_shape(inputs))
        inputs.replay = plan.target
        inputs.graph_ops = graphs.queued_ops()
        self.ranks.send(inputs)
        graphs.run_queued()
        return plan

    def sampled(self, tokens: torch.Tensor) -> None:
        if tokens.numel():
            self.tp.broadcast(tokens)

    def explain(self, exc: Exception) -> BaseException:
        return self.ranks.explain(exc)

    def rank_memory(self, graphs: GraphCache, device: torch.device) -> list[RankMemory]:
        free, total = device_memory(device)
        return self.ranks.memory(RankMemory(0, graphs.used_bytes, free, total))


class Follower(OneDevice):
    """Rank > 0: holds the graphs the leader's cache captures and releases, and replays the one
    each step names; decides nothing (the step's family is a pure function of its shape)."""

    def __init__(self, graphs: GraphCache) -> None:
        self.mirror = GraphMirror(graphs.steps, graphs.backend)

    def plan(self, graphs: GraphCache, inputs: StepInputs) -> StepPlan:
        self.mirror.apply(inputs.graph_ops)
        return StepPlan(graphs.dispatcher.requested(*_shape(inputs)), None, inputs.replay, "", 0.0)

    def replay(self, graphs: GraphCache, plan: StepPlan) -> torch.Tensor:
        assert plan.requested is not None
        return self.mirror.run(plan.requested, plan.target)


def _shape(inputs: StepInputs) -> tuple[int, int, bool, int]:
    """What the dispatcher decides by: the step's tokens, its decode rows (first) and their tokens
    each (1; 1 + k when every row is a speculative verify row of k draft tokens), adapter rows."""
    lora = inputs.lora_slots is not None
    chunks = inputs.chunks
    if chunks and not inputs.positions and all(c.verify and c.length == chunks[0].length for c in chunks):
        return len(inputs.token_ids), len(chunks), lora, chunks[0].length
    return len(inputs.token_ids), len(inputs.positions), lora, 1
