"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) as untrusted input.

Every check runs before any tensor exists, and what is read is bounded by the base model:
- the directory resolves (symlinks included) under the adapter root when there is one, and each file,
  once open, is checked again to be a regular file under it (a symlink swapped in meanwhile is refused);
- the config is at most MAX_CONFIG_BYTES of UTF-8 JSON; r, lora_alpha, rank_pattern and alpha_pattern
  are finite, positive numbers of the right types; module patterns match by name, or by RE2 in linear
  time (service.model.lora_patterns);
- the safetensors file is no larger than an adapter of this model at the largest rank can be; its
  header (bounded too) is parsed first, and every tensor's name, dtype, shape and byte range is checked
  against the base model and the config before one byte of tensor data is read; then only those
  tensors are read, one at a time, and refused when a value is NaN or inf, or overflows the model's
  dtype once the scale is folded in.
A refused adapter leaves nothing behind: the error is raised afresh, outside the frames that held its
tensors, so no traceback keeps them alive. Messages name the file by the path as given (never where a
symlink leads) and say the same whether a directory or a file is missing.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import stat
from dataclasses import dataclass
from typing import Any

import torch

from service.model.lora_patterns import MAX_PATTERN_CHARS, MAX_PATTERNS, Pattern, PatternError, match_patterns
from service.model.spec import ModelSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused module -> its sub-projections, in the order of its output rows.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_PART_OWNER = {part: OWNER[fused] for fused, parts in FUSED.items() for part in parts}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_HEADER_BYTES_PER_TENSOR = 512  # a safetensors header entry is about 150 bytes
_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
           "BF16": (torch.bfloat16, 2)}
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d{1,6})\.(self_attn|mlp)\.(\w{1,64})\.lora_([AB])\.weight")
_KEY_HELP = f"base_model.model.model.layers.<i>.<self_attn|mlp>.<{'|'.join(TARGETS)}>.lora_<A|B>.weight"


class LoraError(ValueError):
    """An adapter's files do not fit this model or these limits; the message names the file."""


class LoraPathError(LoraError):
    """The adapter's path is outside the adapter root (--lora-root)."""


def shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection."""
    hd, h = spec.head_dim, spec.hidden_size
    return {"q_proj": (h, spec.num_heads * hd), "k_proj": (h, spec.num_kv_heads * hd),
            "v_proj": (h, spec.num_kv_heads * hd), "o_proj": (spec.num_heads * hd, h),
            "gate_proj": (h, spec.intermediate_size), "up_proj": (h, spec.intermediate_size),
            "down_proj": (spec.intermediate_size, h)}


def module_name(layer: int, part: str) -> str:
    """The module's name in the base model, as PEFT matches its patterns against it."""
    return f"model.layers.{layer}.{_PART_OWNER[part]}.{part}"


