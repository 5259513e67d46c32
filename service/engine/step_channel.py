"""The per-step message of tensor parallelism: what rank 0 sends the other ranks before each step.

`StepInputs` is everything a rank needs to run a step's forward (rank 0 alone knows the sequences:
its runner's InputBatch builds it from the scheduled step), with the graph operations every rank
runs before it and the graph the step replays (rank 0's graph cache decides both); `StepChannel`
sends it with one broadcast of a fixed-size int64 host buffer over a gloo group, so no rank has to
sync its device to read it (a step too long for the buffer, e.g. many prefix-cache hits at once,
sends the rest in a second broadcast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cache_manager import BatchDescriptor, CudaGraphMode
from cache_manager.mirror import CAPTURE, RELEASE, GraphOp
from service.engine.scheduled_step import TableUpdate
from service.model.step_batch import ChunkSpec

STOP, STEP, MORE_OPS = 0, 1, 2  # MORE_OPS: graph ops of the next message that did not fit in it
# kind, decodes, chunks, token ids, has pending rows, sampling rows, graph ops, replayed graph (kind, size),
# block-table words, words beyond the buffer (sent in a second broadcast)
_HEADER = 11
MAX_OPS = 16  # graph ops per broadcast; a step rarely has any (a capture, a few evictions)
_KINDS = (None, CudaGraphMode.FULL, CudaGraphMode.PIECEWISE)
_ACTIONS = (CAPTURE, RELEASE)


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
    # Rank 0 only (not sent: the other ranks compute the rows' logits and drop them): per chunk row
    # with ChunkSpec.logprob_rows, in order, the prompt token whose log-probability it gives.
    logprob_targets: list[int] | None = None
    # Rank 0's graph cache's decisions: the captures and releases every rank runs before the step
    # (or before nothing: `only_ops`), in order, and the graph the step replays (None: eager).
    graph_ops: list[GraphOp] = field(default_factory=list)
    replay: BatchDescriptor | None = None
    # Block-table entries that the scheduled step's allocations changed (ScheduledStep.table_updates):
    # every rank writes them into its KV cache's table before the forward.
    table_updates: tuple[TableUpdate, ...] = ()

    @classmethod
    def only_ops(cls, ops: list[GraphOp]) -> StepInputs:
        """A message with graph operations and no step (run between steps: what traffic, the warm start
        and operators queued, on an idle engine)."""
        return cls([], [], [], [], None, 0, graph_ops=list(ops))

    @property
    def runs_forward(self) -> bool:
        return bool(self.token_ids)

    @staticmethod
    def capacity(max_running: int, max_num_batched_tokens: int, block_size: int = 16) -> int:
        """int64 words of a usual largest step: a header, 3 per graph op (up to MAX_OPS), 3 per decode,
        5 per chunk, the token ids, and the new blocks of a step (one per row, and the chunks')."""
        table = 4 * max_running + max_num_batched_tokens // block_size
        return _HEADER + 3 * MAX_OPS + 8 * max_running + max_num_batched_tokens + table

    def encode(self, buf: torch.Tensor, ops: list[GraphOp] | None = None) -> torch.Tensor | None:
        """Into buf: the step with `ops` (default: all of graph_ops, at most MAX_OPS). Returns the words
        beyond buf's size (for a second broadcast), or None when it all fits."""
        ops = self.graph_ops if ops is None else ops
        assert len(ops) <= MAX_OPS, f"{len(ops)} graph ops in one message (StepChannel splits them)"
        d, c = len(self.positions), len(self.chunks)
        replay = self.replay
        table = [v for slot, first, blocks in self.table_updates for v in (slot, first, len(blocks), *blocks)]
        body = [*_op_words(ops), *self.positions, *self.slots, *(self.pending_rows or ()),
                *(v for ch in self.chunks
                   for v in (ch.slot, ch.start, ch.length, int(ch.sample) | int(ch.verify) << 1, ch.logprob_rows)),
                *self.token_ids, *table]
        extra = max(0, _HEADER + len(body) - buf.numel())
        words = [STEP, d, c, len(self.token_ids), int(self.pending_rows is not None), self.num_sampling, len(ops),
                 _KINDS.index(replay.mode if replay else None), replay.padded_size if replay else 0, len(table),
                 extra, *body]
        buf[: len(words) - extra] = torch.tensor(words[: len(words) - extra], dtype=torch.long)
        return torch.tensor(words[len(words) - extra:], dtype=torch.long) if extra else None

    @classmethod
    def decode(cls, buf: torch.Tensor, rest: torch.Tensor | None = None) -> StepInputs:
        kind, d, c, t, pending, sampling, num_ops, replay_kind, replay_size, nt, extra = buf[:_HEADER].tolist()
        assert kind == STEP
        n = 3 * num_ops + 2 * d + (d if pending else 0) + 5 * c + t + nt
        words = buf[_HEADER : _HEADER + n - extra].tolist() + (rest.tolist() if extra else [])
        ops, at = _ops_from(words, num_ops), 3 * num_ops
        positions, slots, at = words[at : at + d], words[at + d : at + 2 * d], at + 2 * d
        pending_rows = None
        if pending:
            pending_rows, at = words[at : at + d], at + d
        chunks = [ChunkSpec(*words[at + 5 * i : at + 5 * i + 3], bool(words[at + 5 * i + 3] & 1), words[at + 5 * i + 4],
                            verify=bool(words[at + 5 * i + 3] & 2))
                  for i in range(c)]
        at += 5 * c
        replay = BatchDescriptor(_KINDS[replay_kind], replay_size) if replay_kind else None
        token_ids, at = words[at : at + t], at + t
        updates = []
        while at < len(words):
            slot, first, count = words[at : at + 3]
            updates.append((slot, first, tuple(words[at + 3 : at + 3 + count])))
            at += 3 + count
        return cls(token_ids, positions, slots, chunks, pending_rows, sampling, graph_ops=ops, replay=replay,
                   table_updates=tuple(updates))

    @staticmethod
    def extra_words(buf: torch.Tensor) -> int:
        """Words of the step in buf that follow in a second broadcast."""
        return int(buf[_HEADER - 1])


def _op_words(ops: list[GraphOp]) -> list[int]:
    return [v for op in ops for v in (_ACTIONS.index(op.action), _KINDS.index(op.key.mode), op.key.padded_size)]


def _ops_from(words: list[int], n: int) -> list[GraphOp]:
    return [GraphOp(_ACTIONS[words[3 * i]], BatchDescriptor(_KINDS[words[3 * i + 1]], words[3 * i + 2]))
            for i in range(n)]


class StepChannel:
    """One broadcast per step from rank 0 over a gloo group: a fixed-size host buffer (graph ops
    beyond MAX_OPS go first, in MORE_OPS broadcasts that the receiver joins to the step)."""

    def __init__(self, group: Any, capacity: int) -> None:
        self.group = group
        self.buf = torch.zeros(capacity, dtype=torch.long)

    def send(self, inputs: StepInputs | None) -> None:
        """Rank 0: the next step's inputs (None: stop)."""
        if inputs is None:
            self.buf[0] = STOP
            self._broadcast()
            return
        ops = inputs.graph_ops
        while len(ops) > MAX_OPS:
            words = [MORE_OPS, MAX_OPS, *_op_words(ops[:MAX_OPS])]
            self.buf[: len(words)] = torch.tensor(words, dtype=torch.long)
            self._broadcast()
            ops = ops[MAX_OPS:]
        rest = inputs.encode(self.buf, ops)
        self._broadcast()
        if rest is not None:
            self._broadcast(rest)

    def recv(self) -> StepInputs | None:
        """Ranks > 0: rank 0's next step, or None when rank 0 stops."""
        earlier: list[GraphOp] = []
        while True:
            self._broadcast()
            kind = int(self.buf[0])
            if kind != MORE_OPS:
                break
            n = int(self.buf[1])
            earlier += _ops_from(self.buf[2 : 2 + 3 * n].tolist(), n)
        if kind == STOP:
            return None
        extra = StepInputs.extra_words(self.buf)
        rest = None
        if extra:
            rest = torch.zeros(extra, dtype=torch.long)
            self._broadcast(rest)
        inputs = StepInputs.decode(self.buf, rest)
        inputs.graph_ops[:0] = earlier
        return inputs

    def _broadcast(self, tensor: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        dist.broadcast(self.buf if tensor is None else tensor, src=0, group=self.group)
