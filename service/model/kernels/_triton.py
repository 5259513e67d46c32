"""Triton when importable, else None: kernel modules define their Triton kernels only if it is.
Also the launch helpers the kernel modules share."""

from __future__ import annotations

import os

import torch

try:  # an optional dependency, absent on CI
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (ImportError, or a broken install that fails at import)
    triton = None
    tl = None

__all__ = ["LOG2E", "NO_FP_FUSION", "cdiv", "interpreting", "next_pow2", "pdl", "pdl_launch", "sm_count", "tl",
           "triton"]

LOG2E = 1.4426950408889634  # attention kernels scale scores by it and take the softmax in exp2

# The launch option of a kernel that repeats torch's rounding step by step (x * a + y * b with each
# product rounded to bf16 / fp16, then the sum). Triton compiles with FP fusion on by default: LLVM
# narrows the products and the sum to bf16 ops and contracts one product with the sum into a single
# fma.rn.bf16, so that product is never rounded. The result is then up to half an ulp of the product
# away from torch's, many ulps of a sum that cancels (and two or more E4M3 steps once an FP8 cache
# scales it up). Without fusion each product is its own mul.rn and the result is torch's, bit for bit.
NO_FP_FUSION = {"enable_fp_fusion": False}

_num_sms: dict[int, int] = {}
_pdl: dict[int, bool] = {}
# PDL pays at decode batch 1 (1B step 1.02 -> 0.90 ms on an H200), is neutral at 8 and 64 and costs
# at 256 (2.68 -> 2.78 ms: waiting programs of the next kernel hold SM slots): launches of more rows
# go without it.
PDL_MAX_ROWS = 64


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (cached); 8 under the CPU interpreter (any value does;
    a small one exercises the splits)."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms:
        _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms[idx]


def pdl(device: torch.device, rows: int = 1) -> bool:
    """Whether our kernels launch with programmatic dependent launch (PDL): a kernel may then start
    while the previous one finishes, and waits (griddepcontrol.wait, `pdl_wait`) before it reads what
    that one wrote. Needs Hopper or newer and a Triton that has it; GRAPHSERVE_PDL=0 turns it off
    (an operator's switch, and the benchmarks' A/B). Decided once per device; a launch of more than
    PDL_MAX_ROWS rows (tokens) goes without."""
    if device.type != "cuda" or triton is None or interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _pdl:
        from triton.language.extra import cuda as tl_cuda

        _pdl[idx] = (os.environ.get("GRAPHSERVE_PDL", "1") != "0"
                     and torch.cuda.get_device_capability(idx) >= (9, 0)
                     and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents"))
    return _pdl[idx] and rows <= PDL_MAX_ROWS


def pdl_launch(on: bool) -> dict[str, bool]:
    """The launch option of a PDL launch (none otherwise: older Triton has no launch_pdl)."""
    return {"launch_pdl": True} if on else {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch arithmetic (usable without triton, unlike triton.cdiv)."""
    return -(-a // b)


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """First thing in a kernel launched with PDL, before it reads or writes anything another kernel
        touches: wait for the previous kernel's results, then let the next kernel launch (it waits in
        turn, so it may only prefetch what no kernel writes: weights)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's rows of x and of the weight in a GEMM grid of cdiv(M, BLOCK_M) *
        cdiv(N, BLOCK_N) programs: (offs_m, offs_n, m_mask, n_mask). M varies fastest, so neighbouring
        programs share a weight tile and the second read hits L2."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_m, offs_n, offs_m < M, offs_n < N

    @triton.jit
    def online_softmax(s, v, m_i, l_i, acc):
        """One tile of flash attention's online softmax: s [M, N] float32 scores already scaled by
        LOG2E (masked ones -inf), v [N, D]; the running max m_i and sum l_i [M] and acc [M, D]
        rescaled and accumulated. A row with no visible key yet keeps m = -inf and adds nothing."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # must not give inf - inf
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def kv_quantize(x, scale, FP8_MAX: tl.constexpr):
        """A tile on its way into an FP8 KV cache: x / scale (the layer's) in float32, clamped to
        +-FP8_MAX; the store's cast to E4M3 rounds it (service/model/kv_quant.py)."""
        y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch's, so both round alike
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)

    @triton.jit
    def kv_scales(scale_ptr, FP8_KV: tl.constexpr):
        """The layer's (k scale, v scale) of an FP8 KV cache, loaded from the device; 1.0 otherwise (unread)."""
        k_scale = tl.full([], 1.0, tl.float32)
        v_scale = tl.full([], 1.0, tl.float32)
        if FP8_KV:
            k_scale = tl.load(scale_ptr)
            v_scale = tl.load(scale_ptr + 1)
        return k_scale, v_scale
