"""Our decoder for every family served (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen3-MoE, Mixtral), its paged
KV cache, loader and built-in checkpoints."""

from service.model.builtin import BUILTIN_SHAPES, ensure_builtin
from service.model.kv_cache import KVCache
from service.model.llama import LlamaForCausalLM, decode_attention
from service.model.loader import LoadedModel, load_model
from service.model.spec import ModelLoadError, ModelSpec

__all__ = [
    "BUILTIN_SHAPES",
    "KVCache",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelLoadError",
    "ModelSpec",
    "decode_attention",
    "ensure_builtin",
    "load_model",
]
