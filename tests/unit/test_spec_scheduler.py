"""The scheduler with a proposer (pure logic): which decodes become verify rows of 1 + k tokens,
within the token budget, max_tokens and the free blocks (a draft never preempts), and how a
rejection rolls the computed positions back while only accepted tokens' blocks are registered."""

from __future__ import annotations

from service.engine.block_pool import BlockPool
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence
from tests.unit.test_scheduler import check_blocks, make_seq


class FixedDraft:
    """Proposes `draft` (cut to k) for every row."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft
        self.left: list[Sequence] = []

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.draft[:k]

    def finished(self, seq: Sequence) -> None:
        self.left.append(seq)


def started(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Prefill every sequence and give it its first token (as the engine reads it)."""
    for seq in seqs:
        sched.add(seq)
    step = sched.schedule()
    assert [c.seq for c in step.prefills] == seqs
    for seq in seqs:
        seq.completion_token_ids.append(7)


def test_drafts_fit_the_budget_max_tokens_and_free_blocks_and_never_preempt() -> None:
    proposer = FixedDraft([1, 2, 3, 4, 5])
    sched = Scheduler(4, 12, blocks=BlockPool(1 + 8, 4), proposer=proposer, num_speculative_tokens=4)
    a, b, c = make_seq("a", 3), make_seq("b", 3, max_tokens=3), make_seq("c", 3)
    started(sched, [a, b, c])
    step = sched.schedule()
    # budget 12: 3 decodes' own tokens, then drafts of 4 (a), 1 (b: 3 - 1 done - 1 its own), 4 (c)
    assert [(v.seq.request_id, v.start, v.draft) for v in step.verifies] == [
        ("a", 3, (1, 2, 3, 4)), ("b", 3, (1,)), ("c", 3, (1, 2, 3, 4))]
    assert step.decodes == () and step.num_tokens == 12 and step.num_sampled_rows == 12
    assert a.num_computed_tokens == 8 and len(a.block_ids) == 2
    check_blocks(sched, [a, b, c])
    # The target kept 1 of a's 4 draft tokens (and gave one more): its KV counts to its tokens.
    a.completion_token_ids += [1, 9]
    sched.rejected(a, 3)
    assert a.num_computed_tokens == 5 == a.num_tokens - 1
    b.completion_token_ids += [1, 2]  # all accepted, and the bonus: max_tokens reached
    sched.rejected(b, 0)
    sched.finish(b)
    c.completion_token_ids += [5]  # none accepted
    sched.rejected(c, 4)
    assert c.num_computed_tokens == 4 and proposer.left == [b]
    step = sched.schedule()
    assert [v.seq.request_id for v in step.verifies] == ["a", "c"]
    check_blocks(sched, [a, c])


def test_a_draft_that_needs_blocks_none_has_free_is_dropped_not_taken_from_another_row() -> None:
    sched = Scheduler(2, 18, blocks=BlockPool(1 + 4, 4), proposer=FixedDraft(list(range(1, 9))),
                      num_speculative_tokens=8)
    a, c = make_seq("a", 3), make_seq("c", 3)
    started(sched, [a, c])  # one block each, two free
    step = sched.schedule()  # a's 8 draft tokens need positions 3..11: two more blocks, the last free ones
    assert [v.seq.request_id for v in step.verifies] == ["a"] and [s.request_id for s in step.decodes] == ["c"]
    assert sched.num_preemptions == 0 and sched.kv.pool.num_free == 0
    check_blocks(sched, [a, c])


def test_blocks_of_draft_positions_are_registered_only_once_accepted() -> None:
    sched = Scheduler(2, 16, blocks=BlockPool(1 + 8, 4), proposer=FixedDraft([5, 6, 7, 8]), num_speculative_tokens=4)
    a = make_seq("a", 3)
    started(sched, [a])  # prompt [1, 2, 3], output [7]: 4 tokens, one full block, its last token not computed
    step = sched.schedule()
    assert step.verifies[0].start == 3 and a.num_computed_tokens == 8
    assert a.num_registered_blocks == 1  # block 0 (tokens 1, 2, 3, 7); block 1 holds only draft tokens
    a.completion_token_ids += [5, 9]  # 5 accepted, then 9
    sched.rejected(a, 3)
    step = sched.schedule()  # [1 2 3 7 | 5 9 ...]: block 1 is not full of known tokens yet
    assert a.num_registered_blocks == 1 and step.verifies[0].start == 5
    check_blocks(sched, [a])
