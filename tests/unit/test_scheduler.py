"""Scheduler policy: FIFO admission into the lowest free slots, token-budgeted steps of decodes and
prompt chunks, aborts, finish."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.request import GenerationRequest, SamplingParams, StoppingParams
from service.engine.scheduler import PrefillChunk, Scheduler
from service.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, prompt_len: int = 4) -> Sequence:
    request = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_tokens=16),
    )
    return Sequence(request)


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
    assert ids(batch.prefills) == ["r0", "r1"] and batch.decodes == []
    assert [c.seq.slot for c in batch.prefills] == [0, 1]
    assert all(c.seq.status is SequenceStatus.RUNNING and c.seq.scheduled_at is not None for c in batch.prefills)
    assert (sched.num_running, sched.num_waiting, sched.num_free_slots) == (2, 1, 0)

    # Prefilled sequences have their first token after the step: now they decode.
    assert batch.sampling == seqs[:2]
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
    assert batch.sampling == seqs[:2]  # r2's prompt is not complete: no token for it yet
    assert sched.waiting_prompt_tokens == 0 and sched.num_running == 3
    sample(batch.sampling)
    batch = sched.schedule()
    assert ids(batch.decodes) == ["r0", "r1"] and chunks(batch.prefills) == [("r2", 2, 4)]
    assert batch.sampling == seqs


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
    assert batch.decodes == [] and ids(batch.prefills) == ["wait"] and waiting.slot == 0
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
    decode within the budget, each prompt is prefilled exactly once in order, every request ends once."""
    budget = max_running + extra_budget
    sched = Scheduler(max_running=max_running, max_num_batched_tokens=budget)
    added: list[str] = []
    admitted: list[str] = []
    ended: list[str] = []
    prefilled: dict[str, int] = {}  # request id -> prompt tokens scheduled so far
    running: dict[str, Sequence] = {}  # prompt complete, not finished

    def step() -> None:
        batch = sched.schedule()
        for seq in sched.take_aborted():
            ended.append(seq.request_id)
            running.pop(seq.request_id, None)
        assert batch.num_tokens <= budget
        decoding = [s for s in running.values() if not s.aborted and not s.exhausted and not s.paused]
        assert sorted(ids(batch.decodes)) == sorted(ids(decoding))  # never held back, unless paused
        assert all(not c.seq.aborted for c in batch.prefills) and all(not s.aborted for s in batch.decodes)
        for c in batch.prefills:
            rid = c.seq.request_id
            if c.start == 0:
                admitted.append(rid)
            assert c.start == prefilled.get(rid, 0) and c.end > c.start  # contiguous, in order
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
