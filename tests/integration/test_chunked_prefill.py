"""Prompts longer than the step's token budget, over a real gRPC server on loopback: they are served,
not refused, up to --max-seq-len, and every stream gets what the same request gets from a server
that prefills each prompt in one step."""

from __future__ import annotations

import concurrent.futures

import torch

from service.proto import inference_pb2
from tests.support.server import generate, greedy, running_server

MAX_SEQ = 512  # as the session `server` fixture, whose default budget (2048) holds any of its prompts


def token_prompt(n: int, max_tokens: int) -> dict:
    ids = torch.randint(0, 766, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    return dict(token_ids=inference_pb2.TokenIds(ids=ids), sampling=inference_pb2.SamplingParams(temperature=0.0),
                stopping=inference_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def tokens(stub, request: dict) -> tuple[list[int], int]:  # noqa: ANN001
    chunks, finished = generate(stub, **request)
    return [t for c in chunks for t in c.token_ids], finished.finish_reason


def test_prompts_over_the_budget_are_served_like_unchunked(server, model_cache_dir) -> None:  # noqa: ANN001
    requests = [
        token_prompt(480, 8),  # 16 steps of at most 32 tokens
        token_prompt(MAX_SEQ - 1, 1),  # the longest prompt the context holds
        greedy("Once upon a time", 20),
        greedy("The quick brown fox", 20),
        greedy("hello", 20),
    ]
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "4",
                         "--max-num-batched-tokens", "32", "--max-seq-len", str(MAX_SEQ)]) as chunked:
        stub = chunked.stub()
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda r: tokens(stub, r), requests))
    expected = [tokens(server.stub(), r) for r in requests]
    assert got == expected
    assert [len(ids) for ids, _ in got] == [8, 1, 20, 20, 20]
    assert all(reason == inference_pb2.FINISH_REASON_LENGTH for _, reason in got)
