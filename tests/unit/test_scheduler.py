"""Scheduler policy: FIFO admission into the lowest free slots, token-budgeted steps of decodes and
prompt chunks, aborts, finish."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.block_pool import BlockPool
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.scheduled_step import PrefillChunk, ScheduledStep
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, prompt_len: int = 4, *, prompt: list[int] | None = None, max_tokens: int = 16,
             adapter: str = "") -> Sequence:
    request = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt) if prompt is not None else list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_tokens=max_tokens, seed=0),
        adapter=adapter,
    )
    return Sequence(request)


def check_blocks(sched: Scheduler, seqs: list[Sequence]) -> None:
    """The pool's invariants, and who holds what: only a running sequence holds blocks, each of its
    blocks once, and each block's refs count its holders; a block held by two sequences is a
    registered full block that both hold at the same index of their prefix, under the same hash."""
    sched.check()
    pool = sched.kv.pool
    pool.check()
    holders: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in seqs:
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.block_ids == [], f"{seq.request_id} holds blocks while {seq.status.value}"
            continue
        assert len(set(seq.block_ids)) == len(seq.block_ids), f"{seq.request_id} holds a block twice"
        for i, block in enumerate(seq.block_ids):
            assert block != 0, "the null block was handed out"
            holders.setdefault(block, []).append((seq, i))
    for block in range(1, pool.num_blocks + 1):
        held = holders.get(block, [])
        assert pool.refs(block) == len(held), f"block {block}: refs {pool.refs(block)}, held by {len(held)}"
        if len(held) > 1:
            (_, i), digest = held[0], pool._hash_of.get(block)
            assert digest is not None, f"block {block} is shared but not registered"
            for seq, j in held:
                assert j == i and (i + 1) * sched.kv.block_size <= seq.num_computed_tokens, (seq.request_id, block)
                assert seq.block_hashes[i] == digest, f"{seq.request_id} shares block {block} under another hash"
    stats = pool.stats()
    assert stats.used == len(holders) and stats.used + stats.free == stats.num_blocks


def ids(rows: list[Sequence] | list[PrefillChunk]) -> list[str]:
    return [(r.seq if isinstance(r, PrefillChunk) else r).request_id for r in rows]


def chunks(rows: list[PrefillChunk]) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.end) for c in rows]


def sample(seqs: list[Sequence]) -> None:
    """What the engine does with a step's tokens once read."""
    for seq in seqs:
        seq.completion_token_ids.append(7)


def test_sequence_positions_follow_generated_tokens() -> None:
    seq = make_seq("a", prompt_len=3)
    assert (seq.last_token_id(), seq.next_position(), seq.num_tokens) == (3, 2, 3)
    seq.completion_token_ids.append(42)
    assert (seq.last_token_id(), seq.next_position(), seq.num_tokens) == (42, 3, 4)
    assert (seq.num_prompt_tokens, seq.num_completion_tokens) == (3, 1)


def test_admits_fifo_into_lowest_free_slots_up_to_max_running() -> None:
    sched = Scheduler(max_running=2, max_num_batched_tokens=100)
    seqs = [make_seq(f"r{i}") for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert ids(batch.prefills) == ["r0", "r1"] and batch.decodes == ()
    assert [c.seq.slot for c in batch.prefills] == [0, 1]
    assert all(c.seq.status is SequenceStatus.RUNNING and c.seq.scheduled_at is not None for c in batch.prefills)
    assert (sched.num_running, sched.num_waiting, sched.num_free_slots) == (2, 1, 0)

    # Prefilled sequences have their first token after the step: now they decode.
    assert batch.sampling == tuple(seqs[:2])
    sample(batch.sampling)
    sched.finish(seqs[0])
    assert seqs[0].status is SequenceStatus.FINISHED and seqs[0].slot is None
    batch = sched.schedule()
    assert ids(batch.prefills) == ["r2"] and batch.prefills[0].seq.slot == 0
    assert ids(batch.decodes) == ["r1"]


def test_token_budget_splits_prompts_into_chunks_across_steps() -> None:
    sched = Scheduler(max_running=8, max_num_batched_tokens=10)
    seqs = [make_seq(f"r{i}", prompt_len=4) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert sched.waiting_prompt_tokens == 12
    batch = sched.schedule()
    assert chunks(batch.prefills) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 2)] and batch.num_tokens == 10
    assert batch.sampling == tuple(seqs[:2])  # r2's prompt is not complete: no token for it yet
    assert sched.waiting_prompt_tokens == 0 and sched.num_running == 3
    sample(batch.sampling)
    batch = sched.schedule()
    assert ids(batch.decodes) == ["r0", "r1"] and chunks(batch.prefills) == [("r2", 2, 4)]
    assert batch.sampling == tuple(seqs)


