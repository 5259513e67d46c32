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

from cache_manager import GraphCache
from cache_manager.manager import StepPlan
from cache_manager.mirror import GraphMirror
from cache_manager.sizes import FULL, CudaGraphMode
from service.engine.rank_memory import RankMemory, device_memory
from service.engine.ranks import Ranks
from service.engine.step_channel import StepInputs
from service.model.parallel import TensorParallel


class OneDevice:
    """One rank: the graph cache decides and replays; nothing is shared. The other roles change
    only what they must."""

    ranks: Ranks | None = None  # the other tensor-parallel ranks (the leader's)

    def plan(self, graphs: GraphCache, inputs: StepInputs, kind: CudaGraphMode | None) -> StepPlan | None:
        """Before the step's forward: the graph operations every rank runs now, and the plan of the
        graph to replay (None: the cache plans when it runs)."""
        return None

    def replay(self, graphs: GraphCache, kind: CudaGraphMode, n: int, plan: StepPlan | None,
               inputs: StepInputs) -> torch.Tensor:
        """The step's graph (or its eager run) for n rows or tokens of `kind`."""
        return graphs.run(n, kind)

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
    step). Graph operations go out in a message of their own when the cache runs them: between steps,
    while the engine is idle (or, with no engine to ask, with the next step's inputs)."""

    def __init__(self, ranks: Ranks, tp: TensorParallel, graphs: GraphCache) -> None:
        self.ranks = ranks
        self.tp = tp
        graphs.publish_ops = lambda ops: ranks.send(StepInputs.only_ops(ops))

    def plan(self, graphs: GraphCache, inputs: StepInputs, kind: CudaGraphMode | None) -> StepPlan | None:
        plan = None
        if kind is not None:
            plan = graphs.plan(len(inputs.positions) if kind is FULL else len(inputs.token_ids), kind)
            inputs.replay = plan.target
        inputs.graph_ops = graphs.queued_ops()
        self.ranks.send(inputs)
        graphs.run_queued()
        return plan

    def replay(self, graphs: GraphCache, kind: CudaGraphMode, n: int, plan: StepPlan | None,
               inputs: StepInputs) -> torch.Tensor:
        assert plan is not None, "the leader plans every step that replays"
        return graphs.execute(plan)

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
    each step names; decides nothing."""

    def __init__(self, graphs: GraphCache) -> None:
        self.mirror = GraphMirror(graphs.steps, graphs.backend)

    def plan(self, graphs: GraphCache, inputs: StepInputs, kind: CudaGraphMode | None) -> StepPlan | None:
        self.mirror.apply(inputs.graph_ops)
        return None

    def replay(self, graphs: GraphCache, kind: CudaGraphMode, n: int, plan: StepPlan | None,
               inputs: StepInputs) -> torch.Tensor:
        return self.mirror.run(inputs.replay, kind, n)
