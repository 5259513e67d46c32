"""Which fused Triton kernels the model uses: decided once at construction, by a self-check."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields

import structlog
import torch

from service.model.fp8 import FP8
from service.model.kernels import _triton
from service.model.kernels.compile_cache import CompileCache, environment_key
from service.model.kv_quant import load_kv, store_kv
from service.model.spec import ModelSpec

log = structlog.get_logger("graphserve.model")

FAST_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FastPath:
    """Flags per fused kernel; all False is the torch path (CPU, float32, no Triton, or a failed check)."""

    attention: bool = False  # decode rows
    prefill_attention: bool = False  # prompt chunks
    norm: bool = False
    rope_kv: bool = False
    silu_mul: bool = False
    gemv: bool = False  # one-row linear layers (a batch-1 decode step) through kernels.gemv
    moe: bool = False  # a mixture-of-experts model's routing, sort and grouped GEMMs (kernels.moe)

    @classmethod
    def build(
        cls, device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
        head_dim: int, hidden_size: int, intermediate_size: int, kv_dtype: torch.dtype | None = None,
        spec: ModelSpec | None = None, cache: CompileCache | None = None,
    ) -> FastPath:
        """Self-checks each Triton kernel on small random inputs of the model's head shape; the ones
        that read or write the KV cache on a cache of `kv_dtype` (None: the model's dtype). `spec`
        (None: a Llama) says which variants the family runs: Gemma's norms and GELU, the q/k head
        norm, sliding windows and the score scale, the MoE kernels for its experts and top-k.
        With a `cache`, the results of an earlier start with the same device, versions and shape
        are reused and no check runs; new results are stored there."""
        device = torch.device(device)
        args = (device, dtype, num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size, kv_dtype, spec)
        if cache is None:
            return cls._self_check(*args)
        key = {**environment_key(device), "dtype": str(dtype), "kv_dtype": str(kv_dtype), "num_heads": num_heads,
               "num_kv_heads": num_kv_heads, "head_dim": head_dim, "hidden_size": hidden_size,
               "intermediate_size": intermediate_size, "spec": None if spec is None else repr(spec)}
        cached = cache.lookup("fast_path", key)
        if cached is not None and set(cached) == {f.name for f in fields(cls)}:
            fast = cls(**cached)
            log.info("fast_path", **cached, source="compile_cache")
            return fast
        fast = cls._self_check(*args)
        cache.store("fast_path", key, asdict(fast))
        return fast

    @classmethod
    def _self_check(
        cls, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
        hidden_size: int, intermediate_size: int, kv_dtype: torch.dtype | None, spec: ModelSpec | None,
    ) -> FastPath:
        if device.type != "cuda":
            return cls()
        if dtype not in FAST_DTYPES:
            log.info("fast_path_disabled", reason=f"dtype {dtype} (Triton kernels are for fp16/bf16)")
            return cls()
        if _triton.triton is None:
            log.warning("fast_path_disabled", reason="triton is not importable")
            return cls()
        shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "kv_dtype": kv_dtype}
        gemma = spec is not None and spec.gemma_norms
        act = spec.hidden_act if spec is not None else "silu"
        qk_norm = spec is not None and spec.qk_norm
        scale = spec.query_scale if spec is not None else None
        # a window shorter than the checks' contexts: the kernels' windowed code on every path
        window = 37 if spec is not None and spec.layer_windows else 0
        checks = {
            "attention": lambda: [check_attention(device, dtype, **shape, window=w, scale=scale)
                                  for w in sorted({0, window})],
            "prefill_attention": lambda: [check_prefill_attention(device, dtype, **shape, window=w, scale=scale)
                                          for w in sorted({0, window})],
            "norm": lambda: check_norm(device, dtype, hidden_size, gemma=gemma),
            "rope_kv": lambda: check_rope_kv(device, dtype, **shape, qk_norm=qk_norm, gemma=gemma),
            "silu_mul": lambda: check_silu_mul(device, dtype, intermediate_size, act=act),
            "gemv": lambda: check_gemv(device, dtype, hidden_size, intermediate_size),
        }
        if spec is not None and spec.is_moe:
            checks["moe"] = lambda: check_moe(device, dtype, spec.num_experts, spec.num_experts_per_tok,
                                              spec.norm_topk_prob, act)
        flags = {}
        for name, check in checks.items():
            try:
                with torch.cuda.device(device), torch.inference_mode():
                    check()
                flags[name] = True
            except Exception as e:  # noqa: BLE001  (the fast path must never take the service down)
                log.warning("fast_path_disabled", kernel=name, reason=f"{type(e).__name__}: {e}"[:500])
                flags[name] = False
        fast = cls(**flags)
        log.info("fast_path", **flags, pdl=_triton.pdl(device))
        return fast


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str, atol: float, rtol: float) -> None:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        raise AssertionError(f"{what}: got {ours.dtype}{tuple(ours.shape)}, want {ref.dtype}{tuple(ref.shape)}")
    if not torch.allclose(ours.float(), ref.float(), atol=atol, rtol=rtol):
        diff = (ours.float() - ref.float()).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3g} over atol {atol} rtol {rtol}")


def check_scales(kv_dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """The (k, v) scales the checks read a cache of kv_dtype with: an FP8 cache's are not 1 (a kernel
    that dropped one would fail its check) and put randn values well inside E4M3's range."""
    return torch.tensor([2.0**-5, 3 * 2.0**-6] if kv_dtype == FP8 else [1.0, 1.0], device=device)


