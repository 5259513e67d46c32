"""Tensor parallelism of the model (Megatron): this rank's place in the group and the sharded pieces.

Each of N ranks holds 1/N of every large matrix:

    q/k/v, gate/up   column-parallel: this rank's output rows (its heads, its MLP columns); no collective
    o_proj, down     row-parallel: this rank's input columns; one all-reduce of the partial sums each
    embed_tokens     vocab-parallel: this rank's token rows; ids outside them give zeros; one all-reduce
    lm_head          vocab-parallel: this rank's logits columns; one all-gather to rank 0's sampler

so a layer costs two all-reduces of [N, hidden]. A mixture-of-experts layer splits every expert the
same way (each rank holds all experts' 1/N of the inner dimension: gate/up rows, down columns; the
router whole) and sums its output once; expert parallelism (whole experts per rank) is not served yet.
KV heads are split across ranks, never replicated:
a model whose heads, KV heads or MLP width do not divide by N is refused (ModelLoadError) when it
loads. The vocabulary is padded up to a multiple of N (zero rows, logits cut back after the gather).
With world size 1 every collective below is a no-op, so the model has one code path.

`all_reduce` is the one call every reduction goes through, so it can be swapped (torch's
symmetric-memory one-shot all-reduce on CUDA) without touching the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from service.model.spec import ModelLoadError, ModelSpec

# Hugging Face parameter names by how they are split; anything else (norms, MoE routers) is replicated.
# Mixtral's experts are w1 (gate), w3 (up), w2 (down).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank in the tensor-parallel group; `group` carries the model's collectives."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup; None when world_size == 1
    # Replaces the NCCL/gloo all-reduce (e.g. SymmetricMemoryAllReduce); returns the sum.
    reducer: Callable[[torch.Tensor], torch.Tensor] | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks (the partial products of a row-parallel layer): in place, unless a
        `reducer` returns the sum in a buffer of its own."""
        if self.world_size == 1:
            return x
        if self.reducer is not None:
            return self.reducer(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """x [R, V / N] (this rank's logits columns) -> [R, vocab_size] on every rank."""
        if self.world_size == 1:
            return x

        rows, cols = x.shape
        parts = torch.empty((self.world_size * rows, cols), dtype=x.dtype, device=x.device)
        _all_gather_single(parts, x.contiguous(), group=self.group)  # rank r's rows at [r * rows, ...)
        return parts.view(self.world_size, rows, cols).permute(1, 0, 2).reshape(rows, self.world_size * cols)[:, :vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (the sampled tokens the next step may feed back)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=0, group=self.group)
        return x

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of this rank's vocabulary shard; the last shard may be padded."""
        per_rank = -(-vocab_size // self.world_size)
        return self.rank * per_rank, per_rank


class SymmetricMemoryAllReduce:
    """torch's symmetric-memory one-shot all-reduce (CUDA, NVLink): every rank reads the others'
    buffers directly, one kernel, no NCCL. Inputs are copied into one symmetric buffer of
    [max_rows, hidden] allocated (and rendezvoused across the group) once, so captured graphs keep
    its address. Measured against NCCL by bench/tp_decode_bench.py (--all-reduce symm)."""

    def __init__(self, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device, group: Any) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, harmless after
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buf = symm_mem.empty((max_rows, hidden), dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        part = self.buf[: x.shape[0]]  # storage offset 0: the buffer's own address
        part.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(part, "sum", self.group_name)


def _all_gather_single(output: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, x, group=group)


def shard_spec(spec: ModelSpec, tp: TensorParallel) -> ModelSpec:
    """The spec as one rank sees it: its share of the heads, KV heads and MLP width (vocabulary and
    hidden size stay whole). Raises ModelLoadError when a count does not divide by the world size."""
    n = tp.world_size
    if n == 1:
        return spec
    counts = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
              "intermediate_size": spec.intermediate_size}
    if spec.is_moe:
        counts["moe_intermediate_size"] = spec.moe_intermediate_size
    bad = [f"{name} {value}" for name, value in counts.items() if value % n]
    if bad:
        raise ModelLoadError(
            f"{', '.join(bad)} does not divide by tensor_parallel_size {n}: KV heads are split across ranks, "
            f"never replicated; use a tensor_parallel_size that divides {spec.num_kv_heads}"
        )
    return dataclasses.replace(spec, num_heads=spec.num_heads // n, num_kv_heads=spec.num_kv_heads // n,
                               intermediate_size=spec.intermediate_size // n,
                               moe_intermediate_size=spec.moe_intermediate_size // n)


def shard_index(name: str, shape: tuple[int, ...], tp: TensorParallel) -> tuple[slice, ...] | None:
    """The slice of the whole checkpoint tensor `name` (of `shape`) that this rank loads; None: all of it.
    The last vocabulary slice may be short: `read_shard` pads it."""
    if tp.world_size == 1 or math.prod(shape) == 1:  # a per-tensor scale (a KV scale): the same on every rank
        return None
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _VOCAB:
        start, per_rank = tp.vocab_rows(shape[0])
        return (slice(min(start, shape[0]), min(start + per_rank, shape[0])),)
    if module in _COLUMN:
        per_rank = shape[0] // tp.world_size
        return (slice(tp.rank * per_rank, (tp.rank + 1) * per_rank),)
    # a row-parallel bias is added once, after the all-reduce; a block-scaled FP8 weight's scales split as it does
    if module in _ROW and parts[-1] in ("weight", "weight_scale_inv"):
        per_rank = shape[1] // tp.world_size
        return (slice(None), slice(tp.rank * per_rank, (tp.rank + 1) * per_rank))
    return None


def read_shard(part: Any, name: str, tp: TensorParallel) -> torch.Tensor:
    """This rank's share of checkpoint tensor `name`, read through a safetensors slice
    (`safe_open(...).get_slice(name)`): only this rank's bytes are read."""
    shape = tuple(part.get_shape())
    index = shard_index(name, shape, tp)
    if index is None:
        return part[...]  # (a 0-dim tensor, such as a KV scale, takes no slice)
    t = part[index]
    if name.split(".")[-2] in _VOCAB:  # the last shard of a vocabulary that does not divide by N
        rows = tp.vocab_rows(shape[0])[1]
        if t.shape[0] < rows:
            t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
    return t


class VocabParallelEmbedding(nn.Module):
    """Embedding of this rank's vocabulary rows; each token's row comes from the rank that holds it."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.start, rows = tp.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))
