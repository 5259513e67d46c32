"""KV events against the prefix cache's state: a subscriber that replays every event the KV manager
and the block pool recorded holds exactly the pool's set of cached block hashes, after any sequence
of admissions (cache hits among them), steps, finishes, preemptions (evictions) and resets; with a
host tier under the pool, the same for each medium ("GPU" the pool, "CPU" the tier), and the
copies each step carries leave every cached block, on either side, holding its own KV."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.block_pool import BlockPool, chain_hashes
from service.engine.host_tier import HostTier
from service.engine.kv_events import (
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    from_wire,
    replay,
    to_wire,
)
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.scheduled_step import ScheduledStep
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, SequenceStatus

BS = 4
# A few shared system prompts, so that admissions hit the cache and a small pool evicts.
PREFIXES = [[10 + p] * 9 for p in range(6)]


def make_seq(request_id: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(GenerationRequest(request_id=request_id, prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=max_tokens, seed=0)))


class FakeKV:
    """What each device block and host slot holds, as the digest of the KV written there (None: a
    block's KV before its tokens are all known): the runner's copies and writes, without tensors."""

    def __init__(self) -> None:
        self.device: dict[int, bytes | None] = {}
        self.host: dict[int, bytes | None] = {}

    def run(self, step: ScheduledStep) -> None:
        for block, slot in step.kv_copies.to_host:
            self.host[slot] = self.device.get(block)
        for slot, block in step.kv_copies.to_device:
            self.device[block] = self.host.get(slot)
        bs = BS
        writes = [(d, d.next_position(), d.next_position() + 1) for d in step.decodes]
        writes += [(c.seq, c.start, c.end) for c in step.prefills]
        for seq, start, end in writes:
            for i in range(start // bs, -(-end // bs)):
                self.device[seq.block_ids[i]] = seq.block_hashes[i] if i < len(seq.block_hashes) else None

    def check(self, pool: BlockPool) -> None:
        """Every cached block holds the KV of its hash, on the device and in the host tier."""
        for digest, block in pool._by_hash.items():
            assert self.device.get(block) == digest, f"device block {block}"
        if pool.host is not None:
            for digest, slot in pool.host._slots.items():
                assert self.host.get(slot) == digest, f"host slot {slot}"


def run_step(sched: Scheduler, seqs: list[Sequence], kv: FakeKV | None = None) -> None:
    """One engine step: schedule, each sampling row gets a token, finished ones leave."""
    step = sched.schedule()
    if kv is not None:
        kv.run(step)
    for seq in step.sampling:
        seq.completion_token_ids.append(len(seq.completion_token_ids) + 1)
        if len(seq.completion_token_ids) >= seq.request.sampling.max_tokens:
            sched.finish(seq)


def new_scheduler(num_blocks: int, host_slots: int = 0) -> Scheduler:
    host = HostTier(host_slots, BS) if host_slots else None
    sched = Scheduler(4, 64, blocks=BlockPool(num_blocks, BS, host=host))
    sched.kv.publish_events()
    return sched


def test_stores_carry_the_tokens_and_the_parent_of_each_run_and_evictions_remove() -> None:
    sched = new_scheduler(6)  # 5 usable blocks
    a = make_seq("a", [1] * 8 + [2] * 3, max_tokens=2)  # 2 full prompt blocks
    sched.add(a)
    while a.status is not SequenceStatus.FINISHED:
        run_step(sched, [a])
    batch = sched.kv.take_events()
    hashes = chain_hashes([1] * 8 + [2] * 3 + [1], BS)  # the prompt and its first completion token: 3 blocks
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hashes
    assert stored[0].parent_block_hash is None and stored[0].token_ids == (1,) * 8
    assert all(e.block_size == BS and e.lora_name == "" for e in stored)
    if len(stored) > 1:  # later runs name the block before them
        assert stored[1].parent_block_hash == hashes[len(stored[0].block_hashes) - 1]
    assert sched.kv.take_events() is None  # taken once

    b = make_seq("b", [3] * 20, max_tokens=1)  # needs all 5 blocks: the cached ones are evicted
    sched.add(b)
    run_step(sched, [b])
    removed = [h for e in sched.kv.take_events().events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(hashes)


def test_a_reset_is_one_cleared_event() -> None:
    sched = new_scheduler(16)
    a = make_seq("a", [1] * 9, max_tokens=1)
    sched.add(a)
    run_step(sched, [a])
    assert sched.reset_prefix_cache()
    assert sched.kv.take_events().events == (AllBlocksCleared(),)


def test_nothing_is_recorded_unless_published() -> None:
    sched = Scheduler(4, 64, blocks=BlockPool(16, BS))
    a = make_seq("a", [1] * 9, max_tokens=1)
    sched.add(a)
    run_step(sched, [a])
    assert sched.kv.take_events() is None and sched.kv.pool.events is None


OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(1, 5), max_size=7),
              st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("flush")),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, min_size=8, max_size=40), num_blocks=st.integers(6, 14), host_slots=st.sampled_from([0, 0, 1, 3, 8]))
def test_replaying_every_event_rebuilds_the_cached_hashes(ops: list[tuple], num_blocks: int, host_slots: int) -> None:
    """After every step a subscriber's set equals the pool's cached hashes (and, with a host tier,
    its set of "CPU" blocks the tier's); resuming from any batch boundary (the batches before it
    applied, the rest replayed) gives the same set. Each step's copies keep every cached block's KV."""
    sched = new_scheduler(num_blocks, host_slots)
    host = sched.kv.pool.host
    kv = FakeKV()
    seqs: list[Sequence] = []
    batches = []
    subscriber: set[bytes] = set()
    on_host: set[bytes] = set()
    for op in ops:
        match op:
            case ("add", prefix, tail, max_tokens):
                seq = make_seq(f"r{len(seqs)}", PREFIXES[prefix] + tail, max_tokens)
                seqs.append(seq)
                sched.add(seq)
            case ("step", n):
                for _ in range(n):
                    run_step(sched, seqs, kv)
            case ("abort", i):
                if i < len(seqs):
                    sched.abort(seqs[i].key)
            case ("flush",):
                sched.reset_prefix_cache()  # refused while blocks are held
        batch = sched.kv.take_events()
        if batch is not None:
            batches.append(batch)
            replay(batch.events, subscriber)
            replay(batch.events, on_host, HOST)
        assert subscriber == sched.kv.pool.cached_hashes()
        assert on_host == (host.cached_hashes() if host is not None else set())
        sched.check()
        if host is None or not (host._to_host or host._to_device):  # every copy taken by a step that ran
            kv.check(sched.kv.pool)
    for cut in range(len(batches) + 1):
        resumed = replay([e for b in batches[:cut] for e in b.events], set())
        assert replay([e for b in batches[cut:] for e in b.events], resumed) == subscriber


def test_the_pipe_form_gives_the_same_batch_back() -> None:
    batch = KvEventBatch((BlockStored((b"a" * 16,), None, (1, 2, 3, 4), BS, "ad"), BlockRemoved((b"b" * 16,)),
                          BlockStored((b"b" * 16,), None, (5, 6, 7, 8), BS, "", HOST), BlockRemoved((b"c" * 16,), HOST),
                          AllBlocksCleared()))
    assert from_wire(to_wire(batch)) == batch
