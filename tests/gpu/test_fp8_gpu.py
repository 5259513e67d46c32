"""FP8 weights on a real GPU (compute capability 8.9+): the FP8 GEMV and the FP8 GEMM against a
float32 product of the dequantized weights, a whole FP8 model's logits against bf16's, and a
captured FP8 decode step against eager.

Run: python -m pytest tests/gpu/test_fp8_gpu.py -q -rs
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_kernels_gpu import _captured_decode, _model, _rel, _spec

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


@pytest.fixture(autouse=True)
def _needs_fp8() -> None:
    from service.model.fp8 import unsupported_reason

    reason = unsupported_reason(DEVICE)
    if reason is not None:
        pytest.skip(reason)


# the 1B shape's projections (fused q/k/v, o, gate/up, down), and a bias
SHAPES = [(3072, 2048, False), (2048, 2048, False), (16384, 2048, False), (2048, 8192, False), (528, 512, True)]


@pytest.mark.parametrize("n, k, bias", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_fp8_products_match_float32_of_the_dequantized_weights(n, k, bias, rows):
    from service.model.fp8 import dequantize_rows, fp8_linear, quantize_rows, quantize_tokens

    gen = torch.Generator(DEVICE).manual_seed(n + k + rows)
    w = torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5 * torch.logspace(-1, 1, n, device=DEVICE)[:, None]
    b = torch.randn(n, device=DEVICE, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    q, scale = quantize_rows(w)
    ours = fp8_linear(x, q, b, scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    if rows == 1:  # the GEMV: bf16 activation times the dequantized weight
        xr = x.float()
    else:  # the GEMM: the activation quantized per token too
        xq, xs = quantize_tokens(x)
        xr = xq.float() * xs
    ref = xr @ dequantize_rows(q, scale).t() + (b.float() if bias else 0)
    assert _rel(ours.float(), ref) < 5e-3  # bf16 output rounding and the accumulation order only
    bf16 = torch.nn.functional.linear(x, w.to(torch.bfloat16), b)
    assert _rel(ours.float(), bf16.float()) < 0.08  # what FP8 costs against bf16 weights


@pytest.mark.parametrize("swap, block_n, block_k, split", [(True, 64, 128, 1), (True, 64, 256, 2), (True, 128, 128, 4),
                                                           (False, 32, 256, 1), (False, 64, 128, 2)])
@pytest.mark.parametrize("rows", [2, 17, 64, 256])
def test_every_fp8_gemm_configuration_matches_float32(swap, block_n, block_k, split, rows):
    """The decode GEMM in each tile shape the sweep tries (the weight or x as the left operand, K split
    or not), over rows that fill no tile exactly and a weight of 528 rows with a bias."""
    from service.model.kernels.fp8_gemm import Fp8GemmConfig

    config = Fp8GemmConfig(swap, min(64, max(16, 1 << (rows - 1).bit_length())) if swap else 64, block_n, block_k,
                           split, 4, 3)
    assert _fp8_gemm_error(rows, 528, 1024, config) < 5e-3


@pytest.mark.parametrize("n, k", [(2048, 8192), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("rows", [16, 64, 256])
def test_the_served_fp8_gemm_keeps_float32_accuracy_over_long_k(n, k, rows):
    """The served configuration of the 1B and 8B down projections (K of 8,192 and 14,336) and the 8B
    gate/up, float32 out: the tensor cores' partial sums reach the float32 accumulator every 128
    elements of K, so the error stays near float32's. Summed over all of K in the tensor cores' own
    accumulator (~14 mantissa bits, Triton's default on Hopper) it would be of the order of 1e-3."""
    from service.model.kernels._triton import sm_count
    from service.model.kernels.fp8_gemm import fp8_gemm_config

    config = fp8_gemm_config(rows, n, k, sm_count(DEVICE))
    if config is None:
        pytest.skip(f"cuBLAS serves {rows} rows of a {n}-row weight")
    assert _fp8_gemm_error(rows, n, k, config, out_dtype=torch.float32) < 5e-4


def _fp8_gemm_error(rows: int, n: int, k: int, config, out_dtype: torch.dtype = torch.bfloat16) -> float:  # noqa: ANN001
    """The relative error of fp8_gemm_triton in `config` against float32 of its dequantized operands."""
    from service.model.fp8 import dequantize_rows, quantize_rows, quantize_tokens
    from service.model.kernels.fp8_gemm import fp8_gemm_triton

    gen = torch.Generator(DEVICE).manual_seed(rows + n + config.split_k)
    q, scale = quantize_rows(torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5)
    bias = torch.randn(n, device=DEVICE, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    xq, xs = quantize_tokens(x)
    ours = fp8_gemm_triton(xq, xs, q, scale, bias, out_dtype, config)
    ref = (xq.float() * xs) @ dequantize_rows(q, scale).t() + bias.float()
    assert ours.dtype == out_dtype and ours.shape == (rows, n)
    return _rel(ours.float(), ref)


def test_the_fp8_gemv_reads_every_e4m3_value_exactly() -> None:
    """The GEMV moves E4M3 bits into bf16's rather than converting: each of the 254 finite codes
    (denormals, both zeros, every sign), in each byte of a 32-bit word, comes out as its value."""
    from service.model.kernels.gemv import gemv_triton

    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes: no weight holds them
    k = 16  # row r holds its code at column r % 16: all four byte positions of a word
    w = torch.zeros(256, k, dtype=torch.uint8)
    w[torch.arange(256), torch.arange(256) % k] = codes.to(torch.uint8)
    q = w.view(torch.float8_e4m3fn).to(DEVICE)
    x = torch.ones(1, k, device=DEVICE, dtype=torch.bfloat16)
    y = gemv_triton(x, q, scale=torch.ones(256, device=DEVICE))
    expected = q.float().sum(dim=1)  # every E4M3 value is a bf16 value too
    assert torch.equal(y.float()[0], expected), (y.float()[0] - expected).abs().max()


def test_an_fp8_model_decodes_close_to_bf16_and_its_graph_replay_equals_eager():
    from service.model.kv_cache import KVCache

    spec = _spec()
    ref, model = _model(spec, fast=True), _model(spec, fast=True)
    saved = model.use_fp8()
    assert model.fp8 and saved > 0
    for m in model._linears():
        if m is not model.lm_head:
            assert m.weight.dtype == torch.float8_e4m3fn, m
    batch = 8
    kvs = [KVCache(spec, num_slots=batch, max_seq_len=256, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    # this random model's logits move 0.10-0.11 (relative norm)
    ids, positions, slots = decode_side_by_side(ref, model, kvs, bound=0.15)

    for rows in (1, batch):  # the GEMV step and the GEMM step, captured
        r_ids, r_pos, r_slots = ids[:rows].clone(), positions[:rows].clone(), slots[:rows].clone()
        graph, out, eager = _captured_decode(model, r_ids, r_pos, r_slots, kvs[1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), rows


def test_the_fp8_self_check_passes_here_and_a_wrong_kernel_of_ours_gives_way_to_cublas(monkeypatch):
    """At start every route of the FP8 product is checked on the model's own weights: here all of
    ours pass. A GEMV and a GEMM of ours that are 1% off are turned off instead, the model never
    calls them, and it decodes through cuBLAS as close to bf16 as with them; a quantization kernel
    1% off gives way to torch's ops (and our GEMM stays); cuBLAS wrong: no start."""
    from service.model import fp8
    from service.model.kernels import fp8_gemm, gemv, quant
    from service.model.kv_cache import KVCache
    from service.model.spec import ModelLoadError

    spec = _spec()
    model = _model(spec, fast=True)
    model.use_fp8()
    assert model.fp8_kernels == fp8.Fp8Kernels(gemv=True, gemm=fp8.OUR_GEMM, quant=True)

    calls = []
    real_gemm, real_gemv = fp8_gemm.fp8_gemm_triton, gemv.gemv_triton

    def wrong_gemm(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append("gemm")
        return real_gemm(*args, **kwargs) * 1.01

    def wrong_gemv(x, w, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if w.dtype != fp8.FP8:  # the bf16 LM head's GEMV stays right
            return real_gemv(x, w, *args, **kwargs)
        calls.append("gemv")
        return real_gemv(x, w, *args, **kwargs) * 1.01

    monkeypatch.setattr(fp8_gemm, "fp8_gemm_triton", wrong_gemm)
    monkeypatch.setattr(gemv, "gemv_triton", wrong_gemv)
    ref, broken = _model(spec, fast=True), _model(spec, fast=True)
    broken.use_fp8()
    assert broken.fp8_kernels == fp8.Fp8Kernels(gemv=False, gemm=False)
    calls.clear()
    kvs = [KVCache(spec, num_slots=8, max_seq_len=256, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    ids, positions, slots = decode_side_by_side(ref, broken, kvs, bound=0.15)  # 8 rows: cuBLAS's GEMM
    one = broken.decode(ids[:1], positions[:1], slots[:1], kvs[1])  # a lone row: cuBLAS too
    assert _rel(one, ref.decode(ids[:1], positions[:1], slots[:1], kvs[0])) < 0.15
    assert calls == []

    monkeypatch.undo()  # our GEMV and GEMM right again; the per-token quantization kernel's scales 1% off
    real_quant = quant.quantize_tokens_triton

    def wrong_quant(x, *args):  # noqa: ANN001, ANN002, ANN202
        q, s = real_quant(x, *args)
        return q, s * 1.01

    monkeypatch.setattr(quant, "quantize_tokens_triton", wrong_quant)
    torch_quant = _model(spec, fast=True)
    torch_quant.use_fp8()
    assert torch_quant.fp8_kernels == fp8.Fp8Kernels(gemv=True, gemm=fp8.OUR_GEMM, quant=False)

    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: torch.zeros(1))
    with pytest.raises(ModelLoadError, match=r"through cuBLAS.* are wrong.*serve without --quantization fp8"):
        _model(spec, fast=True).use_fp8()


def test_fp8_prompt_chunks_replayed_as_piecewise_graphs_equal_eager():
    """FP8 weights under piecewise graphs: the pieces' products (our GEMM: the cases stay under 256
    tokens) replayed for mixed steps of prompt chunks and decodes equal the eager forward."""
    from tests.gpu.test_graph_cache import make_model
    from tests.gpu.test_piecewise_gpu import check_piecewise_equals_eager

    model = make_model()
    model.use_fp8()
    check_piecewise_equals_eager(model)


@pytest.fixture(scope="module")
def fp8_eager_streams(model_cache_dir) -> list[tuple]:  # noqa: ANN001
    from tests.gpu.test_piecewise_gpu import streams

    return streams(model_cache_dir, "none", "--quantization", "fp8")


@pytest.mark.parametrize("mode", ["full", "piecewise", "FULL_AND_PIECEWISE"])
def test_an_fp8_server_streams_in_every_graph_mode_what_it_streams_eagerly(model_cache_dir, fp8_eager_streams, mode):  # noqa: ANN001
    """A real server with --quantization fp8 (float32 activations, E4M3 weights): greedy streams of
    short and multi-chunk prompts, twice (the second pass replays what the first captured), are the
    eager server's in every graph mode."""
    from tests.gpu.test_piecewise_gpu import streams

    assert streams(model_cache_dir, mode, "--quantization", "fp8") == fp8_eager_streams


def decode_side_by_side(ref, model, kvs, bound: float, steps: int = 8):  # noqa: ANN001, ANN201
    """The same prompts prefilled by `ref` into kvs[0] and by `model` into kvs[1] (one per slot), then
    `steps` decode steps both fed ref's greedy tokens: every step's logits within `bound` of ref's
    (relative norm), the argmax the same on at least 80% of the rows. Returns the next step's
    (ids, positions, slots)."""
    spec, batch = ref.spec, kvs[0].num_slots
    gen = torch.Generator(DEVICE).manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (n,), device=DEVICE, generator=gen) for n in range(20, 20 + batch)]
    for kv, net in zip(kvs, (ref, model)):
        for slot, p in enumerate(prompts):
            net.prefill(p, slot, kv)
    ids = torch.randint(0, spec.vocab_size, (batch,), device=DEVICE, generator=gen)
    positions = torch.tensor([len(p) for p in prompts], device=DEVICE)
    slots = torch.arange(batch, device=DEVICE)
    agree = 0
    for _ in range(steps):
        a, b = ref.decode(ids, positions, slots, kvs[0]), model.decode(ids, positions, slots, kvs[1])
        assert _rel(b, a) < bound, _rel(b, a)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        ids, positions = a.argmax(-1), positions + 1
    assert agree >= 0.8 * steps * batch, agree
    return ids, positions, slots


@pytest.mark.parametrize("rows, k", [(1, 2048), (64, 2048), (300, 8192), (7, 14336)])
def test_the_token_quantization_kernel_matches_torch(rows, k):
    from service.model.fp8 import FP8_MAX, MIN_SCALE, quantize_tokens
    from service.model.kernels.quant import quantize_tokens_triton

    x = torch.randn(rows, k, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(k)).to(torch.bfloat16)
    x[0] = 0  # an all-zero row
    q, s = quantize_tokens_triton(x, FP8_MAX, MIN_SCALE)
    qr, sr = quantize_tokens(x)
    assert q.dtype == qr.dtype and torch.allclose(s, sr, rtol=1e-6)
    assert (q.float() != qr.float()).float().mean() < 1e-3  # the same rounding but at a few halfway values
    assert not q[0].float().any()
