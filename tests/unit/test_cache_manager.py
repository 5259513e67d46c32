import dataclasses
import json
import threading
import time

import pytest
import structlog
import torch

from cache_manager import (
    BatchDescriptor,
    BucketState,
    CudaGraphMode,
    EngineHooks,
    Fingerprint,
    GraphCache,
    GraphCacheConfig,
    GraphFamily,
    GraphsUnavailableError,
    OpOutcome,
    RankOrder,
)
from cache_manager.sizes import FULL, PIECEWISE
from cache_manager.stats import StatsTables
from cache_manager.testing import CountingStep, FakeGraphBackend, full_sizes

SIZES = (1, 2, 4, 8)
FP = Fingerprint("tiny", "float32", "cpu", torch.__version__, SIZES, 8)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(budget=10**9, bytes_for=lambda s: 1000 * s, fail=None, mode="full", backend=True, gate=None, **kw):
    clock = Clock()
    step = CountingStep(8)
    fake = FakeGraphBackend(bytes_for, fail_sizes=fail, gate=gate) if backend else None
    cfg = GraphCacheConfig(mode, SIZES, 8, memory_budget=budget, **kw)
    cache = GraphCache(step, cfg, torch.device("cpu"), FP, fake, clock=clock)
    return cache, step, fake, clock


def write(step: CountingStep, n: int) -> torch.Tensor:
    rows = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 1
    step.inputs[:n] = rows
    return rows * 2  # what the step computes for the real rows


def bucket(cache, size):
    return next(b for b in cache.snapshot().buckets if b.size == size)


def run_settled(cache, n, kind=None):
    """One step, then everything it sent to the capture thread committed (as by the next steps)."""
    out = cache.run(n) if kind is None else cache.run(n, kind)
    cache.wait_idle()
    return out


def test_lazy_capture_runs_beside_the_step_that_asked_and_is_swapped_in_between_steps():
    gate = threading.Event()
    cache, step, fake, _ = make(gate=gate)
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)  # served eagerly now: the capture waits on the gate
    assert fake.started.wait(5) and fake.captured == []
    assert bucket(cache, 4).state is BucketState.CAPTURING
    assert torch.equal(cache.run(3), expected)  # still capturing: eager again, no second capture
    gate.set()
    cache.wait_idle()
    assert fake.captured == [4] and fake.threads == {"graphserve-capture"}
    assert step.scratch_runs == [4] and step.padding_calls == []  # warm-up never used the live inputs
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)  # replayed, padded
    assert (3, 4) in step.padding_calls
    entry = bucket(cache, 4)
    assert entry.state is BucketState.CAPTURED and entry.since_start.replays == 1
    assert entry.since_start.eager_fallbacks == {"capturing": 2} and entry.since_start.captures == 1
    assert entry.bytes == 4000
    cache.close()


def test_while_capturing_a_step_pads_to_a_larger_captured_graph():
    gate = threading.Event()
    cache, step, fake, _ = make(gate=gate)
    gate.set()
    run_settled(cache, 8)
    gate.clear()
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)  # 4 is being captured: 8 serves it meanwhile
    assert (3, 8) in step.padding_calls and bucket(cache, 8).since_start.replays == 1
    gate.set()
    cache.wait_idle()
    assert fake.captured == [8, 4]
    cache.run(3)
    assert bucket(cache, 4).since_start.replays == 1


def test_without_single_row_padding_a_lone_row_runs_eagerly_while_its_graph_is_captured():
    """pad_single_rows=False (FP8 weights): a one-row step never borrows a larger graph, so it is
    computed the same way until its own graph replays; larger steps still pad."""
    gate = threading.Event()
    cache, step, fake, _ = make(gate=gate, pad_single_rows=False)
    gate.set()
    run_settled(cache, 8)
    gate.clear()
    expected = write(step, 1)
    assert torch.equal(cache.run(1), expected)
    assert (1, 8) not in step.padding_calls and bucket(cache, 8).since_start.replays == 0
    assert bucket(cache, 1).since_start.eager_fallbacks == {"capturing": 1}
    write(step, 3)
    cache.run(3)  # 4 waits behind 1's capture: 8 serves it meanwhile
    assert (3, 8) in step.padding_calls
    gate.set()
    cache.wait_idle()
    assert torch.equal(cache.run(1), expected)
    assert bucket(cache, 1).since_start.replays == 1
    cache.close()


@pytest.mark.parametrize("pad_single_rows", [True, False])
def test_without_single_row_padding_no_policy_or_budget_evicts_size_one(pad_single_rows):
    """A lone row that may not pad would run eagerly without its graph (FP8 8B: 20 ms a step against
    2.8): traffic and a smaller budget evict others, never size 1; an operator's explicit eviction may."""
    cache, step, fake, _ = make(budget=3000, bytes_for=lambda s: 1000, pad_single_rows=pad_single_rows)
    for n, times in ((1, 1), (2, 10), (4, 10)):
        for _ in range(times):
            write(step, n)
            run_settled(cache, n)
    run_settled(cache, 8)  # needs room: 1 is the coldest per byte; 4 is in use
    assert fake.released == ([] if not pad_single_rows else [1])
    kept = {b.size for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED}
    assert kept == ({1, 2, 4} if not pad_single_rows else {2, 4, 8})
    evicted = cache.set_budget(1000)
    assert 1 not in {k.padded_size for k in evicted} or pad_single_rows
    if not pad_single_rows:
        assert bucket(cache, 1).state is BucketState.CAPTURED and cache.snapshot().used_bytes == 1000
        with structlog.testing.capture_logs() as logs:
            assert cache.set_budget(500) == {}  # below the kept graph: it stays, and the log says why
        assert [e["kept"] for e in logs if e["event"] == "graph_budget_below_kept_graphs"] == [["full:1"]]
        assert cache.evict([1])[1].outcome is OpOutcome.EVICTED
    cache.close()


