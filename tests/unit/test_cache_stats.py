import json
import os

import pytest
import torch

from cache_manager import BatchDescriptor, CudaGraphMode, Fingerprint, GraphCache, GraphCacheConfig, StatsStore
from cache_manager.stats import Counters, StatsTables
from cache_manager.testing import CountingStep, FakeGraphBackend, full_sizes

FP = Fingerprint("tiny", "bfloat16", "H200", "2.11", (1, 2, 4, 8), 8)


def full(n: int) -> BatchDescriptor:
    return BatchDescriptor(CudaGraphMode.FULL, n)


def piecewise(n: int) -> BatchDescriptor:
    return BatchDescriptor(CudaGraphMode.PIECEWISE, n)


def tables() -> StatsTables:
    t = StatsTables()
    t.req(full(3)).requests = 5
    t.req(full(3)).add_eager("budget")
    t.bucket(full(4)).replays = 7
    t.bucket(full(4)).bytes = 1234
    t.bucket(piecewise(4)).replays = 2  # same size, other kind: its own entry
    return t


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


def test_atomic_save_round_trips_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "stats.json"
    store = StatsStore(path, FP)
    assert store.save(tables())
    data = json.loads(path.read_text())
    assert data["format_version"] == 2 and data["fingerprint"]["device_name"] == "H200"
    assert set(data["stats"]["buckets"]) == {"full:4", "piecewise:4"}
    assert leftovers(tmp_path) == ["stats.json"]
    loaded = store.load()
    assert loaded.buckets[full(4)].replays == 7 and loaded.buckets[full(4)].bytes == 1234
    assert loaded.buckets[piecewise(4)].replays == 2
    assert loaded.requested[full(3)].eager == {"budget": 1}


def test_a_format_1_file_reads_as_full_graphs(tmp_path):
    """Stats written before piecewise graphs existed (bare sizes) are the FULL graphs' counters."""
    path = tmp_path / "stats.json"
    old = {"requested": {"3": Counters(requests=5).to_json()}, "buckets": {"4": Counters(replays=7).to_json()}}
    path.write_text(json.dumps({"format_version": 1, "fingerprint": FP.to_json(), "saved_at": 0, "stats": old}))
    loaded = StatsStore(path, FP).load()
    assert loaded.buckets == {full(4): Counters(replays=7)} and loaded.requested[full(3)].requests == 5
    assert leftovers(tmp_path) == ["stats.json"]  # not set aside


def test_the_lora_graphs_separate_file_of_earlier_versions_merges_under_lora_keys(tmp_path):
    """Before one graph cache, the LoRA graphs' stats were `<name>.lora`, under a fingerprint naming the
    adapter slots: they load keyed by the LoRA descriptors beside the base file's, the first save moves
    the old file aside, and the next load counts them once. A LoRA file of other adapter slots is
    foreign: set aside, the base counters still load."""
    path, legacy = tmp_path / "stats.json", tmp_path / "stats.json.lora"
    lora_fp = Fingerprint("tiny+lora:2x8", "bfloat16", "H200", "2.11", (1, 2, 4, 8), 8)
    assert StatsStore(path, FP).save(tables()) and StatsStore(legacy, lora_fp).save(tables())
    store = StatsStore(path, FP, lora_fingerprint=lora_fp)
    loaded = store.load()
    lora_full4 = BatchDescriptor(CudaGraphMode.FULL, 4, lora=True)
    assert loaded.buckets[full(4)].replays == 7 and loaded.buckets[lora_full4].replays == 7
    assert loaded.requested[BatchDescriptor(CudaGraphMode.FULL, 3, lora=True)].eager == {"budget": 1}
    assert store.save(loaded)
    assert "full+lora:4" in json.loads(path.read_text())["stats"]["buckets"]
    assert [n.startswith("stats.json.lora.migrated-") for n in leftovers(tmp_path) if n != "stats.json"] == [True]
    assert StatsStore(path, FP, lora_fingerprint=lora_fp).load().buckets[lora_full4].replays == 7
    other = tmp_path / "other"
    other.mkdir()
    assert StatsStore(other / "stats.json", FP).save(tables()) and StatsStore(other / "stats.json.lora", lora_fp).save(tables())
    other_slots = Fingerprint("tiny+lora:4x16", "bfloat16", "H200", "2.11", (1, 2, 4, 8), 8)
    loaded = StatsStore(other / "stats.json", FP, lora_fingerprint=other_slots).load()
    assert loaded.buckets[full(4)].replays == 7 and not loaded.has_lora
    assert [n.startswith("stats.json.lora.foreign-") for n in leftovers(other) if n != "stats.json"] == [True]


def test_missing_file_starts_clean(tmp_path):
    assert StatsStore(tmp_path / "nope.json", FP).load() == StatsTables()


def write_then_load(tmp_path, payload: bytes) -> tuple[StatsTables, list[str]]:
    path = tmp_path / "stats.json"
    path.write_bytes(payload)
    return StatsStore(path, FP).load(), leftovers(tmp_path)


