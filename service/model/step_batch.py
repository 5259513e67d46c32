"""One engine step as the model sees it: decode rows and prompt chunks packed into one flat batch.

Rows are the decodes first (one token each), then each chunk's tokens, in the caller's order. The
per-token tensors (token ids, positions, KV slots) have one fixed shape for every mix of decodes
and chunks with the same (padded) token count: they are what the non-attention pieces of the
forward read. `AttentionMetadata` holds the real per-sequence lengths that only attention reads.
Padding rows (past `num_tokens`) read token 0 at position 0 and write only the scratch KV slot.

Built on the host and copied to the device at once (service.model.device_copy): no host sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from service.model.device_copy import copy_parts
from service.model.kernels.prefill_attention import CHUNK_FIELDS, chunk_tiles


@dataclass(frozen=True)
class ChunkSpec:
    """Prompt tokens at KV positions [start, start + length) of `slot`."""

    slot: int
    start: int  # 0: the prompt starts here; > 0: the slot's KV holds [0, start) from earlier steps
    length: int
    sample: bool = True  # return the logits of its last token
    # Prompt logprobs: the chunk's first `logprob_rows` rows' hidden states come back too
    # (StepBatch.logprob_rows), for the log-probability of the token after each.
    logprob_rows: int = 0
    # A speculative verify row (a decode's token and its draft): every row's logits come back.
    verify: bool = False


@dataclass(frozen=True)
class PromptChunk:
    """Rows [row, row + length) hold a prompt's tokens at KV positions [start, start + length) of
    `slot`: they attend to the slot's KV [0, start) (earlier chunks, or a prefix-cache hit) and
    causally among themselves."""

    row: int
    length: int
    slot: int
    start: int


@dataclass(frozen=True)
class AttentionMetadata:
    num_decodes: int  # rows [0, num_decodes): one token at `position`, attending to KV [0, position]
    chunks: list[PromptChunk]
    num_tokens: int  # real rows; the rest is padding that attention leaves zero
    # The chunks on the device (service.model.kernels.prefill_attention): [C, 4] (row, length,
    # start, slot) and the [T, 2] (chunk, first query) of every query tile; None without chunks.
    chunk_table: torch.Tensor | None = None
    chunk_tiles: torch.Tensor | None = None


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64, KV position of each token
    slot_ids: torch.Tensor  # [S] int64, KV slot of each token (scratch for padding)
    sample_rows: torch.Tensor  # [R] rows whose logits come back: decodes, then sampling chunks' last rows
    # (every row of a verify chunk)
    attention: AttentionMetadata
    pending_rows: torch.Tensor | None = None  # [num_decodes] see build_step_batch
    logprob_rows: torch.Tensor | None = None  # [P] rows whose next-token logprobs are asked (ChunkSpec)
    lora_slots: torch.Tensor | None = None  # [S] int64, each row's LoRA adapter slot (0: none; padding 0)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def build_step_batch(
    decode_positions: list[int],
    decode_slots: list[int],
    chunks: list[ChunkSpec],
    token_ids: list[int] | torch.Tensor,
    max_seq_len: int,
    scratch_slot: int,
    device: torch.device,
    pad_to: int | None = None,
    pending_rows: list[int] | None = None,
    lora_slots: list[int] | None = None,
) -> StepBatch:
    """token_ids: every real row's token, decodes first (host ints, or a device tensor [n]).
    pending_rows: per decode row, an index into the previous step's sampled tokens to take its
    token from on the device (-1: use token_ids); carried to the device in the same copy.
    lora_slots: per real row, its LoRA adapter slot (None: no row has an adapter); same copy."""
    num_decodes = len(decode_positions)
    n = num_decodes + sum(c.length for c in chunks)
    _check(decode_positions, decode_slots, chunks, n, len(token_ids), max_seq_len, scratch_slot)
    size = n if pad_to is None else pad_to
    if size < n:
        raise ValueError(f"pad_to {pad_to} is below the {n} tokens of the step")
    pad = size - n

    first_rows = list(itertools.accumulate((c.length for c in chunks), initial=num_decodes))[:-1]
    positions = [*decode_positions, *(p for c in chunks for p in range(c.start, c.start + c.length)), *[0] * pad]
    slots = [*decode_slots, *(c.slot for c in chunks for _ in range(c.length)), *[scratch_slot] * pad]
    sample_rows = [*range(num_decodes), *(i for r, c in zip(first_rows, chunks) if c.sample
                                           for i in range(r if c.verify else r + c.length - 1, r + c.length))]
    prompt_chunks = [PromptChunk(r, c.length, c.slot, c.start) for r, c in zip(first_rows, chunks)]

    logprob_rows = [r + i for r, c in zip(first_rows, chunks) for i in range(c.logprob_rows)]
    parts: list[list[int]] = [positions, slots, sample_rows]
    if chunks:
        parts.append([x for c in prompt_chunks for x in (c.row, c.length, c.start, c.slot)])
        parts.append(chunk_tiles([c.length for c in chunks]))
    ids_on_host = not isinstance(token_ids, torch.Tensor)
    if ids_on_host:
        parts.append([*token_ids, *[0] * pad])
    if pending_rows is not None:
        assert len(pending_rows) == num_decodes
        parts.append(pending_rows)
    if lora_slots is not None:
        assert len(lora_slots) == n
        parts.append([*lora_slots, *[0] * pad])
    if logprob_rows:
        parts.append(logprob_rows)
    views = copy_parts(parts, torch.long, device)
    positions_t, slots_t, sample_t = views[:3]
    rest = views[3:]
    chunk_t = rest.pop(0).view(-1, CHUNK_FIELDS) if chunks else None
    tiles_t = rest.pop(0).view(-1, 2) if chunks else None
    if ids_on_host:
        ids_t = rest.pop(0)
    else:
        ids_t = token_ids if not pad else torch.cat([token_ids, token_ids.new_zeros(pad)])
    pending_t = rest.pop(0) if pending_rows is not None else None
    lora_t = rest.pop(0) if lora_slots is not None else None
    logprob_t = rest.pop(0) if logprob_rows else None
    meta = AttentionMetadata(num_decodes, prompt_chunks, n, chunk_t, tiles_t)
    return StepBatch(ids_t, positions_t, slots_t, sample_t, meta, pending_t, logprob_t, lora_t)


def _check(
    decode_positions: list[int], decode_slots: list[int], chunks: list[ChunkSpec], num_tokens: int,
    num_ids: int, max_seq_len: int, scratch_slot: int,
) -> None:
    """Raises ValueError unless the rows describe one step that fits the KV cache."""
    if len(decode_positions) != len(decode_slots):
        raise ValueError(f"{len(decode_positions)} decode positions but {len(decode_slots)} slots")
    if num_ids != num_tokens:
        raise ValueError(f"the rows hold {num_tokens} tokens but token_ids has {num_ids}")
    for j, c in enumerate(chunks):
        if c.length < 1:
            raise ValueError(f"chunk {j} is empty ({c.length} tokens)")
        if not 0 <= c.logprob_rows <= c.length:
            raise ValueError(f"chunk {j} asks for {c.logprob_rows} logprob rows of its {c.length}")
        if c.start < 0 or c.start + c.length > max_seq_len:
            raise ValueError(f"chunk {j} at positions [{c.start}, {c.start + c.length}) exceeds the KV cache "
                             f"length {max_seq_len}")
    if num_tokens == 0:
        raise ValueError("a step needs at least one token")
    if any(not 0 <= p < max_seq_len for p in decode_positions):
        raise ValueError(f"a decode position is outside the KV cache length {max_seq_len}")
    slots = [*decode_slots, *(c.slot for c in chunks)]
    if any(not 0 <= s <= scratch_slot for s in slots):
        raise ValueError(f"a slot is outside the KV cache's slots [0, {scratch_slot}]: {slots}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"two rows of the step share a KV slot: {slots}")