def test_above_max_and_mode_none_run_eager_and_count_requested_sizes():
    cache, step, fake, _ = make(mode="none")
    expected = write(step, 5)
    assert torch.equal(cache.run(5), expected)
    snap = cache.snapshot()
    assert snap.mode == "none" and full_sizes(snap.requested_since_start) == {5: 1}
    assert snap.requested_detail[0].eager_fallbacks == {"mode_none": 1}
    assert fake is not None and fake.captured == []
    with pytest.raises(GraphsUnavailableError):
        cache.capture([4])

    cpu, _, _, _ = make(backend=False)  # CPU without an explicit backend: always eager
    cpu.run(1)
    assert cpu.snapshot().disabled_reason == "device cpu has no CUDA graphs"
    with pytest.raises(GraphsUnavailableError, match="cpu"):
        cpu.evict([1])

    step = CountingStep(8)
    cfg = GraphCacheConfig("full", (1, 2, 4), 8)
    big = GraphCache(step, cfg, torch.device("cpu"), FP, FakeGraphBackend())
    big.run(7)
    assert big.snapshot().requested_detail[0].eager_fallbacks == {"above_max": 1}


def test_eviction_never_takes_the_graph_in_use_and_pads_to_a_larger_captured_graph():
    cache, step, fake, _ = make(budget=8000)
    write(step, 8)
    run_settled(cache, 8)
    cache.run(8)  # bucket 8 takes the whole budget and is the graph in use
    expected = write(step, 3)
    out = cache.run(3)  # 4 is estimated at 8000 (from bucket 8): cannot fit without evicting 8
    assert torch.equal(out, expected)
    assert fake.captured == [8] and fake.released == []
    assert (3, 8) in step.padding_calls
    assert bucket(cache, 8).since_start.replays == 2


def test_eager_when_nothing_fits_and_the_measured_size_is_remembered():
    cache, step, fake, _ = make(budget=500)
    expected = write(step, 3)
    assert torch.equal(run_settled(cache, 3), expected)  # captured, measured 4000 > 500, dropped
    assert fake.captured == [4] and fake.live_bytes == 0
    cache.run(3)  # the estimate now knows 4000: no second capture
    assert fake.captured == [4]
    assert cache.snapshot().requested_detail[0].eager_fallbacks == {"capturing": 1, "budget": 1}
    assert bucket(cache, 4).state is BucketState.NOT_CAPTURED
    assert cache.snapshot().used_bytes == 0


def test_policy_evicts_lowest_replays_per_byte_and_keeps_hot_graphs():
    cache, step, fake, _ = make(budget=3000, bytes_for=lambda s: 1000)
    for n, times in ((1, 10), (2, 1), (4, 3)):
        for _ in range(times):
            write(step, n)
            run_settled(cache, n)
    assert fake.live_bytes == 3000
    run_settled(cache, 8)  # needs room: 2 is the coldest per byte; 4 is in use
    assert fake.released == [2]
    assert {b.size for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED} == {1, 4, 8}
    assert fake.live_bytes <= 3000


def test_one_off_batch_does_not_displace_hot_graphs():
    cache, _step, fake, _ = make(budget=2000, bytes_for=lambda s: 1000)
    for _ in range(10):
        run_settled(cache, 1)
        run_settled(cache, 2)
    run_settled(cache, 4)
    assert fake.released == [] and fake.captured == [1, 2]
    assert bucket(cache, 4).since_start.eager_fallbacks == {"budget": 1}


def test_memory_never_exceeds_budget_cycling_three_buckets():
    cache, step, fake, _ = make(budget=2 * 4000, bytes_for=lambda s: 4000)
    for i in range(30):
        n = (1, 3, 7)[i % 3]
        expected = write(step, n)
        assert torch.equal(run_settled(cache, n), expected)
        assert fake.live_bytes <= 8000 and cache.snapshot().used_bytes == fake.live_bytes
    assert fake.peak_bytes <= 8000  # also while captures were in flight


def test_memory_a_released_graph_keeps_counts_against_the_budget():
    """A release that returns less than the graph held (memory some other owner keeps) is still
    device memory: the budget must see it, or graphs plus that memory would exceed it."""

    class Leaky(FakeGraphBackend):
        def release(self, graph, after=None):  # noqa: ANN001, ANN202
            return super().release(graph) - 1000  # the device gets 1000 bytes less back

    cache, step, _, _ = make(budget=8000, bytes_for=lambda s: 4000)
    cache.residency.backend = cache.residency.capturer.backend = cache.backend = Leaky(lambda s: 4000)
    for n in (1, 3, 7, 1, 3, 7):
        write(step, n)
        run_settled(cache, n)
        assert cache.used_bytes <= 8000
    assert cache.residency.unreclaimed_bytes > 0
    held = sum(b.bytes for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED)
    assert cache.used_bytes == held + cache.residency.unreclaimed_bytes


def test_failed_capture_backs_off_doubling_then_recovers():
    cache, step, fake, clock = make(fail={4}, failure_backoff_s=60)
    with structlog.testing.capture_logs() as logs:
        expected = write(step, 3)
        assert torch.equal(run_settled(cache, 3), expected)
    assert any(
        e["event"] == "graph_capture_failed" and e["bucket"] == "full:4" and "OutOfMemory" in e["reason"]
        for e in logs
    )
    entry = bucket(cache, 4)
    assert entry.state is BucketState.FAILED and entry.retry_at == clock.t + 60
    clock.t += 30
    cache.run(3)
    assert entry.since_start.failures == 1
    assert bucket(cache, 4).since_start.eager_fallbacks == {"capturing": 1, "failed": 1}
    clock.t += 31
    run_settled(cache, 3)  # back-off over: retried, fails again, back-off doubles
    assert bucket(cache, 4).since_start.failures == 2 and bucket(cache, 4).retry_at == clock.t + 120
    fake.fail_sizes.clear()
    clock.t += 121
    run_settled(cache, 3)
    assert bucket(cache, 4).state is BucketState.CAPTURED and fake.captured == [4]


