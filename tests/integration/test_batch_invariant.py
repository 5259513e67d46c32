"""--batch-invariant over a real gRPC server: 8 greedy prompts give the same tokens sent one at a
time, all at once, and all at once with prompts split into chunks by a small step budget, in
float32 and bfloat16 (on the CPU here; tests/gpu/test_batch_invariant_gpu.py runs it on a GPU)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from service.proto import inference_pb2
from tests.support.server import generate, running_server

LENS = (3, 40, 17, 64, 1, 29, 51, 8)
MAX_TOKENS = 24


def requests() -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [dict(token_ids=inference_pb2.TokenIds(ids=torch.randint(3, 766, (n,), generator=gen).tolist()),
                 sampling=inference_pb2.SamplingParams(temperature=0.0),
                 stopping=inference_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))
            for n in LENS]


def tokens(stub, request: dict) -> list[int]:  # noqa: ANN001
    chunks, _ = generate(stub, **request)
    return [t for c in chunks for t in c.token_ids]


def concurrently(stub, reqs: list[dict]) -> list[list[int]]:  # noqa: ANN001
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: tokens(stub, r), reqs))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_streams_identical_solo_concurrent_and_chunked(model_cache_dir, dtype: str) -> None:  # noqa: ANN001
    reqs = requests()
    base = ["--model-cache-dir", str(model_cache_dir), "--dtype", dtype, "--batch-invariant", "--max-running-seqs", "8",
            "--max-seq-len", "256"]
    with running_server(base) as server:
        stub = server.stub()
        assert stub.GetModelInfo(inference_pb2.GetModelInfoRequest()).batch_invariant
        solo = [tokens(stub, r) for r in reqs]
        together = concurrently(stub, reqs)
    with running_server([*base, "--max-num-batched-tokens", "16"]) as server:  # prompts over 16 - 8 tokens chunk
        chunked = concurrently(server.stub(), reqs)
    assert all(len(t) == MAX_TOKENS for t in solo)
    for i, n in enumerate(LENS):
        assert together[i] == solo[i], f"prompt {i} ({n} tokens) alone vs with 7 others"
        assert chunked[i] == solo[i], f"prompt {i} ({n} tokens) alone vs chunked with 7 others"
