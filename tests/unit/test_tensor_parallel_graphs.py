"""Graphs with tensor parallelism on the CPU: two gloo ranks in float32, a fake graph backend on each
(it replays by running the step eagerly, so every collective still runs). Rank 0's engine and graph
cache decide; rank 1 mirrors them from the step messages. Both ranks must capture, replay and
release the same graphs in the same order (a mismatch would pair collectives of different steps),
through traffic, the warm start, an operator capture and evictions under a tiny budget; the tokens
must equal one rank's; no capture may run while the engine has a request (a capture stops every
rank's steps), though the engine thread's stall still counts it; and rank 0's view of every rank's
graph memory (the admin state's) must show what rank 1's mirror holds."""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

from cache_manager import BucketState, CudaGraphMode, EngineHooks, GraphCacheConfig
from cache_manager.ops import OpOutcome
from cache_manager.testing import FakeGraph, FakeGraphBackend
from service.model.loader import load_model
from tests.support.ranks import run_ranks

SLOTS, MAX_SEQ, MAX_TOKENS = 4, 128, 32
# Prompt lengths and completion lengths chosen so that steps take many shapes: chunked prefill (a
# 40-token prompt in a 32-token budget), mixed steps, and decode batches of 4, 3, 2 and 1 rows.
JOBS = [([766, 5, 6, 7, 8], 7), ([766, 11, 12], 4), ([766, *range(100, 139)], 6), ([766, 20, 21, 22, 23, 24, 25], 2)]
BUDGET = 60_000  # the fake graph of size s holds 1000 * s bytes: not every size fits
SMALL_BUDGET = 10_000
CAPTURE_DELAY_S = 0.05  # rank 0's fake capture takes this long, so the engine thread's stall must show it


def _kind(step) -> str:  # noqa: ANN001
    return "piecewise" if hasattr(step, "segments") else "full"


class _LoggedGraph(FakeGraph):
    def __init__(self, graph: FakeGraph, kind: str, log: list) -> None:
        super().__init__(graph.step, graph.size, graph.nbytes, graph.capture_ms)
        self.kind, self.log = kind, log

    def replay(self) -> torch.Tensor:
        self.log.append(("replay", self.kind, self.size))
        return super().replay()


class RecordingBackend(FakeGraphBackend):
    """Graphs held per (kind, size); every capture, release and replay in one ordered log."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.log: list[tuple[str, str, int]] = []
        self.engine_busy = None  # rank 0: the engine's has_pending_work, once it exists
        self.captured_while_busy: list[tuple[str, int]] = []

    def capture(self, step, size: int) -> _LoggedGraph:  # noqa: ANN001
        if self.engine_busy is not None and self.engine_busy():
            self.captured_while_busy.append((_kind(step), size))
        time.sleep(self.delay_s)
        graph = super().capture(step, size)
        kind = _kind(step)
        self.live[(kind, size)] = self.live.pop(size)
        self.log.append(("capture", kind, size))
        return _LoggedGraph(graph, kind, self.log)

    def release(self, graph: _LoggedGraph, after: object = None) -> int:
        self.log.append(("release", graph.kind, graph.size))
        return self.live.pop((graph.kind, graph.size))


class _Followers:
    """Rank 0's side of the step channel, as service.engine.ranks.Ranks is without processes to watch."""

    def __init__(self, channel, store) -> None:  # noqa: ANN001
        self.channel = channel
        self.store = store

    def memory(self, own):  # noqa: ANN001, ANN201
        from service.engine.rank_memory import read_memory

        return read_memory(self.store, 2, own)

    def send(self, inputs) -> None:  # noqa: ANN001
        self.channel.send(inputs)

    def check(self) -> None:
        pass

    def explain(self, exc: BaseException, wait_s: float = 1.0) -> BaseException:
        return exc


def _runner(rank: int, world: int, port: int, cache_dir: str, backend: RecordingBackend,
            leader=None):  # noqa: ANN001, ANN202
    """This rank's runner; `leader(channel, store)` makes rank 0's view of the other ranks."""
    from service.engine.ranks import group_store, join_group
    from service.engine.runner import ModelRunner
    from service.engine.step_channel import StepChannel, StepInputs

    torch.set_num_threads(1)
    store = group_store(rank, world, port)
    tp, channel_group = join_group(rank, world, port, torch.device("cpu"), store=store)
    loaded = load_model("builtin:tiny", torch.device("cpu"), torch.float32, pathlib.Path(cache_dir), tp=tp)
    config = GraphCacheConfig(mode=CudaGraphMode.FULL_AND_PIECEWISE, capture_sizes=None, max_batch=SLOTS,
                              max_tokens=MAX_TOKENS, memory_budget=BUDGET, inline_capture=True,
                              warm_start=rank == 0)
    channel = StepChannel(channel_group, StepInputs.capacity(SLOTS, MAX_TOKENS))
    ranks, hooks = (None, None) if leader is None else leader(channel, store)
    runner = ModelRunner(loaded, SLOTS, MAX_SEQ, config, graph_backend=backend, ranks=ranks, hooks=hooks)
    runner.warmup()
    return loaded, runner, tp, channel, store


