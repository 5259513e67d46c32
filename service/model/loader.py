"""load_model: a built-in generated checkpoint, a local Hugging Face directory or a Hub model id
already in the local Hugging Face cache -> LoadedModel.

Never touches the network: configs and tokenizers are read with local_files_only=True, and a Hub id
resolves only to a snapshot that is on disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch
from safetensors import safe_open

from service.model import fp8, kv_quant
from service.model.builtin import (
    _SEED,
    BUILTIN_PREFIX,
    BUILTIN_SHAPES,
    builtin_dir,
    builtin_ready,
    ensure_builtin,
    random_init,
)
from service.model.kernels.compile_cache import CompileCache
from service.model.llama import LlamaForCausalLM
from service.model.parallel import TensorParallel, read_shard
from service.model.spec import ModelLoadError, ModelSpec
from service.model_dirs import MISSING_MODEL, model_dir
from service.telemetry import startup

if TYPE_CHECKING:
    import transformers

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

log = structlog.get_logger("graphserve.model")


@dataclass
class LoadedModel:
    name: str  # what the user passed, e.g. "builtin:tiny" or a path
    path: pathlib.Path
    spec: ModelSpec
    model: LlamaForCausalLM
    tokenizer: transformers.PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None  # what the KV cache stores (None: dtype)
    kv_scales: torch.Tensor | None = None  # the checkpoint's per-layer (k, v) KV scales [L, 2], if any

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "graphserve"


def _weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e})") from e
        files = [path / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{path}: shards named in {index.name} are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(sorted(other))}: convert them to safetensors)" if other else ""
        raise ModelLoadError(f"{path}: no *.safetensors weight files{hint}")
    return files


def _read_weights(
    files: list[pathlib.Path], device: torch.device, tp: TensorParallel | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint; with tensor parallelism only this rank's slices of them."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                    state[key] = sf.get_tensor(key) if tp is None else read_shard(sf.get_slice(key), key, tp)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ModelLoadError(f"cannot read weights {f}: {e}") from e
    return state


def _eos_from_generation_config(path: pathlib.Path) -> tuple[int, ...]:
    # Instruct checkpoints list extra stop ids (e.g. <|eot_id|>) only in generation_config.json.
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except ValueError:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos or ())


def _read_spec(path: pathlib.Path) -> ModelSpec:
    import transformers

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: config.json is missing; is this a Hugging Face model directory?")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # unknown model_type, bad JSON, ...
        raise ModelLoadError(f"{path}/config.json cannot be read by transformers: {e}") from e
    spec = ModelSpec.from_hf_config(config)
    extra = [e for e in _eos_from_generation_config(path) if e not in spec.eos_token_ids]
    return dataclasses.replace(spec, eos_token_ids=spec.eos_token_ids + tuple(extra)) if extra else spec


def read_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    import transformers

    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: tokenizer cannot be loaded: {e}") from e


def _model_dir(model: str, cache_dir: pathlib.Path | None) -> pathlib.Path:
    if model.startswith(BUILTIN_PREFIX):
        return ensure_builtin(model[len(BUILTIN_PREFIX) :], cache_dir or default_cache_dir())
    path = model_dir(model)
    if path is None:
        raise ModelLoadError(f"{model}: {MISSING_MODEL}")
    return path


def existing_model_dir(model: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path | None:
    """The directory load_model reads for `model`, if it is on disk already (None for a built-in not
    generated yet, or a model that is nowhere): what can be read before the model loads."""
    if not model.startswith(BUILTIN_PREFIX):
        return model_dir(model)
    name = model[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_SHAPES:
        return None
    path = builtin_dir(name, cache_dir or default_cache_dir())
    return path if builtin_ready(name, path) else None


def _block_size(path: pathlib.Path) -> tuple[int, int] | None:
    """config.json's quantization_config.weight_block_size (a block-quantized FP8 checkpoint), else None."""
    try:
        block = (json.loads((path / "config.json").read_text()).get("quantization_config") or {}).get(
            "weight_block_size")
    except (ValueError, AttributeError):
        return None
    return (int(block[0]), int(block[1])) if block else None


