"""The paged KV cache as clients meet it, through a real server: a prompt whose prefix is cached gives
the tokens of one computed in full and reports its cached tokens; a pool twice oversubscribed
preempts and resumes requests, every stream completing with its exact tokens; the pool's state in
/metrics and the admin state; a pool too small for one sequence fails the start, saying what to
change."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from service.proto import admin_pb2, admin_pb2_grpc
from service.proto import inference_pb2 as pb
from tests.support.server import generate, running_server

SHARED = list(range(40, 40 + 96))  # six full 16-token blocks
TOKEN = "paged-kv-admin-token"


def ids_request(ids: list[int], max_tokens: int) -> dict:
    return dict(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def tokens_of(chunks: list) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name + (str(sorted(s.labels.items())) if s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_cached_prefix_gives_the_tokens_of_a_full_prefill_and_reports_its_cached_tokens(model_cache_dir) -> None:
    prompts = [SHARED + [300 + i, 301 + i, 302] for i in range(3)]
    results = {}
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256", flag]) as server:
            stub = server.stub()
            runs = [generate(stub, **ids_request(p, 12)) for p in prompts]  # one at a time: later ones hit
            results[flag] = [tokens_of(chunks) for chunks, _ in runs]
            cached = [finished.usage.cached_prompt_tokens for _, finished in runs]
            m = metrics(server.app.metrics_port)
            if flag == "--prefix-caching":
                # The first computes everything; the others find the shared blocks (and the BOS-less
                # token-id prompts share exactly the 96 tokens: 6 blocks).
                assert cached == [0, 96, 96]
                assert m["graphserve_prefix_cache_hits_total"] == 192
                assert m["graphserve_prefix_cache_queries_total"] == sum(len(p) for p in prompts)
                assert m["vllm:prefix_cache_hits_total[('engine', '0'), ('model_name', 'builtin:tiny')]"] == 192
                assert m["graphserve_kv_blocks[('state', 'cached')]"] >= 6
            else:
                assert cached == [0, 0, 0] and m["graphserve_prefix_cache_hits_total"] == 0
            assert m["graphserve_kv_blocks[('state', 'used')]"] == 0  # every request ended: no block held
    assert results["--prefix-caching"] == results["--no-prefix-caching"]


def test_an_oversubscribed_pool_preempts_and_every_stream_completes_exactly(model_cache_dir) -> None:
    """12 streams of 40 + 120 tokens (10 blocks each, 120 at once) over a pool of 60 blocks: requests
    are preempted and recompute, and each stream gets exactly its tokens, the same as with room."""
    prompts = [[(7 * i + 3 * j) % 700 + 3 for j in range(40)] for i in range(12)]
    outputs = {}
    for memory in ("1966080", "64MiB"):  # tiny: 32 KiB per block (60 blocks), then ample
        argv = ["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256", "--kv-cache-memory", memory,
                "--max-running-seqs", "12", "--no-prefix-caching"]
        with running_server(argv, environ={"GRAPHSERVE_ADMIN_TOKEN": TOKEN}) as server:
            stub = server.stub()
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                runs = list(pool.map(lambda p, stub=stub: generate(stub, timeout=120, **ids_request(p, 120)), prompts))
            m = metrics(server.app.metrics_port)
            admin = admin_pb2_grpc.GraphCacheAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.app.admin_port}"))
            state = admin.GetCacheState(admin_pb2.GetCacheStateRequest(),
                                        metadata=[("authorization", f"Bearer {TOKEN}")])
        outputs[memory] = [tokens_of(chunks) for chunks, _ in runs]
        assert all(len(t) == 120 and f.usage.completion_tokens == 120 for t, (_, f) in zip(outputs[memory], runs))
        assert state.kv_cache.block_size == 16 and state.kv_cache.used_blocks == 0
        assert state.kv_cache.dtype == server.app.model.dtype  # --kv-cache-dtype auto: the model's
        if memory == "1966080":
            assert state.kv_cache.total_blocks == 59
            assert m["graphserve_preemptions_total"] > 0 and state.kv_cache.preemptions == m["graphserve_preemptions_total"]
        else:
            assert m["graphserve_preemptions_total"] == 0
    assert outputs["1966080"] == outputs["64MiB"]


def test_a_pool_smaller_than_one_sequence_fails_the_start_saying_what_to_change(model_cache_dir) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--model-cache-dir", str(model_cache_dir), "--port", "0",
         "--admin-port", "0", "--metrics-port", "0", "--max-seq-len", "2048", "--kv-cache-memory", "1MiB"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "fewer than one sequence of --max-seq-len 2048 needs (128)" in out and "--kv-cache-memory" in out
