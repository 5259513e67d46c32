"""The batch-invariant mode on a real GPU (bf16):

- the Triton matmul gives every row bit-identical results for any M (1, 3, 64, 200) and any place of
  the row in the call, at the Llama-3.2-1B weight shapes, within bf16 tolerance of torch;
- decode attention with the fixed split gives a row alone what it gets in any batch;
- a model of the 1B shape (2 layers) gives a prompt's logits bit-identical alone, packed, chunked
  and batched (decode with padding rows);
- a gRPC server with --batch-invariant (graphs on, the default mode) streams identical greedy tokens
  for 8 prompts sent one at a time, all 8 at once, the 8 among 64 concurrent streams, and all with
  prompts chunked by a small step budget.

Run: python -m pytest tests/gpu/test_batch_invariant_gpu.py -q -rs
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
import torch.nn.functional as F

from service.proto import inference_pb2
from tests.support.server import generate, running_server

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# Llama-3.2-1B: qkv, o_proj, gate_up, down, lm_head
SHAPES_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]
SPEC_1B = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_layers": 2,
           "num_heads": 32, "num_kv_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
           "max_position_embeddings": 2048}


@pytest.mark.parametrize("shape", SHAPES_1B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matmul_rows_bit_identical_across_m(shape: tuple[int, int]) -> None:
    from service.model.kernels.matmul import matmul_triton

    n, k = shape
    gen = torch.Generator(DEVICE).manual_seed(0)
    x = torch.randn(200, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(torch.bfloat16)
    whole = matmul_triton(x, w)
    ref = F.linear(x.float(), w.float())
    assert ((whole.float() - ref).norm() / ref.norm()).item() < 1e-2
    for m in (1, 3, 64, 200):
        assert torch.equal(matmul_triton(x[:m], w), whole[:m]), f"M={m}"
    for first, m in ((199, 1), (100, 3), (63, 2), (130, 64)):  # rows at other places of their tile
        assert torch.equal(matmul_triton(x[first: first + m], w), whole[first: first + m]), (first, m)
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    with_bias = matmul_triton(x, w, b)
    assert torch.equal(matmul_triton(x[7:8], w, b), with_bias[7:8])


@pytest.mark.parametrize("heads", [(32, 8, 64), (8, 8, 128), (28, 4, 128)], ids=str)
def test_fixed_split_attention_rows_alone_equal_rows_in_a_batch(heads: tuple[int, int, int]) -> None:
    from service.model.kernels.decode_attention import fixed_split_len
    from service.model.kernels.fast_path import check_attention

    for t in (200, 2048):
        check_attention(DEVICE, torch.bfloat16, *heads, batch=6, max_seq_len=t, split_len=fixed_split_len(t))


def test_model_logits_bit_identical_alone_packed_chunked_batched() -> None:
    from tests.unit.test_batch_invariant import follow_prompt_zero, invariant_model

    model = invariant_model(torch.bfloat16, DEVICE, std=0.02, **SPEC_1B)
    assert model.invariant.backend == "triton"
    got = follow_prompt_zero(model, max_seq=512)
    for way in ("packed", "chunked"):
        assert torch.equal(got[way], got["solo"]), f"{way}: max diff {(got[way] - got['solo']).abs().max()}"
    assert torch.equal(got["decode_batch"], got["decode_solo"])


# ---- through the server ------------------------------------------------------------------------

LENS = (3, 40, 17, 200, 1, 29, 51, 8)  # the 8 prompts followed
MAX_TOKENS = 32


def requests(lens: tuple[int, ...], seed: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [dict(token_ids=inference_pb2.TokenIds(ids=torch.randint(3, vocab, (n,), generator=gen).tolist()),
                 sampling=inference_pb2.SamplingParams(temperature=0.0),
                 stopping=inference_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))
            for n in lens]


def tokens(stub, request: dict) -> list[int]:  # noqa: ANN001
    chunks, _ = generate(stub, timeout=300, **request)
    return [t for c in chunks for t in c.token_ids]


def concurrently(stub, reqs: list[dict]) -> list[list[int]]:  # noqa: ANN001
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: tokens(stub, r), reqs))


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:llama-1b"])
def test_server_greedy_streams_identical_solo_concurrent_64_and_chunked(model: str, tmp_path_factory) -> None:  # noqa: ANN001
    # llama-1b is generated (once, 2.5 GB) into the default model cache, shared with the benchmarks.
    cache = ["--model-cache-dir", str(tmp_path_factory.mktemp("models"))] if model == "builtin:tiny" else []
    vocab = 766 if model == "builtin:tiny" else 128000
    base = ["--model", model, *cache, "--device", "cuda", "--dtype", "bfloat16", "--batch-invariant",
            "--max-running-seqs", "64", "--max-seq-len", "512"]
    followed = requests(LENS, 7, vocab)
    others = requests(tuple(5 + 7 * i % 150 for i in range(56)), 8, vocab)
    with running_server(base) as server:
        stub = server.stub()
        assert stub.GetModelInfo(inference_pb2.GetModelInfoRequest()).batch_invariant
        solo = [tokens(stub, r) for r in followed]
        together = concurrently(stub, followed)
        among_64 = concurrently(stub, followed + others)[: len(followed)]
        assert server.config.cudagraph_mode == "full_and_piecewise"
    with running_server([*base, "--max-num-batched-tokens", "96"]) as server:  # 64 decodes + 32-token chunks
        chunked = concurrently(server.stub(), followed + others)[: len(followed)]
    assert all(len(t) == MAX_TOKENS for t in solo)
    for i, n in enumerate(LENS):
        assert together[i] == solo[i], f"prompt {i} ({n} tokens): alone vs with 7 others"
        assert among_64[i] == solo[i], f"prompt {i} ({n} tokens): alone vs among 64"
        assert chunked[i] == solo[i], f"prompt {i} ({n} tokens): alone vs chunked among 64"
