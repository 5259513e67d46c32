"""The FP8 KV cache (`--kv-cache-dtype fp8`) on a real GPU (compute capability 8.9+): the Triton
KV write, decode and prompt-chunk kernels on an FP8 cache against the torch reference on the same
cache, and against a bf16 cache of the same keys and values; a captured decode step equal to eager;
and servers that generate with FP8 KV in every graph mode.

Run: python -m pytest tests/gpu/test_fp8_kv_gpu.py -q -rs
"""

from __future__ import annotations

import pytest
import torch

from service.model.fp8 import FP8
from tests.gpu.test_fp8_gpu import decode_side_by_side
from tests.gpu.test_kernels_gpu import HEADS, _captured_decode, _model, _rel, _spec
from tests.gpu.test_piecewise_gpu import PROMPTS, streams
from tests.support.server import generate, greedy, running_server

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


@pytest.fixture(autouse=True)
def _needs_fp8_kv() -> None:
    from service.model.kv_quant import unsupported_reason

    reason = unsupported_reason(DEVICE)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("batch, max_seq_len, splits", [(1, 576, None), (3, 200, 1), (64, 576, None), (64, 300, 5)])
def test_decode_kernel_on_fp8_kv_matches_torch_on_the_same_cache(heads, batch, max_seq_len, splits):
    from service.model.kernels.fast_path import check_attention

    check_attention(DEVICE, torch.bfloat16, *heads, batch=batch, max_seq_len=max_seq_len, num_splits=splits,
                    seed=batch, kv_dtype=FP8)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_prompt_chunk_kernel_on_fp8_kv_matches_torch(heads):
    from service.model.kernels.fast_path import check_prefill_attention

    check_prefill_attention(DEVICE, torch.bfloat16, *heads, kv_dtype=FP8)


# Bit for bit on the H200 since the kernel is compiled without FP fusion (a fused multiply-add had
# skipped the rounding of one bf16 product: two E4M3 steps and more after the scale, and the start-up
# self-check kept the kernel off for FP8 caches); bench/fp8_kv_write_diag.py shows both builds.
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_kv_write_on_fp8_kv_matches_torch(heads):
    from service.model.kernels.fast_path import check_rope_kv

    check_rope_kv(DEVICE, torch.bfloat16, *heads, batch=64, max_seq_len=64, kv_dtype=FP8)


def test_the_batch_invariant_split_on_fp8_kv_is_bit_identical_row_by_row():
    from service.model.kernels.decode_attention import fixed_split_len
    from service.model.kernels.fast_path import check_attention

    check_attention(DEVICE, torch.bfloat16, 32, 8, 64, batch=5, max_seq_len=600, split_len=fixed_split_len(600),
                    kv_dtype=FP8)


