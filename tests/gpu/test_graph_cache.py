"""The graph cache on a real GPU: replay equals eager, lazy capture, budget and eviction measured,
failures leave the step eager and correct, and warm start after a restart.

A small Llama-architecture model in bf16 with random weights; the decode step is the engine's own
`ModelDecodeStep`. Graph memory is measured independently of the cache: the allocator's reserved
bytes after emptying its cache, relative to a baseline taken before any capture.
"""

from __future__ import annotations

import gc

import pytest
import structlog
import torch

from cache_manager import (
    BucketState,
    CudaGraphBackend,
    Fingerprint,
    GraphCache,
    GraphCacheConfig,
    OpOutcome,
    default_capture_sizes,
)
from cache_manager.testing import full_sizes

pytestmark = pytest.mark.gpu

MAX_BATCH = 64
MAX_SEQ = 128
PROMPT_LEN = 8
DEVICE = torch.device("cuda")


def _spec():
    from service.model.spec import ModelSpec

    return ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        attention_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        eos_token_ids=(),
        bos_token_id=None,
    )


@pytest.fixture(scope="module")
def model():
    return make_model()


def make_model():  # noqa: ANN201
    """The tests' bf16 model: random projections (std 0.02), norms at 1."""
    from service.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(_spec(), DEVICE, torch.bfloat16)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.02)
    return m


def new_kv():
    from service.model.kv_cache import KVCache

    return KVCache(_spec(), MAX_BATCH, MAX_SEQ, DEVICE, torch.bfloat16)


def new_step(model, kv):
    from service.engine.decode_step import ModelDecodeStep

    return ModelDecodeStep(model, kv, MAX_BATCH, DEVICE)


def fingerprint(sizes=None) -> Fingerprint:
    return Fingerprint(
        "test-llama",
        "bfloat16",
        torch.cuda.get_device_name(DEVICE),
        torch.__version__,
        sizes or default_capture_sizes(MAX_BATCH),
        MAX_BATCH,
    )


def new_cache(step, budget="4GiB", stats_file=None, backend=None, **kw) -> GraphCache:
    cfg = GraphCacheConfig("full", None, MAX_BATCH, memory_budget=budget, stats_file=stats_file, **kw)
    return GraphCache(step, cfg, DEVICE, fingerprint(), backend)