def test_warm_start_captures_hottest_first_one_per_call_within_budget(tmp_path):
    path = tmp_path / "stats.json"
    first, _step, _, _ = make(stats_file=path)
    for n, times in ((8, 5), (2, 9), (1, 2)):
        for _ in range(times + 1):  # the first of each is served eagerly while its graph is captured
            run_settled(first, n)
    first.close()

    cache, _, fake, _ = make(budget=10_000, stats_file=path)  # fits 8 (8000) and 2 (2000), not 1 too
    assert full_sizes(cache.snapshot().warm_queue) == (2, 8, 1)
    assert cache.warm_step() is True
    assert cache.warm_step() is False  # one warm capture at a time
    cache.wait_idle()
    assert fake.captured == [2] and fake.threads == {"graphserve-capture"}
    assert cache.warm_step() is True
    cache.wait_idle()
    assert fake.captured == [2, 8]
    assert cache.warm_step() is False and fake.captured == [2, 8]  # 1 would exceed the budget
    assert fake.released == []
    assert cache.warm_step() is False

    off, _, _fake_off, _ = make(stats_file=path, warm_start=False)
    assert full_sizes(off.snapshot().warm_queue) == () and off.warm_step() is False


def test_a_cold_start_captures_the_largest_size_first_and_traffic_pads_into_it(tmp_path):
    cache, step, fake, _ = make(stats_file=tmp_path / "none-yet.json")
    assert full_sizes(cache.snapshot().warm_queue) == (8,)
    assert cache.warm_step() is True
    cache.wait_idle()
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)  # 4 is captured beside it; the step replays 8, padded
    assert (3, 8) in step.padding_calls and bucket(cache, 8).since_start.replays == 1
    assert bucket(cache, 4).since_start.eager_fallbacks == {}
    cache.wait_idle()
    assert fake.captured == [8, 4]


def test_prepare_warms_every_size_then_captures_the_largest_before_serving_on_a_cold_start(tmp_path):
    cache, step, fake, _ = make(stats_file=tmp_path / "none-yet.json")
    report = cache.prepare(timeout_s=30)
    # Every allowed size ran once on scratch inputs (kernel compiles happen now), then the capture's warm-up.
    assert step.scratch_runs == [1, 2, 4, 8, 8] and step.padding_calls == [] and step.runs == []
    assert report.kernels_warmed == 4 and report.captured == [str(BatchDescriptor(FULL, 8))]
    assert report.left == [] and not report.timed_out
    assert fake.captured == [8] and bucket(cache, 8).state is BucketState.CAPTURED  # committed, not pending
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)  # the first step replays: it waits on neither kernels nor a capture
    assert bucket(cache, 4).since_start.eager_fallbacks == {} and bucket(cache, 8).since_start.replays == 1


def test_without_single_row_padding_a_cold_start_captures_the_lone_row_graph_before_serving(tmp_path):
    cache, step, fake, _ = make(stats_file=tmp_path / "none-yet.json", pad_single_rows=False)
    assert full_sizes(cache.snapshot().warm_queue) == (8, 1)
    report = cache.prepare(timeout_s=30)
    assert fake.captured == [8, 1] and report.left == []
    expected = write(step, 1)
    assert torch.equal(cache.run(1), expected)  # a lone stream's first step replays its own graph
    assert bucket(cache, 1).since_start.replays == 1 and bucket(cache, 1).since_start.eager_fallbacks == {}
    cache.close()


def test_without_single_row_padding_size_1_comes_second_in_warm_and_inline_starts_and_must_be_allowed(tmp_path):
    path = tmp_path / "stats.json"
    first, _, _, _ = make(stats_file=path)
    for n in (8, 2, 2):
        run_settled(first, n)
    first.close()
    warm, _, _, _ = make(stats_file=path, pad_single_rows=False)  # the last run never had a lone row
    assert full_sizes(warm.snapshot().warm_queue) == (2, 1, 8)
    warm.close()
    cfg = GraphCacheConfig("full", SIZES, 8, inline_capture=True, pad_single_rows=False)
    inline = GraphCache(CountingStep(8), cfg, torch.device("cpu"), FP, FakeGraphBackend())
    assert full_sizes(inline.snapshot().warm_queue) == (8, 1, 4, 2)  # the cover, 1 before the rest
    inline.close()
    with pytest.raises(ValueError, match="lack 1"):
        GraphCacheConfig("full", (2, 4, 8), 8, pad_single_rows=False)


def test_prepare_captures_the_hot_sizes_of_a_warm_start_within_budget(tmp_path):
    path = tmp_path / "stats.json"
    first, _, _, _ = make(stats_file=path)
    for n, times in ((8, 5), (2, 9), (1, 2)):
        for _ in range(times + 1):
            run_settled(first, n)
    first.close()
    cache, _, fake, _ = make(budget=10_000, stats_file=path)  # fits 8 and 2, not 1 as well
    report = cache.prepare(timeout_s=30)
    assert fake.captured == [2, 8] and report.captured == [str(BatchDescriptor(FULL, s)) for s in (2, 8)]
    assert report.left == [] and not report.timed_out  # 1 was skipped for the budget, not left


