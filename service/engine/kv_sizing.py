"""How many KV blocks a runner allocates: from --kv-cache-memory, after the weights are loaded.

auto on CUDA: the device memory free once the weights are in, less the graph memory budget and a
margin of 5% of the device (the largest step's activations, the sampler's logits, allocator slack);
auto on CPU: what --max-running-seqs sequences of --max-seq-len need (the most the server could
hold at once), at most 1 GiB. Bytes or a fraction of the device's memory: that much. With tensor
parallelism every rank takes the smallest count of all ranks (the scheduler on rank 0 hands out
the same block ids to every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_manager.budget import parse_memory_budget, resolve_budget
from cache_manager.config import DEFAULT_BUDGET_FRACTION
from service.model.kv_cache import KVCache
from service.model.parallel import TensorParallel
from service.model.spec import ModelLoadError, ModelSpec

CPU_AUTO_BYTES = 1 << 30
CUDA_MARGIN_FRACTION = 0.05


@dataclass(frozen=True)
class KVSizing:
    num_blocks: int  # the null block included
    block_size: int
    bytes_per_block: int
    source: str  # what decided it, for the start-up log

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def size_kv_cache(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device, kv_cache_memory: str, block_size: int,
    max_running: int, max_seq_len: int, graph_budget: str | None, graphs: bool, tp: TensorParallel | None = None,
) -> KVSizing:
    """spec: this rank's share (its KV heads); dtype: what the cache stores (an FP8 cache's blocks cost
    half a bf16 one's: twice as many fit); graphs: whether CUDA graphs take their budget. Raises
    ModelLoadError when not even one sequence of max_seq_len fits, saying what to change."""
    per_block = KVCache.bytes_per_block(spec, block_size, dtype)
    per_seq = -(-max_seq_len // block_size)
    if kv_cache_memory == "auto":
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            graph_bytes = resolve_budget(graph_budget, total, DEFAULT_BUDGET_FRACTION) if graphs else 0
            nbytes = free - graph_bytes - int(CUDA_MARGIN_FRACTION * total)
            source = (f"auto: {free / 2**30:.1f} GiB free after the weights, less {graph_bytes / 2**30:.1f} GiB "
                      f"of graph budget and {CUDA_MARGIN_FRACTION:.0%} of the device")
        else:
            nbytes = min(CPU_AUTO_BYTES, KVCache.contiguous_blocks(max_running, max_seq_len, block_size) * per_block)
            source = "auto (cpu): --max-running-seqs x --max-seq-len, at most 1 GiB"
    else:
        value = parse_memory_budget(kv_cache_memory)
        total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else 0
        if isinstance(value, float) and device.type != "cuda":
            raise ModelLoadError(f"--kv-cache-memory {kv_cache_memory}: a fraction of device memory needs a GPU; "
                                 "give bytes (e.g. 512MiB) on a CPU")
        nbytes = resolve_budget(value, total)
        source = f"--kv-cache-memory {kv_cache_memory}"
    num_blocks = max(0, nbytes // per_block)
    if tp is not None and tp.world_size > 1:
        import torch.distributed as dist

        count = torch.tensor([num_blocks], dtype=torch.long, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.group)
        num_blocks = int(count.item())
    if num_blocks < 1 + per_seq:
        raise ModelLoadError(
            f"the KV cache holds {max(0, num_blocks - 1)} blocks of {block_size} tokens ({source}; "
            f"{per_block / 2**20:.2f} MiB each), fewer than one sequence of --max-seq-len {max_seq_len} needs "
            f"({per_seq}): give --kv-cache-memory more (at least {(1 + per_seq) * per_block / 2**20:.0f} MiB), "
            "lower --max-seq-len, or lower --graph-memory-budget")
    return KVSizing(num_blocks, block_size, per_block, source)