def prefill(model, kv, n: int, seed: int = 1) -> list[int]:
    """Prompt i goes into slot i; returns each row's first token (greedy)."""
    g = torch.Generator().manual_seed(seed)
    first = []
    for slot in range(n):
        ids = torch.randint(0, 4096, (PROMPT_LEN,), generator=g).to(DEVICE)
        first.append(int(model.prefill(ids, slot, kv).argmax()))
    return first


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def graph_bytes(baseline: int) -> int:
    """Memory the allocator holds beyond the baseline once its free cached blocks are returned.
    Garbage first: a capture collects (torch.cuda.graph does), so tensors in an earlier test's
    reference cycles would otherwise be freed between the baseline and the reading."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - baseline


def device_free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def bucket(cache: GraphCache, size: int):
    return next(b for b in cache.snapshot().buckets if b.size == size)


@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_replay_equals_eager(model, n):
    """Greedy decode for 64 steps through the cache equals eager on the same inputs. The first steps
    run eagerly while the capture thread records the graph beside them; the rest replay it."""
    graph_kv, ref_kv, plain_kv = new_kv(), new_kv(), new_kv()
    graph_step, ref_step, plain_step = (
        new_step(model, graph_kv),
        new_step(model, ref_kv),
        new_step(model, plain_kv),
    )
    tokens = prefill(model, graph_kv, n)
    assert prefill(model, ref_kv, n) == tokens and prefill(model, plain_kv, n) == tokens
    cache = new_cache(graph_step)
    padded = cache.descriptor(n).padded_size
    ref_tokens = list(tokens)
    slots = list(range(n))
    eager_steps = 0
    try:
        for t in range(64):
            positions = [PROMPT_LEN + t] * n
            replays = bucket(cache, padded).since_start.replays
            graph_step.write_rows(tokens, positions, slots)
            got = cache.run(n).clone()
            replayed = bucket(cache, padded).since_start.replays > replays
            eager_steps += not replayed
            # Eager on the same inputs at the size the cache ran (padded when replayed): the same
            # kernels, so the same greedy tokens.
            ref_step.write_rows(ref_tokens, positions, slots)
            ref_step.set_padding_rows(n, padded)
            want = ref_step.run(padded if replayed else n)[:n].clone()
            # Eager at the unpadded size, fed the same tokens: other GEMM shapes, so only close.
            plain_step.write_rows(tokens, positions, slots)
            plain = plain_step.run(n)
            assert got.shape == (n, 4096)
            assert rel_err(got, want) < 1e-2, t
            assert rel_err(got, plain) < 1e-2, t
            tokens = got.argmax(-1).tolist()
            ref_tokens = want.argmax(-1).tolist()
            assert tokens == ref_tokens, f"step {t}: max |replay - eager| {(got - want).abs().max()}"
        entry = bucket(cache, padded)
        assert entry.state is BucketState.CAPTURED and eager_steps >= 1
        assert entry.since_start.captures == 1 and entry.since_start.replays == 64 - eager_steps
        assert entry.since_start.eager_fallbacks == {"capturing": eager_steps}
        assert entry.since_start.padded_rows == (64 - eager_steps) * (padded - n)
    finally:
        cache.close()


def test_workload_captures_each_bucket_once_then_replays(model):
    kv = new_kv()
    step = new_step(model, kv)
    prefill(model, kv, 17)
    cache = new_cache(step)
    try:
        for i in range(3):
            for n in (3, 5, 17):
                step.write_rows([1] * n, [PROMPT_LEN] * n, list(range(n)))
                assert cache.run(n).shape[0] == n
            if i == 0:
                cache.wait_idle()  # the first pass ran eagerly while the graphs were captured beside it
        snap = cache.snapshot()
        captured = {b.size: b for b in snap.buckets if b.state is BucketState.CAPTURED}
        assert set(captured) == {4, 8, 24}
        for b in captured.values():
            assert b.since_start.captures == 1 and b.since_start.replays == 2 and b.bytes > 0
        assert all(b.since_start.captures == 0 for b in snap.buckets if b.size not in captured)
        assert full_sizes(snap.requested_since_start) == {3: 3, 5: 3, 17: 3}
    finally:
        cache.close()


def test_budget_of_two_graphs_is_never_exceeded_and_eviction_returns_memory(model):
    kv = new_kv()
    step = new_step(model, kv)
    prefill(model, kv, 24)
    cache = new_cache(step)
    # The capture thread's one-time costs (its cuBLAS handle and workspace) are not graphs.
    cache.capture([8])
    cache.evict([8])
    baseline = graph_bytes(0)

    cache.capture([8, 16, 24])
    sizes = {b.size: b.bytes for b in cache.snapshot().buckets if b.state is BucketState.CAPTURED}
    held = graph_bytes(baseline)
    assert 0 < held <= sum(sizes.values()), (held, sizes)
    cache.evict([8, 16, 24])
    assert graph_bytes(baseline) <= 0.05 * held, "eviction must give the graphs' memory back"

    ordered = sorted(sizes.values())
    budget = ordered[2] + ordered[1] + ordered[0] // 2  # any two fit, never three
    cache.set_budget(budget)
    worst = 0

    def serve(workload: list[int]) -> None:
        nonlocal worst
        for n in workload:
            step.write_rows([1] * n, [PROMPT_LEN] * n, list(range(n)))
            cache.run(n)
            cache.wait_idle()  # measure with no capture in flight: emptying the cache mid-capture is ours to avoid
            worst = max(worst, graph_bytes(baseline))
            assert cache.used_bytes <= budget

    try:
        # Which two graphs stay is the policy's business (unit-tested on CPU with a fake backend);
        # here the device's own numbers must stay within the budget while three buckets compete.
        serve([7, 15, 23] * 10 + [23] * 20 + [7, 15, 23] * 10)
        assert worst <= budget, (worst, budget)
        snap = cache.snapshot()
        assert any(b.state is BucketState.CAPTURED for b in snap.buckets)

        # Eviction gives the memory back to the device: the allocator's reserved bytes and the
        # driver's free bytes, measured here, move by about the bytes measured at capture.
        before, free_before = graph_bytes(baseline), device_free()
        victim = next(b.size for b in snap.buckets if b.state is BucketState.CAPTURED)
        result = cache.evict([victim])[victim]
        after, free_after = graph_bytes(baseline), device_free()
        assert result.outcome is OpOutcome.EVICTED and result.bytes > 0
        returned = max(before - after, free_after - free_before)
        assert returned >= 0.9 * bucket(cache, victim).bytes, (before, after, free_before, free_after, result)
    finally:
        cache.close()


def test_budget_too_small_runs_eager_and_correct(model):
    kv, ref_kv = new_kv(), new_kv()
    step, ref_step = new_step(model, kv), new_step(model, ref_kv)
    tokens = prefill(model, kv, 3)
    prefill(model, ref_kv, 3)
    cache = new_cache(step, budget=1)
    try:
        for t in range(4):
            step.write_rows(tokens, [PROMPT_LEN + t] * 3, [0, 1, 2])
            got = cache.run(3).clone()
            ref_step.write_rows(tokens, [PROMPT_LEN + t] * 3, [0, 1, 2])
            assert torch.equal(got, ref_step.run(3))
            tokens = got.argmax(-1).tolist()
            cache.wait_idle()
        assert cache.used_bytes == 0
        entry = bucket(cache, 4)
        # Nothing was ever measured, so one capture was tried (and dropped); then the estimate knew.
        assert entry.state is not BucketState.CAPTURED
        assert entry.since_start.eager_fallbacks == {"capturing": 1, "budget": 3}
    finally:
        cache.close()


class OomDuringCapture:
    """Wraps the real step; inside a stream capture it runs part of the step, then runs out of memory."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.max_batch = inner.max_batch

    def set_padding_rows(self, start: int, stop: int) -> None:
        self.inner.set_padding_rows(start, stop)

    def run_scratch(self, batch_size: int) -> torch.Tensor:
        return self.inner.run_scratch(batch_size)

    def run(self, batch_size: int) -> torch.Tensor:
        out = self.inner.run(batch_size)
        if torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory (injected during capture)")
        return out

    def input_addresses(self) -> tuple[int, ...]:
        return self.inner.input_addresses()