def read_model_spec(model: str, cache_dir: pathlib.Path | None = None) -> ModelSpec:
    """The spec of "builtin:<name>" or a local HF directory, without loading its weights."""
    return _read_spec(_model_dir(model, cache_dir))


def load_model(
    model: str, device: torch.device, dtype: torch.dtype, cache_dir: pathlib.Path | None = None,
    tp: TensorParallel | None = None, batch_invariant: bool = False, quantization: str = "none",
    kv_cache_dtype: str = "auto", compile_cache: CompileCache | None = None,
) -> LoadedModel:
    """ "builtin:<name>" (generated once into cache_dir) or a local HF directory -> LoadedModel.
    With `tp` of world size N this rank's model holds (and reads) only its 1/N shards; the
    LoadedModel's spec stays the whole model's (the model's own spec is the rank's share).
    `batch_invariant`: the model's batch-invariant mode (LlamaForCausalLM). `quantization` "fp8":
    the decoder's projections in FP8 (service.model.fp8); a checkpoint in FP8 is read either way.
    `kv_cache_dtype` "fp8": the KV cache in E4M3 (service.model.kv_quant), read with the checkpoint's
    KV scales when it has them (they are read, and unused, either way). `compile_cache`: the kernels'
    self-check results kept across starts (kernels.compile_cache)."""
    device = torch.device(device)
    path = _model_dir(model, cache_dir)
    spec = _read_spec(path)
    startup.mark("model_config")
    # a built-in shape too large to write: its weights are made on the device (builtin.random_init)
    shape = BUILTIN_SHAPES[model[len(BUILTIN_PREFIX):]] if model.startswith(BUILTIN_PREFIX) else {}
    files = [] if shape.get("on_device") else _weight_files(path)
    tokenizer = read_tokenizer(path)
    startup.mark("tokenizer")
    sharded = tp is not None and tp.world_size > 1
    kv_dtype = kv_quant.cache_dtype(kv_cache_dtype, dtype)
    net = LlamaForCausalLM(spec, device, dtype, tp=tp, batch_invariant=batch_invariant, kv_dtype=kv_dtype,
                           compile_cache=compile_cache)
    startup.mark("model_build")
    block = _block_size(path)
    kv_scales = None
    if files:
        try:
            state, kv_scales = kv_quant.checkpoint_kv_scales(_read_weights(files, device, tp if sharded else None),
                                                             spec.num_layers)
            state = fp8.dequantize_checkpoint(state, block)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        startup.mark("weights_read")  # safetensors reads straight onto the device: the copy included
        net.load_weights(state)
        startup.mark("weights_loaded")
    else:
        random_init(net, shape["layer_std"], torch.Generator(device).manual_seed(_SEED + (tp.rank if tp else 0)))
        log.info("builtin_weights_on_device", model=model, gib=round(sum(
            p.numel() * p.element_size() for p in net.parameters()) / 2**30, 2))
        startup.mark("weights_random_init")
    net.eval()
    if quantization == "fp8":
        saved = net.use_fp8(expert_block=block)
        log.info("fp8_weights", saved_gib=round(saved / 2**30, 3), experts_block=block)
    return LoadedModel(
        name=model, path=path, spec=spec, model=net, tokenizer=tokenizer, device=device, dtype=dtype,
        kv_dtype=kv_dtype, kv_scales=kv_scales,
    )


def check_model(model: str, cache_dir: pathlib.Path | None = None) -> ModelSpec | None:
    """What load_model would refuse before reading a weight: an unknown built-in name, a directory
    without config.json, an architecture or config we do not serve, no tokenizer, no safetensors
    weights. Raises ModelLoadError saying which. A built-in (None) is not generated here."""
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_SHAPES:
            raise ModelLoadError(f"unknown builtin model {name!r}; known: {', '.join(sorted(BUILTIN_SHAPES))}")
        return None
    path = _model_dir(model, cache_dir)
    spec = _read_spec(path)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
    _weight_files(path)
    return spec