def test_long_prompt_is_served_in_chunks_beside_every_decode() -> None:
    sched = Scheduler(max_running=5, max_num_batched_tokens=16)
    short = [make_seq(f"d{i}", prompt_len=3) for i in range(3)]
    for seq in short:
        sched.add(seq)
    sample(sched.schedule().sampling)
    long = make_seq("long", prompt_len=50)
    tiny = make_seq("tiny", prompt_len=1)
    sched.add(long)
    sched.add(tiny)
    seen: list[tuple[str, int, int]] = []
    while long.num_completion_tokens == 0:
        batch = sched.schedule()
        # Decodes are never held back by the prompt, and the step stays within the budget.
        assert ids(batch.decodes) == ["d0", "d1", "d2"] and batch.num_tokens <= 16
        seen += chunks(batch.prefills)
        assert (long in batch.sampling) == (batch.prefills[0].end == 50)
        sample(batch.sampling)
    # 13 prompt tokens per step beside 3 decodes; the long prompt is contiguous and in order, and
    # "tiny", behind it in the queue, waits for the last step with room to spare.
    assert seen == [("long", 0, 13), ("long", 13, 26), ("long", 26, 39), ("long", 39, 50), ("tiny", 0, 1)]
    assert long.num_prefilled_tokens == 50 and tiny.num_completion_tokens == 1


def test_budget_must_hold_a_decode_of_every_running_sequence() -> None:
    with pytest.raises(ValueError, match="must be >= max_running"):
        Scheduler(max_running=8, max_num_batched_tokens=7)


def test_abort_in_the_middle_of_a_prefill_frees_the_slot() -> None:
    sched = Scheduler(max_running=1, max_num_batched_tokens=4)
    long, nxt = make_seq("long", prompt_len=10), make_seq("next", prompt_len=2)
    sched.add(long)
    sched.add(nxt)
    assert chunks(sched.schedule().prefills) == [("long", 0, 4)]
    sched.abort("long")
    batch = sched.schedule()
    assert sched.take_aborted() == [long] and long.slot is None
    assert chunks(batch.prefills) == [("next", 0, 2)] and nxt.slot == 0


def test_abort_waiting_sequence_leaves_at_once() -> None:
    sched = Scheduler(max_running=1, max_num_batched_tokens=100)
    sched.add(make_seq("a"))
    seq = sched.abort("a")
    assert seq is not None and seq.aborted and seq.status is SequenceStatus.FINISHED
    assert (sched.num_waiting, sched.waiting_prompt_tokens) == (0, 0)
    assert sched.has_work()  # until the engine has taken the aborted sequence
    assert sched.take_aborted() == [seq]
    assert sched.take_aborted() == []
    assert not sched.has_work()
    assert sched.schedule().empty
    assert sched.abort("a") is None and sched.abort("unknown") is None


def test_abort_running_sequence_frees_slot_at_next_schedule() -> None:
    sched = Scheduler(max_running=1, max_num_batched_tokens=100)
    running, waiting = make_seq("run"), make_seq("wait")
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    running.completion_token_ids.append(5)
    assert sched.abort("run") is running
    # The step in flight may still use the slot: nothing is freed before the step boundary.
    assert running.slot == 0 and sched.num_running == 1 and sched.take_aborted() == []
    batch = sched.schedule()
    assert batch.decodes == () and ids(batch.prefills) == ["wait"] and waiting.slot == 0
    assert sched.take_aborted() == [running]
    assert running.slot is None and running.status is SequenceStatus.FINISHED


def test_finish_frees_slot_for_reuse_lowest_first() -> None:
    sched = Scheduler(max_running=3, max_num_batched_tokens=100)
    seqs = [make_seq(f"r{i}") for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    sched.schedule()
    sched.finish(seqs[2])
    sched.finish(seqs[1])
    sched.add(make_seq("n0"))
    sched.add(make_seq("n1"))
    assert [c.seq.slot for c in sched.schedule().prefills] == [1, 2]


def test_a_paused_sequence_keeps_its_slot_and_is_not_decoded_until_resumed() -> None:
    sched = Scheduler(max_running=2, max_num_batched_tokens=100)
    reader, unread = make_seq("reader"), make_seq("unread")
    sched.add(reader)
    sched.add(unread)
    sched.schedule()
    reader.completion_token_ids.append(1)
    unread.completion_token_ids.append(1)
    sched.pause("unread", True)
    assert ids(sched.schedule().decodes) == ["reader"] and unread.slot is not None
    sched.finish(reader)
    assert not sched.has_work()  # only a paused sequence is left: the engine may sleep
    sched.pause("unread", False)
    assert sched.has_work() and ids(sched.schedule().decodes) == ["unread"]
    sched.pause("unread", True)
    sched.abort("unread")
    sched.schedule()
    assert sched.take_aborted() == [unread] and sched.num_free_slots == 2


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "schedule", "finish", "abort", "pause"]),
                              st.integers(0, 30), st.integers(1, 20)), max_size=60),
       max_running=st.integers(1, 4), extra_budget=st.integers(0, 26))
