"""LoRA adapters beside the model: PEFT files in, fixed device slots, batched per-token products.

Every fused projection (qkv_proj, o_proj, gate_up_proj, down_proj) of every layer gets a
`LoraProjection` hook that adds, for each token row, `(x @ A[slot]^T) @ B[slot]^T` to the base
output, where `slot` is that row's adapter slot. Slot 0 is "no adapter" and stays zero, so base rows
in a mixed batch get exactly nothing added. The buffers are allocated once (`max_loras + 1` slots,
zero-padded to the max rank, alpha/r folded into B at load), so loading or swapping an adapter is a
copy into a slot, never a reallocation: a captured graph keeps reading the same addresses.

q/k/v (gate/up) share one fused output; each sub-projection owns a block of rank columns of the
fused module's A and the rows of its output range in B (block-diagonal), so one shrink and one
expand serve all three. The hook only runs inside `lora_tokens(slots)` on the calling thread: base
steps (and base graphs) never run a LoRA kernel, and the capture thread and the engine thread each
decide for themselves.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from service.model.spec import ModelSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused module -> its sub-projections, in the order of its output rows.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# "stacked": one GEMM against every slot's A, a mask, one GEMM against every slot's B (cost grows
# with max_loras * rank, independent of the batch); "gather": per-token gathered A/B and bmm (cost
# grows with the batch). bench/lora_bench.py measures both.
LORA_KERNELS = ("stacked", "gather")


class LoraError(ValueError):
    """An adapter's files do not fit this model or these limits; the message names the file."""


def shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection."""
    hd, h = spec.head_dim, spec.hidden_size
    return {"q_proj": (h, spec.num_heads * hd), "k_proj": (h, spec.num_kv_heads * hd),
            "v_proj": (h, spec.num_kv_heads * hd), "o_proj": (spec.num_heads * hd, h),
            "gate_proj": (h, spec.intermediate_size), "up_proj": (h, spec.intermediate_size),
            "down_proj": (spec.intermediate_size, h)}


@dataclass
class LoraAdapter:
    """An adapter read from disk, laid out for the slot buffers (host memory, pinned on CUDA).

    a[(layer, fused)]: [R, in] with sub-projection j's A in rank rows [j * max_rank, j * max_rank + r);
    b[(layer, fused)]: [out, R], scale folded in, block-diagonal to a. Missing targets stay zero."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]


def _target_of(module_path: str) -> str | None:
    leaf = module_path.rsplit(".", 1)[-1]
    return leaf if leaf in TARGETS else None


def _targets(config: dict, config_file: pathlib.Path, num_layers: int) -> set[str]:
    spec = config.get("target_modules")
    if isinstance(spec, str):  # PEFT: a regex matched against the full module name
        pattern = _regex(spec, config_file, "target_modules")
        names = [f"model.layers.{i}.{owner}.{t}" for i in range(num_layers) for owner in ("self_attn", "mlp")
                 for t in TARGETS]
        found = {n.rsplit(".", 1)[-1] for n in names if pattern.fullmatch(n)}
    elif isinstance(spec, list) and all(isinstance(t, str) for t in spec):
        unknown = sorted({t.rsplit(".", 1)[-1] for t in spec} - set(TARGETS))
        if unknown:
            raise LoraError(f"{config_file}: target_modules {unknown} are not supported; graphserve applies "
                            f"adapters to {list(TARGETS)}")
        found = {t.rsplit(".", 1)[-1] for t in spec}
    else:
        raise LoraError(f"{config_file}: target_modules must be a list of module names or a regex string, "
                        f"got {spec!r}")
    if not found:
        raise LoraError(f"{config_file}: target_modules {spec!r} matches none of {list(TARGETS)}")
    return found


def _regex(pattern: str, config_file: pathlib.Path, field: str) -> Any:
    """A pattern from an adapter's config, compiled by RE2: matching is linear in the name, so no
    pattern (an untrusted file's) can make the engine spin."""
    import re2

    try:
        return re2.compile(pattern)
    except re2.error as exc:
        raise LoraError(f"{config_file}: {field} {pattern!r} is not a valid regular expression ({exc})") from None


def _patterns(config: dict, key: str, config_file: pathlib.Path) -> list[tuple[str, Any, float]]:
    """PEFT's rank_pattern / alpha_pattern, checked: {module name or regex: a finite positive number}."""
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise LoraError(f"{config_file}: {key} must be an object of module name -> number, got {type(patterns).__name__}")
    out = []
    for name, value in patterns.items():
        if not _positive_number(value):
            raise LoraError(f"{config_file}: {key}[{name!r}] must be a finite positive number, got {value!r}")
        out.append((name, _regex(rf"(?:.*\.)?(?:{name})", config_file, f"{key} key"), float(value)))
    return out


