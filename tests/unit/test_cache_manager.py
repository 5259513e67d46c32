import time

import pytest
import structlog
import torch

from cache_manager import (
    BucketState,
    Fingerprint,
    GraphCache,
    GraphCacheConfig,
    GraphsUnavailableError,
    OpOutcome,
)
from cache_manager.testing import CountingStep, FakeGraphBackend

SIZES = (1, 2, 4, 8)
FP = Fingerprint("tiny", "float32", "cpu", torch.__version__, SIZES, 8)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(budget=10**9, bytes_for=lambda s: 1000 * s, fail=None, mode="full", backend=True, **kw):
    clock = Clock()
    step = CountingStep(8)
    fake = FakeGraphBackend(bytes_for, fail_sizes=fail) if backend else None
    cfg = GraphCacheConfig(mode, SIZES, 8, memory_budget=budget, **kw)
    cache = GraphCache(step, cfg, torch.device("cpu"), FP, fake, clock=clock)
    return cache, step, fake, clock


def write(step: CountingStep, n: int) -> torch.Tensor:
    rows = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 1
    step.inputs[:n] = rows
    return rows * 2  # what the step computes for the real rows


def bucket(cache, size):
    return next(b for b in cache.snapshot().buckets if b.size == size)


def test_lazy_capture_then_replay_pads_and_returns_first_rows():
    cache, step, fake, _ = make()
    expected = write(step, 3)
    out = cache.run(3)
    assert fake.captured == [4]
    assert (3, 4) in step.padding_calls
    assert torch.equal(out, expected)
    expected = write(step, 3)
    assert torch.equal(cache.run(3), expected)
    assert fake.captured == [4]  # captured once, replayed after
    entry = bucket(cache, 4)
    assert entry.state is BucketState.CAPTURED and entry.since_start.replays == 2
    assert entry.since_start.padded_rows == 2 and entry.since_start.captures == 1
    assert entry.bytes == 4000


def test_above_max_and_mode_none_run_eager_and_count_requested_sizes():
    cache, step, fake, _ = make(mode="none")
    expected = write(step, 5)
    assert torch.equal(cache.run(5), expected)
    snap = cache.snapshot()
    assert snap.mode == "none" and snap.requested_since_start == {5: 1}
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
    assert torch.equal(cache.run(3), expected)  # captured, measured 4000 > 500, dropped
    assert fake.captured == [4] and fake.live_bytes == 0
    cache.run(3)  # the estimate now knows 4000: no second capture
    assert fake.captured == [4]
    assert cache.snapshot().requested_detail[0].eager_fallbacks == {"budget": 2}
    assert bucket(cache, 4).state is BucketState.NOT_CAPTURED
    assert cache.snapshot().used_bytes == 0


def test_policy_evicts_lowest_replays_per_byte_and_keeps_hot_graphs():
    cache, step, fake, _ = make(budget=3000, bytes_for=lambda s: 1000)
    for n, times in ((1, 10), (2, 1), (4, 3)):
        for _ in range(times):
            write(step, n)
            cache.run(n)
    assert fake.live_bytes == 3000
    cache.run(8)  # needs room: 2 is the coldest per byte; 4 is in use
    assert fake.released == [2]
    assert {b.size for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED} == {1, 4, 8}
    assert fake.live_bytes <= 3000


def test_one_off_batch_does_not_displace_hot_graphs():
    cache, _step, fake, _ = make(budget=2000, bytes_for=lambda s: 1000)
    for _ in range(10):
        cache.run(1)
        cache.run(2)
    cache.run(4)
    assert fake.released == [] and fake.captured == [1, 2]
    assert bucket(cache, 4).since_start.eager_fallbacks == {"budget": 1}


def test_memory_never_exceeds_budget_cycling_three_buckets():
    cache, step, fake, _ = make(budget=2 * 4000, bytes_for=lambda s: 4000)
    for i in range(30):
        n = (1, 3, 7)[i % 3]
        expected = write(step, n)
        assert torch.equal(cache.run(n), expected)
        assert fake.live_bytes <= 8000 and cache.snapshot().used_bytes == fake.live_bytes


def test_memory_a_released_graph_keeps_counts_against_the_budget():
    """A release that returns less than the graph held (memory some other owner keeps) is still
    device memory: the budget must see it, or graphs plus that memory would exceed it."""

    class Leaky(FakeGraphBackend):
        def release(self, graph):  # noqa: ANN001, ANN202
            return super().release(graph) - 1000  # the device gets 1000 bytes less back

    cache, step, _, _ = make(budget=8000, bytes_for=lambda s: 4000)
    cache.residency.backend = cache.backend = Leaky(lambda s: 4000)
    for n in (1, 3, 7, 1, 3, 7):
        write(step, n)
        cache.run(n)
        assert cache.used_bytes <= 8000
    assert cache.residency.unreclaimed_bytes > 0
    held = sum(b.bytes for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED)
    assert cache.used_bytes == held + cache.residency.unreclaimed_bytes


def test_failed_capture_backs_off_doubling_then_recovers():
    cache, step, fake, clock = make(fail={4}, failure_backoff_s=60)
    with structlog.testing.capture_logs() as logs:
        expected = write(step, 3)
        assert torch.equal(cache.run(3), expected)
    assert any(
        e["event"] == "graph_capture_failed" and e["bucket"] == 4 and "OutOfMemory" in e["reason"]
        for e in logs
    )
    entry = bucket(cache, 4)
    assert entry.state is BucketState.FAILED and entry.retry_at == clock.t + 60
    clock.t += 30
    cache.run(3)
    assert entry.since_start.failures == 1 and bucket(cache, 4).since_start.eager_fallbacks == {"failed": 2}
    clock.t += 31
    cache.run(3)  # back-off over: retried, fails again, back-off doubles
    assert bucket(cache, 4).since_start.failures == 2 and bucket(cache, 4).retry_at == clock.t + 120
    fake.fail_sizes.clear()
    clock.t += 121
    cache.run(3)
    assert bucket(cache, 4).state is BucketState.CAPTURED and fake.captured == [4]


