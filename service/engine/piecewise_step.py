"""The step forward split at attention, in the shape piecewise CUDA graphs need.

`PiecewiseStep` implements `cache_manager.DecodeStep` for the PIECEWISE graph kind: static
per-token inputs (token ids, positions, KV slots) and the attention output buffer, sized for the
largest step in tokens. The graph cache captures the L + 1 pieces of a token-count bucket as
graphs sharing one memory pool (`segments`); at replay attention runs eagerly between them on the
current step's real lengths (`write` gives it the step's StepBatch). The result is the final
normed hidden state of every row; the runner takes the rows it samples through the LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.decode_step import pad_rows
from service.model.kv_cache import KVCache
from service.model.lora import LoraSlots, lora_tokens
from service.model.pieces import PieceState, PiecewiseForward
from service.model.step_batch import AttentionMetadata, StepBatch


@dataclass
class Segments:
    """One token bucket's forward as captured: `pieces[i]` runs a piece (recorded as a graph),
    `between[i]` the eager attention after piece i; `output()` is the last piece's result."""

    pieces: list[Callable[[], None]]
    between: list[Callable[[], None]]
    output: Callable[[], torch.Tensor]

    def run(self) -> torch.Tensor:
        """Eagerly, in the order a replay runs them: piece 0, attention 0, piece 1, ..."""
        for i, piece in enumerate(self.pieces):
            piece()
            if i < len(self.between):
                self.between[i]()
        return self.output()