def _pattern_value(patterns: list[tuple[str, Any, float]], module_path: str, default: float) -> float:
    """The first pattern whose key the module's name ends with (or that matches it whole), as PEFT does."""
    for key, regex, value in patterns:
        if module_path.endswith(key) or regex.fullmatch(module_path):
            return value
    return default


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def read_adapter(name: str, path: str | pathlib.Path, spec: ModelSpec, max_rank: int, pin: bool = False,
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Reads and checks a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors):
    raises LoraError naming the file and what is wrong (missing file, rank above max_rank, a target
    module graphserve does not adapt, a tensor whose shape does not fit the base model). The result
    is in `dtype` (the model's; the scale folded in float32 first) and pinned with `pin`, so that
    loading it into a slot is a plain asynchronous copy."""
    from safetensors import safe_open

    root = pathlib.Path(path)
    config_file, weights_file = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not root.is_dir():
        raise LoraError(f"adapter {name!r}: {root} is not a directory (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    for f in (config_file, weights_file):
        if not f.is_file():
            raise LoraError(f"adapter {name!r}: {f} is missing")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{config_file}: expected a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{config_file}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    for key in ("r", "lora_alpha"):
        if not _positive_number(config.get(key)):
            raise LoraError(f"{config_file}: {key} must be a finite positive number, got {config.get(key)!r}")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{config_file}: bias={config['bias']!r} is not supported (train with bias='none')")
    for key in ("use_dora", "modules_to_save"):
        if config.get(key):
            raise LoraError(f"{config_file}: {key} is not supported")
    targets = _targets(config, config_file, spec.num_layers)
    rank_pattern, alpha_pattern = _patterns(config, "rank_pattern", config_file), _patterns(config, "alpha_pattern", config_file)
    rslora = bool(config.get("use_rslora", False))
    dims = shapes(spec)

    try:
        handle = safe_open(str(weights_file), framework="pt")
        keys = list(handle.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a broken file
        raise LoraError(f"{weights_file}: not a readable safetensors file ({exc})") from None
    pattern = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in keys:
        m = pattern.match(key)
        if m is None:
            raise LoraError(f"{weights_file}: unexpected tensor {key!r} (expected base_model.model.model.layers."
                            f"<i>.<self_attn|mlp>.<{'|'.join(TARGETS)}>.lora_<A|B>.weight)")
        layer, target = int(m[1]), m[3]
        if target not in TARGETS:
            raise LoraError(f"{weights_file}: {key!r} adapts {target}, which graphserve does not adapt")
        if layer >= spec.num_layers:
            raise LoraError(f"{weights_file}: {key!r} is for layer {layer}; the base model has {spec.num_layers}")
        found.setdefault((layer, target), {})[m[4]] = handle.get_tensor(key)
    if not found:
        raise LoraError(f"{weights_file}: holds no lora_A/lora_B tensors")

    max_seen = 0
    a_out: dict[tuple[int, str], torch.Tensor] = {}
    b_out: dict[tuple[int, str], torch.Tensor] = {}
    for fused, parts in FUSED.items():
        n_in = dims[parts[0]][0]
        outs = [dims[p][1] for p in parts]
        for layer in range(spec.num_layers):
            if not any((layer, p) in found for p in parts):
                continue
            a = torch.zeros(len(parts) * max_rank, n_in)
            b = torch.zeros(sum(outs), len(parts) * max_rank)
            row = 0
            for j, (part, n_out) in enumerate(zip(parts, outs)):
                pair = found.get((layer, part))
                if pair is not None:
                    module = f"model.layers.{layer}.{_OWNER[fused]}.{part}"
                    if set(pair) != {"A", "B"}:
                        raise LoraError(f"{weights_file}: {module} has lora_{next(iter(pair))} but not its pair")
                    if part not in targets:
                        raise LoraError(f"{weights_file}: {module} has weights but {config_file} does not target {part}")
                    A, B = pair["A"].float(), pair["B"].float()
                    if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
                        raise LoraError(f"{weights_file}: {module} holds non-finite weights (NaN or infinity)")
                    r = A.shape[0]
                    want_r = int(_pattern_value(rank_pattern, module, config["r"]))
                    alpha = float(_pattern_value(alpha_pattern, module, config["lora_alpha"]))
                    if A.shape != (r, n_in) or B.shape != (n_out, r):
                        raise LoraError(f"{weights_file}: {module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} "
                                        f"do not fit the base projection ({n_in} -> {n_out}): expected [r, {n_in}] "
                                        f"and [{n_out}, r]; was the adapter trained on another model?")
                    if r != want_r:
                        raise LoraError(f"{weights_file}: {module} has rank {r} but {config_file} says r={want_r}")
                    if r > max_rank:
                        raise LoraError(f"{weights_file}: {module} has rank {r}, above --max-lora-rank {max_rank}: "
                                        f"restart with --max-lora-rank {r} or more")
                    max_seen = max(max_seen, r)
                    scale = alpha / math.sqrt(r) if rslora else alpha / r
                    a[j * max_rank: j * max_rank + r] = A
                    b[row: row + n_out, j * max_rank: j * max_rank + r] = B * scale
                row += n_out
            a, b = a.to(dtype), b.to(dtype)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # alpha / r can overflow the dtype
                raise LoraError(f"{weights_file}: layer {layer} {fused}: the scaled weights overflow {dtype} "
                                "(lora_alpha / r too large)")
            a_out[(layer, fused)] = a.pin_memory() if pin else a
            b_out[(layer, fused)] = b.pin_memory() if pin else b
    return LoraAdapter(name, str(root), max_seen, tuple(t for t in TARGETS if t in targets), a_out, b_out)


# ---- the per-thread batch the hooks read -----------------------------------------------------------

_local = threading.local()


@dataclass(frozen=True)
class LoraTokens:
    slots: torch.Tensor  # [N] int64, each row's adapter slot (0: none)
    mask: torch.Tensor  # [N, num_slots] in the model dtype: 1 at the row's slot


@contextmanager
def lora_tokens(slots: torch.Tensor, lora: LoraSlots) -> Iterator[None]:
    """Within this block (on this thread) every hooked projection adds the rows' adapters.
    Graph-safe: builds the one-hot mask on the device, no host sync."""
    mask = (slots[:, None] == lora.slot_range[None, :]).to(lora.dtype)
    previous = getattr(_local, "tokens", None)
    _local.tokens = LoraTokens(slots, mask)
    try:
        yield
    finally:
        _local.tokens = previous


class LoraProjection:
    """The hook on one fused projection of one layer: y += per-row LoRA of x."""

    __slots__ = ("lora", "a", "b")

    def __init__(self, lora: LoraSlots, a: torch.Tensor, b: torch.Tensor) -> None:
        self.lora, self.a, self.b = lora, a, b  # a: [S, R, in], b: [out, S, R]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tokens: LoraTokens | None = getattr(_local, "tokens", None)
        if tokens is None:
            return y
        return add_lora(y, x, tokens, self.a, self.b, self.lora.kernel)


def add_lora(y: torch.Tensor, x: torch.Tensor, tokens: LoraTokens, a: torch.Tensor, b: torch.Tensor,
             kernel: str) -> torch.Tensor:
    """y [N, out] += per-row LoRA of x [N, in], in place: row n gets (x[n] @ a[s]^T) @ b[:, s]^T with
    s = tokens.slots[n]. "stacked" is three kernels (shrink against every slot, the slot mask, and
    the expand accumulated into y by the GEMM itself)."""
    num_slots, rank, n_in = a.shape
    n = x.shape[0]
    if kernel == "gather":
        h = torch.bmm(a[tokens.slots], x[:, :, None])  # [N, R, 1]
        return y.add_(torch.bmm(b.permute(1, 0, 2)[tokens.slots], h)[:, :, 0])
    h = torch.mm(x, a.view(num_slots * rank, n_in).T).view(n, num_slots, rank)
    h.mul_(tokens.mask[:, :, None])
    return y.addmm_(h.view(n, num_slots * rank), b.view(b.shape[0], num_slots * rank).T)


class LoraSlots:
    """The device buffers of `max_loras` adapter slots (slot 0: no adapter) and the hooks that read them.

    Owned by the runner; `load(slot, adapter)` and `clear(slot)` run on the engine thread between
    steps. The copies are queued on the current stream, after any step already launched."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, kernel: str = "stacked") -> None:
        if kernel not in LORA_KERNELS:
            raise ValueError(f"unknown LoRA kernel {kernel!r}; allowed: {LORA_KERNELS}")
        spec: ModelSpec = model.spec
        self.max_loras, self.max_rank, self.kernel = max_loras, max_rank, kernel
        self.dtype = model.dtype
        device = model.inv_freq.device
        self.device = device
        self.slot_range = torch.arange(max_loras + 1, device=device)
        dims = shapes(spec)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            for fused, parts in FUSED.items():
                n_in, n_out = dims[parts[0]][0], sum(dims[p][1] for p in parts)
                rank = len(parts) * max_rank
                a = torch.zeros(max_loras + 1, rank, n_in, device=device, dtype=self.dtype)
                b = torch.zeros(n_out, max_loras + 1, rank, device=device, dtype=self.dtype)
                self.a[(i, fused)], self.b[(i, fused)] = a, b
                getattr(getattr(layer, _OWNER[fused]), fused).lora = LoraProjection(self, a, b)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        assert 1 <= slot <= self.max_loras, slot
        assert adapter.a and next(iter(adapter.a.values())).shape[0] % self.max_rank == 0
        non_blocking = self.device.type == "cuda"
        for key, a in self.a.items():
            if key in adapter.a:
                a[slot].copy_(adapter.a[key], non_blocking=non_blocking)
                self.b[key][:, slot].copy_(adapter.b[key], non_blocking=non_blocking)
            else:
                a[slot].zero_()
                self.b[key][:, slot].zero_()

    def clear(self, slot: int) -> None:
        assert 1 <= slot <= self.max_loras, slot
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][:, slot].zero_()