def test_prepare_stops_at_its_timeout_and_leaves_the_rest_to_the_background(tmp_path):
    gate = threading.Event()
    cache, _, fake, _ = make(stats_file=tmp_path / "none-yet.json", gate=gate)
    started = time.monotonic()
    report = cache.prepare(timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert report.timed_out and report.captured == [] and report.left == [str(BatchDescriptor(FULL, 8))]
    gate.set()
    cache.wait_idle()  # the capture goes on and commits once serving
    assert fake.captured == [8] and bucket(cache, 8).state is BucketState.CAPTURED
    off, step, fake_off, _ = make(stats_file=tmp_path / "other.json")
    assert off.prepare(timeout_s=0).kernels_warmed == 0 and fake_off.captured == [] and step.scratch_runs == []


def test_prepare_does_nothing_without_graphs():
    cache, step, _, _ = make(backend=False)  # a CPU device without a backend: eager only
    report = cache.prepare(timeout_s=30)
    assert report.kernels_warmed == 0 and report.captured == [] and step.scratch_runs == []


@pytest.mark.parametrize("scenario", ["cold", "warm", "churn", "operator"])
def test_no_step_waits_on_a_capture(tmp_path, scenario):
    """Every capture is held in flight (the fake's gate stays shut) while steps of every size run:
    each step completes anyway, replaying a graph or eager, so none waits on a capture."""
    path = tmp_path / "stats.json"
    if scenario == "warm":
        first, _, _, _ = make(stats_file=path)
        for n in (1, 2, 4, 8):
            run_settled(first, n)
        first.close()
    gate = threading.Event()
    budget = 9_000 if scenario == "churn" else 10**9  # churn: 8 and one more never fit together
    cache, step, fake, _ = make(budget=budget, stats_file=path, gate=gate)
    gate.set()  # the graphs the start captures before serving
    cache.prepare(timeout_s=30)
    gate.clear()
    if scenario == "operator":
        cache.capture_async([1, 2, 4])
    served: list[int] = []

    def steps() -> None:
        for _ in range(3):
            for n in range(1, 9):
                expected = write(step, n)
                assert torch.equal(cache.run(n), expected)
                served.append(n)

    runner = threading.Thread(target=steps)
    runner.start()
    runner.join(20)
    try:
        assert not runner.is_alive() and len(served) == 24, f"a step waited on a capture ({scenario})"
        assert not gate.is_set() and cache.capturing  # the captures were still in flight all along
    finally:
        gate.set()
        cache.wait_idle()
        cache.close()


def test_operator_capture_evict_and_set_budget():
    cache, step, _fake, _ = make(budget=20_000)
    res = cache.capture([4, 8])
    assert res[4].outcome is OpOutcome.CAPTURED and res[8].outcome is OpOutcome.CAPTURED
    assert cache.capture([4])[4].outcome is OpOutcome.ALREADY_CAPTURED
    assert step.padding_calls == [] and step.scratch_runs == [4, 8]  # warm-ups ran on private inputs
    assert _fake.threads == {"graphserve-capture"}
    with pytest.raises(ValueError, match=r"allowed: \[1, 2, 4, 8\]"):
        cache.capture([3])
    ev = cache.evict([4, 1])
    assert ev[4].outcome is OpOutcome.EVICTED and ev[4].bytes == 4000
    assert ev[1].outcome is OpOutcome.NOT_CAPTURED
    assert bucket(cache, 4).state is BucketState.EVICTED
    cache.capture([1, 2])
    assert cache.snapshot().used_bytes == 11_000
    evicted = cache.set_budget(4000)
    assert set(evicted) == {BatchDescriptor(FULL, 8)} and all(r.outcome is OpOutcome.EVICTED for r in evicted.values())
    assert cache.snapshot().used_bytes <= 4000 == cache.snapshot().budget_bytes
    assert cache.capture([8])[8].outcome is OpOutcome.OVER_BUDGET


def test_operator_capture_never_evicts_a_size_it_reports_captured():
    """Cold start (nothing measured, so both captures are submitted): 4 + 8 KB do not fit 10 KB. The
    capture of 8 must not evict the 4 that the same operation reports as captured."""
    cache, _step, _fake, _ = make(budget=10_000)
    res = cache.capture([4, 8])
    assert res[4].outcome is OpOutcome.CAPTURED and res[8].outcome is OpOutcome.OVER_BUDGET
    assert bucket(cache, 4).state is BucketState.CAPTURED


def test_snapshot_and_reset_stats():
    cache, _step, _fake, _ = make(budget=5000)
    run_settled(cache, 1)
    run_settled(cache, 3)
    run_settled(cache, 3)
    snap = cache.snapshot()
    assert snap.mode == "full" and snap.device == "cpu" and snap.capture_sizes == SIZES
    assert snap.budget_bytes == 5000 and snap.used_bytes == 5000
    assert full_sizes(snap.requested_since_start) == {1: 1, 3: 2}
    states = {b.size: b.state for b in snap.buckets}
    assert states == {
        1: BucketState.CAPTURED,
        2: BucketState.NOT_CAPTURED,
        4: BucketState.CAPTURED,
        8: BucketState.NOT_CAPTURED,
    }
    cache.reset_stats()
    snap = cache.snapshot()
    assert full_sizes(snap.requested_since_start) == {} and full_sizes(snap.requested_persisted) == {}
    assert bucket(cache, 4).bytes == 4000 and bucket(cache, 4).since_start.replays == 0


def test_debug_check_detects_moved_inputs():
    cache, step, _, _ = make(debug_check_addresses=True)
    run_settled(cache, 2)
    cache.run(2)
    step.inputs = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="moved"):
        cache.run(2)


