import pytest

from cache_manager import GraphCacheConfig, parse_memory_budget, resolve_budget
from cache_manager.budget import Candidate, choose_victims, estimate_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1e9", 10**9),
        ("0.2", 0.2),
        ("1", 1.0),
        ("2147483648", 2147483648),
        ("1.5 GB", 1_500_000_000),
        ("64k", 65536),
        ("100B", 100),
    ],
)
def test_parse_memory_budget(text, value):
    assert parse_memory_budget(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "0", "2 parsecs", "1.5e0x", "1000.5", "0.1B"])
def test_parse_memory_budget_rejects(text):
    with pytest.raises(ValueError, match="memory budget"):
        parse_memory_budget(text)


def test_resolve_budget_fraction_bytes_and_default():
    assert resolve_budget("0.25", 1000) == 250
    assert resolve_budget(2048, 1000) == 2048
    assert resolve_budget("1KiB", 10) == 1024
    assert resolve_budget(None, 1000) == 100  # default: a tenth of device memory


def test_config_validates_budget_once():
    with pytest.raises(ValueError, match="memory budget"):
        GraphCacheConfig(mode="full", capture_sizes=None, max_batch=8, memory_budget="lots")
    with pytest.raises(ValueError, match="unknown cuda graph mode"):
        GraphCacheConfig(mode="piecewise-ish", capture_sizes=None, max_batch=8)


def test_estimate_same_bucket_then_interpolates_or_extrapolates():
    assert estimate_bytes(8, {8: 500, 4: 100}) == 500
    assert estimate_bytes(2, {}) == 0
    assert estimate_bytes(64, {8: 22}) == 22  # one point: the fixed part dominates
    assert estimate_bytes(16, {8: 100, 32: 400}) == 200  # interpolation
    assert estimate_bytes(16, {4: 100, 8: 300}) == 700  # extrapolation along the nearest two
    assert estimate_bytes(2, {8: 300, 16: 700}) == 0  # below all: never negative
    assert estimate_bytes(16, {4: 300, 8: 100}) == 100  # never a negative slope


def test_victims_lowest_replays_per_byte_first_then_lru():
    cands = [
        Candidate(1, bytes=100, heat=50, last_use=5.0),  # 0.5 per byte
        Candidate(2, bytes=100, heat=10, last_use=9.0),  # 0.1
        Candidate(4, bytes=100, heat=10, last_use=1.0),  # 0.1, older -> first
        Candidate(8, bytes=1000, heat=10, last_use=9.0),  # 0.01 -> very first
    ]
    assert choose_victims(cands, 1000) == [8]
    assert choose_victims(cands, 1001) == [8, 4]
    assert choose_victims(cands, 1150) == [8, 4, 2]
    assert choose_victims(cands, 10**6) is None  # cannot make room: evict nothing
    assert choose_victims(cands, 0) == []
    # greedy takes 8 then 4 then 2 ... ; pruning keeps only what the room needs
    big_last = [Candidate(1, 100, 0, 0.0), Candidate(2, 5000, 1, 0.0)]
    assert choose_victims(big_last, 1000) == [2]
    tie = [Candidate(1, 100, 0, 0.0), Candidate(8, 800, 0, 0.0)]
    assert choose_victims(tie, 500) == [8]  # equal value and age: the larger graph goes
    assert choose_victims(cands, 150, max_score=0.05) == [8]  # only size 8 is cheap enough
    assert choose_victims(cands, 1050, max_score=0.05) is None  # ...and it alone cannot make room