def test_attention_over_fp8_kv_stays_close_to_bf16_kv():
    """The same keys and values (randn, as a model's are of order 1) in a bf16 cache and in an FP8
    one at scale 1.0 (no calibration): E4M3 keeps 3 mantissa bits (each entry within 2^-4 of
    itself), and attention's weighted sums average the rounding, so the outputs differ by under 5%
    (relative norm) while bf16 against float32 differs by under 1%."""
    from service.model.kernels.decode_attention import decode_attention_triton
    from service.model.kernels.prefill_attention import chunk_tiles, prefill_attention_triton
    from service.model.kv_quant import store_kv

    gen = torch.Generator(DEVICE).manual_seed(0)
    slots, per_seq, bs, h, kvh, d = 8, 64, 16, 32, 8, 64
    k = torch.randn(1 + slots * per_seq, kvh, bs, d, device=DEVICE, generator=gen).to(torch.bfloat16)
    v = torch.randn(k.shape, device=DEVICE, generator=gen).to(torch.bfloat16)
    scale = torch.ones(2, device=DEVICE)
    k8, v8 = store_kv(k, v, scale, FP8)
    table = torch.cat([1 + torch.randperm(slots * per_seq, device=DEVICE, generator=gen).view(slots, per_seq),
                       torch.zeros(1, per_seq, device=DEVICE, dtype=torch.long)]).to(torch.int32)
    q = torch.randn(slots, h, d, device=DEVICE, generator=gen).to(torch.bfloat16)
    slot_ids = torch.arange(slots, device=DEVICE)
    positions = torch.tensor([0, 15, 16, 100, 511, 700, 1000, 1023], device=DEVICE)
    bf16 = decode_attention_triton(q, k, v, table, slot_ids, positions, scale)
    fp8 = decode_attention_triton(q, k8, v8, table, slot_ids, positions, scale)
    assert _rel(fp8.float(), bf16.float()) < 0.05

    chunks = [(0, 200, 0, 0), (200, 70, 300, 1)]  # a prompt's start, and a continuation
    qs = torch.randn(270, h, d, device=DEVICE, generator=gen).to(torch.bfloat16)
    outs = [torch.zeros(270, h * d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    chunk_table = torch.tensor(chunks, device=DEVICE)
    tiles = torch.tensor(chunk_tiles([n for _, n, _, _ in chunks]), device=DEVICE).view(-1, 2)
    for out, (kc, vc) in zip(outs, ((k, v), (k8, v8))):
        prefill_attention_triton(qs, kc, vc, table, chunk_table, tiles, out, scale)
    assert _rel(outs[1].float(), outs[0].float()) < 0.05


def test_an_fp8_kv_model_decodes_close_to_bf16_kv_and_its_graph_replay_equals_eager():
    from service.model.kv_cache import KVCache

    spec = _spec()
    ref, model = _model(spec, fast=True), _model(spec, fast=True, kv_dtype=FP8)  # the same weights
    assert model.fast.attention and model.fast.prefill_attention and model.fast.rope_kv, model.fast
    batch = 8
    kvs = [KVCache(spec, batch, 256, DEVICE, torch.bfloat16, cache_dtype=dtype) for dtype in (None, FP8)]
    kvs[1].scales.fill_(0.5)  # not 1: a kernel that dropped the scale would be far off
    # E4M3 keys and values move this random model's logits less than FP8 weights do (< 0.15)
    ids, positions, slots = decode_side_by_side(ref, model, kvs, bound=0.1)

    for rows in (1, batch):
        r_ids, r_pos, r_slots = ids[:rows].clone(), positions[:rows].clone(), slots[:rows].clone()
        graph, out, eager = _captured_decode(model, r_ids, r_pos, r_slots, kvs[1])
        written = kvs[1].k[0].clone()  # what the eager step wrote (the capture ran nothing)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), rows
        assert torch.equal(kvs[1].k[0].view(torch.uint8), written.view(torch.uint8)), rows  # the same E4M3 write
        kvs[1].scales.fill_(0.25)  # the graph reads the scales on the device, not values fixed at capture
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, eager), rows
        kvs[1].scales.fill_(0.5)


@pytest.mark.parametrize("mode", ["full", "piecewise", "FULL_AND_PIECEWISE"])
def test_every_graph_mode_streams_with_fp8_kv_what_eager_streams(model_cache_dir, mode):  # noqa: ANN001
    """float32 compute (the torch KV write and reads, in graphs and between pieces) on an FP8 cache."""
    assert streams(model_cache_dir, mode, "--kv-cache-dtype", "fp8") == streams(
        model_cache_dir, "none", "--kv-cache-dtype", "fp8")


def test_a_bf16_server_with_fp8_kv_generates(model_cache_dir):  # noqa: ANN001
    """The Triton kernels in FULL and PIECEWISE graphs on an FP8 cache: every prompt streams all of its
    tokens, and the first token agrees with a bf16 cache's for most prompts."""
    outputs = {}
    for kv_dtype in ("auto", "fp8"):
        argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "bfloat16",
                "--model", "builtin:tiny", "--max-running-seqs", "8", "--max-num-batched-tokens", "64",
                "--max-seq-len", "512", "--kv-cache-dtype", kv_dtype]
        with running_server(argv) as server:
            stub = server.stub()
            outputs[kv_dtype] = [[t for c in generate(stub, **greedy(p, 24))[0] for t in c.token_ids] for p in PROMPTS]
    assert all(len(ids) == 24 for ids in outputs["fp8"])
    assert sum(a[0] == b[0] for a, b in zip(outputs["auto"], outputs["fp8"])) >= 2, outputs
