"""A step's decode rows, kept from step to step: the persistent part of the batch.

A decode row is (token id, position, KV slot, pending row): the token to feed, where its KV entry
goes, and, for a token still in flight, the previous launch's row whose sampled token the device
feeds back instead. Built from scratch, that is Python per row and per step (what grows with the
batch). In steady decoding every step has the same rows as the last one, in the same order, each
one position further and each with its token in flight: then the rows are the last step's, with
the positions advanced and the pending rows 0..n-1, and no sequence is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.sequence import Sequence


@dataclass
class DecodeRowInputs:
    token_ids: list[int]  # 0 where the token is pending (fed back on the device)
    positions: list[int]
    slots: list[int]
    pending_rows: list[int]  # per row: the previous launch's sampling row holding its token, or -1


class DecodeRows:
    """Builds each launch's decode rows; reuses the last launch's when they continue it."""

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []  # the last launch's decodes, in row order
        self._rows: DecodeRowInputs | None = None
        self.reused = 0  # launches whose rows continued the last launch's (a test reads it)

    def build(self, decodes: list[Sequence], previous_rows: dict[str, int]) -> DecodeRowInputs:
        """decodes: this launch's, in row order; previous_rows: the last launch's sampling row of each
        sequence key (its decodes first, in their order, then the chunks that completed a prompt)."""
        last = self._rows
        if (last is not None and decodes == self._seqs  # the same sequences in the same order (identity)
                and all(s.num_pending for s in decodes)):
            n = len(decodes)
            rows = DecodeRowInputs([0] * n, [p + 1 for p in last.positions], list(last.slots), list(range(n)))
            self.reused += 1
        else:
            rows = rebuild(decodes, previous_rows)
        self._seqs, self._rows = list(decodes), rows
        return rows

    def reset(self) -> None:
        """Forget the last launch (its tokens were read, or its rows were not the engine's)."""
        self._seqs, self._rows = [], None


def rebuild(decodes: list[Sequence], previous_rows: dict[str, int]) -> DecodeRowInputs:
    """The rows from the sequences themselves (the reference the reuse must equal)."""
    token_ids, positions, slots, pending_rows = [], [], [], []
    for s in decodes:
        if s.num_pending:
            token_ids.append(0)
            pending_rows.append(previous_rows[s.key])
        else:
            token_ids.append(s.last_token_id())
            pending_rows.append(-1)
        positions.append(s.next_position())
        assert s.slot is not None, f"{s.request_id} holds no KV slot"
        slots.append(s.slot)
    return DecodeRowInputs(token_ids, positions, slots, pending_rows)