def test_replay_totals_are_logged_per_interval_not_per_step():
    cache, _step, _, clock = make(replay_log_interval_s=60)
    cache.capture([2])
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            cache.run(2)
            cache.maybe_save()
        clock.t += 61
        cache.maybe_save()
    totals = [e for e in logs if e["event"] == "graph_replay_totals"]
    assert len(totals) == 1 and totals[0]["replays"] == 5 and totals[0]["eager"] == 0


def test_a_bigger_graph_needs_proportionally_more_traffic_to_displace_a_small_one():
    """Mirrors the GPU budget test with the sizes measured on an H200 (4, 4 and 22 MiB)."""
    mib = 2**20
    sizes = {1: 4 * mib, 2: 4 * mib, 4: 22 * mib, 8: 22 * mib}
    cache, _step, fake, _ = make(budget=22 * mib + 4 * mib + 2 * mib, bytes_for=sizes)
    for _ in range(10):
        for n in (1, 2, 3):
            run_settled(cache, n)
            assert fake.live_bytes <= cache.budget_bytes
    assert bucket(cache, 4).state is not BucketState.CAPTURED  # 10 uses do not pay for 22 MiB
    for _ in range(40):
        run_settled(cache, 3)
    assert bucket(cache, 4).state is not BucketState.CAPTURED  # 50 uses per 22 MiB < 10 per 4 MiB
    for _ in range(26):
        run_settled(cache, 3)
    assert bucket(cache, 4).state is BucketState.CAPTURED
    assert fake.released == [4, 1]  # the first capture of 4 measured over budget and was dropped
    assert bucket(cache, 1).since_start.evictions == 1 and bucket(cache, 2).state is BucketState.CAPTURED
    for _ in range(10):
        for n in (1, 2, 3):
            run_settled(cache, n)
            assert fake.live_bytes <= cache.budget_bytes


def test_capture_log_reports_the_engine_threads_stall_apart_from_the_capture_time():
    """A slow capture (warm-up, recording, measurement) costs the engine thread nothing: the log's
    stall_ms is what the engine thread spent on it, ready_ms how long until the graph served."""

    class SlowCapture(FakeGraphBackend):
        def capture(self, step, size):  # noqa: ANN001, ANN201
            time.sleep(0.2)  # as a warm-up and recording on the device would take
            return super().capture(step, size)

    stalls: list[float] = []
    step = CountingStep(8)
    cfg = GraphCacheConfig("full", SIZES, 8)
    cache = GraphCache(step, cfg, torch.device("cpu"), FP, SlowCapture(), hooks=EngineHooks(capture_stall=stalls.append))
    with structlog.testing.capture_logs() as logs:
        write(step, 3)
        started = time.perf_counter()
        cache.run(3)
        returned_after = time.perf_counter() - started
        cache.wait_idle()
    (event,) = [e for e in logs if e["event"] == "graph_captured"]
    assert event["bucket"] == "full:4" and event["ms"] == 1.0
    assert returned_after < 0.2 and event["ready_ms"] >= 200
    assert event["stall_ms"] < 200 and stalls == [pytest.approx(event["stall_ms"] / 1000, abs=1e-3)]


def test_inline_capture_runs_on_the_calling_thread_at_the_next_poll_after_publishing_its_ops():
    """Inline capture (tensor parallelism): the step that asked runs eagerly and queues the capture;
    `poll` hands the queued ops to its order's `publish` (the other ranks), runs them on this thread and
    commits them at once; the stall is the whole capture; evictions travel the same way."""
    from cache_manager.mirror import CAPTURE, RELEASE, GraphOp

    class SlowCapture(FakeGraphBackend):
        def capture(self, step, size):  # noqa: ANN001, ANN201
            time.sleep(0.05)
            return super().capture(step, size)

    stalls: list[float] = []
    published: list[list[GraphOp]] = []
    step, fake = CountingStep(8), SlowCapture()
    cfg = GraphCacheConfig("full", SIZES, 8, memory_budget=20_000, inline_capture=True)
    cache = GraphCache(step, cfg, torch.device("cpu"), FP, fake, hooks=EngineHooks(capture_stall=stalls.append),
                       order=RankOrder(publish=published.append))
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)  # eager; the capture waits for the step boundary
    assert cache.queued_ops() == [GraphOp(CAPTURE, BatchDescriptor(FULL, 4))] and fake.captured == []
    assert bucket(cache, 4).state is BucketState.CAPTURING
    assert cache.poll() == 1
    assert published == [[GraphOp(CAPTURE, BatchDescriptor(FULL, 4))]]
    assert fake.captured == [4] and fake.threads == {threading.current_thread().name}
    assert bucket(cache, 4).state is BucketState.CAPTURED and stalls and stalls[0] >= 0.05
    assert torch.equal(cache.run(3), expected)  # replayed
    # An operator's eviction, then a step's capture: both queued, in order, until rank 0 sends them.
    evicted = cache.evict_async([4])
    plan = cache.plan(2)
    assert plan.target is None and cache.queued_ops() == [GraphOp(RELEASE, BatchDescriptor(FULL, 4)),
                                                          GraphOp(CAPTURE, BatchDescriptor(FULL, 2))]
    cache.run_queued()  # as rank 0 does after sending them with the step
    assert fake.released == [4] and fake.captured == [4, 2]
    cache.execute(plan)
    cache.poll()
    assert bucket(cache, 2).state is BucketState.CAPTURED and bucket(cache, 4).state is BucketState.EVICTED
    assert evicted.result(0)[4].outcome is OpOutcome.EVICTED
    assert len(published) == 1  # those two went with the step, not through publish
    cache.close()