def test_warm_start_captures_hottest_first_one_per_call_within_budget(tmp_path):
    path = tmp_path / "stats.json"
    first, _step, _, _ = make(stats_file=path)
    for n, times in ((8, 5), (2, 9), (1, 2)):
        for _ in range(times):
            first.run(n)
    first.close()

    cache, _, fake, _ = make(budget=10_000, stats_file=path)  # fits 8 (8000) and 2 (2000), not 1 too
    assert cache.snapshot().warm_queue == (2, 8, 1)
    assert cache.warm_step() is True and fake.captured == [2]
    assert cache.warm_step() is True and fake.captured == [2, 8]
    assert cache.warm_step() is False and fake.captured == [2, 8]  # 1 would exceed the budget
    assert fake.released == []
    assert cache.warm_step() is False

    off, _, _fake_off, _ = make(stats_file=path, warm_start=False)
    assert off.snapshot().warm_queue == () and off.warm_step() is False


def test_operator_capture_evict_and_set_budget():
    cache, step, _fake, _ = make(budget=20_000)
    res = cache.capture([4, 8])
    assert res[4].outcome is OpOutcome.CAPTURED and res[8].outcome is OpOutcome.CAPTURED
    assert cache.capture([4])[4].outcome is OpOutcome.ALREADY_CAPTURED
    assert (0, 4) in step.padding_calls  # captures between steps pad every row
    with pytest.raises(ValueError, match=r"allowed: \[1, 2, 4, 8\]"):
        cache.capture([3])
    ev = cache.evict([4, 1])
    assert ev[4].outcome is OpOutcome.EVICTED and ev[4].bytes == 4000
    assert ev[1].outcome is OpOutcome.NOT_CAPTURED
    assert bucket(cache, 4).state is BucketState.EVICTED
    cache.capture([1, 2])
    assert cache.snapshot().used_bytes == 11_000
    evicted = cache.set_budget(4000)
    assert set(evicted) == {8} and all(r.outcome is OpOutcome.EVICTED for r in evicted.values())
    assert cache.snapshot().used_bytes <= 4000 == cache.snapshot().budget_bytes
    assert cache.capture([8])[8].outcome is OpOutcome.OVER_BUDGET


def test_snapshot_and_reset_stats():
    cache, _step, _fake, _ = make(budget=5000)
    cache.run(1)
    cache.run(3)
    cache.run(3)
    snap = cache.snapshot()
    assert snap.mode == "full" and snap.device == "cpu" and snap.capture_sizes == SIZES
    assert snap.budget_bytes == 5000 and snap.used_bytes == 5000
    assert snap.requested_since_start == {1: 1, 3: 2}
    states = {b.size: b.state for b in snap.buckets}
    assert states == {
        1: BucketState.CAPTURED,
        2: BucketState.NOT_CAPTURED,
        4: BucketState.CAPTURED,
        8: BucketState.NOT_CAPTURED,
    }
    cache.reset_stats()
    snap = cache.snapshot()
    assert snap.requested_since_start == {} and snap.requested_persisted == {}
    assert bucket(cache, 4).bytes == 4000 and bucket(cache, 4).since_start.replays == 0


def test_debug_check_detects_moved_inputs():
    cache, step, _, _ = make(debug_check_addresses=True)
    cache.run(2)
    cache.run(2)
    step.inputs = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="moved"):
        cache.run(2)


def test_replay_totals_are_logged_per_interval_not_per_step():
    cache, _step, _, clock = make(replay_log_interval_s=60)
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
            cache.run(n)
            assert fake.live_bytes <= cache.budget_bytes
    assert bucket(cache, 4).state is not BucketState.CAPTURED  # 10 uses do not pay for 22 MiB
    for _ in range(40):
        cache.run(3)
    assert bucket(cache, 4).state is not BucketState.CAPTURED  # 50 uses per 22 MiB < 10 per 4 MiB
    for _ in range(26):
        cache.run(3)
    assert bucket(cache, 4).state is BucketState.CAPTURED
    assert fake.released == [4, 1]  # the first capture of 4 measured over budget and was dropped
    assert bucket(cache, 1).since_start.evictions == 1 and bucket(cache, 2).state is BucketState.CAPTURED
    for _ in range(10):
        for n in (1, 2, 3):
            cache.run(n)
            assert fake.live_bytes <= cache.budget_bytes


def test_capture_log_reports_the_stall_beside_the_capture_time():
    """A capture's own time leaves out its warm-up, collection and measurement; the log also says how
    long the step that asked for it waited."""

    class SlowAroundCapture(FakeGraphBackend):
        def capture(self, step, size):  # noqa: ANN001, ANN201
            time.sleep(0.05)  # warm-up and gc before the timed capture, as the CUDA backend does
            return super().capture(step, size)

    cache, step, _, _ = make()
    cache.residency.backend = cache.backend = SlowAroundCapture()
    with structlog.testing.capture_logs() as logs:
        write(step, 3)
        cache.run(3)
    (event,) = [e for e in logs if e["event"] == "graph_captured"]
    assert event["bucket"] == 4 and event["ms"] == 1.0
    assert event["stall_ms"] >= 50