def kv_cache_of(k: torch.Tensor, v: torch.Tensor, kv_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v as a cache of kv_dtype (None: their own) stores them, the scales it is read with)."""
    scale = check_scales(kv_dtype, k.device)
    return *store_kv(k, v, scale, kv_dtype or k.dtype), scale


def _float_kv(k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache as float32 values (the references' input): an FP8 cache's dequantized."""
    k, v = load_kv(k, v, scale, torch.float32)
    return k.float(), v.float()


def check_attention(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    batch: int = 3, max_seq_len: int = 200, num_splits: int | None = None, seed: int = 0,
    split_len: int | None = None, block_size: int = 16, kv_dtype: torch.dtype | None = None,
    window: int = 0, scale: float | None = None,
) -> None:
    """The Triton decode kernel against the torch one over a paged cache whose rows hold blocks in a
    shuffled order (and rows sharing a prefix block, as prefix caching makes them), the cache of
    kv_dtype (None: the model's); with a sliding window and a score scale when given."""
    from service.model.kernels.decode_attention import decode_attention_torch, decode_attention_triton

    gen = torch.Generator(device).manual_seed(seed)
    slots = 4
    per_seq = -(-max_seq_len // block_size)
    num_blocks = 1 + slots * per_seq
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(k.shape, device=device, dtype=dtype, generator=gen)
    k, v, kv_scale = kv_cache_of(k, v, kv_dtype)
    table = (1 + torch.randperm(num_blocks - 1, device=device, generator=gen)).view(slots, per_seq)
    table[1, 0] = table[0, 0]  # a shared first block
    table = torch.cat([table, torch.zeros(1, per_seq, dtype=table.dtype, device=device)]).to(torch.int32)
    slot_ids = torch.randint(0, slots + 1, (batch,), device=device, generator=gen)
    positions = torch.randint(0, max_seq_len, (batch,), device=device, generator=gen)
    positions[0] = 0  # a padding-like row of length 1
    positions[-1] = max_seq_len - 1  # a full row
    kw = {"window": window, "scale": scale}
    ref = decode_attention_torch(q.float(), *_float_kv(k, v, kv_scale), table, slot_ids, positions, **kw).to(dtype)
    ours = decode_attention_triton(q, k, v, table, slot_ids, positions, kv_scale, num_splits=num_splits,
                                   split_len=split_len, **kw)
    _close(ours, ref, "decode_attention", atol=2e-2, rtol=2e-2)
    if split_len is not None:  # a fixed split: each row alone is bit-identical to the same row in the batch
        for row in range(batch):
            alone = decode_attention_triton(q[row: row + 1], k, v, table, slot_ids[row: row + 1],
                                            positions[row: row + 1], kv_scale, split_len=split_len, **kw)
            if not torch.equal(alone, ours[row: row + 1]):
                raise AssertionError(f"decode_attention row {row} alone differs from the same row in a batch")


def check_prefill_attention(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    chunks: tuple[tuple[int, int], ...] = ((0, 1), (0, 70), (37, 5), (16, 64), (130, 66)), seed: int = 0,
    block_size: int = 16, max_seq_len: int = 208, kv_dtype: torch.dtype | None = None,
    window: int = 0, scale: float | None = None,
) -> None:
    """The Triton chunk kernel against the torch one: chunks (start, length) that start a prompt or
    continue one, over more than one query tile and across block boundaries, each on its own slot
    whose blocks lie shuffled over the pool (two slots sharing a prefix block, as prefix caching
    makes them), rows of the step that are not chunks' left untouched; the cache of kv_dtype."""
    from service.model.kernels.prefill_attention import chunk_tiles, prefill_attention_torch, prefill_attention_triton

    gen = torch.Generator(device).manual_seed(seed)
    per_seq = -(-max_seq_len // block_size)
    slots = len(chunks)
    num_blocks = 1 + slots * per_seq
    k = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(k.shape, device=device, dtype=dtype, generator=gen)
    k, v, kv_scale = kv_cache_of(k, v, kv_dtype)
    table = (1 + torch.randperm(num_blocks - 1, device=device, generator=gen)).view(slots, per_seq)
    if slots > 1:
        table[1, 0] = table[0, 0]
    table = torch.cat([table, torch.zeros(1, per_seq, dtype=table.dtype, device=device)]).to(torch.int32)
    decodes = 3  # rows before the chunks, as a step's decode rows are
    rows = list(itertools.accumulate((n for _, n in chunks), initial=decodes))
    spec = [(row, n, start, slot) for slot, (row, (start, n)) in enumerate(zip(rows, chunks))]
    q = torch.randn(rows[-1] + 2, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    ref = torch.full((q.shape[0], num_heads * head_dim), 7.0, device=device)
    prefill_attention_torch(q.float(), *_float_kv(k, v, kv_scale), table, spec, ref, window=window, scale=scale)
    ours = torch.full(ref.shape, 7.0, device=device, dtype=dtype)
    chunk_table = torch.tensor([x for c in spec for x in c], device=device).view(-1, 4)
    tiles = torch.tensor(chunk_tiles([n for _, n in chunks]), device=device).view(-1, 2)
    prefill_attention_triton(q, k, v, table, chunk_table, tiles, ours, kv_scale, window=window, scale=scale)
    _close(ours, ref.to(dtype), "prefill_attention", atol=2e-2, rtol=2e-2)


def check_norm(device: torch.device, dtype: torch.dtype, hidden: int, rows: int = 3, seed: int = 0,
               gemma: bool = False) -> None:
    from service.model.kernels.norm import add_rmsnorm_torch, add_rmsnorm_triton

    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen)
    d = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen)
    w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype, generator=gen)
    for delta in (None, d):
        res_ref, h_ref = add_rmsnorm_torch(x, delta, w, 1e-5, gemma)
        res, h = add_rmsnorm_triton(x, delta, w, 1e-5, gemma)
        _close(res, res_ref, "residual add", atol=0, rtol=0)
        _close(h, h_ref, "rmsnorm", atol=1e-2, rtol=1e-2)


