"""Tensor parallelism on two GPUs (NCCL): the sharded decode step, eager and captured as a CUDA graph
with its all-reduces inside, against one GPU's logits; and a gRPC server with two ranks, eager and
with graphs (every rank capturing and replaying what rank 0's graph cache decides)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from service.model.loader import load_model
from service.model.step_batch import ChunkSpec, build_step_batch
from tests.support.ranks import run_ranks
from tests.support.server import generate, greedy, running_server

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = [[1, 5, 9, 200, 767, 3, 42, 11], [300, 301, 302], [17] * 20]
# The decode step's input tokens, the same in every run: each run's own prefill argmax may differ
# in bf16 between one GPU and two, and a row fed another token has incomparable logits.
NEXT = [100, 101, 102]
ADMIN_TOKEN = "gpu-tp-admin-test-token"


def _decode_logits(model, device: torch.device, graphed: bool) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Prefill PROMPTS into slots 0..2, then one decode step of the tokens NEXT: eager logits and,
    with `graphed`, the same step replayed from a CUDA graph."""
    from cache_manager import CudaGraphBackend
    from service.engine.decode_step import ModelDecodeStep
    from service.model.kv_cache import KVCache

    kv = KVCache(model.spec, 4, 64, device, model.dtype)
    chunks = [ChunkSpec(slot, 0, len(p)) for slot, p in enumerate(PROMPTS)]
    tokens = [t for p in PROMPTS for t in p]
    model.forward_step(build_step_batch([], [], chunks, tokens, kv.max_seq_len, kv.scratch_slot, device), kv)
    step = ModelDecodeStep(model, kv, 4, device)
    step.write_rows(NEXT, [len(p) for p in PROMPTS], [0, 1, 2])
    eager = step.run(3).clone()
    if not graphed:
        return eager, eager
    backend = CudaGraphBackend(device)
    graph = backend.capture(step, 3)  # both ranks capture together: the all-reduces are inside
    replayed = graph.replay()[:3].clone()
    backend.release(graph)
    return eager, replayed


def _rank(rank: int, world: int, port: int, cache_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    from service.engine.ranks import join_group, rank_device

    device = rank_device(torch.device("cuda"), rank)
    tp, _ = join_group(rank, world, port, device)
    model = load_model("builtin:tiny", device, torch.bfloat16, pathlib.Path(cache_dir), tp=tp).model
    eager, replayed = _decode_logits(model, device, graphed=True)
    return eager.cpu(), replayed.cpu()


def test_two_gpu_graphed_decode_is_within_bf16_tolerance_of_one_gpu(model_cache_dir) -> None:  # noqa: ANN001
    device = torch.device("cuda", 0)
    one = load_model("builtin:tiny", device, torch.bfloat16, model_cache_dir).model
    ref = _decode_logits(one, device, graphed=False)[0].cpu()
    eager, replayed = run_ranks(_rank, 2, str(model_cache_dir), timeout=300)[0]
    torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)  # the graph replays the same step
    scale = ref.abs().max().item()
    assert (eager - ref).abs().max().item() <= 0.05 * scale, "TP=2 is not within bf16 tolerance of TP=1"
    assert (eager.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 2 / 3


def test_grpc_server_on_two_gpus_streams_what_one_gpu_streams_in_float32(model_cache_dir) -> None:  # noqa: ANN001
    argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "float32",
            "--max-running-seqs", "8", "--max-seq-len", "256"]
    prompts = ["Explain CUDA graphs", "The quick brown fox", "Once upon a time"]

    def texts(args: list[str]) -> list[str]:
        with running_server(args) as srv:
            stub = srv.stub()
            return ["".join(c.text for c in generate(stub, timeout=120, **greedy(p, 24))[0]) for p in prompts]

    assert texts([*argv, "--tensor-parallel-size", "2"]) == texts(argv)


def test_grpc_server_on_two_gpus_serves_bf16(model_cache_dir) -> None:  # noqa: ANN001
    argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "bfloat16",
            "--tensor-parallel-size", "2", "--max-running-seqs", "8"]
    with running_server(argv) as srv:
        chunks, finished = generate(srv.stub(), timeout=120, **greedy("Once upon a time", 32))
    assert sum(len(c.token_ids) for c in chunks) == 32 and finished.usage.completion_tokens == 32


def test_grpc_server_on_two_gpus_with_graphs_streams_what_one_gpu_with_graphs_streams(
        model_cache_dir, tmp_path, capsys) -> None:  # noqa: ANN001
    """float32, both kinds of graph: each prompt's prefill replays (or pads into) piecewise graphs and
    its decodes full ones, captured on both ranks (the cold start's cover before serving, other sizes
    between requests); a second pass replays what the first captured."""
    from tests.gpu.test_admin_gpu import Ctl

    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN)
    argv = ["--model-cache-dir", str(model_cache_dir), "--device", "cuda", "--dtype", "float32",
            "--cudagraph-mode", "full_and_piecewise", "--max-running-seqs", "8", "--max-seq-len", "256"]
    prompts = ["Explain CUDA graphs", "The quick brown fox", "Once upon a time"]

    def serve(args: list[str]) -> tuple[list[list[int]], dict]:
        with running_server(args, environ={"GRAPHSERVE_ADMIN_TOKEN": ADMIN_TOKEN}) as srv:
            stub = srv.stub()
            tokens = [[t for c in generate(stub, timeout=120, **greedy(p, 24))[0] for t in c.token_ids]
                      for p in [*prompts, *prompts]]
            state = Ctl(f"127.0.0.1:{srv.app.admin_port}", str(token_file), capsys).json("state")
        return tokens, state

    one, _ = serve(argv)
    two, state = serve([*argv, "--tensor-parallel-size", "2"])
    assert two == one
    captured = [b for b in state["buckets"] if b["state"] == "BUCKET_STATE_CAPTURED"]
    assert {b.get("kind", "full") for b in captured} == {"full", "piecewise"}, state["buckets"]
    assert sum(int(b.get("replays", 0)) for b in state["buckets"]) > 0
    # Every rank's memory as the admin state shows it: rank 1 published its graphs and its device's
    # free and total memory (the CUDA path of the rank-memory report).
    ranks = {int(r.get("rank", 0)): r for r in state["ranks"]}
    assert sorted(ranks) == [0, 1], state["ranks"]
    for r in ranks.values():
        assert r.get("reported") and int(r["graph_bytes"]) > 0, r
        assert 0 < int(r["device_free_bytes"]) < int(r["device_total_bytes"]), r