def good_payload() -> bytes:
    return json.dumps(
        {"format_version": 1, "fingerprint": FP.to_json(), "saved_at": 0, "stats": tables().to_json()}
    ).encode()


@pytest.mark.parametrize(
    "payload",
    [
        good_payload()[: len(good_payload()) // 2],  # truncated mid-write
        os.urandom(256),  # random bytes
        b"[1, 2, 3]",  # wrong top-level type
        json.dumps({"format_version": 99, "fingerprint": FP.to_json(), "stats": {}}).encode(),
        json.dumps(
            {
                "format_version": 1,
                "fingerprint": FP.to_json(),
                "stats": {"requested": {}, "buckets": {"4": {"replays": "many"}}},
            }
        ).encode(),
        json.dumps(
            {
                "format_version": 1,
                "fingerprint": FP.to_json(),
                "stats": {"requested": {"-3": {}}, "buckets": {}},
            }
        ).encode(),
    ],
    ids=["truncated", "random", "not-object", "version", "wrong-type", "bad-key"],
)
def test_corrupt_file_is_moved_aside_and_service_starts_clean(tmp_path, payload):
    loaded, names = write_then_load(tmp_path, payload)
    assert loaded == StatsTables()
    assert len(names) == 1 and names[0].startswith("stats.json.bad-")


def test_foreign_fingerprint_is_moved_aside(tmp_path):
    other = Fingerprint("other-model", "bfloat16", "H200", "2.11", (1, 2, 4, 8), 8)
    StatsStore(tmp_path / "stats.json", other).save(tables())
    loaded = StatsStore(tmp_path / "stats.json", FP).load()
    assert loaded == StatsTables()
    names = leftovers(tmp_path)
    assert len(names) == 1 and names[0].startswith("stats.json.foreign-")


def test_unreadable_file_is_moved_aside(tmp_path):
    (tmp_path / "stats.json").mkdir()  # reading a directory fails even as root
    assert StatsStore(tmp_path / "stats.json", FP).load() == StatsTables()
    assert leftovers(tmp_path)[0].startswith("stats.json.bad-")


def test_unwritable_directory_warns_and_never_raises(tmp_path):
    (tmp_path / "afile").write_text("x")
    store = StatsStore(tmp_path / "afile" / "stats.json", FP)  # parent is a regular file
    assert store.save(tables()) is False
    assert leftovers(tmp_path) == ["afile"]


def test_counters_merge_sums_counts_and_keeps_newest_measurement():
    old = Counters(replays=3, bytes=100, eager={"budget": 1}, last_use=1.0)
    new = Counters(replays=2, bytes=0, eager={"budget": 1, "failed": 2}, last_use=5.0)
    merged = old.merged(new)
    assert (merged.replays, merged.bytes, merged.last_use) == (5, 100, 5.0)
    assert merged.eager == {"budget": 2, "failed": 2}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_cache_saves_every_interval_and_at_close_with_cumulative_counts(tmp_path):
    path = tmp_path / "stats.json"
    clock = Clock()
    cfg = GraphCacheConfig("full", (1, 2, 4, 8), 8, memory_budget=10**6, stats_file=path, save_interval_s=5)
    cache = GraphCache(CountingStep(8), cfg, torch.device("cpu"), FP, FakeGraphBackend(), clock=clock)
    cache.capture([4])
    cache.run(3)
    cache.maybe_save()
    assert not path.exists()  # interval not passed yet
    clock.t += 6
    cache.maybe_save()  # on a save thread: the engine thread never waits for the disk
    assert cache.stats.join(10)
    assert json.loads(path.read_text())["stats"]["buckets"]["full:4"]["replays"] == 1
    cache.run(3)
    cache.close()
    assert json.loads(path.read_text())["stats"]["buckets"]["full:4"]["replays"] == 2

    again = GraphCache(CountingStep(8), cfg, torch.device("cpu"), FP, FakeGraphBackend(), clock=clock)
    again.run(3)  # eager while its graph is captured (warm start would have captured it first)
    again.wait_idle()
    again.run(3)
    snap = again.snapshot()
    entry = next(b for b in snap.buckets if b.size == 4)
    assert entry.since_start.replays == 1 and entry.persisted.replays == 3
    assert full_sizes(snap.requested_since_start) == {3: 2} and full_sizes(snap.requested_persisted) == {3: 4}


def test_cache_with_unwritable_stats_path_keeps_serving(tmp_path):
    (tmp_path / "afile").write_text("x")
    cfg = GraphCacheConfig("full", (1, 2, 4, 8), 8, stats_file=tmp_path / "afile" / "stats.json")
    cache = GraphCache(CountingStep(8), cfg, torch.device("cpu"), FP, FakeGraphBackend())
    cache.run(2)
    cache.save()
    cache.close()
    assert cache.snapshot().last_save_time is None