def test_deferred_inline_captures_wait_for_an_idle_engine_and_evict_nothing_meanwhile(tmp_path):
    """Tensor parallelism with an engine (`RankOrder(busy=...)`): while it has work, a capture that traffic
    asks for evicts nothing (the graphs steps pad into stay in service) and runs no capture; an
    operator's release still runs at once; the warm start waits. Once idle, `poll` asks again for
    what did not fit, evicting by policy, and captures it. A cold start's queue is a cover of sizes."""
    busy = [False]
    step, fake = CountingStep(8), FakeGraphBackend(lambda s: 2000 + 500 * s)  # 8: 6,000 bytes, 4: 4,000
    cfg = GraphCacheConfig("full", SIZES, 8, memory_budget=12_000, inline_capture=True,
                           stats_file=tmp_path / "none-yet.json")
    cache = GraphCache(step, cfg, torch.device("cpu"), FP, fake, order=RankOrder(busy=lambda: busy[0]))
    assert full_sizes(cache.snapshot().warm_queue) == (8, 4, 2, 1)  # the cover, largest first
    for _ in range(2):  # 8 and 4: 10,000 of 12,000 bytes
        assert cache.warm_step() is True
        cache.poll()
    assert fake.captured == [8, 4]
    busy[0] = True
    assert cache.warm_step() is False  # 2 and 1 wait for an idle engine
    for _ in range(5):
        for n in (1, 2):
            write(step, n)
            cache.run(n)  # pads into 4; asks for its own size, which would need an eviction
        cache.poll()
    assert fake.released == [] and cache.queued_ops() == []
    expected = write(step, 7)
    assert torch.equal(cache.run(7), expected) and (7, 8) in step.padding_calls  # 8 still in service
    evicted = cache.evict_async([4])  # an operator's release: no rank waits on it
    cache.poll()
    assert fake.released == [4] and evicted.result(0)[4].outcome is OpOutcome.EVICTED
    assert fake.captured == [8, 4]
    busy[0] = False
    cache.poll()  # idle: asked again (now within budget without evicting), captured one at a time
    assert sorted(fake.captured[2:]) == [1, 2] and cache.used_bytes <= 12_000
    cache.close()


def test_the_cold_start_cover_pads_every_allowed_size_at_most_twice_over():
    from cache_manager.sizes import PaddingTable
    from cache_manager.warm import _cover

    for sizes in [(1, 2, 4, 8), tuple(range(1, 101)), (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100),
                  (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)]:
        cover = _cover(sizes)
        assert cover[0] == sizes[-1] and cover[-1] == sizes[0] and cover == sorted(cover, reverse=True)
        table = PaddingTable(tuple(sorted(cover)))
        assert all(table.bucket_for(n) <= 2 * n for n in sizes), (sizes, cover)


def test_eviction_while_another_capture_is_pending_takes_the_graph_out_at_once():
    gate = threading.Event()
    cache, step, fake, _ = make(gate=gate)
    gate.set()
    cache.capture([8])
    gate.clear()
    cache.run(3)  # 4 goes to the capture thread and waits on the gate; 8 serves it meanwhile
    assert fake.started.wait(5) and bucket(cache, 8).since_start.replays == 1
    evicted = cache.evict_async([8])
    assert bucket(cache, 8).state is BucketState.EVICTED and not evicted.done()
    write(step, 8)
    cache.run(8)  # 8 is no longer replayed: eager while it is captured again (queued behind 4)
    assert bucket(cache, 8).since_start.replays == 1
    gate.set()
    cache.wait_idle()
    assert evicted.result()[8].outcome is OpOutcome.EVICTED and evicted.result()[8].bytes == 8000
    assert fake.captured == [8, 4, 8] and fake.released == [8]
    assert cache.used_bytes == fake.live_bytes == 12_000


def test_budget_counts_captures_in_flight():
    gate = threading.Event()
    cache, _step, fake, _ = make(budget=8000, bytes_for=lambda s: 4000, gate=gate)
    gate.set()
    run_settled(cache, 1)
    cache.run(1)  # replayed: 1 is the graph in use
    gate.clear()
    cache.run(2)  # estimated 4000: fits beside 1 (4000 + 4000 <= 8000); goes to the capture thread
    cache.run(3)  # 4 would need 4000 more while 2 is in flight: over budget, and 1 is in use
    assert bucket(cache, 4).since_start.eager_fallbacks == {"budget": 1}
    gate.set()
    cache.wait_idle()
    assert fake.captured == [1, 2] and fake.peak_bytes <= 8000


def test_close_during_a_capture_ends_cleanly_and_skips_queued_captures():
    gate = threading.Event()
    cache, _step, fake, _ = make(gate=gate)
    cache.run(1)
    assert fake.started.wait(5)
    cache.run(2)
    cache.run(3)  # 2 and 4 are queued behind 1
    threading.Timer(0.1, gate.set).start()
    cache.close()
    assert fake.captured == [1] and fake.live == {}  # 1 finished and was released; 2 and 4 never started


def test_close_with_a_hung_capture_returns_and_says_so():
    cache, _step, fake, _ = make(gate=threading.Event())
    cache.run(1)
    assert fake.started.wait(5)
    with structlog.testing.capture_logs() as logs:
        cache.close(timeout=0.2)
    assert any(e["event"] == "graph_capture_thread_hung" for e in logs)
    fake.gate.set()  # let the thread end


