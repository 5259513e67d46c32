"""Adaptive k: how many draft tokens each decode is offered in a step, from what its drafts have
been worth so far and from the size of the batch.

Acceptance: each row keeps an exponential moving average of its drafts' per-token acceptance
(Sequence.draft_acceptance): a verify row whose target kept n of its d draft tokens is n Bernoulli
trials that succeeded, then one that failed when n < d, so it measures n / (n + [n < d]). A row
starts from the server's average over earlier rows (1.0 at start: drafts are tried at full length
until they prove poor). Draft token j stands only if the j - 1 before it did, about alpha^j for a
per-token acceptance alpha, so a row is offered the largest k whose last token still has a chance
of MIN_CHANCE or more, at least MIN_K (a row whose drafts all fail keeps probing with one token, so
it notices when its text turns repetitive) and at most num_speculative_tokens.

Batch size: a step's decodes and draft tokens together stay within verify_token_budget, shared
evenly: each decode is offered at most (budget - decodes) // decodes draft tokens. At batch 1 a
verify row of 1 + k tokens costs about a decode step (the weights are read once either way); at
large batches the step turns compute-bound and drafts that are rejected cost throughput, so above
budget / 2 decodes (or vLLM's disable_by_batch_size, when given) no row speculates.

Pure Python, called by the scheduler on the engine thread.
"""

from __future__ import annotations

from service.config import SpeculativeConfig
from service.engine.sequence import Sequence

MIN_K = 1
# The least chance of standing (alpha^j) for which a draft's j-th token is worth a verify position.
MIN_CHANCE = 0.2
ROW_WEIGHT = 0.3  # weight of a verify row's measurement in its row's average
SERVER_WEIGHT = 0.05  # and in the server's, which new rows start from
DEFAULT_VERIFY_TOKEN_BUDGET = 64


class AdaptiveK:
    def __init__(self, max_k: int, verify_token_budget: int = DEFAULT_VERIFY_TOKEN_BUDGET,
                 disable_by_batch_size: int | None = None) -> None:
        assert max_k >= MIN_K, max_k
        self.max_k = max_k
        self.verify_token_budget = verify_token_budget
        self.disable_by_batch_size = disable_by_batch_size
        self.server_acceptance = 1.0

    def step_limit(self, num_decodes: int) -> int:
        """The most draft tokens any of a step's num_decodes decodes may have (0: none speculates)."""
        if num_decodes < 1 or (self.disable_by_batch_size is not None and num_decodes > self.disable_by_batch_size):
            return 0
        return max(0, min(self.max_k, (self.verify_token_budget - num_decodes) // num_decodes))

    def row_k(self, seq: Sequence, limit: int) -> int:
        """Draft tokens seq is offered in a step whose limit is `limit` (step_limit)."""
        if limit < 1:
            return 0
        alpha = seq.draft_acceptance if seq.draft_acceptance is not None else self.server_acceptance
        k = MIN_K
        chance = alpha ** (k + 1)
        while k < limit and chance >= MIN_CHANCE:
            k += 1
            chance *= alpha
        return k

    def observe(self, seq: Sequence, num_draft_tokens: int, num_accepted: int) -> None:
        """seq's verify row: the target kept num_accepted of its num_draft_tokens draft tokens."""
        assert 0 <= num_accepted <= num_draft_tokens and num_draft_tokens > 0
        measured = num_accepted / (num_accepted + (num_accepted < num_draft_tokens))
        before = seq.draft_acceptance if seq.draft_acceptance is not None else self.server_acceptance
        seq.draft_acceptance = before + ROW_WEIGHT * (measured - before)
        self.server_acceptance += SERVER_WEIGHT * (measured - self.server_acceptance)


def adaptive_k(config: SpeculativeConfig) -> AdaptiveK:
    return AdaptiveK(config.num_speculative_tokens, config.verify_token_budget, config.disable_by_batch_size)
