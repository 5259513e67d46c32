"""The runner's persistent input batch: a scheduled step turned into the rows every rank runs.

`InputBatch.build` is the one way a step's inputs are made (step_channel.StepInputs): whichever
graph kind runs it and on every tensor-parallel rank. The rows are the decodes first, each (token
id, position, KV slot, pending row): the token to feed, where its KV entry goes and, for a token
still in flight, the previous launch's sampling row whose token the device feeds back instead;
then each verify row's tokens (speculative decoding: a decode's token and its draft), then each
prompt chunk's tokens. Beside them: each row's adapter slot, the prompt tokens whose
log-probabilities the chunks give, and the block-table entries the KV manager changed, which every
rank writes into its table in place before the forward (service/model/kv_cache.py).

Decode rows persist from launch to launch. Built from the sequences they are Python per row and
per step (what grows with the batch). In steady decoding every step has the same decodes as the
last one, in the same order, each one position further and each with its token in flight: then
the rows are the last launch's with the positions advanced and the pending rows 0..n-1, and no
sequence is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.scheduled_step import PrefillChunk, ScheduledStep
from service.engine.sequence import Sequence
from service.engine.step_channel import StepInputs
from service.model.step_batch import ChunkSpec


@dataclass
class DecodeRowInputs:
    token_ids: list[int]  # 0 where the token is pending (fed back on the device)
    positions: list[int]
    slots: list[int]
    pending_rows: list[int]  # per row: the previous launch's sampling row holding its token, or -1


class InputBatch:
    """Builds each launch's inputs; keeps the last launch's decode rows and sampling order."""

    def __init__(self, adapters: bool = True) -> None:
        """adapters: whether rows may have an adapter (False: the rows' adapter slots are not read)."""
        self._adapters = adapters
        self._decodes: tuple[Sequence, ...] = ()  # the last launch's decodes, in row order
        self._rows: DecodeRowInputs | None = None
        self._sampled: tuple[Sequence, ...] = ()  # the last launch's sampling order: its token rows
        self.reused = 0  # launches whose decode rows continued the last launch's (a test reads it)

    def build(self, step: ScheduledStep) -> StepInputs:
        """The step's inputs; from now on the step is the last launch (reset() if it was not launched)."""
        d = self._decode_rows(step.decodes)
        chunks = step.prefills
        token_ids = d.token_ids.copy() if chunks or step.verifies else d.token_ids
        specs = []
        for v in step.verifies:  # a decode and its draft: a chunk whose every row is sampled
            specs.append(ChunkSpec(slot_of(v.seq), v.start, v.num_tokens, verify=True))
            token_ids += v.token_ids()
        targets: list[int] | None = None
        for c in chunks:
            n = prompt_logprob_rows(c)
            specs.append(ChunkSpec(slot_of(c.seq), c.start, c.num_tokens, c.completes_prompt, n))
            token_ids += c.token_ids()
            if n:
                targets = (targets or []) + c.seq.request.prompt_token_ids[c.start + 1: c.start + 1 + n]
        lora_slots = None
        if self._adapters and (any(s.lora_slot for s in step.decodes) or any(c.seq.lora_slot for c in chunks)):
            lora_slots = ([s.lora_slot for s in step.decodes]
                          + [v.seq.lora_slot for v in step.verifies for _ in range(v.num_tokens)]
                          + [c.seq.lora_slot for c in chunks for _ in range(c.num_tokens)])
        self._sampled = step.sampling
        pending = d.pending_rows if max(d.pending_rows, default=-1) >= 0 else None
        return StepInputs(token_ids, d.positions, d.slots, specs, pending, step.num_sampled_rows, lora_slots, targets,
                          table_updates=step.table_updates)

    def reset(self) -> None:
        """Forget the last launch (it failed: its rows never ran)."""
        self._decodes, self._rows, self._sampled = (), None, ()

    def _decode_rows(self, decodes: tuple[Sequence, ...]) -> DecodeRowInputs:
        last = self._rows
        if (last is not None and decodes == self._decodes  # the same sequences in the same order (identity)
                and all(s.num_pending for s in decodes)):
            n = len(decodes)
            rows = DecodeRowInputs([0] * n, [p + 1 for p in last.positions], last.slots, list(range(n)))
            self.reused += 1
        else:
            rows = rebuild(decodes, self._sampled)
        self._decodes, self._rows = decodes, rows
        return rows


def rebuild(decodes: tuple[Sequence, ...], previous: tuple[Sequence, ...]) -> DecodeRowInputs:
    """The decode rows from the sequences themselves (the reference the reuse must equal); previous:
    the last launch's sampling order, where a pending token sits."""
    token_ids, positions, slots, pending_rows = [], [], [], []
    previous_rows: dict[Sequence, int] | None = None
    for s in decodes:
        if s.num_pending:
            if previous_rows is None:
                previous_rows = {p: row for row, p in enumerate(previous)}
            token_ids.append(0)
            pending_rows.append(previous_rows[s])
        else:
            token_ids.append(s.last_token_id())
            pending_rows.append(-1)
        positions.append(s.next_position())
        slots.append(slot_of(s))
    return DecodeRowInputs(token_ids, positions, slots, pending_rows)


def prompt_logprob_rows(chunk: PrefillChunk) -> int:
    """The chunk's rows that give prompt logprobs: those before the prompt's last token (whose logits
    sample the first completion token)."""
    seq = chunk.seq
    if not seq.needs_prompt_logits:
        return 0
    return max(0, min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1) - chunk.start)


def slot_of(seq: Sequence) -> int:
    assert seq.slot is not None, f"{seq.request_id} holds no KV slot"
    return seq.slot