def test_full_and_piecewise_entries_share_one_budget_and_evict_each_other():
    """Both kinds of graph under one budget: a hot piecewise size displaces a cold full one, each
    kind pads only into graphs of its own kind, and the counters stay per kind."""
    full_step, piece_step = CountingStep(8), CountingStep(32)
    cfg = GraphCacheConfig("full_and_piecewise", (1, 2, 4, 8, 16, 32), 8, memory_budget=10_000, max_tokens=32)
    fake = FakeGraphBackend(lambda s: 4000)
    cache = GraphCache({GraphFamily(FULL): full_step, GraphFamily(PIECEWISE): piece_step}, cfg, torch.device("cpu"), FP,
                       fake)
    assert cfg.sizes == (1, 2, 4, 8) and cfg.piecewise_sizes == (1, 2, 4, 8, 16, 32)
    write(full_step, 8)
    run_settled(cache, 8)  # full:8 (4000)
    run_settled(cache, 2)  # full:2 (4000): 8000 of 10,000
    for _ in range(5):  # a 12-token step asks for piecewise:16, hot: displaces the coldest full graph
        run_settled(cache, 12, CudaGraphMode.PIECEWISE)
    captured = {(b.kind, b.size) for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED}
    assert ("piecewise", 16) in captured and len(captured) == 2
    # The first piecewise graph had no measurement of its kind to estimate from (estimated 0): it was
    # recorded beside the two full graphs, and its commit evicted the cold one to fit the budget.
    assert fake.peak_bytes == 12_000 and fake.released == [2]
    assert cache.used_bytes == fake.live_bytes <= 10_000
    piece = next(b for b in cache.snapshot().buckets if (b.kind, b.size) == ("piecewise", 16))
    assert piece.since_start.replays == 4 and piece.since_start.padded_rows == 4 * 4
    assert (12, 16) in piece_step.padding_calls and (12, 16) not in full_step.padding_calls
    # a full step never pads into a piecewise graph, nor the reverse
    assert cache.descriptor(3) == BatchDescriptor(CudaGraphMode.FULL, 4)
    assert cache.descriptor(3, CudaGraphMode.PIECEWISE) == BatchDescriptor(CudaGraphMode.PIECEWISE, 4)
    with pytest.raises(ValueError, match="piecewise capture sizes|are not capture sizes"):
        cache.capture([3], "piecewise")
    assert cache.evict([16], "piecewise")[16].outcome is OpOutcome.EVICTED
    cache.close()


LORA = GraphFamily(FULL, lora=True)


def make_lora(budget=10**9, bytes_for=lambda s: 1000 * s, **kw):
    """A cache of base and LoRA graphs (steps with adapter rows) over fake graphs: "lora:s" in the fake's records."""
    clock = Clock()
    base, lora = CountingStep(8), CountingStep(8, name="lora")
    fake = FakeGraphBackend(bytes_for)
    cfg = GraphCacheConfig("full", SIZES, 8, memory_budget=budget, **kw)
    cache = GraphCache({GraphFamily(FULL): base, LORA: lora}, cfg, torch.device("cpu"), FP, fake, clock=clock)
    return cache, base, lora, fake


def test_lora_and_base_graphs_share_one_budget_and_evict_each_other():
    """One cache holds the graphs of steps with and without adapter rows under one budget: a LoRA
    graph displaces the coldest base graph and the reverse (by the same recent replays per byte),
    each family replays and pads only into its own graphs, and together they never exceed the budget."""
    cache, base, lora, fake = make_lora(budget=8000, bytes_for=lambda s: 3000)
    for _ in range(3):
        run_settled(cache, 1)  # full:1, hot
    run_settled(cache, 2)  # full:2, asked for once: 6000 of 8000
    assert fake.live == {1: 3000, 2: 3000}
    expected = write(lora, 3)
    assert torch.equal(run_settled(cache, 3, LORA), expected)  # eager: no LoRA graph to pad into
    assert (3, 4) not in base.padding_calls and lora.runs == [3]
    # Its commit measured 3000 more: the coldest graph per byte goes, a base one (full:1 is hot).
    assert fake.captured == [1, 2, "lora:4"] and fake.released == [2]
    assert fake.live_bytes <= 8000 and cache.used_bytes == fake.live_bytes
    assert torch.equal(cache.run(3, LORA), expected)  # replays the LoRA graph, padded
    assert (3, 4) in lora.padding_calls and (3, 4) not in base.padding_calls
    cache.run(1)  # a base step: full:1 is the graph in use now
    run_settled(cache, 2)  # full:2 asked for again (twice now): the LoRA graph is as cold per byte, and goes
    assert fake.released == [2, "lora:4"] and set(fake.live) == {1, 2} and fake.live_bytes <= 8000
    snap = cache.snapshot()
    lora_entry = next(b for b in snap.buckets if b.lora and b.size == 4)
    assert lora_entry.state is BucketState.EVICTED and lora_entry.since_start.replays == 1
    assert lora_entry.since_start.evictions == 1 and snap.lora_used_bytes == 0
    assert [b.lora for b in snap.buckets] == [False] * 4 + [True] * 4  # base rows first, then LoRA ones
    cache.close()


def test_a_budget_shrink_evicts_from_lora_and_base_graphs_alike():
    """The one budget: a shrink evicts by policy among every graph (cold LoRA graphs before hot base
    ones) until together they fit, and a capture of either family then counts against it."""
    cache, _, _, fake = make_lora(budget=100_000)
    cache.capture([1, 2, 4])  # 7000 bytes
    cache.capture([2, 8], "full+lora")  # 10_000 bytes
    for n in (1, 2, 4, 1, 2, 4):
        run_settled(cache, n)  # the base graphs are hot; the LoRA ones were never replayed

    def shrink(budget: int) -> dict:
        evicted = cache.set_budget(budget)
        assert cache.budget_bytes == budget
        assert cache.used_bytes == fake.live_bytes <= budget
        return evicted

    evicted = shrink(10_000)  # 7000 over: the cold LoRA graph of 8 alone frees enough
    assert set(evicted) == {BatchDescriptor(FULL, 8, lora=True)}
    assert evicted[BatchDescriptor(FULL, 8, lora=True)].outcome is OpOutcome.EVICTED
    assert evicted[BatchDescriptor(FULL, 8, lora=True)].bytes == 8000
    assert fake.live == {1: 1000, 2: 2000, 4: 4000, "lora:2": 2000}
    evicted = shrink(2500)  # 6500 over: the last LoRA graph, then the base graphs of least replays per byte
    assert set(evicted) == {BatchDescriptor(FULL, 2), BatchDescriptor(FULL, 4), BatchDescriptor(FULL, 2, lora=True)}
    assert all(r.outcome is OpOutcome.EVICTED for r in evicted.values())
    assert fake.live == {1: 1000}
    assert cache.capture([8], LORA)[8].outcome is OpOutcome.OVER_BUDGET  # the LoRA graphs' budget is the one
    cache.close()


