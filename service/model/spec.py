"""ModelSpec: the few numbers our decoder needs, read once from a Hugging Face config.

One model code path serves every family (service.model.llama); a family is a handful of switches
here, decided once: Qwen3's per-head q/k RMSNorm, Gemma 3's norms (x * (1 + w), four a layer),
embedding scale, query scale, GELU, logit soft-capping and sliding-window layers with their own
RoPE, and the mixture-of-experts MLP of Qwen3-MoE and Mixtral (service.model.moe). A config that
asks for something this code would compute wrongly raises ModelLoadError, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# hidden_act (hidden_activation in Gemma configs) -> ours: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class ModelLoadError(Exception):
    """A model cannot be loaded; the message says what is missing or unsupported and what to do."""


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_params(config: Any, layer_type: str | None = None) -> dict:
    """The RoPE parameters of the config (transformers 5's `rope_parameters`, or the older
    `rope_theta` / `rope_scaling`); Gemma 3 keeps one dict per layer type."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    return params


def _rope(params: dict, config: Any) -> tuple[float, dict | None]:
    """Returns (rope_theta, scaling dict or None): llama3 or linear scaling."""
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported; use a model with full-width RoPE")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    if rope_type != "llama3":
        raise ModelLoadError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3); "
            "use a checkpoint without it or add it to service/model/llama.py"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ModelLoadError(f"llama3 rope scaling in config.json lacks {missing}")
    scaling = {"rope_type": "llama3", **{k: params[k] for k in keys}}
    return theta, scaling


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (MoE models: of their dense layers, if any)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 or linear scaling
    attention_bias: bool  # qkv bias (Qwen2 True); Llama's flag also biases o_proj, Qwen2's does not
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # The config's sliding-window size (Mistral, Qwen2/3 with use_sliding_window, Gemma 3); which
    # layers use it is `layer_windows`.
    sliding_window: int | None = None
    # Per layer: the sliding window it attends over (a query at position p sees keys (p - w, p]),
    # 0 for full attention; () for every layer full. Paged KV keeps every position: the window is a mask.
    layer_windows: tuple[int, ...] = ()
    # RoPE base of the sliding layers when it differs from the global one (Gemma 3's local 10,000);
    # None: every layer rotates by rope_theta / rope_scaling.
    local_rope_theta: float | None = None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # Gemma: RMSNorm scales by (1 + w) in float32; norms around both branches
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # Mixture of experts (0 experts: a dense model): every layer's MLP is `num_experts` experts of
    # width moe_intermediate_size, each token through its top num_experts_per_tok, weighted by the
    # router's softmax (renormalised over the chosen ones with norm_topk_prob), except the layers in
    # dense_layers, which keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> str:
        """The architecture without "ForCausalLM": what logs, metrics and the model table say."""
        return self.architecture.removesuffix("ForCausalLM")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Builds a spec from a transformers PretrainedConfig; anything we would compute wrongly raises."""
        archs = list(getattr(config, "architectures", None) or [])
        model_type = getattr(config, "model_type", None)
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(model_type or "", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch or model_type!r} (model_type={model_type!r}); "
                f"graphserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "Gemma3ForCausalLM"
        act_name = getattr(config, "hidden_activation", None) if gemma else None
        act_name = act_name or getattr(config, "hidden_act", "silu")
        if act_name not in _ACTIVATIONS:
            raise ModelLoadError(f"{arch}: hidden_act {act_name!r} is not supported (silu, gelu_pytorch_tanh)")
        if getattr(config, "mlp_bias", False):
            raise ModelLoadError("mlp_bias=True is not supported")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ModelLoadError(f"{arch}: attn_logit_softcapping is not served (our attention kernels do not "
                                 "soft-cap scores); use a checkpoint without it")
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError(f"{arch}: use_bidirectional_attention is not served (a decoder attends causally)")
        theta, scaling = _rope(_rope_params(config, "full_attention" if gemma else None), config)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {num_heads} is not a multiple of kv heads {num_kv_heads}"
            )
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        # Qwen2 hard-codes q/k/v biases; the others read attention_bias.
        bias = True if arch == "Qwen2ForCausalLM" else bool(getattr(config, "attention_bias", False))
        bos = getattr(config, "bos_token_id", None)
        layers = int(config.num_hidden_layers)
        window, windows = _windows(arch, config, layers)
        local_theta = None
        if gemma:
            local_theta, local_scaling = _rope(_rope_params(config, "sliding_attention"), config)
            if local_scaling is not None:
                raise ModelLoadError(f"{arch}: RoPE scaling on the sliding layers is not supported")
        moe = _moe(arch, config, layers)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(
            architecture=arch,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bias,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=int(config.max_position_embeddings),
            eos_token_ids=_as_ids(getattr(config, "eos_token_id", None)),
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            sliding_window=window,
            layer_windows=windows,
            local_rope_theta=local_theta,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            gemma_norms=gemma,
            hidden_act=_ACTIVATIONS[act_name],
            embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
            query_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else None,
            final_logit_softcap=float(softcap) if softcap else None,
            **moe,
        )


def _windows(arch: str, config: Any, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the config's sliding window, each layer's window (0: full; () for all full))."""
    window = getattr(config, "sliding_window", None)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not getattr(
            config, "use_sliding_window", False):
        window = None  # Qwen configs carry a window value even when it is switched off
    if not window or window >= config.max_position_embeddings:
        return None, ()
    window = int(window)
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral, Mixtral: every layer; Qwen2 before layer_types: from max_window_layers on
        first = int(getattr(config, "max_window_layers", 0)) if arch.startswith("Qwen") else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(f"{arch}: layer types {unknown} are not supported (sliding_attention, full_attention)")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types[:layers])
    return window, (windows if any(windows) else ())


def _moe(arch: str, config: Any, layers: int) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral config (none for a dense model)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0))
    top_k = int(config.num_experts_per_tok)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(f"{arch}: {experts} experts with num_experts_per_tok {top_k}")
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": int(config.intermediate_size), "norm_topk_prob": True}
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
    dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(config.moe_intermediate_size),
            "norm_topk_prob": bool(getattr(config, "norm_topk_prob", False)), "dense_layers": dense}
