"""One step as the scheduler decided it: an immutable value that the engine launches, the runner
turns into its inputs and, through step_channel.StepInputs, every tensor-parallel rank runs.

Pure data (no torch). Rows are the decodes first (one token each, in slot order), then the verify
rows of speculative decoding (a decode's token and its draft: 1 + k tokens), then the prompt
chunks (oldest prompt first); the sequences that sample are the decodes, the verify rows (1 + k
tokens each: the target's token after each of the row's tokens), then those whose prompt a chunk
completes. The block-table updates are the KV manager's (service/engine/kv_manager.py):
the rows' entries that the blocks allocated for this step changed, and the copies between the
device pool and its host tier that must run before the step's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.host_tier import KvCopies
from service.engine.sequence import Sequence

# Block-table row `slot`'s entries [first, first + len(blocks)) become `blocks`.
TableUpdate = tuple[int, int, tuple[int, ...]]


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, end) of one sequence, prefilled in this step."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_prompt(self) -> bool:
        """The chunk holds the last token to prefill: the step samples the next completion token."""
        return self.end == self.seq.prefill_len

    def token_ids(self) -> list[int]:
        return self.seq.token_ids(self.start, self.end)


@dataclass(frozen=True)
class VerifyRow:
    """A decode with a draft: its newest token and the draft's tokens at KV positions [start, start
    + 1 + len(draft)) of its row, scored in one forward."""

    seq: Sequence
    start: int  # the position of its newest token (Sequence.next_position when scheduled)
    draft: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.draft)

    def token_ids(self) -> list[int]:
        return [self.seq.last_token_id(), *self.draft]


@dataclass(frozen=True)
class ScheduledStep:
    decodes: tuple[Sequence, ...] = ()  # running, with >= 1 completion token (seen or in flight)
    prefills: tuple[PrefillChunk, ...] = ()  # prompt chunks, oldest prompt first
    table_updates: tuple[TableUpdate, ...] = ()
    verifies: tuple[VerifyRow, ...] = ()  # decodes with a draft (speculative decoding), slot order
    # Copies between the device pool and the host tier (host_tier.py) that run before the forward.
    kv_copies: KvCopies = KvCopies()
    # Speculative decoding: the most draft tokens a decode was offered (adaptive k; 0: none, at this
    # batch size or because no row could take any); None: no proposer, or no decode.
    speculative_k: int | None = None
    # The sequences that get tokens from this step, in the order of its tokens: the decodes, the
    # verify rows (1 + k tokens each), then those whose prompt this step completes (a chunk that
    # leaves part of it for later samples nothing).
    sampling: tuple[Sequence, ...] = field(init=False)

    def __post_init__(self) -> None:
        completed = tuple(c.seq for c in self.prefills if c.completes_prompt)
        verified = tuple(v.seq for v in self.verifies)
        object.__setattr__(self, "sampling", self.decodes + verified + completed if completed or verified
                           else self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + sum(v.num_tokens for v in self.verifies)
                + sum(c.num_tokens for c in self.prefills))

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits are sampled: one per decode and completed prompt, 1 + k per verify row."""
        return len(self.sampling) + sum(len(v.draft) for v in self.verifies)