def test_lora_and_base_stats_round_trip_in_one_file_and_warm_start_both(tmp_path):
    path = tmp_path / "stats.json"
    first, _, _, _ = make_lora(stats_file=path)
    for n, kind, times in ((8, FULL, 3), (2, LORA, 5)):
        for _ in range(times + 1):
            run_settled(first, n, kind)
    first.close()
    saved = json.loads(path.read_text())
    assert {"full:8", "full+lora:2"} <= set(saved["stats"]["buckets"]) and "full+lora:2" in saved["stats"]["requested"]
    cache, _, _, fake = make_lora(stats_file=path)
    assert list(cache.snapshot().warm_queue) == [BatchDescriptor(FULL, 2, lora=True), BatchDescriptor(FULL, 8)]
    cache.prepare(timeout_s=30)
    assert fake.captured == ["lora:2", 8]
    persisted = {(b.lora, b.size): b.persisted.replays for b in cache.snapshot().buckets if b.persisted.replays}
    assert persisted == {(True, 2): 5, (False, 8): 3}
    cache.close()


def test_the_separate_lora_stats_file_of_earlier_versions_is_merged_and_moved_aside(tmp_path):
    """Before one cache, the LoRA graphs' stats were a file of their own (`<stats>.lora`, keyed like the
    base file, under a fingerprint naming the adapter slots): a restart after the upgrade merges it,
    so both warm starts survive, and its first save moves the old file aside (merged once only)."""
    path = tmp_path / "stats.json"
    lora_fp = dataclasses.replace(FP, model="tiny+lora:2x8")
    old_base, old_lora = StatsTables(), StatsTables()
    old_base.bucket(BatchDescriptor(FULL, 8)).replays = 3
    old_lora.bucket(BatchDescriptor(FULL, 2)).replays = 5
    old_lora.bucket(BatchDescriptor(FULL, 2)).bytes = 2000
    old_lora.req(BatchDescriptor(FULL, 2)).requests = 5
    for file, fingerprint, tables in ((path, FP, old_base), (tmp_path / "stats.json.lora", lora_fp, old_lora)):
        file.write_text(json.dumps({"format_version": 2, "fingerprint": fingerprint.to_json(), "stats": tables.to_json()}))

    def new_cache() -> GraphCache:
        cfg = GraphCacheConfig("full", SIZES, 8, stats_file=path)
        steps = {GraphFamily(FULL): CountingStep(8), LORA: CountingStep(8, name="lora")}
        return GraphCache(steps, cfg, torch.device("cpu"), FP, FakeGraphBackend(), lora_fingerprint=lora_fp)

    cache = new_cache()
    assert list(cache.snapshot().warm_queue) == [BatchDescriptor(FULL, 2, lora=True), BatchDescriptor(FULL, 8)]
    assert cache.snapshot().requested_persisted == {BatchDescriptor(FULL, 2, lora=True): 5}
    assert cache.save()
    assert [p.name.startswith("stats.json.lora.migrated-") for p in tmp_path.iterdir() if p.name != "stats.json"] == [True]
    cache.close()
    again = new_cache()  # the counters are in the one file now, and counted once
    assert again.snapshot().requested_persisted == {BatchDescriptor(FULL, 2, lora=True): 5}
    again.close()


def test_verify_steps_are_graph_entries_of_their_own_keyed_by_query_tokens():
    """A uniform step of 1 + k tokens a row (speculative verify) is keyed FULL+q(1+k) by the one
    dispatcher, captured lazily beside the decode graph of the same row count; a mixed step, or a
    verify width without a registered step, runs as pieces (or outside the cache)."""
    from cache_manager import GraphFamily

    steps = {GraphFamily(FULL): CountingStep(8), GraphFamily(FULL, query_tokens=4): CountingStep(8, name="q4"),
             GraphFamily(PIECEWISE): CountingStep(64, name="pieces")}
    fake = FakeGraphBackend()
    cfg = GraphCacheConfig("full_and_piecewise", SIZES, 8, memory_budget=10**9, max_tokens=64)
    cache = GraphCache(steps, cfg, torch.device("cpu"), FP, fake, clock=Clock())
    for plan_args in [(3, 3), (12, 3, False, 4)]:  # a decode of 3 rows, then a verify step of 3 rows x 4
        cache.execute(cache.plan_step(*plan_args))
        cache.wait_idle()
    assert fake.captured == [4, "q4:4"]
    keys = {str(k) for k in cache.residency.buckets if cache.residency.buckets[k].graph is not None}
    assert keys == {"full:4", "full+q4:4"}
    plan = cache.plan_step(12, 3, False, 4)
    assert str(plan.target) == "full+q4:4" and plan.requested.query_tokens == 4
    assert cache.plan_step(9, 3, False, 3).requested.mode is PIECEWISE  # no q3 step: pieces, by tokens
    assert cache.plan_step(13, 3, False, 4).requested.mode is PIECEWISE  # not uniform (a prompt beside)
    cache.close()
