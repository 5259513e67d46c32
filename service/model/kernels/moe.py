"""Mixture-of-experts MLP: top-k routing, then each token through its experts, weighted and summed.

Weights are stacked per layer: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I], in the model's dtype or FP8 E4M3 (`ExpertWeights`: one scale per output channel
[E, N], or one per block of `block` = (rows, columns) [E, N / rows, K / columns]).

Every shape here is a function of (tokens T, experts E, top_k) only, never of which experts a batch
picks, so both paths run inside CUDA graphs (FULL and PIECEWISE) and one capture serves any routing:

- torch (the CPU path, and the GPU's when a kernel of ours fails its check): `moe_torch` computes
  every expert on every token in fixed groups of experts (dense over experts) and weighs each
  result by the token's routing weight for that expert, 0 where it did not pick it. E / top_k times
  the work of the fused path; no data-dependent control flow.
- Triton (`moe_triton`): the token-expert pairs sorted by expert into a buffer padded to a static
  worst case (`align_triton`, one program: each expert's pairs start on a BLOCK_M boundary, so a
  block of BLOCK_M sorted pairs belongs to one expert; at most P + min(E, P) * (BLOCK_M - 1) slots
  for P = T * top_k pairs), then two grouped GEMMs over the blocks (`_moe_gemm_kernel`): gate-up
  with the activation fused (act(gate) * up written per pair), down with the routing weight
  applied; a block past the used ones exits at once. The top_k results of a token are summed last.
  The routing itself (softmax, top-k, renormalisation) is one kernel per token (`route_triton`).

`align_torch` is the same sort in torch ops: the reference the align kernel is tested against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from service.model.kernels._triton import cdiv, next_pow2, tl, triton

if triton is not None:
    from service.model.kernels.activation import activate

EXPERT_GROUP = 8  # experts per dense product of the torch path: bounds its [group, T, 2I] buffer


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's experts: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; FP8 ones with
    their float32 scales, per output channel ([E, 2I], [E, H]) or per `block` ([E, 2I / bn, H / bk])."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None  # (rows, columns) of a scale's block; None: per channel

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


# ---- the torch path -----------------------------------------------------------------------------


def route_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (float32 weights [T, top_k], expert ids [T, top_k] int64): the softmax
    over all experts in float32, its top_k, renormalised to sum 1 (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """Stacked expert weights [e, N, K] (FP8 with its scales, or as they are) -> dtype."""
    if scale is None:
        return w.to(dtype)
    if block is None:
        return (w.float() * scale.float()[:, :, None]).to(dtype)
    bn, bk = block
    s = scale.float().repeat_interleave(bn, dim=1)[:, : w.shape[1]].repeat_interleave(bk, dim=2)[:, :, : w.shape[2]]
    return (w.float() * s).to(dtype)


def moe_torch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
              act: str = "silu") -> torch.Tensor:
    """x [T, H], routing weights [T, k] float32 and ids [T, k] -> [T, H] in x's dtype: sum over the
    token's experts e of weight * down_e(act(gate_e(x)) * up_e(x)). Dense over experts, in groups of
    EXPERT_GROUP, with static shapes (see the module docstring)."""
    from service.model.kernels.activation import act_mul_torch

    num_experts = experts.num_experts
    t = x.shape[0]
    # [T, E] routing weight of every expert, 0 for the ones a token did not pick
    dense = torch.zeros(t, num_experts, dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for first in range(0, num_experts, EXPERT_GROUP):
        group = slice(first, min(first + EXPERT_GROUP, num_experts))
        w13 = dequantize_experts(experts.w13[group], _part(experts.w13_scale, group), experts.block, x.dtype)
        w2 = dequantize_experts(experts.w2[group], _part(experts.w2_scale, group), experts.block, x.dtype)
        gate_up = torch.matmul(x[None], w13.transpose(1, 2))  # [g, T, 2I]
        h = act_mul_torch(gate_up, act)  # [g, T, I]
        y = torch.matmul(h, w2.transpose(1, 2))  # [g, T, H]
        out += (y.float() * dense[:, group].T[:, :, None]).sum(0)
    return out.to(x.dtype)


def _part(scale: torch.Tensor | None, group: slice) -> torch.Tensor | None:
    return None if scale is None else scale[group]


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The sorted buffer's static size for num_pairs token-expert pairs: each of at most
    min(E, pairs) used experts pads its pairs to a multiple of block_m."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_torch(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (sorted [S] int32: pair indices t * k + j grouped by expert, each expert's
    group starting at a multiple of block_m, ascending within it; block_expert [S / block_m] int32:
    each block's expert, -1 past the used blocks; block_rows [S / block_m] int32: the block's real
    pairs, 0 past them). Entries of `sorted` past a block's real pairs are left 0. S = padded_pairs."""
    flat = ids.reshape(-1)
    p = flat.shape[0]
    size = padded_pairs(p, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(p, device=ids.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    sorted_ids = torch.zeros(size, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, starts[by_expert] + rank, order.to(torch.int32))
    block_pos = torch.arange(size // block_m, device=ids.device) * block_m
    expert = torch.searchsorted(ends, block_pos, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    rows = (counts[e] - (block_pos - starts[e])).clamp(0, block_m)
    return (sorted_ids, torch.where(used, expert, -1).to(torch.int32),
            torch.where(used, rows, 0).to(torch.int32))


# ---- the Triton path ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int  # sorted pairs a block (one expert's)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Shared memory a grouped GEMM's pipeline may take (an H100 / H200 block has 227 KiB; the epilogue's
# layout conversions take the rest). A bf16 gate-up GEMM at 64 x 128 x 128 in 4 stages needs 320 KiB
# and fails to launch ("out of resources"); FP8 weights (1 byte) fit the same tiles.
PIPELINE_SMEM_BYTES = 192 * 1024


def pipeline_smem(c: MoeGemmConfig, a_bytes: int, w_bytes: int, gated: bool) -> int:
    """Bytes of shared memory the software pipeline holds: num_stages copies of the a tile and of
    the one (down) or two (gate and up) weight tiles."""
    weight_tiles = 2 if gated else 1
    return c.num_stages * (c.block_m * c.block_k * a_bytes + weight_tiles * c.block_n * c.block_k * w_bytes)


def moe_config(num_tokens: int, n: int, k: int, block: tuple[int, int] | None = None, a_bytes: int = 2,
               w_bytes: int = 2, gated: bool = False) -> MoeGemmConfig:
    """A tile configuration for a grouped GEMM of num_tokens tokens' pairs against [E, n, k] experts.
    Small token counts (decode) are bandwidth-bound: the fewest rows a tile (16, tl.dot's least) and
    narrow weight tiles so every expert's weight spreads over many programs; prompt-sized ones take
    64-row tiles. A per-block FP8 weight needs block_k to divide the scale's block columns. Tiles
    whose pipeline would pass PIPELINE_SMEM_BYTES take a shorter block_k (down to 32), then fewer
    stages (down to 2). Unswept: the H200 session's bench/moe_bench.py sweeps it (bench/NOTES.md)."""
    block_m = 16 if num_tokens <= 64 else 64
    block_n = 64 if num_tokens <= 64 else 128
    block_k = 128 if k % 128 == 0 else 64
    if block is not None:
        block_k = min(block_k, block[1])
    c = MoeGemmConfig(block_m, block_n, block_k, 4, 3 if block_m == 16 else 4)
    while pipeline_smem(c, a_bytes, w_bytes, gated) > PIPELINE_SMEM_BYTES and c.block_k > 32:
        c = dataclasses.replace(c, block_k=c.block_k // 2)  # halving keeps dividing a scale block's columns
    while pipeline_smem(c, a_bytes, w_bytes, gated) > PIPELINE_SMEM_BYTES and c.num_stages > 2:
        c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As route_torch (ids int32): one program per token."""
    t, e = logits.shape
    assert logits.stride(1) == 1
    weights = torch.empty((t, top_k), device=logits.device, dtype=torch.float32)
    ids = torch.empty((t, top_k), device=logits.device, dtype=torch.int32)
    _route_kernel[(t,)](logits, weights, ids, logits.stride(0), E=e, TOP_K=top_k, RENORM=renormalize,
                        BLOCK_E=max(16, next_pow2(e)), BLOCK_K=max(2, next_pow2(top_k)), num_warps=1)
    return weights, ids


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As align_torch, in one program (the counts, the blocks' experts, then the pairs' places)."""
    flat = ids.reshape(-1)
    p = flat.shape[0]
    size = padded_pairs(p, num_experts, block_m)
    sorted_ids = torch.zeros(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    block_rows = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    block_e = max(16, next_pow2(num_experts))
    _align_kernel[(1,)](flat, sorted_ids, block_expert, block_rows, p, size // block_m, E=num_experts,
                        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=max(16, min(128, 8192 // block_e)),
                        BLOCK_B=64, num_warps=4)
    return sorted_ids, block_expert, block_rows


def moe_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
               act: str = "silu", config: MoeGemmConfig | None = None) -> torch.Tensor:
    """As moe_torch: the sorted pairs through the two grouped GEMMs, their results summed per token."""
    assert x.dim() == 2 and x.stride(1) == 1
    t, hidden = x.shape
    top_k = ids.shape[1]
    w13, w2 = experts.w13, experts.w2
    inter = w2.shape[2]
    assert w13.shape[1] == 2 * inter and w13.shape[2] == hidden and w2.shape[1] == hidden
    a_bytes, w_bytes = x.element_size(), w13.element_size()
    c = config or moe_config(t, inter, hidden, experts.block, a_bytes, w_bytes, gated=True)
    sorted_ids, block_expert, block_rows = align_triton(ids, experts.num_experts, c.block_m)
    blocks = block_expert.shape[0]
    h = torch.empty((t * top_k, inter), device=x.device, dtype=x.dtype)
    _grouped_gemm(x, w13, experts.w13_scale, experts.block, h, sorted_ids, block_expert, block_rows, weights,
                  top_k, blocks, c, per_token=True, gated=True, gelu=act == "gelu_tanh")
    y = torch.empty((t * top_k, hidden), device=x.device, dtype=x.dtype)
    c2 = config or moe_config(t, hidden, inter, experts.block, a_bytes, w2.element_size())
    if c2.block_m != c.block_m:  # the same sort serves both GEMMs
        c2 = dataclasses.replace(c2, block_m=c.block_m)
    _grouped_gemm(h, w2, experts.w2_scale, experts.block, y, sorted_ids, block_expert, block_rows, weights,
                  top_k, blocks, c2, per_token=False, gated=False, gelu=False)
    return y.view(t, top_k, hidden).sum(dim=1)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                  out: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, block_rows: torch.Tensor,
                  weights: torch.Tensor, top_k: int, blocks: int, c: MoeGemmConfig, per_token: bool, gated: bool,
                  gelu: bool) -> None:
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    assert w.stride(2) == 1 and out.stride(1) == 1 and a.stride(1) == 1
    fp8 = scale is not None
    if fp8 and block is not None:
        assert block[1] % c.block_k == 0 and (not gated or n % block[0] == 0), (block, c, n)
    _moe_gemm_kernel[(blocks, cdiv(n, c.block_n))](
        a, w, scale if fp8 else w, out, sorted_ids, block_expert, block_rows, weights,
        n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0,
        scale.stride(2) if fp8 and block is not None else 0,
        TOP_K=top_k, PER_TOKEN=per_token, GATED=gated, GELU=gelu, ROUTED=not gated, W_FP8=fp8,
        SCALE_BN=block[0] if fp8 and block is not None else 0, SCALE_BK=block[1] if fp8 and block is not None else 0,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages,
    )


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, w_ptr, ids_ptr, stride_l, E: tl.constexpr, TOP_K: tl.constexpr,
                      RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        mask = offs < E
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(mask, p / tl.sum(p, 0), -1.0)  # the softmax; -1 below every probability off the end
        offs_k = tl.arange(0, BLOCK_K)
        vals = tl.zeros([BLOCK_K], dtype=tl.float32)
        idx = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOP_K):  # the largest left, TOP_K times
            best = tl.max(p, 0)
            at = tl.min(tl.where(p == best, offs, BLOCK_E), 0)  # the first of equal ones
            vals = tl.where(offs_k == j, best, vals)
            idx = tl.where(offs_k == j, at, idx)
            p = tl.where(offs == at, -1.0, p)
        if RENORM:
            vals = vals / tl.sum(tl.where(offs_k < TOP_K, vals, 0.0), 0)
        tl.store(w_ptr + row * TOP_K + offs_k, vals, mask=offs_k < TOP_K)
        tl.store(ids_ptr + row * TOP_K + offs_k, idx, mask=offs_k < TOP_K)

    @triton.jit
    def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, P, NUM_BLOCKS, E: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
        offs_e = tl.arange(0, BLOCK_E)
        # 1. pairs per expert
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
            counts += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        # 2. each block's expert (the experts ending at or before it are before it) and real pairs
        for b0 in range(0, NUM_BLOCKS, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            pos = offs_b * BLOCK_M
            expert = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), 1)
            pick = offs_e[None, :] == expert[:, None]
            count = tl.sum(tl.where(pick, counts[None, :], 0), 1)
            start = tl.sum(tl.where(pick, starts[None, :], 0), 1)
            used = expert < E
            rows = tl.minimum(tl.maximum(count - (pos - start), 0), BLOCK_M)
            tl.store(block_expert_ptr + offs_b, tl.where(used, expert, -1), mask=offs_b < NUM_BLOCKS)
            tl.store(block_rows_ptr + offs_b, tl.where(used, rows, 0), mask=offs_b < NUM_BLOCKS)
        # 3. each pair's place: its expert's start, plus the pairs of that expert before it
        seen = tl.zeros([BLOCK_E], dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
            onehot = (e[:, None] == offs_e[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
            before = tl.cumsum(onehot, 0) - onehot  # pairs of the same expert earlier in this chunk
            place = tl.sum(onehot * (before + (starts + seen)[None, :]), 1)
            tl.store(sorted_ptr + place, offs.to(tl.int32), mask=offs < P)
            seen += tl.sum(onehot, 0)

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, topk_w_ptr,
        N, K, stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk,
        TOP_K: tl.constexpr, PER_TOKEN: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr, ROUTED: tl.constexpr,
        W_FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One block of BLOCK_M sorted pairs (one expert's) times BLOCK_N of that expert's output rows.
        PER_TOKEN: a's rows are tokens (pair // TOP_K), else pairs. GATED: w holds N gate rows, then N
        up rows, and the output is act(gate) * up; ROUTED: the output times the pair's routing weight.
        W_FP8: an E4M3 weight, scaled per output channel, or per (SCALE_BN, SCALE_BK) block."""
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:  # past the used blocks: nothing to do
            return
        rows = tl.load(block_rows_ptr + pid_m)
        offs_r = tl.arange(0, BLOCK_M)
        r_mask = offs_r < rows
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_r, mask=r_mask, other=0).to(tl.int64)
        a_row = pair
        if PER_TOKEN:
            a_row = pair // TOP_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        u_ptrs = g_ptrs + N * stride_wn
        s_base = ws_ptr + expert.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(a.dtype)
            if SCALE_BK > 0:  # per-block FP8 scales vary along K: scale each BLOCK_K's product
                sg = tl.load(s_base + (offs_n // SCALE_BN) * stride_sn + (k0 // SCALE_BK) * stride_sk,
                             mask=n_mask, other=0.0)
                acc += tl.dot(a, tl.trans(wg)) * sg[None, :]
            else:
                acc = tl.dot(a, tl.trans(wg), acc)
            if GATED:
                wu = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(a.dtype)
                if SCALE_BK > 0:
                    su = tl.load(s_base + ((offs_n + N) // SCALE_BN) * stride_sn + (k0 // SCALE_BK) * stride_sk,
                                 mask=n_mask, other=0.0)
                    acc_u += tl.dot(a, tl.trans(wu)) * su[None, :]
                else:
                    acc_u = tl.dot(a, tl.trans(wu), acc_u)
                u_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        if W_FP8 and SCALE_BK == 0:  # per output channel
            acc = acc * tl.load(s_base + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
            if GATED:
                acc_u = acc_u * tl.load(s_base + (offs_n + N) * stride_sn, mask=n_mask, other=0.0)[None, :]
        dt = out_ptr.dtype.element_ty
        if GATED:  # rounded as torch: the projections, act(gate), then the product
            g = activate(acc.to(dt).to(tl.float32), GELU).to(dt)
            y = (g.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)
        else:
            if ROUTED:
                acc = acc * tl.load(topk_w_ptr + pair, mask=r_mask, other=0.0)[:, None]
            y = acc.to(dt)
        tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], y, mask=r_mask[:, None] & n_mask[None, :])


def route(logits: torch.Tensor, top_k: int, renormalize: bool, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return route_triton(logits, top_k, renormalize) if fast else route_torch(logits, top_k, renormalize)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, experts: ExpertWeights, top_k: int, renormalize: bool,
              act: str, fast: bool) -> torch.Tensor:
    """x [T, H], router logits [T, E] -> the MoE MLP's output [T, H]: Triton where `fast`, else torch."""
    weights, ids = route(logits, top_k, renormalize, fast)
    if fast:
        return moe_triton(x, weights, ids, experts, act)
    return moe_torch(x, weights, ids.long(), experts, act)

