"""BlockPool: refs and the free queue (LRU by free time, a sequence's tail first), all-or-nothing
allocation, the prefix cache over registered full blocks, chained hashes, stats."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from service.engine.block_pool import NULL_BLOCK, ROOT, BlockPool, block_hash, chain_hashes

DIGESTS = [bytes([i]) * 16 for i in range(6)]  # a small set, so that lookups hit and registrations collide


def h(i: int) -> bytes:
    return DIGESTS[i]


# ---- deterministic ---------------------------------------------------------------------------


def test_a_pool_needs_the_null_block_and_one() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, 16)
    pool = BlockPool(2, 16)
    assert pool.allocate(1) == [1] and pool.allocate(1) is None
    pool.check()


def test_allocate_hands_out_each_block_once_never_the_null_block() -> None:
    pool = BlockPool(9, 4)
    got = pool.allocate(3) + pool.allocate(5)
    assert sorted(got) == list(range(1, 9)) and NULL_BLOCK not in got
    assert all(pool.refs(b) == 1 for b in got) and pool.num_free == 0
    pool.check()


def test_allocate_returns_none_and_takes_nothing_when_short() -> None:
    pool = BlockPool(6, 4)
    held = pool.allocate(2)
    pool.register(held[0], h(0))
    pool.free(held)  # free, and block held[0] still cached
    before = (pool.stats(), list(pool._free), dict(pool._by_hash))
    assert pool.allocate(6) is None
    assert (pool.stats(), list(pool._free), dict(pool._by_hash)) == before  # nothing evicted, nothing taken
    assert pool.lookup([h(0)], 1) == [held[0]]  # still a hit
    assert pool.allocate(5) is None and pool.allocate(4) is not None and pool.num_free == 0
    pool.check()


def test_a_freed_registered_block_is_hit_until_allocate_evicts_it() -> None:
    pool = BlockPool(4, 4)  # 3 usable blocks
    a = pool.allocate(1)
    pool.register(a[0], h(1))
    pool.free(a)
    assert pool.stats().cached == 1 and pool.stats().used == 0
    for _ in range(3):  # hit, give back, hit again: it stays cached while free
        assert pool.lookup([h(1)], 1) == a and pool.refs(a[0]) == 1 and pool.stats().used == 1
        pool.free(a)
    # The free queue is [2, 3, a]: two allocations leave it cached, the third takes and evicts it.
    assert a[0] not in pool.allocate(2)
    assert pool.lookup([h(1)], 1) == a
    pool.free(a)
    assert pool.allocate(1) == a and pool.refs(a[0]) == 1
    assert pool.lookup([h(1)], 1) == [] and pool.stats().cached == 0
    pool.check()


def test_a_held_cached_block_is_shared_and_freed_once_per_hold() -> None:
    pool = BlockPool(4, 4)
    a = pool.allocate(1)
    pool.register(a[0], h(2))
    assert pool.lookup([h(2)], 1) == a and pool.refs(a[0]) == 2  # a second holder, no new block
    assert pool.stats().used == 1
    pool.free(a)
    assert pool.refs(a[0]) == 1 and a[0] not in pool._free
    pool.free(a)
    assert pool.refs(a[0]) == 0 and a[0] in pool._free
    with pytest.raises(AssertionError, match="freed more often than held"):
        pool.free(a)
    pool.check()


def test_eviction_is_lru_by_free_time_and_a_sequences_tail_goes_first() -> None:
    pool = BlockPool(7, 4)  # blocks 1..6
    first = pool.allocate(3)  # [1, 2, 3]
    second = pool.allocate(3)  # [4, 5, 6]
    assert (first, second) == ([1, 2, 3], [4, 5, 6])
    for i, block in enumerate(first + second):
        pool.register(block, h(i))
    pool.free(second)  # freed first: 6, 5, 4 (tail first)
    pool.free(first)  # then 3, 2, 1
    assert list(pool._free) == [6, 5, 4, 3, 2, 1]
    # Reuse takes the least recently freed, the tail of a sequence before its head: the head of
    # `first` (its shared prefix, were it one) is evicted last.
    assert pool.allocate(1) == [6] and pool.lookup([h(3), h(4), h(5)], 3) == [4, 5]
    pool.free([4, 5])  # back at the end, 5 before 4
    assert pool.allocate(3) == [3, 2, 1]
    assert pool.allocate(2) == [5, 4] and pool.num_free == 0
    assert pool.stats().cached == 0
    pool.check()


def test_a_lookup_hit_that_is_given_back_moves_to_the_back_of_the_queue() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(3)
    pool.register(blocks[0], h(0))
    pool.free(blocks)  # free queue: 3, 2, 1
    assert pool.lookup([h(0)], 1) == [1]
    pool.free([1])  # touched again: now the most recently freed
    assert list(pool._free) == [3, 2, 1]
    assert pool.allocate(2) == [3, 2] and pool.lookup([h(0)], 1) == [1]


def test_lookup_stops_at_the_first_miss_and_respects_max_blocks() -> None:
    pool = BlockPool(8, 4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        if i != 2:
            pool.register(block, h(i))
    pool.free(blocks)
    assert pool.lookup([h(0), h(1), h(2), h(3)], 4) == blocks[:2]  # h(2) misses: h(3) is not reached
    pool.free(blocks[:2])
    assert pool.lookup([h(0), h(1), h(3)], 2) == blocks[:2]  # capped at 2 though h(3) would hit
    pool.free(blocks[:2])
    assert pool.lookup([h(0), h(1)], 0) == [] and pool.lookup([], 5) == []
    assert pool.lookup([h(5), h(0)], 2) == []  # a miss first: nothing, even if later ones are cached
    assert pool.stats().used == 0
    pool.check()


def test_register_keeps_the_first_block_under_a_hash_and_the_first_hash_of_a_block() -> None:
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    pool.register(a, h(0))
    pool.register(b, h(0))  # an identical block computed meanwhile stays private
    pool.register(a, h(1))  # a block keeps its first hash
    assert pool.lookup([h(0)], 1) == [a] and pool.lookup([h(1)], 1) == []
    assert pool.stats().cached == 1
    with pytest.raises(AssertionError, match="registered while free"):
        c = pool.allocate(1)
        pool.free(c)
        pool.register(c[0], h(3))
    pool.check()


def test_without_prefix_caching_nothing_is_registered_or_hit() -> None:
    pool = BlockPool(4, 4, prefix_caching=False)
    a = pool.allocate(1)
    pool.register(a[0], h(0))
    pool.free(a)
    assert pool.lookup([h(0)], 1) == [] and pool.stats().cached == 0 and pool.stats().used == 0
    pool.check()


def test_stats_count_used_free_cached_and_the_hit_rate() -> None:
    pool = BlockPool(11, 16)
    s = pool.stats()
    assert (s.num_blocks, s.block_size, s.used, s.free, s.cached) == (10, 16, 0, 10, 0)
    assert s.hit_rate == 0.0  # no query yet: no division by zero
    a = pool.allocate(4)
    pool.register(a[0], h(0))
    pool.register(a[1], h(1))
    pool.free(a[2:])
    s = pool.stats()
    assert (s.used, s.free, s.cached) == (2, 8, 2)
    pool.free(a[:2])
    s = pool.stats()
    assert (s.used, s.free, s.cached) == (0, 10, 2)  # cached blocks count as free
    pool.count_query(40, 32)
    pool.count_query(60, 0)
    s = pool.stats()
    assert (s.prefix_queries, s.prefix_hits) == (100, 32) and s.hit_rate == pytest.approx(0.32)
    pool.allocate(10)
    assert pool.stats().cached == 0  # evicted on reuse


def test_chain_hashes_depend_on_every_earlier_block_and_the_adapter() -> None:
    bs = 4
    base = list(range(1, 13))  # three full blocks
    hs = chain_hashes(base, bs)
    assert len(hs) == 3 and len(set(hs)) == 3
    assert chain_hashes(base + [99, 98], bs) == hs  # a partial block is not hashed
    assert chain_hashes(list(base), bs) == hs  # equal tokens: equal hashes
    assert hs[0] == block_hash(ROOT, base[:4]) and hs[1] == block_hash(hs[0], base[4:8])
    changed = [base[0] + 100] + base[1:]  # only the first block differs ...
    other = chain_hashes(changed, bs)
    assert all(x != y for x, y in zip(hs, other, strict=True))  # ... yet every later hash differs
    changed_mid = base[:5] + [0] + base[6:]
    assert chain_hashes(changed_mid, bs)[0] == hs[0] and chain_hashes(changed_mid, bs)[1:] != hs[1:]
    assert all(x != y for x, y in zip(chain_hashes(changed_mid, bs)[1:], hs[1:], strict=True))
    ha = chain_hashes(base, bs, adapter="a#0")
    assert all(x != y for x, y in zip(hs, ha, strict=True))
    assert chain_hashes(base, bs, adapter="a#0") == ha and chain_hashes(base, bs, adapter="a#1") != ha
    # Resuming a chain from its last hash gives the same hashes as hashing it whole.
    assert chain_hashes(base, bs, parent=hs[0], first=1) == hs[1:]
    assert chain_hashes(base, bs, parent=hs[1], first=2) == hs[2:]


def test_adapter_names_cannot_run_into_token_bytes() -> None:
    # The adapter key is NUL-terminated and tokens are fixed-width: no two (adapter, tokens) pairs
    # hash the same bytes.
    assert block_hash(ROOT, [1, 2], "a") != block_hash(ROOT, [1, 2], "a\0")
    assert block_hash(ROOT, [1, 2], "") != block_hash(ROOT, [1, 2], "\0")
    assert block_hash(ROOT, [1], "") != block_hash(ROOT, [1, 0], "")


# ---- properties ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 3), max_size=20), b=st.lists(st.integers(0, 3), max_size=20),
       bs=st.integers(1, 4), adapter_a=st.sampled_from(["", "x#0", "x#1"]),
       adapter_b=st.sampled_from(["", "x#0", "x#1"]))
def test_chain_hashes_are_equal_exactly_when_the_prefix_and_adapter_are(a: list[int], b: list[int], bs: int,
                                                                        adapter_a: str, adapter_b: str) -> None:
    ha, hb = chain_hashes(a, bs, adapter_a), chain_hashes(b, bs, adapter_b)
    assert len(ha) == len(a) // bs and len(hb) == len(b) // bs
    for i in range(min(len(ha), len(hb))):
        same = a[: (i + 1) * bs] == b[: (i + 1) * bs] and adapter_a == adapter_b
        assert (ha[i] == hb[i]) == same, (i, a, b)
    for k in range(1, len(ha) + 1):  # a resumed chain matches
        assert chain_hashes(a, bs, adapter_a, parent=ha[k - 1], first=k) == ha[k:]


class PoolMachine(RuleBasedStateMachine):
    """BlockPool against a model: holds per block, the free queue in free order, the hash table."""

    @initialize(num_blocks=st.integers(2, 9), prefix_caching=st.booleans())
    def setup(self, num_blocks: int, prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, 4, prefix_caching)
        self.caching = prefix_caching
        self.refs = collections.Counter()
        self.free_q = list(range(1, num_blocks))  # front: reused first
        self.by_hash: dict[bytes, int] = {}
        self.holds: list[list[int]] = []  # what each "sequence" holds, in its order
        self.queries = self.hits = 0

    def _evict(self, block: int) -> None:
        for d in [d for d, b in self.by_hash.items() if b == block]:
            del self.by_hash[d]

    @rule(n=st.integers(0, 10))
    def allocate(self, n: int) -> None:
        before_free = list(self.pool._free)
        got = self.pool.allocate(n)
        if n > len(self.free_q):
            assert got is None
            assert list(self.pool._free) == before_free  # nothing taken, nothing evicted
            return
        assert got == self.free_q[:n]  # the least recently freed first
        del self.free_q[:n]
        for block in got:
            assert self.refs[block] == 0
            self.refs[block] = 1
            self._evict(block)
        self.holds.append(got)

    @precondition(lambda self: self.holds)
    @rule(pick=st.integers(0, 100))
    def free(self, pick: int) -> None:
        blocks = self.holds.pop(pick % len(self.holds))
        self.pool.free(blocks)
        for block in reversed(blocks):  # the tail first
            self.refs[block] -= 1
            assert self.refs[block] >= 0
            if self.refs[block] == 0:
                self.free_q.append(block)

    @precondition(lambda self: self.holds)
    @rule(pick=st.integers(0, 100), at=st.integers(0, 100), digest=st.integers(0, len(DIGESTS) - 1))
    def register(self, pick: int, at: int, digest: int) -> None:
        blocks = self.holds[pick % len(self.holds)]
        if not blocks:
            return
        block = blocks[at % len(blocks)]
        self.pool.register(block, h(digest))
        if self.caching and h(digest) not in self.by_hash and block not in self.by_hash.values():
            self.by_hash[h(digest)] = block

    @rule(digests=st.lists(st.integers(0, len(DIGESTS) - 1), max_size=5), max_blocks=st.integers(0, 6))
    def lookup(self, digests: list[int], max_blocks: int) -> None:
        hashes = [h(d) for d in digests]
        expected = []
        for d in hashes[:max_blocks]:
            if d not in self.by_hash:
                break
            expected.append(self.by_hash[d])
        got = self.pool.lookup(hashes, max_blocks)
        assert got == expected
        for block in got:
            if self.refs[block] == 0:
                self.free_q.remove(block)
            self.refs[block] += 1
        self.holds.append(got)
        self.pool.count_query(len(hashes) * 4, len(got) * 4)
        self.queries += len(hashes) * 4
        self.hits += len(got) * 4

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check()
        free = set(pool._free)
        for block in range(1, pool.num_blocks + 1):
            assert pool.refs(block) == self.refs[block] >= 0
            assert not (block in free and pool.refs(block) > 0), f"block {block} both free and held"
        assert list(pool._free) == self.free_q
        assert pool.refs(NULL_BLOCK) == 0 and NULL_BLOCK not in free
        held = sum(1 for b in range(1, pool.num_blocks + 1) if self.refs[b])
        s = pool.stats()
        assert (s.used, s.free, s.cached) == (held, len(self.free_q), len(self.by_hash))
        assert (s.prefix_queries, s.prefix_hits) == (self.queries, self.hits)
        assert s.used + s.free == s.num_blocks
        assert dict(pool._by_hash) == self.by_hash
        if not self.caching:
            assert s.cached == 0


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
