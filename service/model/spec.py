"""ModelSpec: the few numbers our Llama-family model needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class ModelLoadError(Exception):
    """A model cannot be loaded; the message says what is missing or unsupported and what to do."""


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(config: Any) -> tuple[float, dict | None]:
    """Returns (rope_theta, llama3 scaling dict or None). transformers 5 folds both into
    `rope_parameters`; older configs carry `rope_theta` and `rope_scaling` separately."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported; use a model with full-width RoPE")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: default, llama3); "
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
    architecture: str  # "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 scaling only
    attention_bias: bool  # qkv bias (Qwen2 True); Llama's flag also biases o_proj, Qwen2's does not
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Mistral/Qwen2 sliding-window size. Our attention is always full, which is exact only while
    # the context stays within the window: the engine should cap max_seq_len at it.
    sliding_window: int | None = None

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
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        if getattr(config, "mlp_bias", False):
            raise ModelLoadError("mlp_bias=True is not supported")
        theta, scaling = _rope(config)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {num_heads} is not a multiple of kv heads {num_kv_heads}"
            )
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        # Qwen2 hard-codes q/k/v biases; Llama and Mistral read attention_bias.
        bias = True if arch == "Qwen2ForCausalLM" else bool(getattr(config, "attention_bias", False))
        bos = getattr(config, "bos_token_id", None)
        window = getattr(config, "sliding_window", None)
        if arch == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
            window = None  # Qwen2 configs carry a window value even when it is switched off
        return cls(
            architecture=arch,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
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
            sliding_window=int(window) if window and window < config.max_position_embeddings else None,
        )
