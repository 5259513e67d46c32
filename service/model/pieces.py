"""The step forward split at attention: the shape piecewise CUDA graphs capture.

A model of L layers runs as L + 1 pieces with attention between them:

    piece 0      embedding, RoPE tables, layer 0's input norm and qkv projection, RoPE and KV write
    attention 0
    piece i      layer i-1's o_proj, post-attention norm and MLP; layer i's input norm, qkv, RoPE, KV write
    attention i
    piece L      layer L-1's o_proj, post-attention norm and MLP; the final norm and the LM head

Pieces read only per-token tensors of one fixed shape per padded token count (token ids,
positions, KV slots, the rows to sample) and the state the previous piece left, so one capture
per token-count bucket serves any mix of decodes and prompt chunks. Attention reads the real
per-sequence lengths (StepBatch.attention) and runs eagerly between them, writing into the output
buffer the next piece reads. On CPU everything runs eagerly; `forward` equals
LlamaForCausalLM.forward_step, the same forward unsplit.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from service.model.kv_cache import KVCache, WriteIndex
from service.model.llama import LlamaForCausalLM
from service.model.lora import LoraSlots, lora_tokens
from service.model.step_batch import StepBatch


@dataclass
class PieceState:
    """What one piece hands to the next, across an attention call. All [S, ...] per token."""

    x: torch.Tensor  # residual stream [S, hidden]
    cos: torch.Tensor  # [S, 1, D]
    sin: torch.Tensor
    q: torch.Tensor  # [S, H, D] rotated queries of the next attention (its K/V already written)
    index: WriteIndex  # each row's KV entry (block, offset), computed once per step by the first piece


class PiecewiseForward:
    """Runs a step as pieces with eager attention between them. The caller owns the StepBatch's
    tensors; a capturing wrapper (later) must keep them at fixed addresses and copy inputs in."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.num_layers = len(model.model.layers)
        self.lora: LoraSlots | None = None  # set when the server serves adapters

    @property
    def num_pieces(self) -> int:
        return self.num_layers + 1

    def first(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> PieceState:
        m = self.model
        x, cos, sin = m.embed(input_ids, positions)
        x, qkv = m.model.layers[0].pre_attention(x, None, m.fast)
        index = self.kv.write_index(slot_ids, positions)
        return PieceState(x, cos, sin, m.rope_kv_write(0, qkv, cos, sin, index, self.kv), index)

    def middle(self, layer: int, state: PieceState, attn: torch.Tensor) -> PieceState:
        """Finishes layer - 1 with its attention output attn [S, H * D]; runs layer up to its attention."""
        m = self.model
        x, delta = m.model.layers[layer - 1].post_attention(state.x, attn, m.fast)
        x, qkv = m.model.layers[layer].pre_attention(x, delta, m.fast)
        q = m.rope_kv_write(layer, qkv, state.cos, state.sin, state.index, self.kv)
        return PieceState(x, state.cos, state.sin, q, state.index)

    def last_hidden(self, state: PieceState, attn: torch.Tensor) -> torch.Tensor:
        """Finishes the last layer -> the final normed hidden states [S, hidden] of every row."""
        m = self.model
        x, delta = m.model.layers[-1].post_attention(state.x, attn, m.fast)
        return m.final_norm(x, delta)

    def attention(self, layer: int, state: PieceState, batch: StepBatch) -> torch.Tensor:
        return self.model.step_attention(layer, state.q, batch, self.kv)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [R, V] of batch.sample_rows; writes every row's K/V into its slot. Rows of a
        batch with `lora_slots` get their adapters (the pieces read the slots like the other per-token inputs)."""
        return self.model.logits(self.hidden(batch)[batch.sample_rows])

    @torch.inference_mode()
    def hidden(self, batch: StepBatch) -> torch.Tensor:
        """The step run eagerly -> the final normed hidden states [S, hidden] of every row."""
        if batch.lora_slots is not None:
            assert self.lora is not None, "a batch with adapter rows on a server without adapter slots"
        adapters = lora_tokens(batch.lora_slots, self.lora) if batch.lora_slots is not None else nullcontext()
        with adapters:
            state = self.first(batch.input_ids, batch.positions, batch.slot_ids)
            for layer in range(1, self.num_layers):
                state = self.middle(layer, state, self.attention(layer - 1, state, batch))
            return self.last_hidden(state, self.attention(self.num_layers - 1, state, batch))
