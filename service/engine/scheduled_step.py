"""One step as the scheduler decided it: an immutable value that the engine launches, the runner
turns into its inputs and, through step_channel.StepInputs, every tensor-parallel rank runs.

Pure data (no torch). Rows are the decodes first (one token each, in slot order), then the prompt
chunks (oldest prompt first); the sequences that sample a token are the decodes, then those whose
prompt a chunk completes. The block-table updates are the KV manager's (service/engine/kv_manager.py):
the rows' entries that the blocks allocated for this step changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class ScheduledStep:
    decodes: tuple[Sequence, ...] = ()  # running, with >= 1 completion token (seen or in flight)
    prefills: tuple[PrefillChunk, ...] = ()  # prompt chunks, oldest prompt first
    table_updates: tuple[TableUpdate, ...] = ()
    # The sequences that get a token from this step, in the order of its tokens: the decodes, then
    # those whose prompt this step completes (a chunk that leaves part of it for later samples nothing).
    sampling: tuple[Sequence, ...] = field(init=False)

    def __post_init__(self) -> None:
        completed = tuple(c.seq for c in self.prefills if c.completes_prompt)
        object.__setattr__(self, "sampling", self.decodes + completed if completed else self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)