def test_failed_capture_leaves_step_eager_and_correct(model):
    kv, ref_kv = new_kv(), new_kv()
    inner, ref_step = new_step(model, kv), new_step(model, ref_kv)
    tokens = prefill(model, kv, 8)
    prefill(model, ref_kv, 8)
    step = OomDuringCapture(inner)
    cfg = GraphCacheConfig("full", None, MAX_BATCH, memory_budget="4GiB")
    cache = GraphCache(step, cfg, DEVICE, fingerprint(), CudaGraphBackend(DEVICE))
    try:
        with structlog.testing.capture_logs() as logs:
            for t in range(3):
                inner.write_rows(tokens, [PROMPT_LEN + t] * 8, list(range(8)))
                got = cache.run(8).clone()
                ref_step.write_rows(tokens, [PROMPT_LEN + t] * 8, list(range(8)))
                assert torch.equal(got, ref_step.run(8))
                tokens = got.argmax(-1).tolist()
                cache.wait_idle()
        failed = [e for e in logs if e["event"] == "graph_capture_failed"]
        assert len(failed) == 1 and "OutOfMemoryError" in failed[0]["reason"]
        entry = bucket(cache, 8)
        assert entry.state is BucketState.FAILED and entry.retry_at is not None
        assert entry.since_start.failures == 1
        assert entry.since_start.eager_fallbacks == {"capturing": 1, "failed": 2}
        # The device is still healthy: the real step captures and replays afterwards.
        healthy = new_cache(inner)
        assert healthy.capture([8])[8].outcome is OpOutcome.CAPTURED
        inner.write_rows(tokens, [PROMPT_LEN + 3] * 8, list(range(8)))
        got = healthy.run(8).clone()
        ref_step.write_rows(tokens, [PROMPT_LEN + 3] * 8, list(range(8)))
        ref_step.set_padding_rows(8, 8)
        assert rel_err(got, ref_step.run(8)) < 1e-2
        assert bucket(healthy, 8).state is BucketState.CAPTURED
        healthy.close()
    finally:
        cache.close()


