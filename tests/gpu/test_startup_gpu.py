"""On a GPU: what a new server and a closed LLM leave to their users.

- Before the first request, the largest graph of each kind is captured (every step can pad into it)
  and every allowed size has run once, so the first steps replay: no eager fallback, no capture wait.
- Streams that join one by one (each new batch size is captured lazily beside serving) see no
  inter-token gap near the freezes the issue measured.
- LLM.close() with graphs gives the device memory back, every time.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from cache_manager import BucketState
from service import LLM, SamplingParams
from service.proto import inference_pb2, inference_pb2_grpc
from tests.support.server import greedy, running_server

pytestmark = pytest.mark.gpu


def test_a_new_llm_has_its_largest_graphs_before_the_first_request(model_cache_dir) -> None:  # noqa: ANN001
    with LLM("builtin:tiny", model_cache_dir=model_cache_dir, device="cuda", dtype="bfloat16",
             max_running_seqs=16, max_num_batched_tokens=256, max_seq_len=512) as llm:
        state = llm.graph_cache_state()
        captured = {(b.kind, b.size) for b in state.buckets if b.state is BucketState.CAPTURED}
        assert ("full", 16) in captured and ("piecewise", 256) in captured, captured
        llm.generate(["The first request"], SamplingParams(temperature=0, max_tokens=4))
        after = llm.graph_cache_state()
        fallbacks = {(r.kind, r.size): r.eager_fallbacks for r in after.requested_detail if r.eager_fallbacks}
        assert fallbacks == {}, fallbacks  # every step replayed a graph (padded if need be)


def test_streams_joining_one_by_one_see_no_freeze_while_their_sizes_are_captured(model_cache_dir) -> None:  # noqa: ANN001
    argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "bfloat16",
            "--max-running-seqs", "16", "--max-seq-len", "1024"]
    gaps: list[float] = []
    errors: list[BaseException] = []

    def stream(stub: inference_pb2_grpc.InferenceStub) -> None:
        try:
            last = None
            for response in stub.Generate(inference_pb2.GenerateRequest(**greedy("Once upon a time", 300)), timeout=120):
                now = time.perf_counter()
                if response.WhichOneof("kind") == "chunk" and last is not None:
                    gaps.append(now - last)
                last = now
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with running_server(argv) as server:
        stub = server.stub()
        threads = []
        for _ in range(16):  # batch sizes 1..16 appear one after another, each new to the cache
            threads.append(threading.Thread(target=stream, args=(stub,)))
            threads[-1].start()
            time.sleep(0.05)
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert len(gaps) > 16 * 20  # the server may coalesce tokens into fewer messages
    # A lazy capture used to freeze every stream for 0.5-0.9 s; the target for a 1B model is 50 ms.
    assert max(gaps) < 0.05, f"longest gap {max(gaps) * 1000:.1f} ms"


def test_llm_close_with_graphs_gives_the_device_memory_back(model_cache_dir) -> None:  # noqa: ANN001
    def held() -> int:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    base = held()
    after = []
    for _ in range(3):
        llm = LLM("builtin:tiny", model_cache_dir=model_cache_dir, device="cuda", dtype="bfloat16",
                  max_running_seqs=16, max_seq_len=512)
        llm.generate(["Explain CUDA graphs", "hello"], SamplingParams(temperature=0, max_tokens=8))
        assert any(b.state is BucketState.CAPTURED for b in llm.graph_cache_state().buckets)
        llm.close()
        after.append(held() - base)
    # The first LLM leaves the capture streams' cuBLAS workspaces, kept for the process (a fresh
    # stream per capture would leave one behind each time, cache_manager/backend.py); nothing grows.
    assert after[0] < 64 * 2**20 and max(after) - min(after) < 4 * 2**20, [a / 2**20 for a in after]
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["again"], SamplingParams(max_tokens=1))