class PiecewiseStep:
    def __init__(self, pieces: PiecewiseForward, kv: KVCache, max_tokens: int, device: torch.device) -> None:
        self.pieces = pieces
        self.kv = kv
        self.max_batch = max_tokens  # the graph cache's name for the largest size this step runs
        self.device = device
        spec = pieces.model.spec
        width = spec.num_heads * spec.head_dim
        dtype = kv.dtype
        # Static inputs: the pieces' graphs read views of these; they are never reallocated.
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_ids = torch.full((max_tokens,), kv.scratch_slot, dtype=torch.long, device=device)
        self.attn_out = torch.zeros(max_tokens, width, dtype=dtype, device=device)  # attention -> next piece
        self.batch: StepBatch | None = None  # the step being run: attention reads its real lengths
        # The capture thread's warm-up runs on these, never on the serving buffers above: only the
        # scratch slot is written, every row a one-token "decode" at position 0.
        self._scratch = (
            torch.zeros(max_tokens, dtype=torch.long, device=device),
            torch.zeros(max_tokens, dtype=torch.long, device=device),
            torch.full((max_tokens,), kv.scratch_slot, dtype=torch.long, device=device),
            torch.zeros(max_tokens, width, dtype=dtype, device=device),
        )

    def write(self, batch: StepBatch) -> None:
        """Copy the step's real rows [0, n) into the static inputs (n = batch.size, unpadded)."""
        n = batch.size
        assert n <= self.max_batch, f"a step of {n} tokens exceeds the {self.max_batch} the buffers hold"
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_ids[:n].copy_(batch.slot_ids)
        self.batch = batch

    def set_padding_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) read token 0 at position 0 and write only the scratch KV slot."""
        pad_rows(self.input_ids, self.positions, self.slot_ids, self.kv.scratch_slot, start, stop)

    def run(self, size: int) -> torch.Tensor:
        """Eager: the final normed hidden states [size, hidden] of rows [0, size) of the static inputs."""
        assert self.batch is not None, "write() a step before running it"
        return self._segments(size, self.input_ids, self.positions, self.slot_ids, self.attn_out, self.batch).run()

    def run_scratch(self, size: int) -> torch.Tensor:
        """Like `run`, on private inputs that write only the scratch slot (the capture warm-up)."""
        ids, positions, slots, out = (t[:size] for t in self._scratch)
        meta = AttentionMetadata(num_decodes=size, chunks=[], num_tokens=size)
        batch = StepBatch(ids, positions, slots, torch.arange(size, device=self.device), meta)
        return self._segments(size, *self._scratch[:3], self._scratch[3], batch).run()

    def segments(self, size: int) -> Segments:
        """The pieces of a `size`-token bucket over the serving buffers, for capture: attention
        between them reads the StepBatch last given to `write` when the graphs replay."""
        return self._segments(size, self.input_ids, self.positions, self.slot_ids, self.attn_out, None)

    def input_addresses(self) -> tuple[int, ...]:
        return (self.input_ids.data_ptr(), self.positions.data_ptr(), self.slot_ids.data_ptr(),
                self.attn_out.data_ptr())

    def _segments(
        self, size: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attn_out: torch.Tensor,
        batch: StepBatch | None,
    ) -> Segments:
        """batch None: attention reads `self.batch` when it runs (replay); else this fixed batch."""
        p = self.pieces
        ids, positions, slots, out = ids[:size], positions[:size], slots[:size], attn_out[:size]
        state: dict[str, PieceState] = {}  # the latest piece's output
        states: dict[int, PieceState] = {}  # layer -> the state its piece left (kept: replay reads its tensors)
        hidden: list[torch.Tensor] = []

        def first() -> None:
            state["s"] = p.first(ids, positions, slots)
            states[0] = state["s"]

        def middle(layer: int) -> Callable[[], None]:
            def run() -> None:
                state["s"] = p.middle(layer, state["s"], out)
                states[layer] = state["s"]
            return run

        def last() -> None:
            hidden[:] = [p.last_hidden(state["s"], out)]

        def attend(layer: int) -> Callable[[], None]:
            def run() -> None:
                step = batch if batch is not None else self.batch
                piece = states[layer]
                p.model.step_attention(layer, piece.q, step, self.kv, out=out)
            return run

        pieces = [first, *(middle(layer) for layer in range(1, p.num_layers)), last]
        between = [attend(layer) for layer in range(p.num_layers)]
        return Segments(pieces, between, lambda: hidden[0])


class LoraPiecewiseStep:
    """The piecewise step with LoRA products: the base step's static inputs (and attention output
    buffer) plus each token's adapter slot, a static input too, so swapping an adapter needs no
    recapture. The graph cache captures its pieces for its LoRA family; base-only steps keep the
    base step's."""

    def __init__(self, base: PiecewiseStep, lora: LoraSlots) -> None:
        self.base, self.lora = base, lora
        self.max_batch = base.max_batch
        self.lora_slots = torch.zeros(base.max_batch, dtype=torch.long, device=base.device)
        self._scratch_slots = torch.zeros(base.max_batch, dtype=torch.long, device=base.device)  # never written

    def write(self, batch: StepBatch) -> None:
        assert batch.lora_slots is not None, "a step without adapter rows runs the base step"
        self.base.write(batch)
        self.lora_slots[: batch.size].copy_(batch.lora_slots)

    def set_padding_rows(self, start: int, stop: int) -> None:
        self.base.set_padding_rows(start, stop)
        if stop > start:
            self.lora_slots[start:stop].zero_()

    def run(self, size: int) -> torch.Tensor:
        with lora_tokens(self.lora_slots[:size], self.lora):
            return self.base.run(size)

    def run_scratch(self, size: int) -> torch.Tensor:
        with lora_tokens(self._scratch_slots[:size], self.lora):
            return self.base.run_scratch(size)

    def segments(self, size: int) -> Segments:
        """The base step's segments, each piece run (and so recorded) with the rows' adapters."""
        base = self.base.segments(size)
        slots = self.lora_slots[:size]

        def with_lora(piece: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                with lora_tokens(slots, self.lora):
                    piece()
            return run

        return Segments([with_lora(p) for p in base.pieces], base.between, base.output)

    def input_addresses(self) -> tuple[int, ...]:
        return (*self.base.input_addresses(), self.lora_slots.data_ptr())
