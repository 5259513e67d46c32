"""The Python API's keywords as the server's configuration: one table from each `LLM(...)` keyword to
the ServeConfig field it sets. vLLM's names stand beside ours where the meaning is the same
(`max_model_len`, `max_num_seqs`, `enforce_eager`, `kv_cache_memory_bytes`); vLLM's keywords with no
equal here are refused with what to use instead (VLLM_REFUSED), never taken for something else.
Types are checked here (the server's flags are
parsed as their type, so neither takes "8" for 8 nor "no", a true string, for False); values are
checked by ServeConfig.validate, the server's own checks, whose messages then name the keyword.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import ConfigError, ServeConfig, default_max_running_seqs


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_or_none(v: Any) -> bool:
    return v is None or _int(v)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _path_or_none(v: Any) -> bool:
    return v is None or isinstance(v, str | os.PathLike)


def _memory(v: Any) -> bool:
    return isinstance(v, str | int | float) and not isinstance(v, bool)


def _sizes(v: Any) -> bool:
    return v is None or (isinstance(v, Sequence) and not isinstance(v, str | bytes) and all(_int(s) for s in v))


def _adapters(v: Any) -> bool:
    return v is None or isinstance(v, str | Path) or (isinstance(v, Sequence) and all(isinstance(x, str | Path) for x in v))


def lora_entries(weights: str | Path | Sequence[str | Path] | None) -> list[tuple[str, str]]:
    """lora_weights as (name, path): "NAME=PATH" names it, a bare path is its own name."""
    if weights is None:
        return []
    items = [weights] if isinstance(weights, str | Path) else list(weights)
    entries = []
    for item in map(str, items):
        name, sep, path = item.partition("=")
        entries.append((name, path) if sep and name and not Path(item).is_dir() else (item, item))
    return entries


@dataclass(frozen=True)
class Keyword:
    field: str | None  # the ServeConfig field it sets (None: the Python API's own)
    accepts: Callable[[Any], bool]  # the Python values taken
    what: str  # those values, for the TypeError
    convert: Callable[[Any], Any] = lambda v: v  # to the field's value


def _as_path(v: Any) -> Path | None:
    return None if v is None else Path(v)


KEYWORDS: dict[str, Keyword] = {
    "tensor_parallel_size": Keyword("tensor_parallel_size", _int, "an int"),
    # LoRA adapter directories (PEFT): "PATH" (its name is the path as given) or "NAME=PATH", or a list
    "lora_weights": Keyword("lora_modules", _adapters, "a path, 'NAME=PATH' or a list of them",
                            lambda w: ",".join(f"{n}={p}" for n, p in lora_entries(w)) or None),
    "max_loras": Keyword("max_loras", _int, "an int"),  # 0: 4, or as many as lora_weights names
    "max_lora_rank": Keyword("max_lora_rank", _int, "an int"),
    "cudagraph_mode": Keyword("cudagraph_mode", lambda v: _str(v) or _str(getattr(v, "value", None)),
                              "a string or a CUDAGraphMode", lambda m: str(getattr(m, "value", m)).lower()),
    "enforce_eager": Keyword("cudagraph_mode", _bool, "True or False",  # vLLM's: no CUDA graphs
                             lambda eager: "none" if eager else ServeConfig.cudagraph_mode),
    "cudagraph_capture_sizes": Keyword("capture_sizes", _sizes, "None or a list of ints",
                                       lambda s: None if s is None else ",".join(map(str, s))),
    "device": Keyword("device", _str, "a string"),
    "dtype": Keyword("dtype", lambda v: _str(v) or type(v).__name__ == "dtype", "a string or a torch.dtype",
                     lambda d: d if isinstance(d, str) else str(d).removeprefix("torch.")),
    # default: the server's, raised to the largest capture size
    "max_running_seqs": Keyword("max_running_seqs", _int_or_none, "an int or None"),
    "max_num_seqs": Keyword("max_running_seqs", _int_or_none, "an int or None"),  # vLLM's name
    "max_seq_len": Keyword("max_seq_len", _int, "an int"),
    "max_model_len": Keyword("max_seq_len", _int, "an int"),  # vLLM's name
    "max_num_batched_tokens": Keyword("max_num_batched_tokens", _int, "an int"),
    "default_max_tokens": Keyword("default_max_tokens", _int, "an int"),
    "overlap_steps": Keyword("overlap_steps", _bool, "True or False"),
    # vLLM's: {"method": "ngram" | "suffix", "num_speculative_tokens": k, "prompt_lookup_min/max": n}
    "speculative_config": Keyword("speculative_config", lambda v: v is None or isinstance(v, dict | str),
                                  "None, a dict or its JSON text",
                                  lambda v: v if v is None or isinstance(v, str) else json.dumps(v)),
    # Each prompt's tokens independent of the other prompts and of chunking
    "batch_invariant": Keyword("batch_invariant", _bool, "True or False"),
    "block_size": Keyword("block_size", _int, "an int"),
    "kv_cache_memory": Keyword("kv_cache_memory", _memory,
                               "'auto', bytes ('8GiB', 8 << 30) or a fraction of device memory (0.5)", str),
    "kv_cache_memory_bytes": Keyword("kv_cache_memory", _int, "an int (bytes)", lambda v: f"{v}B"),  # vLLM's name
    "kv_cache_dtype": Keyword("kv_cache_dtype", _str, "a string"),  # "auto" (the model's) or "fp8", as vLLM's
    "enable_prefix_caching": Keyword("prefix_caching", _bool, "True or False"),  # vLLM's name
    "kv_host_cache_memory": Keyword("kv_host_cache_memory", _memory, "bytes ('16GiB', 16 << 30) or 0 (off)", str),
    "kv_offloading_size": Keyword("kv_host_cache_memory", _memory, "GiB (a number)", lambda v: f"{v}GiB" if v else "0"),  # vLLM's
    "graph_memory_budget": Keyword("graph_memory_budget", lambda v: v is None or _memory(v),
                                   "None, bytes ('8GiB', 8 << 30) or a fraction of device memory (0.2)",
                                   lambda v: None if v is None else str(v)),
    "stats_file": Keyword("stats_file", _path_or_none, "None or a path", _as_path),
    "warm_start": Keyword("warm_start", _bool, "True or False"),
    "model_cache_dir": Keyword("model_cache_dir", _path_or_none, "None or a path", _as_path),
    "compile_cache_dir": Keyword("compile_cache_dir", _path_or_none, "None or a path", _as_path),
    "log_level": Keyword("log_level", _str, "a string"),  # used only when the program has not configured structlog
    "seed": Keyword(None, _int_or_none, "an int or None"),  # seeds the seeds of requests that give none
    # vLLM's: the model's own tokenizer is the only one (None or the model's path says so)
    "tokenizer": Keyword(None, lambda v: v is None or isinstance(v, str | os.PathLike), "None or a path"),
}
# vLLM's keywords with no equal here -> what to do instead; None or False passes (it asks nothing).
VLLM_REFUSED = {
    "gpu_memory_utilization": "graphserve sizes the KV cache alone, after the weights and the graph budget: "
                              "kv_cache_memory='auto' (the default) takes what is free less 5% of the device; give a "
                              "fraction of device memory (kv_cache_memory=0.4) or bytes (kv_cache_memory_bytes=20 << 30)",
    "trust_remote_code": "graphserve runs its own model code and never a checkpoint's: drop the keyword",
}
VALID_KEYWORDS = ("model", *KEYWORDS)


def config_of(model: str, options: dict[str, Any]) -> ServeConfig:
    """The server's config for `LLM(model, **options)`: TypeError for an unknown keyword, one of the
    wrong type, or two that set one field; the server's ConfigError (naming keywords) for values."""
    refused = sorted(k for k in set(options) & set(VLLM_REFUSED) if options[k] not in (None, False))
    if refused:
        raise TypeError(f"LLM() keyword {refused[0]!r} (vLLM's) has no equal in graphserve: {VLLM_REFUSED[refused[0]]}")
    options = {k: v for k, v in options.items() if k not in VLLM_REFUSED}
    unknown = sorted(set(options) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"valid keywords: {', '.join(VALID_KEYWORDS)}")
    values: dict[str, Any] = {}
    named: dict[str, str] = {}  # field -> the keyword that set it
    for name, value in options.items():
        key = KEYWORDS[name]
        if not key.accepts(value):
            raise TypeError(f"{name} must be {key.what}, got {value!r} ({type(value).__name__})")
        if key.field is None:
            continue
        if key.field in named:
            raise TypeError(f"{named[key.field]} and {name} set the same thing: give one of them")
        values[key.field], named[key.field] = key.convert(value), name
    tokenizer = options.get("tokenizer")
    if tokenizer is not None and os.fspath(tokenizer) != str(model):
        raise TypeError(f"LLM() keyword 'tokenizer' is {tokenizer!r}: graphserve uses the model's own tokenizer; "
                        "give None or the model's path")
    for _, path in lora_entries(options.get("lora_weights")):
        if not Path(path).is_dir():
            raise ConfigError(f"lora_weights: {path!r} is not a directory; give PEFT adapter directories "
                              "(adapter_config.json + adapter_model.safetensors), as 'PATH' or 'NAME=PATH'")
    if values.get("max_running_seqs") is None:  # capture sizes above the default batch would be refused
        largest = max(map(int, (values.get("capture_sizes") or "0").split(",")))
        values["max_running_seqs"] = max(default_max_running_seqs(values.get("device", ServeConfig.device)), largest)
    if values.get("lora_modules") and not values.get("max_loras"):
        values["max_loras"] = max(4, len(lora_entries(options["lora_weights"])))
    values.setdefault("log_level", "warning")
    values["max_tokens_limit"] = max(ServeConfig.max_tokens_limit, values.get("default_max_tokens", 0))
    config = ServeConfig(model=str(model), **values)
    try:
        config.validate()
    except ConfigError as exc:  # the server names its flags: name the keywords instead
        raise ConfigError(_FLAG.sub(lambda m: _keyword_of(m[1].replace("-", "_"), named), str(exc))) from None
    return config


_FLAG = re.compile(r"--([a-z][a-z-]*)")


def _keyword_of(field: str, named: dict[str, str]) -> str:
    """The keyword the caller used for a config field, else the first one that sets it."""
    return named.get(field) or next((k for k, key in KEYWORDS.items() if key.field == field), field)
