"""Where the Triton RoPE + KV write into an FP8 (E4M3) cache differs from torch's, entry by entry.

Builds exactly the inputs of the start-up self-check (service.model.kernels.fast_path.check_rope_kv,
via rope_kv_inputs: bf16, batch 64, max_seq_len 64, k scale 2^-5, v scale 3 * 2^-6) for each head
shape of tests/gpu (or --heads), and runs the kernel (rope._rope_kv_kernel) two ways:

- served: launched as rope_kv_write_triton launches it, without FP fusion (NO_FP_FUSION);
- fused: with Triton's default FP fusion, as it was launched before: LLVM contracts one bf16 product
  of the rotation with the sum into a fused multiply-add, so that product is never rounded.

Each run writes an FP8 cache, and the same kernel with float32 caches (FP8_KV on, the same code up to
the store) gives the float32 value it casts (x / scale, clamped). Torch's side is rope_kv_write_torch
and x.float() / scale. Per run and cache (k, v): how many entries differ from torch's, how many are
outside the self-check's tolerance (atol 2^-9, rtol 2^-3), the largest difference, how many of the
values cast (x / scale) differ, and how many entries differ only in the cast (torch's cast of
Triton's float32 is not Triton's E4M3). Then the first --show differing entries (slot, head, pos,
dim) with both E4M3 values and both float32 values before the cast.

Then the cast alone: a Triton kernel that only casts float32 to float8e4nv, against torch's
.to(torch.float8_e4m3fn), on every E4M3 value in [-448, 448], every halfway point between neighbours,
one float32 ulp either side of each halfway point, and random values.

    python bench/fp8_kv_write_diag.py                 # an H200: ~20 s, all four head shapes
    python bench/fp8_kv_write_diag.py --heads 32x8x64 --show 40

Without CUDA (or Triton) it says so and exits 0: the interpreter's float8 cast (TRITON_INTERPRET=1)
is not the GPU's (it rounds halves up and loses the carry into the exponent), so it cannot stand in.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result  # noqa: E402
from service.model.fp8 import FP8, FP8_MAX  # noqa: E402
from service.model.kernels._triton import interpreting, tl, triton  # noqa: E402

HEADS = [(32, 8, 64), (8, 8, 128), (28, 4, 128), (4, 1, 64)]  # tests/gpu/test_kernels_gpu.HEADS
ATOL, RTOL = 2.0**-9, 2.0**-3  # check_rope_kv's for an FP8 cache


def _fmt(x: float) -> str:
    return f"{x:.9g}"


def _launch(qkv, cos, sin, k_cache, v_cache, slot_ids, positions, num_heads, num_kv_heads, scale, fp8_kv: bool,
            fusion: bool) -> torch.Tensor:
    """rope_kv_write_triton's launch (PDL off: it does not change a value), FP8_KV and FP fusion as given."""
    from service.model.kernels.rope import _rope_kv_kernel

    b, head_dim = qkv.shape[0], k_cache.shape[-1]
    cos2, sin2 = cos.reshape(b, head_dim), sin.reshape(b, head_dim)
    q = torch.empty((b, num_heads, head_dim), device=qkv.device, dtype=qkv.dtype)
    _rope_kv_kernel[(b, num_heads + num_kv_heads)](
        qkv, cos2, sin2, slot_ids, positions, q, k_cache, v_cache, scale,
        qkv.stride(0), cos2.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK=triton.next_power_of_2(head_dim // 2), FP8_KV=fp8_kv, FP8_MAX=FP8_MAX, PDL=False,
        num_warps=1, enable_fp_fusion=fusion,
    )
    return q


def write_diag(device: torch.device, heads: tuple[int, int, int], show: int, seed: int) -> list[dict]:
    from service.model.kernels.fast_path import check_scales, rope_kv_inputs
    from service.model.kernels.rope import apply_rope, rope_kv_write_torch, split_qkv

    num_heads, num_kv_heads, head_dim = heads
    qkv, cos, sin, slot_ids, positions, shape = rope_kv_inputs(device, torch.bfloat16, num_heads, num_kv_heads,
                                                               head_dim, batch=64, max_seq_len=64, seed=seed)
    scale = check_scales(FP8, device)
    ref = [torch.zeros(shape, device=device, dtype=FP8) for _ in range(2)]
    q_ref = rope_kv_write_torch(qkv, cos, sin, *ref, slot_ids, positions, num_heads, num_kv_heads, scale)
    _, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    pre_ref = [torch.zeros(shape, device=device) for _ in range(2)]  # torch's float32 before the cast
    for cache, x, s in zip(pre_ref, (apply_rope(k, cos, sin), v), scale):
        cache[slot_ids, :, positions] = (x.float() / s).clamp(-FP8_MAX, FP8_MAX)
    written = torch.zeros(shape[:3], dtype=torch.bool, device=device)
    written[slot_ids, :, positions] = True

    rows = []
    for mode, fusion in (("served", False), ("fused", True)):
        ours = [torch.zeros(shape, device=device, dtype=FP8) for _ in range(2)]
        pre = [torch.zeros(shape, device=device) for _ in range(2)]
        q = _launch(qkv, cos, sin, *ours, slot_ids, positions, num_heads, num_kv_heads, scale, True, fusion)
        _launch(qkv, cos, sin, *pre, slot_ids, positions, num_heads, num_kv_heads, scale, True, fusion)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        q_equal = torch.equal(q, q_ref)
        for name, a8, r8, pa, pr in zip("kv", ours, ref, pre, pre_ref):
            a, r = a8.float(), r8.float()
            diff = a != r
            outside = ~torch.isclose(a, r, atol=ATOL, rtol=RTOL)
            cast_only = (pa.to(FP8).float() != a) & written[..., None]  # Triton's E4M3 is not torch's cast of its float
            rows.append({
                "heads": "x".join(map(str, heads)), "mode": mode, "cache": name, "q_equal": q_equal,
                "differ": int(diff.sum()), "outside_tol": int(outside.sum()),
                "max_abs_diff": float((a - r).abs().max()), "precast_differ": int((pa != pr).sum()),
                "cast_only_differ": int(cast_only.sum()),
                "unwritten_touched": int(((a8.view(torch.uint8) != 0) & ~written[..., None]).sum()),
                "entries": [
                    {"slot": i[0], "head": i[1], "pos": i[2], "dim": i[3], "torch": float(r[tuple(i)]),
                     "triton": float(a[tuple(i)]), "torch_precast": float(pr[tuple(i)]),
                     "triton_precast": float(pa[tuple(i)]), "outside_tol": bool(outside[tuple(i)])}
                    for i in diff.nonzero()[:show].tolist()
                ],
            })
    return rows


def e4m3_sweep(device: torch.device) -> torch.Tensor:
    """float32 values: every E4M3 value in [-448, 448], every halfway point between neighbours, one
    float32 ulp either side of each, and random ones (normal at several scales, uniform in range)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    values = codes[torch.isfinite(codes)].unique().sort().values  # -448 .. 448, one zero
    mids = (values[1:] + values[:-1]) / 2  # exact in float32
    up, down = torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(float("-inf")))
    gen = torch.Generator().manual_seed(0)
    rand = [torch.randn(1 << 16, generator=gen) * s for s in (2.0**-8, 1.0, 32.0, 128.0)]
    rand.append((torch.rand(1 << 16, generator=gen) * 2 - 1) * 448)
    return torch.cat([values, mids, up, down, *rand]).to(device)


if triton is not None:

    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        """y = x cast to y's type (float8e4nv), as the KV write's store casts."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=mask)


def cast_check(device: torch.device) -> dict:
    x = e4m3_sweep(device)
    ours = torch.empty(x.shape, device=device, dtype=FP8)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, ours, x.numel(), BLOCK=1024)
    ref = x.to(FP8)
    bad = (ours.view(torch.uint8) != ref.view(torch.uint8)).nonzero().flatten()
    return {"values": x.numel(), "differ": bad.numel(),
            "entries": [{"x": float(x[i]), "torch": float(ref[i].float()), "triton": float(ours[i].float())}
                        for i in bad[:10].tolist()]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default=",".join("x".join(map(str, h)) for h in HEADS),
                   help="head shapes H x KVH x D, comma separated (default: tests/gpu's four)")
    p.add_argument("--show", type=int, default=20, help="differing entries listed per run and cache")
    p.add_argument("--seed", type=int, default=0, help="check_rope_kv's seed (the self-check uses 0)")
    args = p.parse_args()

    if not torch.cuda.is_available() or triton is None or interpreting():
        print("fp8_kv_write_diag: needs a CUDA GPU (compute capability 8.9+) with Triton; nothing to do here "
              "(the interpreter's float8 cast is not the GPU's).")
        return 0
    from service.model.kv_quant import unsupported_reason

    device = torch.device("cuda")
    if (reason := unsupported_reason(device)) is not None:
        print(f"fp8_kv_write_diag: {reason}; nothing to do here.")
        return 0
    heads = [tuple(int(n) for n in h.split("x")) for h in args.heads.split(",")]
    rows = []
    with torch.inference_mode():
        for h in heads:
            rows += write_diag(device, h, args.show, args.seed)
        cast = cast_check(device)

    for r in rows:
        if r["entries"]:
            print(f"\n{r['heads']} {r['mode']} {r['cache']} cache: first {len(r['entries'])} of {r['differ']} "
                  "differing entries")
            print_table([{**e, **{c: _fmt(e[c]) for c in ("torch", "triton", "torch_precast", "triton_precast")},
                          "outside_tol": "X" if e["outside_tol"] else ""} for e in r["entries"]],
                        ["slot", "head", "pos", "dim", "torch", "triton", "torch_precast", "triton_precast",
                         "outside_tol"])
    print(f"\ncast alone (Triton float32 -> float8e4nv vs torch .to(float8_e4m3fn)): {cast['differ']} of "
          f"{cast['values']} values differ")
    for e in cast["entries"]:
        print(f"  x={_fmt(e['x'])} torch={_fmt(e['torch'])} triton={_fmt(e['triton'])}")
    print()
    print_table(rows, ["heads", "mode", "cache", "q_equal", "differ", "outside_tol", "max_abs_diff", "precast_differ",
                       "cast_only_differ", "unwritten_touched"],
                title="RoPE + KV write into E4M3 vs torch (served: no FP fusion; fused: Triton's default); "
                      f"tolerance atol {ATOL} rtol {RTOL}")
    path = write_result("fp8_kv_write_diag", {"rows": rows, "cast": cast}, device)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
