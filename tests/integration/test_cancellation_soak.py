"""Several hundred streams over about a minute with random cancels and deadlines.

Every stream that is neither cancelled nor past its deadline gets exactly its tokens; at the end
no sequence is running or waiting, every slot is free, and the process's memory has settled.
"""

from __future__ import annotations

import concurrent.futures
import random
import resource
import time

import grpc
import pytest

from service.proto import inference_pb2
from tests.support.server import generate, greedy, running_server

PROMPTS = ["Once upon a time", "The quick brown fox", "graphs and caches", "hello", "a b c d", "numbers 1 2 3"]
MAX_TOKENS = 64


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stream(stub, prompt: str, max_tokens: int, cancel_after: int | None, deadline: float | None):  # noqa: ANN001, ANN202
    call = stub.Generate(inference_pb2.GenerateRequest(**greedy(prompt, max_tokens)), timeout=deadline or 120)
    tokens: list[int] = []
    try:
        for response in call:
            tokens += response.chunk.token_ids
            if cancel_after is not None and len(tokens) >= cancel_after:
                call.cancel()
        return "ok", tokens
    except grpc.RpcError as exc:
        return exc.code().name, tokens


@pytest.mark.slow
def test_cancellation_soak(model_cache_dir) -> None:  # noqa: ANN001
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "16",
                         "--max-seq-len", "256"]) as server:
        stub = server.stub()
        reference = {p: [t for c in generate(stub, **greedy(p, MAX_TOKENS))[0] for t in c.token_ids] for p in PROMPTS}
        rng = random.Random(7)
        plans = []
        for _ in range(800):
            kind = rng.random()
            cancel_after = rng.randint(1, 20) if kind < 0.3 else None
            deadline = rng.uniform(0.05, 0.6) if 0.3 <= kind < 0.5 else None
            plans.append((rng.choice(PROMPTS), rng.randint(1, MAX_TOKENS), cancel_after, deadline))

        def run(plan):  # noqa: ANN001, ANN202
            return plan, _stream(stub, *plan)

        rss = []
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            for round_start in range(0, len(plans), 200):
                for (prompt, max_tokens, cancel_after, deadline), (status, tokens) in pool.map(
                        run, plans[round_start:round_start + 200]):
                    if cancel_after is None and deadline is None:
                        assert status == "ok" and tokens == reference[prompt][:max_tokens]
                    elif cancel_after is not None:
                        assert status in ("ok", "CANCELLED")
                    else:
                        assert status in ("ok", "DEADLINE_EXCEEDED")
                    assert tokens == reference[prompt][:len(tokens)]  # whatever arrived is right
                rss.append(_rss_mib())
        elapsed = time.monotonic() - started

        engine = server.app.engine
        deadline = time.monotonic() + 10
        while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_running == 0 and engine.num_waiting == 0
        assert engine.num_free_slots == 16
        assert not server.app.streams.active
        # Memory settles: the last round grows the process by little over the second.
        assert rss[-1] - rss[1] < 100, f"RSS per round (MiB): {rss}"
        print(f"soak: {len(plans)} streams in {elapsed:.1f} s, RSS per 200 streams (MiB): {[round(r) for r in rss]}")