def _rank(rank: int, world: int, port: int, cache_dir: str) -> dict:
    if rank > 0:
        from service.engine.rank_main import follow_steps
        from service.engine.rank_memory import MemoryPublisher

        backend = RecordingBackend()
        _, runner, _, channel, store = _runner(rank, world, port, cache_dir, backend)
        follower = runner.follow()
        follow_steps(runner, channel, MemoryPublisher(store, rank, torch.device("cpu")))
        return {"log": backend.log, "held": sorted(backend.live), "used": follower.mirror.held_bytes}
    return _lead(rank, world, port, cache_dir)


def _lead(rank: int, world: int, port: int, cache_dir: str) -> dict:
    from service.config import load_config
    from service.engine.builder import LoadedRunner, new_engine, prepare_graphs
    from service.engine.request import GenerationRequest, SamplingParams
    from tests.unit.test_overlap import Results

    backend = RecordingBackend(CAPTURE_DELAY_S)
    stalls: list[float] = []
    loaded, runner, _, channel, store = _runner(
        rank, world, port, cache_dir, backend,
        leader=lambda channel, store: (_Followers(channel, store), EngineHooks(capture_stall=stalls.append)))
    c = load_config(["--max-running-seqs", str(SLOTS), "--max-num-batched-tokens", str(MAX_TOKENS)], {})
    lr = LoadedRunner(loaded, runner, MAX_SEQ, CudaGraphMode.FULL_AND_PIECEWISE)
    prepare_graphs(lr, 30)  # as a server does before SERVING: the cold start's cover of sizes
    startup = list(backend.log)
    engine = new_engine(c, lr)
    # what a capture must not run beside: a request (operator calls, which the engine also waits out,
    # may arrive from this thread while an idle capture runs)
    backend.engine_busy = lambda: engine.num_running + engine.num_waiting > 0
    engine.start()
    out = Results()

    def serve(tag: str) -> list[list[int]]:
        engine.call(lambda: graphs.wait_idle(30)).result(60)  # what the last phase queued has run
        ids = []
        for i, (prompt, n) in enumerate(JOBS):
            request = GenerationRequest(f"{tag}{i}", prompt,
                                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=0),
                                        arrival_time=time.monotonic())
            engine.submit(request, out.sink(request.request_id))
            ids.append(request.request_id)
        out.wait(ids, timeout=60)
        return [out.tokens[i] for i in ids]

    def operator(fn) -> dict:  # noqa: ANN001
        return engine.call(fn).result(30).result(30)  # on the engine thread; committed between steps

    graphs = runner.graphs

    def memory() -> tuple[int, list]:
        """Rank 0's used bytes and its view of every rank, once rank 1 has published the same bytes
        (it applies the operations after rank 0 sent them, then publishes)."""
        deadline = time.monotonic() + 10
        while True:
            used = engine.call(lambda: graphs.used_bytes).result(30)  # between steps
            view = runner.rank_memory()
            if view[1].graph_bytes == used or time.monotonic() > deadline:
                return used, view
            time.sleep(0.01)

    try:
        first = serve("first")
        memory_first = memory()
        evicted = operator(lambda: graphs.set_budget_async(SMALL_BUDGET))
        operator(lambda: graphs.evict_async([2], "full"))
        captured = operator(lambda: graphs.capture_async([2], "full"))
        second = serve("second")
        # Between steps, once what traffic queued has been captured (the engine is idle now): every
        # decided op has run everywhere
        snap = engine.call(lambda: (graphs.wait_idle(30), graphs.snapshot())[1]).result(60)
        memory_last = memory()
    finally:
        engine.stop()
    graphs.close()  # releases rank 0's graphs (the log stops here: rank 1 keeps its own)
    channel.send(None)
    held = sorted((b.kind, b.size) for b in snap.buckets if b.state is BucketState.CAPTURED)
    return {"log": backend.log, "held": held, "used": snap.used_bytes, "tokens": [first, second], "stalls": stalls,
            "evicted": evicted, "captured": captured[2].outcome, "memory": [memory_first, memory_last],
            "startup": startup, "captured_while_busy": backend.captured_while_busy}


