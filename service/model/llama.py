"""Our own decoder for every family we serve (Llama, Mistral, Qwen2, Qwen3, Gemma 3, and the
mixture-of-experts Qwen3-MoE and Mixtral): prefill into and decode from a paged KVCache.

Parameter names follow Hugging Face so checkpoints load as they are. All tokens of a call are
handled as a flat [N, ...] batch so a step (decodes and prompt chunks, see step_batch), the decode
graph's step and the cache-free forward share the layer code and differ only in how attention reads
and writes keys and values. Each layer is two halves around attention, so the same forward can run
split at attention (service.model.pieces).

The families differ by switches decided at construction (ModelSpec): Qwen3 and Gemma 3 normalise
each q and k head before RoPE (inside the RoPE/KV-write kernel), Gemma 3 has its own norms (four a
layer, `GemmaDecoderLayer`), GELU, an embedding scale, a score scale and logit soft-capping, and its
sliding-window layers rotate with their own RoPE base (the step's RoPE tables are [kinds, N, 1, D],
a layer reads its kind's). A sliding-window layer (Gemma 3, Mistral, Qwen with use_sliding_window)
attends within its window: the paged KV keeps every position, the window is a mask in the attention
kernels. An MoE layer's MLP is service.model.moe.SparseMoe. The per-layer choices are lists read by
index, so the Llama step runs the code it ran before.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from service.model import fp8, kv_quant
from service.model.attention import (
    ChunkAttention,
    DecodeAttention,
    causal_attention,
    chunk_attention_torch,
    chunk_attention_triton,
    rowwise_step_attention,
    step_attention,
)
from service.model.kernels import FastPath
from service.model.kernels.activation import act_mul_torch, act_mul_triton
from service.model.kernels.compile_cache import CompileCache
from service.model.kernels.decode_attention import decode_attention_torch, decode_attention_triton
from service.model.kernels.fast_path import check_moe
from service.model.kernels.gemv import linear as gemv_linear
from service.model.kernels.invariant import InvariantKernels, Matmul
from service.model.kernels.norm import add_rmsnorm_torch, add_rmsnorm_triton
from service.model.kernels.rope import (
    QkNorm,
    apply_rope,
    norm_heads,
    rope_kv_write_torch,
    rope_kv_write_triton,
    split_qkv,
)
from service.model.kv_cache import KVCache, WriteIndex
from service.model.moe import SparseMoe, checkpoint_name
from service.model.parallel import TensorParallel, VocabParallelEmbedding, shard_spec
from service.model.spec import ModelLoadError, ModelSpec
from service.model.step_batch import ChunkSpec, StepBatch, build_step_batch
from service.telemetry import startup

# attend(layer_idx, qkv [N, (H + 2 KVH) * D], cos, sin [kinds, N, 1, D]) -> [N, H * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

log = structlog.get_logger("graphserve.model")

# The torch reference (gathers whole slots); the CPU path. Kept under this name for callers.
decode_attention = decode_attention_torch


def rope_inv_freq(spec: ModelSpec, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, computed exactly as transformers does; `local`:
    the sliding layers' (spec.local_rope_theta, unscaled)."""
    dim = spec.head_dim
    theta = spec.local_rope_theta if local else spec.rope_theta
    assert theta is not None
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = None if local else spec.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / float(s["factor"])
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


def _check_packed(num_tokens: int, seq_lens: list[int], slots: list[int], kv: KVCache) -> None:
    """Raises ValueError unless seq_lens/slots describe num_tokens packed prompts that fit the cache."""
    if not seq_lens:
        raise ValueError("packed prefill needs at least one prompt")
    if len(seq_lens) != len(slots):
        raise ValueError(f"{len(seq_lens)} prompt lengths but {len(slots)} slots")
    for j, n in enumerate(seq_lens):
        if n < 1:
            raise ValueError(f"prompt {j} is empty ({n} tokens); every prompt needs at least one token")
        if n > kv.max_seq_len:
            raise ValueError(f"prompt {j} of {n} tokens exceeds the KV cache length {kv.max_seq_len}")
    if sum(seq_lens) != num_tokens:
        raise ValueError(f"prompt lengths sum to {sum(seq_lens)} but input_ids holds {num_tokens} tokens")
    for slot in slots:
        if not 0 <= slot <= kv.scratch_slot:
            raise ValueError(f"slot {slot} is outside the KV cache's slots [0, {kv.scratch_slot}]")
    if len(set(slots)) != len(slots):
        raise ValueError(f"two prompts share a KV slot: {slots}")