def test_random_operations_keep_slots_consistent(ops: list[tuple[str, int, int]], max_running: int,
                                                 extra_budget: int) -> None:
    """Whatever the interleaving: slots are exclusive, admission is FIFO, every step holds every
    decode within the budget, each prompt is prefilled exactly once in order from its cached prefix
    (whole blocks: make_seq prompts share them), every request ends once, and the block pool stays
    consistent with who holds what (only cached prefix blocks are shared)."""
    budget = max_running + extra_budget
    sched = Scheduler(max_running=max_running, max_num_batched_tokens=budget)
    added: list[str] = []
    admitted: list[str] = []
    ended: list[str] = []
    prefilled: dict[str, int] = {}  # request id -> prompt tokens scheduled so far
    running: dict[str, Sequence] = {}  # prompt complete, not finished
    seqs: list[Sequence] = []

    def step() -> None:
        batch = sched.schedule()
        check_blocks(sched, seqs)
        for seq in sched.take_aborted():
            ended.append(seq.request_id)
            running.pop(seq.request_id, None)
        assert batch.num_tokens <= budget
        decoding = [s for s in running.values() if not s.aborted and not s.exhausted and not s.paused]
        assert sorted(ids(batch.decodes)) == sorted(ids(decoding))  # never held back, unless paused
        assert all(not c.seq.aborted for c in batch.prefills) and all(not s.aborted for s in batch.decodes)
        for c in batch.prefills:
            rid = c.seq.request_id
            if rid not in prefilled:  # admitted: the first chunk starts after the cached prefix
                admitted.append(rid)
                cached = c.seq.num_cached_tokens
                assert c.start == cached and cached % sched.kv.block_size == 0 and cached < c.seq.num_prompt_tokens
                assert c.token_ids() == c.seq.request.prompt_token_ids[c.start:c.end]
            assert c.start == prefilled.get(rid, c.start) and c.end > c.start  # contiguous, in order
            prefilled[rid] = c.end
        assert len({c.seq.request_id for c in batch.prefills}) == len(batch.prefills)
        for seq in batch.sampling:
            seq.completion_token_ids.append(1)  # what the step's sampler would do
            running[seq.request_id] = seq
        holders = {c.seq for c in batch.prefills} | {s for s in running.values() if not s.aborted}
        slots = [s.slot for s in holders]
        assert len(set(slots)) == len(slots) and all(0 <= s < max_running for s in slots)
        assert sched.num_free_slots + sched.num_running == max_running

    for op, pick, prompt_len in ops:
        if op == "add":
            seq = make_seq(f"r{len(added)}", prompt_len)
            sched.add(seq)
            added.append(seq.request_id)
            seqs.append(seq)
        elif op == "schedule":
            step()
        elif op == "finish" and running:
            candidates = [s for s in running.values() if not s.aborted]
            if candidates:
                seq = candidates[pick % len(candidates)]
                sched.finish(seq)
                del running[seq.request_id]
                ended.append(seq.request_id)
        elif op == "abort" and added:
            sched.abort(added[pick % len(added)])
        elif op == "pause" and added:
            sched.pause(added[pick % len(added)], prompt_len % 2 == 0)
        check_blocks(sched, seqs)
    for request_id in added:  # the clients read what they were sent
        sched.pause(request_id, False)
    while sched.has_work():  # drain: every sequence finishes once its prompt is done
        step()
        for seq in [s for s in running.values() if not s.aborted]:
            sched.finish(seq)
            del running[seq.request_id]
            ended.append(seq.request_id)
    assert admitted == sorted(admitted, key=lambda r: int(r[1:]))
    assert sorted(ended) == sorted(added) and len(set(ended)) == len(ended)
    assert sched.num_free_slots == max_running
    check_blocks(sched, seqs)
    assert sched.kv.pool.stats().used == 0 and sched.num_preemptions == 0  # the default pool is ample
    assert all(prefilled[s.request_id] == s.num_prompt_tokens for s in seqs if not s.aborted)


def test_requests_for_resident_adapters_pass_a_blocked_one_a_bounded_number_of_times() -> None:
    from service.engine.adapters import AdapterRegistry

    class Writer:
        def load(self, slot: int, adapter: object) -> None: ...
        def clear(self, slot: int) -> None: ...

    reg = AdapterRegistry(1, Writer())
    for name in ("a", "b"):
        reg.register(type("Adapter", (), {"name": name, "path": "/x", "rank": 8, "targets": ("q_proj",)})())

    def seq(i: int, adapter: str) -> Sequence:
        q = make_seq(f"{adapter or 'base'}{i}")
        q.request.adapter = adapter
        return q

    s = Scheduler(4, 64, adapters=reg)
    a0, b0 = seq(0, "a"), seq(0, "b")
    s.add(a0)
    s.add(b0)
    assert ids(s.schedule().prefills) == ["a0"]  # a0 holds a's slot throughout; b0 waits for it
    passed = []
    for i in range(1, 9):  # a steady stream of short requests for a, and base requests
        s.add(seq(i, "a"))
        s.add(seq(i, ""))
        admitted = [c.seq for c in s.schedule().prefills]
        assert f"base{i}" in ids(admitted)  # base requests always pass: they hold no adapter slot
        passed += [q for q in admitted if q.request.adapter == "a"]
        for q in admitted:
            s.finish(q)
    # a's requests passed b0 max_running (4) times, then queued behind it: a's slot can drain.
    assert ids(passed) == ["a1", "a2", "a3", "a4"] and b0.status is SequenceStatus.WAITING
    s.finish(a0)
    assert ids(s.schedule().prefills) == ["b0"]
    assert s.num_waiting == 4  # a5..a8 wait for b0's slot, in order


# ---- paged KV: a small block pool, prefix caching, preemption ----------------------------------


class StubAdapters:
    """What the scheduler asks of an adapter registry: a cache key per adapter, a slot per running
    sequence (never refused here), its release."""

    def __init__(self) -> None:
        self.running = 0

    def cache_key(self, name: str) -> str:
        return f"{name}#0"

    def admit(self, name: str) -> int:
        self.running += 1
        return 1 + "abcdefgh".index(name)

    def release(self, slot: int) -> None:
        assert self.running > 0
        self.running -= 1