def _one_rank_tokens(cache_dir: pathlib.Path) -> list[list[int]]:
    from service.engine.runner import ModelRunner

    loaded = load_model("builtin:tiny", torch.device("cpu"), torch.float32, cache_dir)
    runner = ModelRunner(loaded, SLOTS, MAX_SEQ, GraphCacheConfig(mode="none", capture_sizes=None, max_batch=SLOTS))
    from service.engine.engine import Engine
    from service.engine.request import GenerationRequest, SamplingParams
    from service.engine.scheduler import Scheduler
    from tests.unit.test_overlap import Results

    engine = Engine(runner, Scheduler(SLOTS, MAX_TOKENS), loaded.tokenizer, frozenset(loaded.spec.eos_token_ids))
    engine.start()
    out = Results()
    try:
        for i, (prompt, n) in enumerate(JOBS):
            engine.submit(GenerationRequest(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=0),
                                            arrival_time=time.monotonic()), out.sink(str(i)))
        out.wait([str(i) for i in range(len(JOBS))], timeout=60)
    finally:
        engine.stop()
    return [out.tokens[str(i)] for i in range(len(JOBS))]


@pytest.fixture(scope="module")
def two_ranks(model_cache_dir) -> dict[int, dict]:  # noqa: ANN001
    load_model("builtin:tiny", torch.device("cpu"), torch.float32, model_cache_dir)  # generate it once
    return run_ranks(_rank, 2, str(model_cache_dir), timeout=120)


def test_both_ranks_capture_replay_and_release_the_same_graphs_in_the_same_order(two_ranks) -> None:  # noqa: ANN001
    lead, follower = two_ranks[0]["log"], two_ranks[1]["log"]
    # Rank 0's close released its graphs after the last step; rank 1 was only told to stop.
    assert follower == lead[: len(follower)]
    assert all(action == "release" for action, _, _ in lead[len(follower):])
    actions = {(a, k) for a, k, _ in follower}
    assert {("capture", "full"), ("capture", "piecewise"), ("replay", "full"), ("replay", "piecewise"),
            ("release", "full"), ("release", "piecewise")} <= actions
    # Rank 1 holds what rank 0 held before closing: the budget holds on both.
    assert two_ranks[1]["held"] == two_ranks[0]["held"]
    assert two_ranks[1]["used"] == two_ranks[0]["used"] <= SMALL_BUDGET


def test_operator_capture_and_budget_evictions_reach_every_rank(two_ranks) -> None:  # noqa: ANN001
    lead = two_ranks[0]
    assert lead["captured"] is OpOutcome.CAPTURED
    assert lead["evicted"], "the smaller budget evicted nothing"
    log = two_ranks[1]["log"]
    captures_of_2 = [i for i, e in enumerate(log) if e == ("capture", "full", 2)]
    releases_of_2 = [i for i, e in enumerate(log) if e == ("release", "full", 2)]
    assert releases_of_2 and captures_of_2 and captures_of_2[-1] > releases_of_2[0]


def test_greedy_tokens_equal_one_rank_and_no_capture_runs_while_a_request_does(two_ranks, model_cache_dir) -> None:  # noqa: ANN001
    one = _one_rank_tokens(model_cache_dir)
    first, second = two_ranks[0]["tokens"]
    assert first == one and second == one
    lead = two_ranks[0]
    assert lead["captured_while_busy"] == []
    captures = [e for e in lead["log"] if e[0] == "capture"]
    startup = [e for e in lead["startup"] if e[0] == "capture"]
    assert len(captures) > len(startup), "traffic's own sizes were never captured (in the idle gaps)"
    stalls = lead["stalls"]  # the engine thread still spends each capture: counted, though no step waited
    assert stalls and min(stalls) >= CAPTURE_DELAY_S


def test_a_cold_start_captures_a_cover_of_sizes_largest_first(two_ranks) -> None:  # noqa: ANN001
    startup = [(kind, size) for action, kind, size in two_ranks[0]["startup"] if action == "capture"]
    full = [size for kind, size in startup if kind == "full"]
    # every decode batch of 1 .. SLOTS then pads into a graph at most twice its size
    assert full == [4, 2, 1]
    piecewise = [size for kind, size in startup if kind == "piecewise"]
    assert piecewise[0] == MAX_TOKENS and piecewise == sorted(piecewise, reverse=True)


def test_rank_0_sees_what_every_rank_s_graphs_hold(two_ranks) -> None:  # noqa: ANN001
    (used_first, first), (used_last, last) = two_ranks[0]["memory"]
    assert used_first > 0, "no graph was captured before the budget shrank"
    for used, view in ((used_first, first), (used_last, last)):
        assert [m.rank for m in view] == [0, 1]
        assert view[0].graph_bytes == view[1].graph_bytes == used  # both ranks hold the same graphs
        assert view[1].device_free_bytes is None and view[1].device_total_bytes is None  # not measured on the CPU
    assert last[1].graph_bytes == two_ranks[1]["used"]  # what rank 1's mirror held when it stopped
