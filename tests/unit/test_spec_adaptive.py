"""Adaptive k: drafts that the target always refuses shrink to one token a row (and the output stays
the output without speculation), drafts it always keeps stay at num_speculative_tokens, and above a
batch size derived from the step's verify-token budget (or vLLM's disable_by_batch_size) no decode
speculates; the k each step chose is a metric."""

from __future__ import annotations

import pytest

from service.config import SpeculativeConfig
from service.engine.block_pool import BlockPool
from service.engine.scheduler import Scheduler
from service.engine.spec.adaptive import AdaptiveK, adaptive_k
from service.telemetry.engine_metrics import EngineMetrics
from tests.unit.test_metrics import scrape, server_metrics, value
from tests.unit.test_scheduler import make_seq
from tests.unit.test_spec_decode import Oracle, assert_same, references, request, run
from tests.unit.test_spec_scheduler import FixedDraft, started


class Offered(Oracle):
    """Proposes the reference's continuation, or (wrong=True) k tokens whose first is never the
    target's; records the k each row was offered, per call."""

    def __init__(self, references: list[list[int]], wrong: bool) -> None:
        super().__init__(references)
        self.wrong = wrong
        self.offered: dict[str, list[int]] = {}

    def propose(self, seq, k: int) -> list[int]:  # noqa: ANN001
        self.offered.setdefault(seq.request_id, []).append(k)
        right = super().propose(seq, k)
        return [(t + 1) % 768 for t in right] + [0] * (k - len(right)) if self.wrong else right


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def speculate(loaded, max_tokens: int, k: int, wrong: bool):  # noqa: ANN001, ANN201
    """Two greedy requests with drafts always right or always wrong: their output equals the output
    without speculation; returns the proposer (the k it was offered) and the totals."""
    reqs = [request(loaded, "a", "The service reads a request", max_tokens=max_tokens),
            request(loaded, "b", "Tokens stream back to the client", max_tokens=max_tokens)]
    off, _, _ = run(loaded, reqs)
    proposer = Offered(references(off, reqs), wrong=wrong)
    on, counts, _ = run(loaded, reqs, proposer, k=k)
    assert_same(off, on, reqs)
    return proposer, counts


def test_always_rejected_drafts_shrink_to_one_token_and_output_equals_off(loaded):  # noqa: ANN001
    proposer, counts = speculate(loaded, 40, 6, wrong=True)
    assert counts.accepted == 0 and counts.drafts > 0
    for rid in ("a", "b"):
        offered = proposer.offered[rid]
        assert offered[0] == 6 and offered[-10:] == [1] * 10, offered  # at the floor, and it stays there
        assert offered == sorted(offered, reverse=True)
    # The last step offers none: max_tokens leaves room for the target's token only.
    assert counts.last_k == 0 and counts.steps_by_k[1] > 30 and counts.steps_by_k[6] == 1


def test_always_accepted_drafts_keep_k_at_its_maximum(loaded):  # noqa: ANN001
    proposer, counts = speculate(loaded, 41, 4, wrong=False)
    # Each verify row emits 5 tokens: k = 4 until max_tokens leaves fewer (41 = 1 + 8 x 5).
    assert proposer.offered == {"a": [4] * 8, "b": [4] * 8}
    assert counts.accepted == counts.draft_tokens == 64 and set(counts.steps_by_k) == {4}


def first_decode_step(adaptive: AdaptiveK, num_seqs: int):  # noqa: ANN201
    sched = Scheduler(8, 64, blocks=BlockPool(1 + 64, 4), proposer=FixedDraft([1, 2, 3, 4]),
                      num_speculative_tokens=adaptive.max_k, adaptive=adaptive)
    started(sched, [make_seq(f"s{i}", 3) for i in range(num_seqs)])
    return sched.schedule()


def test_above_half_the_verify_token_budget_no_decode_speculates() -> None:
    step = first_decode_step(AdaptiveK(4, verify_token_budget=12), 3)  # (12 - 3) // 3 = 3 draft tokens each
    assert [v.draft for v in step.verifies] == [(1, 2, 3)] * 3 and step.speculative_k == 3
    step = first_decode_step(AdaptiveK(4, verify_token_budget=12), 5)  # (12 - 5) // 5 = 1
    assert [v.draft for v in step.verifies] == [(1,)] * 5 and step.speculative_k == 1
    step = first_decode_step(AdaptiveK(4, verify_token_budget=12), 7)  # above 12 / 2: none
    assert step.verifies == () and len(step.decodes) == 7 and step.speculative_k == 0 and step.num_tokens == 7


def test_disable_by_batch_size_turns_speculation_off_above_it() -> None:
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    step = first_decode_step(adaptive_k(config), 2)
    assert [v.draft for v in step.verifies] == [(1, 2)] * 2
    step = first_decode_step(adaptive_k(config), 3)
    assert step.verifies == () and len(step.decodes) == 3 and step.speculative_k == 0


@pytest.mark.parametrize("field, bad", [("verify_token_budget", 1), ("disable_by_batch_size", 0),
                                        ("disable_by_batch_size", "8")])
def test_bad_adaptive_fields_are_refused_by_name(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"speculative_config.{field} must be an integer"):
        SpeculativeConfig.parse({"method": "ngram", field: bad})


def test_the_k_each_step_chose_is_a_metric() -> None:
    engine = EngineMetrics(model_name="builtin:tiny")
    m = server_metrics(engine)
    for k in (4, 4, 2, 0):
        engine.on_speculative_k(k)
    s = scrape(m)
    assert value(s, "graphserve_spec_decode_k_count") == 4
    assert value(s, "graphserve_spec_decode_k_sum") == 10
    assert value(s, "graphserve_spec_decode_k_bucket", le="0.0") == 1
    assert value(s, "graphserve_spec_decode_k_last") == 0