@dataclass
class LoraAdapter:
    """An adapter read from disk, laid out for the slot buffers (host memory, pinned on CUDA).

    a[(layer, fused)]: [R, in] with sub-projection j's A in rank rows [j * max_rank, j * max_rank + r);
    b[(layer, fused)]: [out, R], scale folded in, block-diagonal to a. Missing targets stay zero.
    Every value is finite (read_adapter refuses the others): the stacked LoRA kernel relies on it."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]


def read_adapter(name: str, path: str | pathlib.Path, spec: ModelSpec, max_rank: int, pin: bool = False,
                 dtype: torch.dtype = torch.float32, root: pathlib.Path | None = None) -> LoraAdapter:
    """Reads and checks a PEFT LoRA directory: raises LoraError naming the file and what is wrong
    (LoraPathError when `path` is outside `root`; a relative path is taken under `root`). The result
    is in `dtype` (the model's; the scale folded in float32 first) and pinned with `pin`, so that
    loading it into a slot is a plain asynchronous copy."""
    try:
        return _Reader(name, pathlib.Path(path), spec, max_rank, dtype, root).read(pin)
    except LoraError as exc:
        error = type(exc)(str(exc))
    raise error  # outside the except block: no context or traceback holds the refused tensors


def inside(path: pathlib.Path, root: pathlib.Path) -> bool:
    """Whether `path` (resolved) is `root` (resolved) or under it."""
    return path == root or root in path.parents


def resolve_under(path: pathlib.Path, root: pathlib.Path | None) -> pathlib.Path | None:
    """The real path of `path` (relative ones under `root`), or None when it is outside `root`."""
    if root is None:
        return path
    real = pathlib.Path(os.path.realpath(path if path.is_absolute() else root / path))
    return real if inside(real, pathlib.Path(os.path.realpath(root))) else None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if value > 0 else None


def _positive_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) and number > 0 else None


class _Reader:
    def __init__(self, name: str, given: pathlib.Path, spec: ModelSpec, max_rank: int, dtype: torch.dtype,
                 root: pathlib.Path | None) -> None:
        self.name, self.given, self.spec, self.max_rank, self.dtype = name, given, spec, max_rank, dtype
        self.root = pathlib.Path(os.path.realpath(root)) if root is not None else None
        directory = resolve_under(given, self.root)
        if directory is None:
            raise LoraPathError(f"adapter {name!r}: {given} is outside --lora-root; adapters load only from under it")
        self.directory = directory
        self.config_file, self.weights_file = given / CONFIG_FILE, given / WEIGHTS_FILE  # as shown in messages
        self.dims = shapes(spec)
        self.names = [module_name(layer, part) for layer in range(spec.num_layers) for part in TARGETS]

    # ---- files --------------------------------------------------------------------------------

    def _open(self, file_name: str) -> tuple[int, int]:
        """(fd, size) of a regular file of the adapter directory, under the root."""
        missing = LoraError(f"adapter {self.name!r}: {self.given} holds no readable {file_name} (a PEFT adapter "
                            f"directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
            fd = os.open(self.directory / file_name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (OSError, ValueError):
            raise missing from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise missing
            if self.root is not None:
                try:
                    opened = pathlib.Path(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    opened = None  # no /proc: the resolved directory was checked already
                if opened is not None and not inside(opened, self.root):
                    raise LoraPathError(f"adapter {self.name!r}: {self.given / file_name} is outside --lora-root")
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    def _pread(self, fd: int, size: int, offset: int, shown: pathlib.Path) -> bytearray:
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        try:
            while done < size:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    raise LoraError(f"{shown}: the file ended early (it changed while being read?)")
                done += n
        except OSError:
            raise LoraError(f"{shown}: could not be read") from None
        return buf

    # ---- adapter_config.json ------------------------------------------------------------------

    def _config(self) -> dict:
        cf = self.config_file
        fd, size = self._open(CONFIG_FILE)
        try:
            if size > MAX_CONFIG_BYTES:
                raise LoraError(f"{cf}: {size} bytes; an adapter config is at most {MAX_CONFIG_BYTES} bytes")
            raw = self._pread(fd, size, 0, cf)
        finally:
            os.close(fd)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LoraError(f"{cf}: not UTF-8 text (a PEFT adapter config is JSON)") from None
        try:
            config = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise LoraError(f"{cf}: not valid JSON ({str(exc)[:200]})") from None
        if not isinstance(config, dict):
            raise LoraError(f"{cf}: expected a JSON object")
        return config

    def _settings(self, config: dict) -> tuple[dict[str, int], dict[str, float], bool]:
        """Each targeted module's rank and alpha (rank_pattern / alpha_pattern applied), and use_rslora."""
        cf = self.config_file
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise LoraError(f"{cf}: peft_type is {str(config.get('peft_type'))[:64]!r}; only LORA adapters are served")
        r, alpha = _positive_int(config.get("r")), _positive_float(config.get("lora_alpha"))
        if r is None:
            raise LoraError(f"{cf}: r must be a positive integer, got {_shown(config.get('r'))}")
        if alpha is None:
            raise LoraError(f"{cf}: lora_alpha must be a finite positive number, got {_shown(config.get('lora_alpha'))}")
        if config.get("bias", "none") != "none":
            raise LoraError(f"{cf}: bias={_shown(config['bias'])} is not supported (train with bias='none')")
        for key in ("use_dora", "modules_to_save"):
            if config.get(key):
                raise LoraError(f"{cf}: {key} is not supported")
        rslora = config.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise LoraError(f"{cf}: use_rslora must be true or false, got {_shown(rslora)}")
        rank_pattern = self._pattern_table(config, "rank_pattern", _positive_int, "a positive integer rank")
        alpha_pattern = self._pattern_table(config, "alpha_pattern", _positive_float, "a finite positive alpha")
        if len(rank_pattern) + len(alpha_pattern) > MAX_PATTERNS:
            raise LoraError(f"{cf}: rank_pattern and alpha_pattern hold {len(rank_pattern) + len(alpha_pattern)} "
                            f"keys; at most {MAX_PATTERNS}")
        target_patterns = self._target_patterns(config.get("target_modules"))
        keyed = [Pattern(f"rank_pattern key {k[:64]!r}", k, "suffix") for k in rank_pattern]
        keyed += [Pattern(f"alpha_pattern key {k[:64]!r}", k, "suffix") for k in alpha_pattern]
        try:
            matched = match_patterns(target_patterns + keyed, self.names)
        except PatternError as exc:
            raise LoraError(f"{cf}: {exc}") from None
        targeted = set().union(*matched[:len(target_patterns)])
        if not targeted:
            raise LoraError(f"{cf}: target_modules {_shown(config.get('target_modules'))} matches none of "
                            f"{list(TARGETS)}")
        rank_sets = matched[len(target_patterns): len(target_patterns) + len(rank_pattern)]
        alpha_sets = matched[len(target_patterns) + len(rank_pattern):]

        def first(table: dict, sets: list[set[str]], module: str, default: float) -> float:
            # PEFT's get_pattern_key: the first key (in the config's order) that matches the module
            return next((v for v, s in zip(table.values(), sets) if module in s), default)

        ranks = {m: int(first(rank_pattern, rank_sets, m, r)) for m in targeted}
        alphas = {m: float(first(alpha_pattern, alpha_sets, m, alpha)) for m in targeted}
        return ranks, alphas, rslora

    def _pattern_table(self, config: dict, key: str, check: Any, what: str) -> dict[str, Any]:
        table = config.get(key)
        if table is None:
            return {}
        if not isinstance(table, dict):
            raise LoraError(f"{self.config_file}: {key} must be an object mapping module patterns to {what}s, "
                            f"got a {type(table).__name__}")
        out = {}
        for pattern, value in table.items():
            checked = check(value)
            if checked is None:
                raise LoraError(f"{self.config_file}: {key}[{pattern[:64]!r}] must be {what}, got {_shown(value)}")
            out[pattern] = checked
        return out

    def _target_patterns(self, spec: Any) -> list[Pattern]:
        cf = self.config_file
        if isinstance(spec, str):  # PEFT: a regex matched against the full module name
            return [Pattern("target_modules", spec, "full")]
        if not (isinstance(spec, list) and spec and all(isinstance(t, str) for t in spec)):
            raise LoraError(f"{cf}: target_modules must be a list of module names or a regex string, got "
                            f"{_shown(spec)}")
        if len(spec) > MAX_PATTERNS or any(len(t) > MAX_PATTERN_CHARS for t in spec):
            raise LoraError(f"{cf}: target_modules is too long (at most {MAX_PATTERNS} names of at most "
                            f"{MAX_PATTERN_CHARS} characters)")
        unknown = sorted({t.rsplit(".", 1)[-1] for t in spec} - set(TARGETS))
        if unknown:
            raise LoraError(f"{cf}: target_modules {unknown[:8]} are not supported; graphserve applies "
                            f"adapters to {list(TARGETS)}")
        # PEFT's rule for a list: the module's name, or a dotted suffix of it; no regex.
        return [Pattern("target_modules", t, "name") for t in spec]

    # ---- adapter_model.safetensors ------------------------------------------------------------

    def _header(self, fd: int, size: int) -> tuple[dict, int]:
        """The header's tensor entries and where the data starts; refuses a file larger than an adapter
        of this model at max_rank can be, before reading anything."""
        wf = self.weights_file
        num_tensors = 2 * len(self.names)
        header_limit = 4096 + _HEADER_BYTES_PER_TENSOR * num_tensors
        data_limit = 8 * self.max_rank * sum(sum(self.dims[part]) for part in TARGETS) * self.spec.num_layers
        if size > 8 + header_limit + data_limit:
            raise LoraError(f"{wf}: {size} bytes, more than an adapter of this model at rank <= {self.max_rank} "
                            f"can hold ({8 + header_limit + data_limit} bytes)")
        if size < 8:
            raise LoraError(f"{wf}: not a readable safetensors file (too short)")
        length = int.from_bytes(self._pread(fd, 8, 0, wf), "little")
        if length > min(header_limit, size - 8):
            raise LoraError(f"{wf}: not a readable safetensors file (a header of {length} bytes)")
        try:
            header = json.loads(self._pread(fd, length, 8, wf).decode("utf-8"))
        except (ValueError, RecursionError):
            raise LoraError(f"{wf}: not a readable safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise LoraError(f"{wf}: not a readable safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        return header, 8 + length

    def _entries(self, header: dict, data_len: int) -> dict[tuple[int, str], dict[str, tuple]]:
        """(layer, part) -> {"A"|"B": (torch dtype, shape, begin, end)}, every entry checked."""
        wf = self.weights_file
        found: dict[tuple[int, str], dict[str, tuple]] = {}
        spans = []
        for key, meta in header.items():
            m = _KEY.fullmatch(key) if len(key) <= 256 else None
            if m is None:
                raise LoraError(f"{wf}: unexpected tensor {key[:128]!r} (expected {_KEY_HELP})")
            layer, target = int(m[1]), m[3]
            if target not in TARGETS:
                raise LoraError(f"{wf}: {key!r} adapts {target}, which graphserve does not adapt")
            if layer >= self.spec.num_layers:
                raise LoraError(f"{wf}: {key!r} is for layer {layer}; the base model has {self.spec.num_layers}")
            if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in _DTYPES:
                raise LoraError(f"{wf}: {key!r} has dtype {_shown(meta.get('dtype') if isinstance(meta, dict) else meta)}"
                                f"; adapters are {', '.join(_DTYPES)}")
            dtype, itemsize = _DTYPES[meta["dtype"]]
            shape, offsets = meta.get("shape"), meta.get("data_offsets")
            if not (_ints(shape, 2) and _ints(offsets, 2)):
                raise LoraError(f"{wf}: {key!r} has a malformed shape or data_offsets")
            begin, end = offsets
            if not (0 <= begin <= end <= data_len) or end - begin != shape[0] * shape[1] * itemsize:
                raise LoraError(f"{wf}: {key!r}: data_offsets {offsets} do not hold a {meta['dtype']} tensor of "
                                f"shape {shape} within the file")
            found.setdefault((layer, target), {})[m[4]] = (dtype, tuple(shape), begin, end)
            spans.append((begin, end))
        if not found:
            raise LoraError(f"{wf}: holds no lora_A/lora_B tensors")
        spans.sort()
        if any(b < prev_end for (_, prev_end), (b, _) in zip(spans, spans[1:])):
            raise LoraError(f"{wf}: not a readable safetensors file (tensors overlap)")
        if sum(e - b for b, e in spans) != data_len:
            raise LoraError(f"{wf}: not a readable safetensors file (bytes that belong to no tensor)")
        return found

    def _check_pairs(self, found: dict, ranks: dict[str, int]) -> None:
        wf, cf = self.weights_file, self.config_file
        for (layer, part), pair in sorted(found.items()):
            module = module_name(layer, part)
            if set(pair) != {"A", "B"}:
                raise LoraError(f"{wf}: {module} has lora_{next(iter(pair))} but not its pair")
            if module not in ranks:
                raise LoraError(f"{wf}: {module} has weights but {cf} does not target {part}")
            n_in, n_out = self.dims[part]
            a_shape, b_shape = pair["A"][1], pair["B"][1]
            r = a_shape[0]
            if a_shape != (r, n_in) or b_shape != (n_out, r):
                raise LoraError(f"{wf}: {module}: lora_A {a_shape} and lora_B {b_shape} do not fit the base "
                                f"projection ({n_in} -> {n_out}): expected [r, {n_in}] and [{n_out}, r]; was the "
                                "adapter trained on another model?")
            if r != ranks[module]:
                raise LoraError(f"{wf}: {module} has rank {r} but {cf} says r={ranks[module]}")
            if r > self.max_rank:
                raise LoraError(f"{wf}: {module} has rank {r}, above --max-lora-rank {self.max_rank}: "
                                f"restart with --max-lora-rank {r} or more")

    def _tensor(self, fd: int, entry: tuple, data_start: int) -> torch.Tensor:
        dtype, shape, begin, end = entry
        buf = self._pread(fd, end - begin, data_start + begin, self.weights_file)
        return torch.frombuffer(buf, dtype=dtype).view(shape).float()

    def _finite(self, tensor: torch.Tensor, what: str, module: str, scaled: bool = False) -> torch.Tensor:
        """`tensor` (float32; `scaled`: a finite tensor times the scale) in the model's dtype; LoraError
        when a value is not finite there."""
        if not bool(torch.isfinite(tensor).all()):
            raise LoraError(f"{self.weights_file}: {module}: {what} " + ("overflows float32" if scaled else
                                                                          "holds NaN or inf"))
        out = tensor.to(self.dtype)
        if not bool(torch.isfinite(out).all()):
            raise LoraError(f"{self.weights_file}: {module}: {what} overflows {str(self.dtype).removeprefix('torch.')}")
        return out

    # ---- all of it ----------------------------------------------------------------------------

    def read(self, pin: bool) -> LoraAdapter:
        ranks, alphas, rslora = self._settings(self._config())
        fd, size = self._open(WEIGHTS_FILE)
        try:
            header, data_start = self._header(fd, size)
            found = self._entries(header, size - data_start)
            self._check_pairs(found, ranks)
            a_out, b_out, max_seen = self._weights(fd, found, data_start, alphas, rslora)
        finally:
            os.close(fd)
        if pin:
            a_out = {k: v.pin_memory() for k, v in a_out.items()}
            b_out = {k: v.pin_memory() for k, v in b_out.items()}
        targets = tuple(t for t in TARGETS if any(m.endswith(f".{t}") for m in ranks))
        return LoraAdapter(self.name, str(self.given), max_seen, targets, a_out, b_out)

    def _weights(self, fd: int, found: dict, data_start: int, alphas: dict[str, float],
                 rslora: bool) -> tuple[dict, dict, int]:
        """The checked tensors laid out for the slots; each read, checked and dropped one at a time."""
        max_rank, max_seen = self.max_rank, 0
        a_out: dict[tuple[int, str], torch.Tensor] = {}
        b_out: dict[tuple[int, str], torch.Tensor] = {}
        for fused, parts in FUSED.items():
            n_in = self.dims[parts[0]][0]
            outs = [self.dims[p][1] for p in parts]
            for layer in range(self.spec.num_layers):
                if not any((layer, p) in found for p in parts):
                    continue
                a = torch.zeros(len(parts) * max_rank, n_in, dtype=self.dtype)
                b = torch.zeros(sum(outs), len(parts) * max_rank, dtype=self.dtype)
                row = 0
                for j, (part, n_out) in enumerate(zip(parts, outs)):
                    pair = found.get((layer, part))
                    if pair is not None:
                        module = module_name(layer, part)
                        r = pair["A"][1][0]
                        alpha = alphas[module]
                        scale = alpha / math.sqrt(r) if rslora else alpha / r
                        a[j * max_rank: j * max_rank + r] = self._finite(self._tensor(fd, pair["A"], data_start),
                                                                         "lora_A", module)
                        b_scaled = self._tensor(fd, pair["B"], data_start)
                        if not bool(torch.isfinite(b_scaled).all()):
                            raise LoraError(f"{self.weights_file}: {module}: lora_B holds NaN or inf")
                        b[row: row + n_out, j * max_rank: j * max_rank + r] = self._finite(
                            b_scaled.mul_(scale), f"lora_B x scale {scale:g}", module, scaled=True)
                        max_seen = max(max_seen, r)
                    row += n_out
                a_out[(layer, fused)], b_out[(layer, fused)] = a, b
        return a_out, b_out, max_seen


def _ints(value: Any, length: int) -> bool:
    return (isinstance(value, list) and len(value) == length
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in value))


def _shown(value: Any) -> str:
    """A config value for a message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
