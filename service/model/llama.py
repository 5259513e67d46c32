"""Our own Llama-family decoder (Llama, Mistral, Qwen2): prefill into and decode from a static KVCache.

Parameter names follow Hugging Face so checkpoints load as they are. All tokens of a call are
handled as a flat [N, ...] batch so prefill, decode and the cache-free forward share the layer code
and differ only in how attention reads and writes keys and values.

Mistral's (and Qwen2's optional) sliding window is not applied: attention is always over the full
context. That is exact while the context is no longer than the window (4096 for Mistral-7B v0.1);
ModelSpec.sliding_window tells the engine where to cap max_seq_len.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from service.model.kv_cache import KVCache
from service.model.spec import ModelLoadError, ModelSpec

# attend(layer_idx, q [N, H, D], k [N, KVH, D], v [N, KVH, D]) -> [N, H * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, computed exactly as transformers does."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = spec.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    # positions: [N] -> cos, sin: [N, 1, D] (broadcast over heads); computed in float32 like transformers
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One query token per row against its own slot, positions [0, positions[i]] visible.

    q: [B, H, D]; k_cache, v_cache: [num_slots + 1, KVH, T, D]; slot_ids, positions: [B] long.
    Returns [B, H * D]. Fixed shapes for a given B and no host syncs, so it can be graph-captured;
    it gathers whole slots, which a paged or flash-decoding kernel can later replace.
    """
    b, h, d = q.shape
    kvh, t = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.index_select(0, slot_ids)  # [B, KVH, T, D]
    v = v_cache.index_select(0, slot_ids)
    visible = torch.arange(t, device=q.device)[None, :] <= positions[:, None]  # [B, T]
    qg = q.view(b, kvh, h // kvh, d)  # GQA: the query heads of one kv head share its keys
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :])  # [B, KVH, G, D]
    return out.reshape(b, h * d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [L, H, D], k, v: [L, KVH, D] -> [L, H * D]
    groups = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [1, H, L, D]
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def _empty(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: load_weights fills every parameter, and random init of 1B weights
    # (or building on "meta", which pulls in torch._dynamo for seconds) would only cost start time.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self, n_in: int, n_out: int, bias: bool, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = _empty(n_out, n_in, device=device, dtype=dtype)
        self.bias = _empty(n_out, device=device, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(num, dim, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # normalise in float32 like transformers, scale in the model dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        hd, bias = spec.head_dim, spec.attention_bias
        kw = {"device": device, "dtype": dtype}
        self.q_proj = Linear(spec.hidden_size, spec.num_heads * hd, bias, **kw)
        self.k_proj = Linear(spec.hidden_size, spec.num_kv_heads * hd, bias, **kw)
        self.v_proj = Linear(spec.hidden_size, spec.num_kv_heads * hd, bias, **kw)
        # Llama's attention_bias also covers o_proj; Qwen2 biases only q/k/v.
        o_bias = bias and spec.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(spec.num_heads * hd, spec.hidden_size, o_bias, **kw)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = Linear(spec.hidden_size, spec.intermediate_size, **kw)
        self.up_proj = Linear(spec.hidden_size, spec.intermediate_size, **kw)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(spec, device, dtype)
        self.mlp = MLP(spec, device, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def forward(
        self, idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        # x: [N, hidden]
        n, a = x.shape[0], self.self_attn
        h = self.input_layernorm(x)
        q = apply_rope(a.q_proj(h).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(a.k_proj(h).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = a.v_proj(h).view(n, self.num_kv_heads, self.head_dim)
        x = x + a.o_proj(attend(idx, q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, device, dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, device, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)


class LlamaForCausalLM(nn.Module):
    """Weights are allocated uninitialised and must be filled by load_weights."""

    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec, self.dtype = spec, dtype
        self.model = LlamaModel(spec, device, dtype)
        # Tied heads reuse embed_tokens.weight at logits time, so no lm_head parameter exists.
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else Linear(spec.hidden_size, spec.vocab_size, False, device, dtype)
        )
        self.register_buffer("inv_freq", rope_inv_freq(spec).to(device), persistent=False)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        # input_ids, positions: [N] -> final hidden states [N, hidden]
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(i, x, cos, sin, attend)
        return self.model.norm(x)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, slot: int, kv: KVCache) -> torch.Tensor:
        """input_ids [L]: writes KV positions [0, L) of `slot`; returns float32 logits [V] of the last one."""
        n = input_ids.shape[0]
        if n > kv.max_seq_len:
            raise ValueError(f"prompt of {n} tokens exceeds the KV cache length {kv.max_seq_len}")

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.k[i][slot, :, :n] = k.transpose(0, 1)
            kv.v[i][slot, :, :n] = v.transpose(0, 1)
            return causal_attention(q, k, v)

        positions = torch.arange(n, device=input_ids.device)
        return self._logits(self._run(input_ids, positions, attend)[-1])

    @torch.inference_mode()
    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        """input_ids, positions, slot_ids: [B] -> float32 logits [B, V]. Graph-safe: no host syncs."""

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.k[i][slot_ids, :, positions] = k  # [B, KVH, D] into (slot, :, position)
            kv.v[i][slot_ids, :, positions] = v
            return decode_attention(q, kv.k[i], kv.v[i], slot_ids, positions)

        return self._logits(self._run(input_ids, positions, attend))

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, L] -> float32 logits [1, L, V] without a cache (reference path for tests)."""
        ids = input_ids[0]
        positions = torch.arange(ids.shape[0], device=ids.device)
        h = self._run(ids, positions, lambda i, q, k, v: causal_attention(q, k, v))
        return self._logits(h)[None]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copies HF-named tensors in (casting to the model dtype); any mismatch raises ModelLoadError."""
        params = dict(self.named_parameters())

        def ignored(name: str) -> bool:  # derived buffers, and the duplicate head some tied checkpoints store
            return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")

        missing = sorted(set(params) - set(state))
        unexpected = sorted(n for n in state if n not in params and not ignored(n))
        bad_shape = [
            f"{n}: {tuple(state[n].shape)} != {tuple(p.shape)}"
            for n, p in params.items()
            if n in state and state[n].shape != p.shape
        ]
        problems = [
            f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            for label, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape mismatch", bad_shape),
            )
            if names
        ]
        if problems:
            raise ModelLoadError(
                f"checkpoint does not match {self.spec.architecture}: " + "; ".join(problems)
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