def test_restart_warm_start_captures_hot_buckets_before_first_request(model, tmp_path):
    stats = tmp_path / "graph-stats.json"
    kv = new_kv()
    step = new_step(model, kv)
    prefill(model, kv, 17)
    first = new_cache(step, stats_file=stats)
    first.capture([24, 4])
    for n in [17] * 6 + [3] * 3:
        step.write_rows([1] * n, [PROMPT_LEN] * n, list(range(n)))
        first.run(n)
    first.close()
    assert stats.exists()

    step = new_step(model, kv)
    second = new_cache(step, stats_file=stats)
    try:
        assert full_sizes(second.snapshot().warm_queue) == (24, 4)  # hottest first
        assert bucket(second, 24).state is BucketState.NOT_CAPTURED
        assert second.warm_step() is True
        second.wait_idle()
        assert (
            bucket(second, 24).state is BucketState.CAPTURED
            and bucket(second, 4).state is not BucketState.CAPTURED
        )
        assert second.warm_step() is True
        second.wait_idle()
        assert second.warm_step() is False
        for n in (17, 3):
            step.write_rows([1] * n, [PROMPT_LEN] * n, list(range(n)))
            second.run(n)
        for size in (24, 4):
            entry = bucket(second, size)
            assert entry.since_start.captures == 1 and entry.since_start.replays == 1
            assert entry.since_start.eager_fallbacks == {}
            assert entry.persisted.replays == entry.since_start.replays + (6 if size == 24 else 3)
    finally:
        second.close()


def test_captures_beside_serving_steps_leave_their_outputs_and_kv_intact(model):
    """Every bucket is captured on the capture thread while the main thread keeps decoding 64 live
    rows through the cache (eager until the largest bucket is in, then replayed at the same size).
    The live rows' tokens and KV equal a run that captured nothing: the warm-ups (which execute)
    touched only the scratch slot, and recording read the static inputs that the serving steps were
    rewriting without disturbing them."""
    kv, ref_kv = new_kv(), new_kv()
    step, ref_step = new_step(model, kv), new_step(model, ref_kv)
    tokens = prefill(model, kv, MAX_BATCH)
    assert prefill(model, ref_kv, MAX_BATCH) == tokens
    ref_tokens = list(tokens)
    cache = new_cache(step)
    try:
        everything = cache.capture_async(cache.config.sizes)
        t = 0
        while not everything.done() or t < 4:
            cache.poll()
            positions, slots = [PROMPT_LEN + t] * MAX_BATCH, list(range(MAX_BATCH))
            step.write_rows(tokens, positions, slots)
            got = cache.run(MAX_BATCH).clone()
            ref_step.write_rows(ref_tokens, positions, slots)
            want = ref_step.run(MAX_BATCH)
            assert rel_err(got, want) < 1e-2, t
            tokens, ref_tokens = got.argmax(-1).tolist(), want.argmax(-1).tolist()
            assert tokens == ref_tokens, t
            t += 1
            assert t < MAX_SEQ - PROMPT_LEN, "captures did not finish"
        assert all(r.outcome is OpOutcome.CAPTURED for r in everything.result().values())
        for layer in range(len(kv.k)):
            filled = PROMPT_LEN + t
            for got, want in ((kv.k[layer], ref_kv.k[layer]), (kv.v[layer], ref_kv.v[layer])):
                got, want = kv.slot_view(got), ref_kv.slot_view(want)  # [slot, KVH, position, D]
                assert rel_err(got[:MAX_BATCH, :, :filled], want[:MAX_BATCH, :, :filled]) < 1e-2
        # After all that, every bucket replays what eager computes.
        for n in cache.config.sizes:
            step.write_rows([1] * n, [PROMPT_LEN] * n, list(range(n)))
            got = cache.run(n).clone()
            ref_step.write_rows([1] * n, [PROMPT_LEN] * n, list(range(n)))
            assert rel_err(got, ref_step.run(n)) < 1e-2, n
    finally:
        cache.close()


def test_two_caches_on_one_device_capture_at_once(model):
    """Two graph caches in one process (as two LLM objects hold) each run a capture thread; their
    captures share the device's side stream and take turns, so every size of both gets captured and
    replays what eager gives."""
    kv = new_kv()
    steps = [new_step(model, kv), new_step(model, kv)]
    caches = [new_cache(step) for step in steps]
    try:
        for cache in caches:  # both capture threads start before either is waited for
            cache.capture_async([1, 2, 4, 8])
        for cache in caches:
            cache.wait_idle(timeout=120)
        for cache in caches:
            states = {b.size: b.state for b in cache.snapshot().buckets if b.size <= 8}
            assert states == {n: BucketState.CAPTURED for n in (1, 2, 4, 8)}, states
        tokens = prefill(model, kv, 3)
        for step, cache in zip(steps, caches):
            step.write_rows(tokens, [PROMPT_LEN] * 3, [0, 1, 2])
            eager = step.run(3).clone()
            step.write_rows(tokens, [PROMPT_LEN] * 3, [0, 1, 2])
            assert rel_err(cache.run(3)[:3], eager) < 1e-2
    finally:
        for cache in caches:
            cache.close()