def greedy(adapter: str, tokens: list[int]) -> int:
    """The simulated model's next token: a function of the adapter and every token so far, so that equal
    prefixes continue alike (and share completion blocks too)."""
    return 1 + (sum(tokens) * 7 + len(tokens) + len(adapter)) % 3


class SimEngine:
    """The engine's part around the scheduler, as Engine.step does it: schedule, launch (the device
    samples each of batch.sampling a token: num_pending += 1), read (num_pending -= 1, the token is
    appended unless the sequence finished or was aborted meanwhile, a finish at max_tokens or at a
    stop). With overlap, a step's tokens are read after the next step is scheduled and launched.

    The device's KV cache is simulated too: each scheduled position writes, into its block, what its
    KV depends on (the adapter and every token up to it), and every step first checks that the
    positions a sequence attends to hold exactly its own KV, whether it computed them or took them
    from the prefix cache."""

    def __init__(self, sched: Scheduler, overlap: bool = False) -> None:
        self.sched, self.overlap = sched, overlap
        self.bs = sched.kv.block_size
        self.seqs: list[Sequence] = []
        self.device: dict[Sequence, list[int]] = {}  # every token sampled on the device, read or not
        self.kv: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}  # (block, offset) -> its KV
        self.table: dict[int, list[int]] = {}  # the runner's block table, from the steps' updates: slot -> row
        self.in_flight: list[Sequence] = []
        self.unread: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.aborted: list[Sequence] = []
        self.stop: set[Sequence] = set()  # finish at their next token read (a stop token)
        self.recomputes: list[tuple[int, PrefillChunk]] = []  # prompt chunks of preempted sequences
        self.steps = 0
        self.admitted: dict[Sequence, int] = {}
        self.hit_starts = 0  # admissions that started after a cached prefix
        self.finished_waiting = 0  # finished while preempted

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.seqs.append(seq)
        self.device[seq] = []

    def _tokens(self, seq: Sequence) -> list[int]:
        return seq.request.prompt_token_ids + self.device[seq]

    def _kv_of(self, seq: Sequence, pos: int) -> tuple[str, tuple[int, ...]]:
        return (self.sched.kv.adapter_key(seq), tuple(self._tokens(seq)[: pos + 1]))

    def _compute(self, seq: Sequence, start: int, end: int) -> None:
        """A step computes positions [start, end) of seq, attending to [0, end)."""
        assert len(seq.block_ids) * self.bs >= end, f"{seq.request_id}: no block for position {end - 1}"
        for pos in range(start):
            slot = (seq.block_ids[pos // self.bs], pos % self.bs)
            assert self.kv.get(slot) == self._kv_of(seq, pos), f"{seq.request_id} reads wrong KV at {pos}"
        for pos in range(start, end):
            block = seq.block_ids[pos // self.bs]
            assert self.sched.kv.pool.refs(block) == 1, f"{seq.request_id} writes shared block {block}"
            self.kv[(block, pos % self.bs)] = self._kv_of(seq, pos)

    def step(self, read: bool = True) -> ScheduledStep:
        """Schedule and launch a step, then read the tokens of this one (or, with overlap, of the one
        before). read=False leaves them in self.unread for the caller to read."""
        sched = self.sched
        batch = sched.schedule()
        self.steps += 1
        check_blocks(sched, self.seqs)
        self.aborted += sched.take_aborted()
        assert batch.num_tokens <= sched.max_num_batched_tokens
        waiting = [s for s in self.seqs if s.status is SequenceStatus.WAITING]
        assert sched.num_waiting == len(waiting)
        assert sched.waiting_prompt_tokens == sum(s.num_prompt_tokens for s in waiting)
        scheduled = [*batch.decodes, *(c.seq for c in batch.prefills)]
        assert len(set(scheduled)) == len(scheduled), f"a sequence is scheduled twice: {ids(scheduled)}"
        assert all(s.status is SequenceStatus.RUNNING and not s.aborted for s in scheduled)
        for slot, first, blocks in batch.table_updates:  # what the runner writes into its table
            row = self.table.setdefault(slot, [])
            assert first <= len(row), f"row {slot}: entries from {first} but {len(row)} written"
            row[first: first + len(blocks)] = blocks
        for seq in scheduled:  # the step reads each sequence's KV through its table row
            row = self.table.get(seq.slot, [])
            assert row[: len(seq.block_ids)] == seq.block_ids, f"{seq.request_id}: row {row}, blocks {seq.block_ids}"
        for seq in batch.decodes:
            pos = seq.next_position()
            assert len(seq.block_ids) * self.bs > pos, f"{seq.request_id} decodes {pos} without a block"
            self._compute(seq, pos, pos + 1)
        for c in batch.prefills:
            seq = c.seq
            known = seq.request.prompt_token_ids + seq.completion_token_ids
            assert c.token_ids() == known[c.start:c.end] and seq.num_pending == 0
            if seq.num_preemptions:  # a recompute: the prompt and the completion so far
                assert seq.prefill_len == len(known)
                self.recomputes.append((seq.admitted, c))
            if self.admitted.get(seq) != seq.admitted:  # its first chunk since (re)admission
                self.admitted[seq] = seq.admitted
                assert c.start % self.bs == 0 and c.start < seq.prefill_len
                self.hit_starts += c.start > 0
            self._compute(seq, c.start, c.end)
        for seq in batch.sampling:
            self.device[seq].append(greedy(seq.request.adapter, self._tokens(seq)))
            seq.num_pending += 1
        launched = batch.sampling
        if self.overlap:
            launched, self.in_flight = self.in_flight, launched
        if read:
            self.read(launched)
        else:
            self.unread = launched
        check_blocks(sched, self.seqs)
        return batch

    def read(self, launched: list[Sequence]) -> None:
        for seq in launched:
            seq.num_pending -= 1
            assert seq.num_pending >= 0
            if seq.status is SequenceStatus.FINISHED or seq.aborted:
                continue  # surplus
            seq.completion_token_ids.append(self.device[seq][seq.num_completion_tokens])
            assert seq.num_completion_tokens <= seq.request.sampling.max_tokens
            if seq.num_completion_tokens == seq.request.sampling.max_tokens or seq in self.stop:
                self.finished_waiting += seq.status is SequenceStatus.WAITING
                self.sched.finish(seq)  # a preempted one may be waiting
                assert seq.status is SequenceStatus.FINISHED and seq.block_ids == []
                self.finished.append(seq)

    def drain(self, max_steps: int = 5000) -> None:
        while self.sched.has_work() or self.in_flight:
            assert self.steps < max_steps, "no progress"
            self.step()


@st.composite
def small_pool_requests(draw: st.DrawFn, cap: int, stem: list[int]) -> list[tuple[list[int], int, str]]:
    """(prompt, max_tokens, adapter) of requests that each fit the pool alone (prompt + max_tokens <=
    cap), most of them large enough that two do not: their prompts start with some of the stem."""
    out = []
    for _ in range(draw(st.integers(1, 8))):
        total = draw(st.integers(2, cap) | st.integers(max(2, cap // 2), cap))
        max_tokens = draw(st.integers(1, min(total - 1, 12)))
        prompt_len = total - max_tokens
        shared = draw(st.sampled_from([prompt_len, prompt_len - 1, prompt_len // 2]) | st.integers(0, prompt_len))
        prompt = stem[:shared] + [4 + (k + shared) % 2 for k in range(prompt_len - shared)]
        out.append((prompt, max_tokens, draw(st.sampled_from(["", "", "", "a", "b"]))))
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), num_blocks=st.integers(3, 12), prefix_caching=st.booleans(), overlap=st.booleans(),
       max_running=st.integers(1, 4), extra_budget=st.integers(0, 12),
       stem=st.lists(st.integers(1, 3), min_size=44, max_size=44))
def test_random_operations_on_a_small_pool_finish_every_request(data: st.DataObject, num_blocks: int,
                                                                 prefix_caching: bool, overlap: bool, max_running: int,
                                                                 extra_budget: int, stem: list[int]) -> None:
    """A pool so small that sequences preempt each other, prompts that share prefixes (a common stem,
    then tokens of their own), adapters, random adds, steps, stops and aborts, with and without
    overlap, then steps until idle: the pool and the holds stay consistent, every KV a step reads is
    its own, each recompute covers the prompt and completion so far, and every request ends once:
    with exactly max_tokens tokens (the greedy continuation of its prompt) unless stopped or aborted."""
    bs = 4
    cap = (num_blocks - 1) * bs  # one sequence, prompt + max_tokens, always fits
    sched = Scheduler(max_running, max_running + extra_budget, adapters=StubAdapters(),  # type: ignore[arg-type]
                      blocks=BlockPool(num_blocks, bs, prefix_caching))
    sim = SimEngine(sched, overlap)
    requests = data.draw(small_pool_requests(cap, stem), label="requests")
    ops = data.draw(st.lists(st.tuples(st.sampled_from(["add"] * 3 + ["step"] * 5 + ["stop", "abort", "pause"]),
                                       st.integers(0, 1000)), max_size=50), label="ops")

    def add() -> None:
        prompt, max_tokens, adapter = requests[len(sim.seqs)]
        sim.add(make_seq(f"r{len(sim.seqs)}", prompt=prompt, max_tokens=max_tokens, adapter=adapter))

    for op, pick in ops:
        if op == "add" and len(sim.seqs) < len(requests):
            add()
        elif op == "step":
            sim.step()
        elif op == "stop" and sim.seqs:
            sim.stop.add(sim.seqs[pick % len(sim.seqs)])
        elif op == "abort" and sim.seqs:
            sched.abort(sim.seqs[pick % len(sim.seqs)].key)
        elif op == "pause" and sim.seqs:
            sched.pause(sim.seqs[pick % len(sim.seqs)].key, pick % 2 == 0)
        check_blocks(sched, sim.seqs)
    while len(sim.seqs) < len(requests):
        add()
    for seq in sim.seqs:  # the clients read what they were sent
        sched.pause(seq.key, False)
    sim.drain()

    assert not sched.has_work() and sched.num_waiting == 0 and sched.num_free_slots == max_running
    ended = sim.finished + sim.aborted
    assert len(ended) == len(set(ended)) and set(ended) == set(sim.seqs)  # each ends once
    for seq in sim.seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.num_pending == 0
        expected = []  # the greedy continuation, as a never-preempted run would produce it
        for _ in range(seq.num_completion_tokens):
            expected.append(greedy(seq.request.adapter, seq.request.prompt_token_ids + expected))
        assert seq.completion_token_ids == expected
        if seq in sim.finished and seq not in sim.stop:
            assert seq.num_completion_tokens == seq.request.sampling.max_tokens, seq.request_id
    check_blocks(sched, sim.seqs)
    stats = sched.kv.pool.stats()
    assert stats.used == 0 and stats.free == num_blocks - 1
    assert sched.adapters.running == 0  # type: ignore[union-attr]
    if not prefix_caching:
        assert stats.cached == 0 and stats.prefix_hits == 0 and all(s.num_cached_tokens == 0 for s in sim.seqs)
    assert sum(s.num_preemptions for s in sim.seqs) == sched.num_preemptions
    assert all(c.seq.num_preemptions for _, c in sim.recomputes)


def run_prompt(sched: Scheduler, seq: Sequence) -> list[PrefillChunk]:
    """Add seq and step until its prompt is done (no other work); returns its chunks."""
    sched.add(seq)
    seen = []
    while seq.num_completion_tokens == 0:
        batch = sched.schedule()
        seen += [c for c in batch.prefills if c.seq is seq]
        sample(batch.sampling)
    return seen


def test_a_prefix_hit_skips_the_cached_blocks() -> None:
    sched = Scheduler(max_running=4, max_num_batched_tokens=64)  # the default pool: blocks of 16
    prompt = list(range(100, 140))  # 40 tokens: two full blocks and 8 more
    first = make_seq("first", prompt=prompt)
    assert chunks(run_prompt(sched, first)) == [("first", 0, 40)] and first.num_cached_tokens == 0
    # An identical prompt takes both full blocks (computed and registered by `first`, still running).
    second = make_seq("second", prompt=prompt)
    assert chunks(run_prompt(sched, second)) == [("second", 32, 40)] and second.num_cached_tokens == 32
    assert second.block_ids[:2] == first.block_ids[:2] and second.block_ids[2] != first.block_ids[2]
    # One that shares only the first block takes only that one.
    third = make_seq("third", prompt=prompt[:16] + [1] * 24)
    assert chunks(run_prompt(sched, third)) == [("third", 16, 40)] and third.num_cached_tokens == 16
    assert third.block_ids[0] == first.block_ids[0] and sched.kv.pool.refs(first.block_ids[0]) == 3
    stats = sched.block_stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (120, 48) and stats.hit_rate == pytest.approx(0.4)
    check_blocks(sched, [first, second, third])
    for seq in (first, second, third):
        sched.finish(seq)
    assert sched.block_stats().used == 0 and sched.block_stats().cached >= 2


def test_a_prefix_hit_still_computes_the_last_prompt_token() -> None:
    sched = Scheduler(max_running=2, max_num_batched_tokens=64)
    prompt = list(range(1, 33))  # exactly two blocks of 16
    first = make_seq("first", prompt=prompt)
    run_prompt(sched, first)
    sched.finish(first)  # its blocks are free, and still cached
    again = make_seq("again", prompt=prompt)
    sched.add(again)
    batch = sched.schedule()
    # The second block is cached too, but its last token must be computed: its logits give the first
    # completion token. So only the first block is taken.
    assert chunks(batch.prefills) == [("again", 16, 32)] and batch.sampling == (again,)
    assert again.num_cached_tokens == 16 and again.num_prefilled_tokens == 32
    assert sched.block_stats().prefix_hits == 16
    # A one-token prompt, or any prompt within one block, has nothing to take.
    short = make_seq("short", prompt=prompt[:16])
    sched.add(short)
    assert chunks(sched.schedule().prefills) == [("short", 0, 16)] and short.num_cached_tokens == 0


def test_prompts_arriving_together_share_the_first_ones_prefill() -> None:
    """n samples of one prompt (or a burst with one system prompt): the others wait one step for the
    first's prefill and take its full blocks; what arrived after them waits that step too (FIFO)."""
    sched = Scheduler(max_running=8, max_num_batched_tokens=256)
    prompt = list(range(100, 150))  # 50 tokens: three full blocks and 2 more
    samples = [make_seq(f"s{i}", prompt=prompt) for i in range(3)]
    other = make_seq("other", prompt=list(range(300, 350)))
    for seq in [*samples, other]:
        sched.add(seq)
    first = sched.schedule()
    assert chunks(first.prefills) == [("s0", 0, 50)]
    sample(first.sampling)
    second = sched.schedule()
    assert chunks(second.prefills) == [("s1", 48, 50), ("s2", 48, 50), ("other", 0, 50)]
    assert ids(second.decodes) == ["s0"]
    assert [s.num_cached_tokens for s in samples] == [0, 48, 48]
    assert all(s.block_ids[:3] == samples[0].block_ids[:3] for s in samples)
    check_blocks(sched, [*samples, other])


def test_without_prefix_caching_prompts_arriving_together_do_not_wait() -> None:
    sched = Scheduler(max_running=8, max_num_batched_tokens=256, blocks=BlockPool(64, 16, prefix_caching=False))
    prompt = list(range(100, 150))
    for i in range(2):
        sched.add(make_seq(f"s{i}", prompt=prompt))
    assert chunks(sched.schedule().prefills) == [("s0", 0, 50), ("s1", 0, 50)]


def _admit_each(sched: Scheduler, seqs: list[Sequence]) -> list[tuple[str, int, int]]:
    out = []
    for seq in seqs:
        out += chunks(run_prompt(sched, seq))
        sched.finish(seq)
    return out


def test_sequences_of_different_adapters_never_share_blocks() -> None:
    sched = Scheduler(max_running=4, max_num_batched_tokens=64, adapters=StubAdapters())  # type: ignore[arg-type]
    prompt = list(range(1, 41))
    seqs = [make_seq(f"{adapter or 'base'}{i}", prompt=prompt, adapter=adapter)
            for i, adapter in enumerate(["a", "b", "", "a", "b", ""])]
    # The first of each adapter (and of the base model) computes everything; the second hits its own.
    assert _admit_each(sched, seqs) == [("a0", 0, 40), ("b1", 0, 40), ("base2", 0, 40),
                                        ("a3", 32, 40), ("b4", 32, 40), ("base5", 32, 40)]
    assert sched.adapters.running == 0  # type: ignore[union-attr]


def test_an_adapter_loaded_again_under_its_name_does_not_hit_the_old_ones_blocks() -> None:
    from service.engine.adapters import AdapterRegistry

    class Writer:
        def load(self, slot: int, adapter: object) -> None: ...
        def clear(self, slot: int) -> None: ...

    def adapter(name: str) -> object:
        return type("Adapter", (), {"name": name, "path": "/x", "rank": 8, "targets": ("q_proj",)})()

    reg = AdapterRegistry(2, Writer())
    reg.register(adapter("x"))
    sched = Scheduler(max_running=2, max_num_batched_tokens=64, adapters=reg)
    prompt = list(range(1, 41))
    assert _admit_each(sched, [make_seq(f"x{i}", prompt=prompt, adapter="x") for i in range(2)]) == [
        ("x0", 0, 40), ("x1", 32, 40)]
    reg.unregister("x")
    reg.register(adapter("x"))  # other weights under the same name: a new cache key
    assert _admit_each(sched, [make_seq(f"y{i}", prompt=prompt, adapter="x") for i in range(2)]) == [
        ("y0", 0, 40), ("y1", 32, 40)]


def test_without_prefix_caching_nothing_is_ever_cached() -> None:
    sched = Scheduler(max_running=2, max_num_batched_tokens=64, blocks=BlockPool(20, 16, prefix_caching=False))
    prompt = list(range(1, 41))
    first = make_seq("first", prompt=prompt)
    run_prompt(sched, first)
    for _ in range(30):  # decodes past a block boundary
        sample(sched.schedule().sampling)
    second = make_seq("second", prompt=prompt)
    assert chunks(run_prompt(sched, second)) == [("second", 0, 40)]  # while `first` runs ...
    sched.finish(first)
    sched.finish(second)
    third = make_seq("third", prompt=prompt)
    assert chunks(run_prompt(sched, third)) == [("third", 0, 40)]  # ... and once it is free
    stats = sched.block_stats()
    assert stats.cached == 0 and stats.prefix_hits == 0 and stats.hit_rate == 0.0
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 0, 0)
    assert not any(s.block_hashes for s in (first, second, third))


def old_and_new(new_max_tokens: int, overlap: bool, prefix_caching: bool = True,
                ) -> tuple[Scheduler, SimEngine, Sequence, Sequence]:
    """4 blocks of 4 tokens and two sequences: `old` (4-token prompt, 12 out), then `new` (5-token prompt)."""
    sched = Scheduler(max_running=2, max_num_batched_tokens=5, blocks=BlockPool(5, 4, prefix_caching))
    sim = SimEngine(sched, overlap)
    old = make_seq("old", prompt=[1, 2, 3, 4], max_tokens=12)
    new = make_seq("new", prompt=[5, 6, 7, 8, 9], max_tokens=new_max_tokens)
    sim.add(old)
    sim.add(new)
    return sched, sim, old, new


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_running_out_of_blocks_preempts_the_newest_which_recomputes_and_completes(prefix_caching: bool,
                                                                                  overlap: bool) -> None:
    # 4 blocks of 4 tokens. `old` and `new` take 2 each by their 5th token; at position 8 `old`
    # needs a third: `new`, admitted last, gives its blocks back and waits.
    sched, sim, old, new = old_and_new(9, overlap, prefix_caching)
    while not sched.num_preemptions:
        assert sim.steps < 20 and new.status is not SequenceStatus.FINISHED
        sim.step()
    assert new.num_preemptions == 1 and old.num_preemptions == 0 and old.status is SequenceStatus.RUNNING
    assert len(old.block_ids) == 3 and old.next_position() >= 8
    sim.drain()
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    for seq in (old, new):  # each completes, with the tokens it would have had without preemption
        expected: list[int] = []
        while len(expected) < seq.request.sampling.max_tokens:
            expected.append(greedy("", seq.request.prompt_token_ids + expected))
        assert seq.completion_token_ids == expected and seq in sim.finished
    # Its last admission recomputed, in chunks, the prompt and every completion token known then
    # (less a cached prefix).
    redone = [c for adm, c in sim.recomputes if adm == new.admitted]
    assert all(a.end == b.start for a, b in zip(redone, redone[1:]))
    start, end = redone[0].start, redone[-1].end
    assert start == 0 or (prefix_caching and start % 4 == 0)
    assert redone[-1].completes_prompt and end == new.prefill_len > new.num_prompt_tokens
    assert [t for c in redone for t in c.token_ids()] == (new.request.prompt_token_ids
                                                         + new.completion_token_ids)[start:end]
    assert sched.block_stats().used == 0
    sched.kv.pool.check()


def test_a_sequence_preempted_with_a_token_in_flight_waits_until_it_is_read() -> None:
    sched = Scheduler(max_running=2, max_num_batched_tokens=5, blocks=BlockPool(5, 4, prefix_caching=False))
    sim = SimEngine(sched, overlap=True)
    old = make_seq("old", prompt=[1, 2, 3, 4], max_tokens=12)
    new = make_seq("new", prompt=[5, 6, 7, 8, 9], max_tokens=9)
    sim.add(old)
    sim.add(new)
    while True:
        assert sim.steps < 20 and new.status is not SequenceStatus.FINISHED
        batch = sim.step(read=False)  # scheduled and launched; the step before is still unread
        if sched.num_preemptions:
            break
        sim.read(sim.unread)
    # Preempted while the previous step samples its token: not admitted in this step ...
    assert new.status is SequenceStatus.WAITING and new.num_pending == 1 and new.block_ids == []
    assert chunks(batch.prefills) == [] and ids(batch.decodes) == ["old"]
    # ... nor in a later one while the token is unread, though every block, row and token is free then
    # (`old` stops: the engine finishes it).
    sched.finish(old)
    assert sched.kv.pool.num_free == 4 and sched.num_free_slots == 2
    assert sched.schedule().empty and new.status is SequenceStatus.WAITING and sched.has_work()
    known = new.num_completion_tokens
    sim.read(sim.unread)  # the engine reads the token: the waiting sequence keeps it
    assert new.num_pending == 0 and new.num_completion_tokens == known + 1
    batch = sim.step()
    assert chunks(batch.prefills) == [("new", 0, 5)] and new.prefill_len == new.num_tokens == 5 + known + 1
    sim.drain()
    assert new in sim.finished and new.num_completion_tokens == 9


def test_a_preempted_sequence_can_finish_while_it_waits() -> None:
    # `new`'s last token is in flight when `old` needs its block: it is preempted, then the engine
    # reads that token and finishes it while it waits.
    sched, sim, old, new = old_and_new(4, overlap=True)
    while not sched.num_preemptions:
        assert sim.steps < 20 and new.status is not SequenceStatus.FINISHED
        sim.step(read=False)
        if not sched.num_preemptions:
            sim.read(sim.unread)
    assert new.status is SequenceStatus.WAITING and new.exhausted and new.num_pending == 1
    assert sched.num_waiting == 1 and sched.waiting_prompt_tokens == 5
    sim.read(sim.unread)  # calls sched.finish(new) on a waiting sequence
    assert new in sim.finished and sim.finished_waiting == 1 and new.num_completion_tokens == 4
    assert new.status is SequenceStatus.FINISHED and sched.num_waiting == 0 and sched.waiting_prompt_tokens == 0
    sim.drain()
    assert old in sim.finished and sched.block_stats().used == 0 and not sched.has_work()
    # Finishing it directly, without the simulated engine, works the same.
    sched2 = Scheduler(max_running=1, max_num_batched_tokens=8, blocks=BlockPool(3, 4))
    seq = make_seq("s", prompt=[1, 2, 3], max_tokens=4)
    sched2.add(seq)
    sched2.schedule()
    sched2._preempt(seq)
    assert seq.status is SequenceStatus.WAITING and sched2.num_waiting == 1
    sched2.finish(seq)
    assert seq.status is SequenceStatus.FINISHED and sched2.num_waiting == 0 and not sched2.has_work()
    assert sched2.block_stats().used == 0


def test_a_small_pool_with_many_requests_preempts_and_still_finishes_them_all() -> None:
    for overlap in (False, True):
        sched = Scheduler(max_running=4, max_num_batched_tokens=8, blocks=BlockPool(7, 4))
        sim = SimEngine(sched, overlap)
        for i in range(8):
            sim.add(make_seq(f"r{i}", prompt=[1 + i % 2] * (6 + i % 5), max_tokens=10))
        sim.drain()
        assert sched.num_preemptions > 0 and sim.recomputes and sim.hit_starts > 0
        assert all(s in sim.finished and s.num_completion_tokens == 10 for s in sim.seqs)
        assert sched.block_stats().used == 0


def test_a_paused_sequence_gives_its_blocks_up_first_and_nobody_is_admitted_in_a_preempting_step() -> None:
    # 7 blocks of 4. `holder` (3 blocks) is paused by back-pressure; `long` (24 tokens) cannot fit beside
    # it. The paused one is preempted (its client reads nothing), not the newest: `long` prefills on
    # without redoing a chunk, and the step that preempted admits nobody (the blocks just given back
    # would let the preempted one straight back in).
    sched = Scheduler(max_running=2, max_num_batched_tokens=8, blocks=BlockPool(8, 4, prefix_caching=False))
    holder = make_seq("holder", prompt=list(range(1, 13)), max_tokens=8)
    long = make_seq("long", prompt=list(range(50, 74)), max_tokens=2)
    sched.add(holder)
    sample(sched.schedule().sampling)
    sched.pause("holder", True)
    sched.add(long)
    seen = []
    for _ in range(4):
        batch = sched.schedule()
        seen.append(chunks(batch.prefills))
        if holder.num_preemptions:
            break
    assert holder.num_preemptions == 1 and long.num_preemptions == 0
    assert holder.status is SequenceStatus.WAITING and all(c[0] == "long" for c in seen[-1]), seen
    starts = [c[1] for step in seen for c in step if c[0] == "long"]
    assert starts == sorted(set(starts)), f"long redid a chunk: {seen}"