def _empty(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: load_weights fills every parameter, and random init of 1B weights
    # (or building on "meta", which pulls in torch._dynamo for seconds) would only cost start time.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    # Set by service.model.lora.LoraSlots on the projections it adapts: (x, y) -> y + the rows' LoRA.
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (x, weight, bias) -> y; set by the model in batch-invariant mode (LlamaForCausalLM).
    matmul: Matmul = F.linear

    def __init__(
        self, n_in: int, n_out: int, bias: bool, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = _empty(n_out, n_in, device=device, dtype=dtype)
        self.bias = _empty(n_out, device=device, dtype=dtype) if bias else None

    @classmethod
    def view_of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A Linear whose parameters share the given tensors' storage (no allocation)."""
        part = cls.__new__(cls)
        nn.Module.__init__(part)
        part.weight = nn.Parameter(weight, requires_grad=False)
        part.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class RowParallelLinear(Linear):
    """y = x W^T + b where x holds this rank's input columns (o_proj, down_proj under tensor
    parallelism): partial products summed over the ranks, then the (replicated) bias. With one rank it
    is exactly Linear, its LoRA and matmul hooks included (both are one-rank features)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, tp: TensorParallel,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(n_in, n_out, bias, device, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.matmul(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class FusedLinear(nn.Module):
    """One GEMM for several projections of the same input (q/k/v, gate/up).

    The fused weight (and bias) are non-persistent buffers; `parts` are plain Linear modules whose
    parameters are row-slice views of them, registered by the owner under their HF names. So
    load_weights, checkpoints and anything filling named_parameters() write the fused storage.
    Do not move the model with .to()/.cuda(): that would copy parameters and buffers apart.
    """

    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # as Linear.lora
    matmul: Matmul = F.linear  # as Linear.matmul

    def __init__(
        self, n_in: int, n_outs: tuple[int, ...], bias: bool, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.register_buffer(
            "weight", torch.empty(sum(n_outs), n_in, device=device, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "bias", torch.empty(sum(n_outs), device=device, dtype=dtype) if bias else None, persistent=False
        )
        self.parts: list[Linear] = []
        start = 0
        for n in n_outs:
            rows = slice(start, start + n)
            self.parts.append(Linear.view_of(self.weight[rows], self.bias[rows] if bias else None))
            start += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class WeightView(nn.Module):
    """A parameter `weight` that is a view of storage another module owns (a q/k norm's row, an expert's matrix)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str, dtype: torch.dtype,
                 gemma: bool = False) -> None:
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = _empty(dim, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, fast: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rmsnorm(x + delta)); normalises in float32 like transformers, scales in the model
        dtype (Gemma's: by 1 + w in float32)."""
        if fast:
            return add_rmsnorm_triton(x, delta, self.weight, self.eps, self.gemma)
        return add_rmsnorm_torch(x, delta, self.weight, self.eps, self.gemma)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        hd, bias = spec.head_dim, spec.attention_bias
        kw = {"device": device, "dtype": dtype}
        qkv = (spec.num_heads * hd, spec.num_kv_heads * hd, spec.num_kv_heads * hd)
        self.qkv_proj = FusedLinear(spec.hidden_size, qkv, bias, **kw)
        self.q_proj, self.k_proj, self.v_proj = self.qkv_proj.parts
        # Llama's attention_bias also covers o_proj; Qwen2 biases only q/k/v.
        o_bias = bias and spec.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(spec.num_heads * hd, spec.hidden_size, o_bias, tp, **kw)
        # Qwen3 / Gemma 3: q_norm and k_norm (one head_dim weight each, shared by every head) are the
        # rows of one [2, D] buffer, which the RoPE/KV-write kernel reads
        self.qk_norm: QkNorm | None = None
        if spec.qk_norm:
            self.register_buffer("qk_norm_weight", torch.empty(2, hd, **kw), persistent=False)
            self.q_norm, self.k_norm = WeightView(self.qk_norm_weight[0]), WeightView(self.qk_norm_weight[1])
            self.qk_norm = QkNorm(self.qk_norm_weight, spec.rms_norm_eps, spec.gemma_norms)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        inter = spec.intermediate_size
        self.gate_up_proj = FusedLinear(spec.hidden_size, (inter, inter), **kw)
        self.gate_proj, self.up_proj = self.gate_up_proj.parts
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, tp=tp, **kw)
        self.act = spec.hidden_act

    def forward(self, x: torch.Tensor, fast: FastPath) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2 * intermediate]
        if fast.silu_mul:
            return self.down_proj(act_mul_triton(gate_up, self.act))
        return self.down_proj(act_mul_torch(gate_up, self.act))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, device: torch.device | str, dtype: torch.dtype,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(spec, device, dtype, tp)
        self.mlp = (SparseMoe if spec.is_moe_layer(index) else MLP)(spec, device, dtype, tp)
        norm = {"eps": spec.rms_norm_eps, "device": device, "dtype": dtype, "gemma": spec.gemma_norms}
        self.input_layernorm = RMSNorm(spec.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, **norm)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def forward(
        self,
        idx: int,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        fast: FastPath,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: residual stream [N, hidden]; delta: the previous layer's MLP output, not yet added
        (None for the first layer), so the add fuses with this layer's norm. Returns (x, mlp delta)."""
        x, qkv = self.pre_attention(x, delta, fast)
        return self.post_attention(x, attend(idx, qkv, cos, sin), fast)

    def pre_attention(
        self, x: torch.Tensor, delta: torch.Tensor | None, fast: FastPath
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, qkv [N, (H + 2 KVH) * D]): the add, the input norm and the fused projection."""
        x, h = self.input_layernorm(x, delta, fast.norm)
        return x, self.self_attn.qkv_proj(h)

    def post_attention(
        self, x: torch.Tensor, attn: torch.Tensor, fast: FastPath
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [N, H * D] -> (x + o_proj(attn), mlp delta): the output projection, the add, the norm, the MLP."""
        x, h = self.post_attention_layernorm(x, self.self_attn.o_proj(attn), fast.norm)
        return x, self.mlp(h, fast)


class GemmaDecoderLayer(DecoderLayer):
    """Gemma's layer: each branch's output is normed before it joins the residual stream
    (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input by its own norm."""

    def __init__(self, spec: ModelSpec, index: int, device: torch.device | str, dtype: torch.dtype,
                 tp: TensorParallel) -> None:
        super().__init__(spec, index, device, dtype, tp)
        norm = {"eps": spec.rms_norm_eps, "device": device, "dtype": dtype, "gemma": True}
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, **norm)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, **norm)

    def post_attention(
        self, x: torch.Tensor, attn: torch.Tensor, fast: FastPath
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [N, H * D] -> (x + norm(o_proj(attn)), norm(mlp(norm(that))))."""
        branch = self.post_attention_layernorm(self.self_attn.o_proj(attn), None, fast.norm)[1]
        x, h = self.pre_feedforward_layernorm(x, branch, fast.norm)
        return x, self.post_feedforward_layernorm(self.mlp(h, fast), None, fast.norm)[1]


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp, device, dtype)
        layer = GemmaDecoderLayer if spec.gemma_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(spec, i, device, dtype, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype, spec.gemma_norms)


class LlamaForCausalLM(nn.Module):
    """Weights are allocated uninitialised and must be filled by load_weights.

    On CUDA with fp16/bf16 and Triton importable, `fast` enables fused Triton kernels (each
    self-checked here against its torch reference, see service.model.kernels); `fast_path=False`
    or any failed check keeps the torch path, which is also the CPU path.

    With `tp` of world size N (service.model.parallel) this rank's model holds 1/N of the heads,
    the MLP and the vocabulary; `spec` is then this rank's share (shard_spec) and `load_weights`
    takes this rank's slices of the checkpoint.

    `batch_invariant` is the one switch of the batch-invariant mode (service.model.kernels.invariant):
    every linear layer and the LM head get its matmul, attention runs every row through the
    per-row decode kernel, so a row's logits do not depend on the other rows of its step.

    `compile_cache` keeps the fast path's self-check results across starts (kernels.compile_cache).

    `kv_dtype` is what its KV caches store (None: the model's dtype; FP8: service.model.kv_quant):
    the fast path's attention and KV-write kernels are checked on such a cache. Raises
    ModelLoadError on a device that cannot serve it.
    """

    def __init__(
        self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, fast_path: bool = True,
        tp: TensorParallel | None = None, batch_invariant: bool = False, kv_dtype: torch.dtype | None = None,
        compile_cache: CompileCache | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        spec = shard_spec(spec, tp)
        self.spec, self.dtype = spec, dtype
        self.kv_dtype = kv_dtype or dtype
        reason = kv_quant.unsupported_reason(torch.device(device)) if self.kv_dtype == fp8.FP8 else None
        if reason is not None:
            raise ModelLoadError(f"--kv-cache-dtype fp8: {reason}; use --kv-cache-dtype auto")
        self.model = LlamaModel(spec, device, dtype, tp)
        # Tied heads reuse embed_tokens.weight at logits time, so no lm_head parameter exists.
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else Linear(spec.hidden_size, tp.vocab_rows(spec.vocab_size)[1], False, device, dtype)
        )
        self.register_buffer("inv_freq", rope_inv_freq(spec).to(device), persistent=False)
        # Per layer, read by index on the step: its sliding window (0: none), its RoPE table (0: the
        # global one; 1: the sliding layers' own, Gemma 3), its q/k head norm
        self.windows = [spec.window(i) for i in range(spec.num_layers)]
        local = spec.local_rope_theta is not None
        self.rope_kind = [int(local and w > 0) for w in self.windows]
        self.inv_freq_local = rope_inv_freq(spec, local=True).to(device) if local else None
        self.qk_norms = [layer.self_attn.qk_norm for layer in self.model.layers]
        self.attn_scale = spec.query_scale
        # Gemma: the embeddings' scale, rounded to the model dtype as transformers rounds it
        self.embed_scale = None if spec.embed_scale is None else float(torch.tensor(spec.embed_scale, dtype=dtype))
        self.softcap = spec.final_logit_softcap
        if spec.is_moe and batch_invariant:
            raise ModelLoadError(f"the batch-invariant mode is not served with mixture-of-experts models "
                                 f"({spec.architecture}: the expert products are not batch-invariant)")
        self.fast = (
            FastPath.build(
                device,
                dtype,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.hidden_size,
                spec.intermediate_size,
                self.kv_dtype,
                spec,
                compile_cache,
            )
            if fast_path
            else FastPath()
        )
        if torch.device(device).type != "meta":  # a meta model only names the parameters (builtin.py)
            startup.mark("kernel_self_checks")
        self.invariant: InvariantKernels | None = None
        self.fp8 = False  # use_fp8
        self.fp8_kernels: fp8.Fp8Kernels | None = None  # use_fp8's self-check
        self.matmul: Matmul = F.linear  # the LM head's
        self.set_fast(self.fast)
        if batch_invariant:
            if tp.world_size > 1:
                raise ModelLoadError("the batch-invariant mode is not served with tensor parallelism (the "
                                     "all-reduce's algorithm depends on the message size)")
            shapes = {(*m.weight.shape, m.bias is not None) for m in self._linears()}
            shapes.add((*self.model.embed_tokens.weight.shape, False))  # a tied head's
            heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
            self.use_invariant(InvariantKernels.build(device, dtype, self.fast, shapes, heads, self.kv_dtype))

    def _linears(self) -> list[nn.Module]:
        """Every linear layer that runs (not the per-projection views of a fused one), the LM head included."""
        views = {id(p) for m in self.modules() if isinstance(m, FusedLinear) for p in m.parts}
        return [m for m in self.modules()
                if isinstance(m, Linear | FusedLinear) and id(m) not in views]

    def set_fast(self, fast: FastPath) -> None:
        """The fast path's kernels (construction, or a benchmark's A/B): with `fast.gemv` every linear
        layer and the LM head run a one-row call through kernels.gemv. The batch-invariant mode keeps
        its own matmul."""
        self.fast = fast
        if self.invariant is not None:
            return
        self.matmul = gemv_linear if fast.gemv else F.linear
        for m in self._linears():
            if not hasattr(m, "weight_scale"):  # an FP8 weight keeps its own product (use_fp8)
                m.matmul = self.matmul

    def use_invariant(self, kernels: InvariantKernels) -> None:
        """The batch-invariant mode: every linear layer and the LM head through kernels.matmul, the
        attention of every row through kernels.attention. Called once, at construction."""
        self.invariant = kernels
        self.matmul = kernels.matmul
        for m in self._linears():
            m.matmul = kernels.matmul

    def use_fp8(self, expert_block: tuple[int, int] | None = None) -> int:
        """`--quantization fp8`, after load_weights: every decoder projection's weight to E4M3 with
        one scale per output channel, its products through service.model.fp8.fp8_linear; the
        embeddings, the LM head, MoE routers and any weight with a dimension not a multiple of 16 (the
        FP8 GEMM's granule) stay. Experts go to E4M3 too, one scale per output channel, or per
        `expert_block` (rows, columns) as a block-quantized checkpoint had them; the MoE kernel is
        checked on them (the torch path serves if it fails). Returns the bytes the weights no longer take."""
        if self.invariant is not None:
            raise ModelLoadError("the batch-invariant mode is not served with FP8 weights (--quantization fp8)")
        reason = fp8.unsupported_reason(self.model.embed_tokens.weight.device)
        if reason is not None:
            raise ModelLoadError(f"--quantization fp8: {reason}")
        saved = 0
        quantized = []
        for m in self._linears():
            if m is self.lm_head or getattr(m, "keep_dtype", False) or any(d % 16 for d in m.weight.shape):
                continue  # the head, a router, and shapes the FP8 GEMMs (multiples of 16) do not take
            q, scale = fp8.quantize_rows(m.weight)
            saved += m.weight.numel() * (m.weight.element_size() - 1) - scale.numel() * 4
            if isinstance(m, FusedLinear):
                m.weight = q  # a buffer; the parts become views of the E4M3 rows
                start = 0
                for part in m.parts:
                    rows = part.weight.shape[0]
                    part.weight = nn.Parameter(q[start: start + rows], requires_grad=False)
                    start += rows
            else:
                m.weight = nn.Parameter(q, requires_grad=False)
            m.register_buffer("weight_scale", scale, persistent=False)
            quantized.append(m)
        # Our FP8 kernels checked on the model's own weights, one of each shape: cuBLAS serves for one that fails.
        shapes = {(*m.weight.shape, m.bias is not None): m for m in quantized}
        try:
            self.fp8_kernels = fp8.self_check([(m.weight, m.weight_scale, m.bias) for m in shapes.values()], self.dtype)
        except RuntimeError as e:
            raise ModelLoadError(f"--quantization fp8: {e}") from None
        for m in quantized:
            m.matmul = functools.partial(fp8.fp8_linear, scale=m.weight_scale, kernels=self.fp8_kernels)
        saved += self._experts_to_fp8(expert_block)
        self.fp8 = True
        torch.cuda.empty_cache()
        return saved

    def _experts_to_fp8(self, block: tuple[int, int] | None) -> int:
        moes = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoe)]
        if not moes:
            return 0
        s = self.spec
        inter = s.moe_intermediate_size
        if block is not None and (inter % block[0] or s.hidden_size % block[0] or inter % block[1]
                                  or s.hidden_size % block[1]):
            raise ModelLoadError(f"--quantization fp8: {s.architecture}'s experts ({inter} x {s.hidden_size} on this "
                                 f"rank) do not divide into the checkpoint's {block[0]} x {block[1]} scale blocks; "
                                 "use a tensor_parallel_size that keeps them whole")
        saved = sum(m.use_fp8(block) for m in moes)
        if self.fast.moe:
            try:
                check_moe(self.inv_freq.device, self.dtype, s.num_experts, s.num_experts_per_tok, s.norm_topk_prob,
                          s.hidden_act, fp8=True, block=block)
            except Exception as e:  # noqa: BLE001 - a kernel of ours must never take the service down
                log.warning("fast_path_disabled", kernel="moe_fp8", reason=f"{type(e).__name__}: {e}"[:500])
                self.fast = dataclasses.replace(self.fast, moe=False)
        return saved

    @property
    def batch_invariant(self) -> bool:
        return self.invariant is not None

    def row_attention(self) -> DecodeAttention:
        """The per-row attention kernel: the invariant mode's, else Triton when the fast path has it."""
        if self.invariant is not None:
            return self.invariant.attention
        return decode_attention_triton if self.fast.attention else decode_attention_torch

    def chunk_attention(self) -> ChunkAttention:
        """The prompt chunks' attention: Triton when the fast path has it."""
        return chunk_attention_triton if self.fast.prefill_attention else chunk_attention_torch

    def attention_args(self, layer: int) -> dict:
        """The layer's window and the model's score scale, as the attention kernels take them."""
        return {"window": self.windows[layer], "scale": self.attn_scale}

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
             num_layers: int | None = None) -> torch.Tensor:
        # input_ids, positions: [N] -> final hidden states [N, hidden] (after the first num_layers layers)
        x, cos, sin = self.embed(input_ids, positions)
        delta = None
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        for i, layer in enumerate(layers):
            x, delta = layer(i, x, delta, cos, sin, attend, self.fast)
        return self.final_norm(x, delta)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """input_ids, positions [N] -> (embeddings [N, hidden], cos, sin [kinds, N, 1, D]: one table per
        RoPE kind, rope_kind[layer] says a layer's)."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if self.inv_freq_local is None:
            return x, cos[None], sin[None]
        cos_local, sin_local = rope_cos_sin(self.inv_freq_local, positions, x.dtype)
        return x, torch.stack((cos, cos_local)), torch.stack((sin, sin_local))

    def final_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x, delta, self.fast.norm)[1]

    def rope_kv_write(
        self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: WriteIndex, kv: KVCache,
    ) -> torch.Tensor:
        """Rotates q and k of every row and writes k, v at the rows' (block, offset) `index`
        (KVCache.write_index) of the layer's cache; returns rotated q [N, H, D]. Graph-safe: no host syncs."""
        s = self.spec
        write = rope_kv_write_triton if self.fast.rope_kv else rope_kv_write_torch
        blocks, offsets = index
        kind = self.rope_kind[layer]
        return write(qkv, cos[kind], sin[kind], kv.k[layer], kv.v[layer], blocks, offsets, s.num_heads,
                     s.num_kv_heads, kv.scales[layer], self.qk_norms[layer])

    def step_attention(
        self, layer: int, q: torch.Tensor, batch: StepBatch, kv: KVCache, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of a step's rows (their K/V already in the cache at `index`) -> [S, H * D]. Eager."""
        if self.invariant is not None:
            return rowwise_step_attention(q, kv, layer, batch, self.invariant.attention, out,
                                          self.invariant.rows_per_call, **self.attention_args(layer))
        return step_attention(q, kv, layer, batch, self.row_attention(), self.chunk_attention(), out,
                              **self.attention_args(layer))

    def _rope(
        self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv [N, (H + 2 KVH) * D] -> rotated q [N, H, D], rotated k, v [N, KVH, D]
        s = self.spec
        q, k, v = split_qkv(qkv, s.num_heads, s.num_kv_heads, s.head_dim)
        q, k = norm_heads(q, k, self.qk_norms[layer])
        kind = self.rope_kind[layer]
        return apply_rope(q, cos[kind], sin[kind]), apply_rope(k, cos[kind], sin[kind]), v

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [R, hidden] -> float32 logits [R, V] (soft-capped where the family caps them)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.tp.gather_vocab(self.matmul(h, weight, None), self.spec.vocab_size).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, slot: int, kv: KVCache) -> torch.Tensor:
        """input_ids [L]: writes KV positions [0, L) of `slot`; returns float32 logits [V] of the last one."""
        return self.prefill_packed(input_ids, [input_ids.shape[0]], [slot], kv)[0]

    @torch.inference_mode()
    def prefill_packed(
        self, input_ids: torch.Tensor, seq_lens: list[int], slots: list[int], kv: KVCache
    ) -> torch.Tensor:
        """input_ids [N]: P prompts back to back (seq_lens, slots: [P]) -> float32 logits [P, V] of
        each prompt's last token. Writes KV positions [0, len) of each prompt's slot.

        One forward pass over all N tokens: positions restart at 0 per prompt, attention is causal
        within each prompt only (all prompts in one chunk-attention call), and the lm head runs on
        the P last rows only. No host syncs."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [N], got shape {tuple(input_ids.shape)}")
        _check_packed(input_ids.shape[0], seq_lens, slots, kv)
        chunks = [ChunkSpec(slot, 0, n) for n, slot in zip(seq_lens, slots)]
        batch = build_step_batch([], [], chunks, input_ids, kv.max_seq_len, kv.scratch_slot, input_ids.device)
        return self.forward_step(batch, kv)

    @torch.inference_mode()
    def forward_step(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """One step over decode rows and prompt chunks (service.model.step_batch) in one forward pass:
        writes every row's K/V into its slot and returns float32 logits [R, V] of batch.sample_rows.
        The reference for the same forward split at attention (service.model.pieces)."""

        index = kv.write_index(batch.slot_ids, batch.positions)

        def attend(i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q = self.rope_kv_write(i, qkv, cos, sin, index, kv)
            return self.step_attention(i, q, batch, kv)

        return self.logits(self._run(batch.input_ids, batch.positions, attend)[batch.sample_rows])

    @torch.inference_mode()
    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        """input_ids, positions, slot_ids: [B] -> float32 logits [B, V]. Graph-safe: no host syncs."""
        attention = self.row_attention()
        index = kv.write_index(slot_ids, positions)

        def attend(i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q = self.rope_kv_write(i, qkv, cos, sin, index, kv)
            return attention(q, kv.k[i], kv.v[i], kv.block_table, slot_ids, positions, kv.scales[i],
                             **self.attention_args(i))

        return self.logits(self._run(input_ids, positions, attend))

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, L] -> float32 logits [1, L, V] without a cache (reference path for tests)."""
        ids = input_ids[0]
        positions = torch.arange(ids.shape[0], device=ids.device)
        h = self._run(ids, positions, lambda i, qkv, cos, sin: causal_attention(*self._rope(i, qkv, cos, sin),
                                                                                 **self.attention_args(i)))
        return self.logits(h)[None]

    @torch.inference_mode()
    def draft_greedy(self, input_ids: torch.Tensor, start: int, num_layers: int | None, k: int) -> torch.Tensor:
        """Greedy drafting: the k greedy tokens after input_ids [L] (at positions start .. start + L - 1)
        of this model cut after its first num_layers layers (self-speculation, as LayerSkip), or whole
        (None: a separate draft model), then its final norm and LM head -> [k] int64. Never touches a
        KV cache: the K/V of the draft's layers live for this call only (one pass over the L tokens,
        then one pass per draft token). No host syncs."""
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: rotated k, v [M, KVH, D]

        def attend(i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q, key, value = self._rope(i, qkv, cos, sin)
            if i < len(cache):
                key, value = torch.cat((cache[i][0], key)), torch.cat((cache[i][1], value))
                cache[i] = key, value
            else:
                cache.append((key, value))
            return causal_attention(q, key, value, **self.attention_args(i))

        ids, positions = input_ids, torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        out = torch.empty(k, dtype=torch.long, device=input_ids.device)
        for j in range(k):
            token = self.logits(self._run(ids, positions, attend, num_layers)[-1:]).argmax(-1)  # [1]
            out[j] = token[0]
            ids, positions = token, positions[-1:] + 1
        return out

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copies HF-named tensors in (casting to the model dtype); any mismatch raises ModelLoadError.
        A family's own checkpoint names (Mixtral's experts) are read as ours (moe.checkpoint_name)."""
        params = dict(self.named_parameters())
        state = {checkpoint_name(self.spec.architecture, n): t for n, t in state.items()}

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
