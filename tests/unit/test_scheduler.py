"""Scheduler policy: FIFO admission into the lowest free slots, prefill budget, aborts, finish."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.request import GenerationRequest, SamplingParams, StoppingParams
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, prompt_len: int = 4) -> Sequence:
    request = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_tokens=16),
    )
    return Sequence(request)


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def test_sequence_positions_follow_generated_tokens() -> None:
    seq = make_seq("a", prompt_len=3)
    assert (seq.last_token_id(), seq.next_position(), seq.num_tokens) == (3, 2, 3)
    seq.completion_token_ids.append(42)
    assert (seq.last_token_id(), seq.next_position(), seq.num_tokens) == (42, 3, 4)
    assert (seq.num_prompt_tokens, seq.num_completion_tokens) == (3, 1)


def test_admits_fifo_into_lowest_free_slots_up_to_max_running() -> None:
    sched = Scheduler(max_running=2, max_prefill_tokens=100)
    seqs = [make_seq(f"r{i}") for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert ids(batch.prefills) == ["r0", "r1"] and batch.decodes == []
    assert [s.slot for s in batch.prefills] == [0, 1]
    assert all(s.status is SequenceStatus.RUNNING and s.scheduled_at is not None for s in batch.prefills)
    assert (sched.num_running, sched.num_waiting, sched.num_free_slots) == (2, 1, 0)

    # Prefilled sequences have their first token after the step: now they decode.
    for seq in batch.prefills:
        seq.completion_token_ids.append(7)
    sched.finish(seqs[0])
    assert seqs[0].status is SequenceStatus.FINISHED and seqs[0].slot is None
    batch = sched.schedule()
    assert ids(batch.prefills) == ["r2"] and batch.prefills[0].slot == 0
    assert ids(batch.decodes) == ["r1"]


def test_prefill_budget_splits_admission_across_steps() -> None:
    sched = Scheduler(max_running=8, max_prefill_tokens=10)
    for i in range(3):
        sched.add(make_seq(f"r{i}", prompt_len=4))
    assert sched.waiting_prompt_tokens == 12
    assert ids(sched.schedule().prefills) == ["r0", "r1"]
    assert sched.waiting_prompt_tokens == 4
    assert ids(sched.schedule().prefills) == ["r2"]


def test_prompt_longer_than_budget_runs_alone_and_is_not_overtaken() -> None:
    sched = Scheduler(max_running=8, max_prefill_tokens=10)
    sched.add(make_seq("short", prompt_len=4))
    sched.add(make_seq("long", prompt_len=50))
    sched.add(make_seq("tiny", prompt_len=1))
    assert ids(sched.schedule().prefills) == ["short"]  # "tiny" does not jump the queue
    assert ids(sched.schedule().prefills) == ["long"]  # alone, over budget: no starvation
    assert ids(sched.schedule().prefills) == ["tiny"]


def test_abort_waiting_sequence_leaves_at_once() -> None:
    sched = Scheduler(max_running=1, max_prefill_tokens=100)
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
    sched = Scheduler(max_running=1, max_prefill_tokens=100)
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


def test_a_paused_sequence_keeps_its_slot_and_is_not_decoded_until_resumed() -> None:
    sched = Scheduler(max_running=2, max_prefill_tokens=100)
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


def test_finish_frees_slot_for_reuse_lowest_first() -> None:
    sched = Scheduler(max_running=3, max_prefill_tokens=100)
    seqs = [make_seq(f"r{i}") for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    sched.schedule()
    sched.finish(seqs[2])
    sched.finish(seqs[1])
    sched.add(make_seq("n0"))
    sched.add(make_seq("n1"))
    assert [s.slot for s in sched.schedule().prefills] == [1, 2]


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "schedule", "finish", "abort", "pause"]),
                              st.integers(0, 30), st.integers(1, 20)), max_size=60),
       max_running=st.integers(1, 4), budget=st.integers(1, 30))
def test_random_operations_keep_slots_consistent(ops: list[tuple[str, int, int]], max_running: int,
                                                 budget: int) -> None:
    """Whatever the interleaving: slots are exclusive, admission is FIFO, every request ends once."""
    sched = Scheduler(max_running=max_running, max_prefill_tokens=budget)
    added: list[str] = []
    admitted: list[str] = []
    ended: list[str] = []
    running: dict[str, Sequence] = {}
    for op, pick, prompt_len in ops:
        if op == "add":
            seq = make_seq(f"r{len(added)}", prompt_len)
            sched.add(seq)
            added.append(seq.request_id)
        elif op == "schedule":
            batch = sched.schedule()
            for seq in sched.take_aborted():
                ended.append(seq.request_id)
                running.pop(seq.request_id, None)
            assert not set(batch.prefills) & set(batch.decodes)
            assert all(not s.aborted for s in batch.prefills + batch.decodes)
            assert all(not s.paused for s in batch.decodes)
            assert sum(s.num_prompt_tokens for s in batch.prefills) <= budget or len(batch.prefills) == 1
            for seq in batch.decodes + batch.prefills:
                seq.completion_token_ids.append(1)  # what the step's sampler would do
            for seq in batch.prefills:
                admitted.append(seq.request_id)
                running[seq.request_id] = seq
            slots = [s.slot for s in running.values() if not s.aborted]
            assert len(set(slots)) == len(slots) and all(0 <= s < max_running for s in slots)
            assert sched.num_free_slots + sched.num_running == max_running
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
    while sched.has_work():  # drain: every running sequence finishes, the queue empties
        batch = sched.schedule()
        ended.extend(s.request_id for s in sched.take_aborted())
        admitted.extend(s.request_id for s in batch.prefills)
        for seq in batch.prefills + batch.decodes:
            sched.finish(seq)
            ended.append(seq.request_id)
    assert admitted == sorted(admitted, key=lambda r: int(r[1:]))
    assert sorted(ended) == sorted(added) and len(set(ended)) == len(ended)
    assert sched.num_free_slots == max_running
