"""The per-step message of tensor parallelism: what rank 0 sends the other ranks before each step.

`StepInputs` is everything a rank needs to run a step's forward (rank 0 alone knows the sequences);
`StepChannel` sends it with one broadcast of a fixed-size int64 host buffer over a gloo group, so
no rank has to sync its device to read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.model.step_batch import ChunkSpec

STOP, STEP = 0, 1
_HEADER = 6  # kind, decodes, chunks, token ids, has pending rows, sampling rows


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward; rank 0 alone knows the sequences."""

    token_ids: list[int]  # every row's token: decodes first, then the prompt chunks' tokens
    positions: list[int]  # per decode row
    slots: list[int]  # per decode row
    chunks: list[ChunkSpec]
    pending_rows: list[int] | None  # per decode row: the previous step's token row to feed back, or -1
    num_sampling: int  # rows that sample (decodes, then chunks that complete their prompt)
    # Per token row, the LoRA adapter slot (0: base). Not sent: adapters and tensor parallelism are
    # not served together (the config refuses it), so the other ranks never see an adapter row.
    lora_slots: list[int] | None = None

    @staticmethod
    def capacity(max_running: int, max_num_batched_tokens: int) -> int:
        """int64 words of the largest step: a header, 3 per decode, 4 per chunk, the token ids."""
        return _HEADER + 7 * max_running + max_num_batched_tokens

    def encode(self, buf: torch.Tensor) -> None:
        d, c = len(self.positions), len(self.chunks)
        words = [STEP, d, c, len(self.token_ids), int(self.pending_rows is not None), self.num_sampling,
                 *self.positions, *self.slots, *(self.pending_rows or ()),
                 *(v for ch in self.chunks for v in (ch.slot, ch.start, ch.length, int(ch.sample))),
                 *self.token_ids]
        assert len(words) <= buf.numel(), f"a step of {len(words)} words exceeds the channel's {buf.numel()}"
        buf[: len(words)] = torch.tensor(words, dtype=torch.long)

    @classmethod
    def decode(cls, buf: torch.Tensor) -> StepInputs:
        kind, d, c, t, pending, sampling = buf[:_HEADER].tolist()
        assert kind == STEP
        n = 2 * d + (d if pending else 0) + 4 * c + t
        words = buf[_HEADER : _HEADER + n].tolist()
        positions, slots, at = words[:d], words[d : 2 * d], 2 * d
        pending_rows = None
        if pending:
            pending_rows, at = words[at : at + d], at + d
        chunks = [ChunkSpec(*words[at + 4 * i : at + 4 * i + 3], bool(words[at + 4 * i + 3])) for i in range(c)]
        at += 4 * c
        return cls(words[at : at + t], positions, slots, chunks, pending_rows, sampling)


class StepChannel:
    """One broadcast per step from rank 0 over a gloo group: a fixed-size host buffer."""

    def __init__(self, group: Any, capacity: int) -> None:
        self.group = group
        self.buf = torch.zeros(capacity, dtype=torch.long)

    def send(self, inputs: StepInputs | None) -> None:
        """Rank 0: the next step's inputs (None: stop)."""
        import torch.distributed as dist

        if inputs is None:
            self.buf[0] = STOP
        else:
            inputs.encode(self.buf)
        dist.broadcast(self.buf, src=0, group=self.group)

    def recv(self) -> StepInputs | None:
        """Ranks > 0: rank 0's next step, or None when rank 0 stops."""
        import torch.distributed as dist

        dist.broadcast(self.buf, src=0, group=self.group)
        return None if int(self.buf[0]) == STOP else StepInputs.decode(self.buf)
