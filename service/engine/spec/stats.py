"""Running totals of speculative decoding since start (the engine's; read by tests, benchmarks and,
later, the admin state). The engine thread writes them; other threads may read them."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    drafts: int = 0  # verify rows (decodes that had a draft)
    draft_tokens: int = 0
    accepted: int = 0  # draft tokens the target accepted
    # Steps with decodes by the most draft tokens a decode was offered (adaptive k; 0: off at that batch).
    steps_by_k: collections.Counter[int] = field(default_factory=collections.Counter)
    last_k: int | None = None

    def add_step(self, k: int) -> None:
        self.steps_by_k[k] += 1
        self.last_k = k

    def add(self, num_drafts: int, num_draft_tokens: int, accepted: list[int]) -> None:
        self.drafts += num_drafts
        self.draft_tokens += num_draft_tokens
        self.accepted += sum(accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify row emitted on average (accepted draft tokens + the target's one)."""
        return 1 + self.accepted / self.drafts if self.drafts else None