def rope_kv_inputs(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    batch: int = 3, max_seq_len: int = 16, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """check_rope_kv's inputs: (qkv, cos, sin, slot_ids, positions, the caches' shape)."""
    gen = torch.Generator(device).manual_seed(seed)
    slots = max(4, batch)  # distinct slots: two rows writing one (slot, position) would race
    qkv = torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype, generator=gen)
    slot_ids = torch.randperm(slots + 1, device=device, generator=gen)[:batch]  # may include the scratch slot
    positions = torch.randint(0, max_seq_len, (batch,), device=device, generator=gen)
    angles = positions[:, None].float() * (1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return qkv, cos, sin, slot_ids, positions, (slots + 1, num_kv_heads, max_seq_len, head_dim)


def check_rope_kv(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    batch: int = 3, max_seq_len: int = 16, seed: int = 0, kv_dtype: torch.dtype | None = None,
    qk_norm: bool = False, gemma: bool = False,
) -> None:
    """The fused RoPE and KV write against torch's, into caches of kv_dtype (None: the model's): an
    FP8 cache's entries within one E4M3 step of torch's (compiled without FP fusion the kernel is
    torch's bit for bit on the H200; the step is the margin). With `qk_norm` each q and k head is
    normalised first (Gemma's norm with `gemma`)."""
    from service.model.kernels.rope import QkNorm, rope_kv_write_torch, rope_kv_write_triton

    qkv, cos, sin, slot_ids, positions, shape = rope_kv_inputs(device, dtype, num_heads, num_kv_heads, head_dim,
                                                               batch, max_seq_len, seed)
    caches = [torch.zeros(shape, device=device, dtype=kv_dtype or dtype) for _ in range(4)]
    scale = check_scales(kv_dtype, device)
    norm = None
    if qk_norm:
        weight = 1 + 0.1 * torch.randn(2, head_dim, device=device, generator=torch.Generator(device).manual_seed(seed))
        norm = QkNorm(weight.to(dtype), 1e-6, gemma)
    q_ref = rope_kv_write_torch(qkv, cos, sin, caches[0], caches[1], slot_ids, positions, num_heads, num_kv_heads,
                                scale, norm)
    q = rope_kv_write_triton(qkv, cos, sin, caches[2], caches[3], slot_ids, positions, num_heads, num_kv_heads, scale,
                             norm)
    _close(q, q_ref, "rope q", atol=1e-2, rtol=1e-2)
    fp8_kv = kv_dtype == FP8  # one E4M3 step: 2^-3 of a normal value, 2^-9 for a subnormal one
    _close(caches[2], caches[0], "rope k cache", atol=2.0**-9 if fp8_kv else 1e-2, rtol=2.0**-3 if fp8_kv else 1e-2)
    _close(caches[3], caches[1], "v cache", atol=2.0**-9 if fp8_kv else 0, rtol=2.0**-3 if fp8_kv else 0)


def check_silu_mul(device: torch.device, dtype: torch.dtype, intermediate: int, rows: int = 3, seed: int = 0,
                   act: str = "silu") -> None:
    from service.model.kernels.activation import act_mul_torch, act_mul_triton

    gen = torch.Generator(device).manual_seed(seed)
    gu = torch.randn(rows, 2 * intermediate, device=device, dtype=dtype, generator=gen)
    _close(act_mul_triton(gu, act), act_mul_torch(gu, act), f"{act}_mul", atol=1e-2, rtol=1e-2)


def check_moe(
    device: torch.device, dtype: torch.dtype, num_experts: int, top_k: int, renormalize: bool, act: str = "silu",
    hidden: int = 128, intermediate: int = 128, token_counts: tuple[int, ...] = (1, 5, 70), seed: int = 0,
    fp8: bool = False, block: tuple[int, int] | None = None,
) -> None:
    """The MoE kernels (routing, the padded sort, both grouped GEMMs) against the torch path, with the
    model's expert count and top-k on small expert widths, at token counts of both tile sizes: the
    same experts picked, their weights within float32 rounding, the output within bf16's. `fp8`: the
    experts in E4M3, one scale per channel, or per `block`."""
    from service.model import fp8 as fp8_weights
    from service.model.kernels import moe

    gen = torch.Generator(device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=device, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, device=device, generator=gen) / intermediate**0.5
    if fp8:
        (q13, s13), (q2, s2) = (fp8_weights.quantize_experts(w, block) for w in (w13, w2))
        experts = moe.ExpertWeights(q13, q2, s13, s2, block)
    else:
        experts = moe.ExpertWeights(w13.to(dtype), w2.to(dtype))
    reference = moe.ExpertWeights(*(moe.dequantize_experts(w, s, experts.block, torch.float32) for w, s in (
        (experts.w13, experts.w13_scale), (experts.w2, experts.w2_scale))))
    for t in token_counts:
        logits = torch.randn(t, num_experts, device=device, generator=gen).to(dtype)
        x = torch.randn(t, hidden, device=device, generator=gen).to(dtype)
        w_ref, ids_ref = moe.route_torch(logits, top_k, renormalize)
        w, ids = moe.route_triton(logits, top_k, renormalize)
        # the same experts with the same weights, in any order; a row whose k-th and next probability
        # tie (within rounding) may pick either
        probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        tie = (probs[:, top_k - 1] - probs[:, min(top_k, num_experts - 1)]) < 1e-6 if top_k < num_experts else \
            torch.zeros(t, dtype=torch.bool, device=device)
        (ids_a, order_a), (ids_b, order_b) = ids.long().sort(-1), ids_ref.sort(-1)
        if not torch.equal(ids_a[~tie], ids_b[~tie]):
            raise AssertionError(f"moe routing of {t} tokens picked other experts than torch's")
        _close(w.gather(1, order_a)[~tie], w_ref.gather(1, order_b)[~tie], "moe routing weights", atol=1e-6,
               rtol=1e-5)
        ref = moe.moe_torch(x.float(), w_ref, ids_ref, reference, act).to(dtype)
        _close(moe.moe_triton(x, w_ref, ids_ref.to(torch.int32), experts, act), ref, f"moe of {t} tokens",
               atol=3e-2, rtol=3e-2)


def check_gemv(
    device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, head: bool = True, seed: int = 0
) -> None:
    """The one-row GEMV against a float32 GEMM on the model's projection shapes (K = hidden and
    K = intermediate, N not a multiple of its block), with and without a bias, and on a head-sized
    weight (its own configuration); more rows go to F.linear."""
    from service.model.kernels.gemv import HEAD_ROWS, gemv_triton, linear

    gen = torch.Generator(device).manual_seed(seed)
    shapes = [(3 * 7 + 1, hidden, True), (hidden, intermediate, False)] + [(HEAD_ROWS + 3, 64, False)] * head
    for n, k, bias in shapes:
        w = (torch.randn(n, k, device=device, dtype=torch.float32, generator=gen) / k**0.5).to(dtype)
        b = torch.randn(n, device=device, dtype=dtype, generator=gen) if bias else None
        x = torch.randn(2, k, device=device, dtype=dtype, generator=gen)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
        _close(gemv_triton(x[1:], w, b), ref[1:], f"gemv [{n}, {k}]", atol=2e-2, rtol=2e-2)
        _close(linear(x, w, b), torch.nn.functional.linear(x, w, b), f"linear of 2 rows [{n}, {k}]", atol=0, rtol=0)


def check_matmul(
    device: torch.device, dtype: torch.dtype, n: int, k: int, bias: bool = False, rows: int = 70, seed: int = 0
) -> None:
    """The batch-invariant matmul with the tile configuration of a weight [n, k] (on a weight of at
    most a few tiles' rows): close to torch, and every row bit-identical whatever the call's M."""
    from service.model.kernels._triton import sm_count
    from service.model.kernels.matmul import matmul_config, matmul_triton

    config = matmul_config(n, k, sm_count(device))
    # A few tiles' rows, the last one as full as the real weight's (same N % 16 for Triton's specialisation)
    bn = config.block_n
    n_rows = n if n <= 4 * bn else 2 * bn + (n % bn or bn)
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
    w = (torch.randn(n_rows, k, device=device, dtype=torch.float32, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n_rows, device=device, dtype=dtype, generator=gen) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    ours = matmul_triton(x, w, b, config)
    _close(ours, ref, "matmul", atol=2e-2, rtol=2e-2)
    for first, count in ((rows - 1, 1), (5, 3), (0, min(rows, 64))):  # other M, other tile positions
        part = matmul_triton(x[first: first + count], w, b, config)
        if not torch.equal(part, ours[first: first + count]):
            raise AssertionError(f"matmul rows [{first}, {first + count}) alone differ from the same rows "
                                 f"in a call of {rows}: not batch-invariant")
