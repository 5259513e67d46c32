"""The host tier under the prefix cache, as a user of the Python API meets it (CPU, float32): a
conversation whose prefix the small device pool evicted comes back from host memory, with the
greedy tokens of a full recomputation; the tier holds no more blocks than its bound; every block
goes back when the requests end; a router subscribed to KV events sees both tiers, and /metrics
counts the tier."""

from __future__ import annotations

import collections

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from service.engine.block_pool import chain_hashes
from service.engine_client.calls import ReadKvState
from service.llm import LLM, SamplingParams
from service.server.vllm_servicer import wire_hash
from tests.integration.test_kv_events import Subscriber, complete
from tests.integration.test_vllm_metrics import scrape
from tests.support.server import running_server

BLOCK_BYTES = 32 * 1024  # the tiny model's float32 KV block (16 tokens)
SYSTEM = [(13 * j) % 500 + 3 for j in range(96)]  # six full blocks
FILLERS = [[(7 * i + 5 * j) % 600 + 3 for j in range(80)] for i in range(4)]  # five blocks each
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def conversation(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """A first turn, other users' prompts that turn the device pool over, then the second turn
    (the first with its answer and a follow-up). Returns every answer and each one's cached tokens."""
    first = llm.generate(SYSTEM + [7, 8, 9], GREEDY)[0]
    answers, cached = [first.outputs[0].token_ids], [first.num_cached_tokens]
    for filler in FILLERS:
        out = llm.generate(filler, GREEDY)[0]
        answers.append(out.outputs[0].token_ids)
    second = llm.generate(SYSTEM + [7, 8, 9] + list(first.outputs[0].token_ids) + [11, 12], GREEDY)[0]
    answers.append(second.outputs[0].token_ids)
    cached.append(second.num_cached_tokens)
    return answers, cached


def new_llm(model_cache_dir, host_blocks: int) -> LLM:  # noqa: ANN001
    # 14 usable blocks: the fillers evict the conversation's prefix from the device pool.
    return LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, device="cpu", dtype="float32",
               max_running_seqs=2, max_seq_len=128, kv_cache_memory_bytes=15 * BLOCK_BYTES,
               kv_host_cache_memory=host_blocks * BLOCK_BYTES)


def test_a_prefix_evicted_from_the_device_comes_back_from_host_memory_with_the_same_tokens(model_cache_dir) -> None:  # noqa: ANN001
    with new_llm(model_cache_dir, 0) as llm:
        recomputed, cached_off = conversation(llm)
        start_free = llm._engine.engine.scheduler.block_stats().free
    assert cached_off == [0, 0]  # the device pool alone lost the prefix

    with new_llm(model_cache_dir, 64) as llm:
        scheduler = llm._engine.engine.scheduler
        free = scheduler.block_stats().free
        restored, cached_on = conversation(llm)
        stats = scheduler.block_stats()
    assert restored == recomputed
    assert cached_on == [0, 96]  # the six system blocks, from the host tier
    assert stats.host.hits * 16 >= 96 and stats.host.stored >= 6
    assert stats.free == free == start_free and stats.used == 0  # no block leaked


def test_the_host_tier_keeps_at_most_its_bound_least_recently_used_out_first(model_cache_dir) -> None:  # noqa: ANN001
    with new_llm(model_cache_dir, 4) as llm:  # four blocks: the system prompt's six do not all fit
        scheduler = llm._engine.engine.scheduler
        answers, cached = conversation(llm)
        stats = scheduler.block_stats()
        assert stats.host.cached <= 4 and stats.host.bytes_used <= 4 * BLOCK_BYTES
        assert stats.host.evictions > 0
        # The fillers went in after the system prompt: the system prompt's blocks went out first.
        assert cached == [0, 0]
        assert stats.free == stats.num_blocks and stats.used == 0


def test_a_router_sees_blocks_move_to_host_memory_and_back_and_metrics_count_the_tier(model_cache_dir) -> None:  # noqa: ANN001
    """Through SubscribeKvEvents: the system prompt's blocks are removed from "GPU" and stored on "CPU"
    (tier HOST) when the pool evicts them, stored on "GPU" again when the second turn brings them
    back; per tier, the replayed sets equal the engine's. /metrics counts the tier's hits and bytes."""
    argv = ["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "128", "--max-running-seqs", "2",
            "--kv-cache-memory", str(15 * BLOCK_BYTES), "--kv-host-cache-memory", str(64 * BLOCK_BYTES)]
    with running_server(argv) as server:
        sub = TieredSubscriber(server).start()
        try:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
            first = complete(stub, SYSTEM + [7, 8, 9], 8)
            for filler in FILLERS:
                complete(stub, filler, 8)
            system = {wire_hash(h) for h in chain_hashes(SYSTEM, 16)}
            sub.wait_for(lambda: system <= sub.cached[common_pb2.KV_CACHE_TIER_HOST])
            assert not system & sub.cached[common_pb2.KV_CACHE_TIER_DEVICE]
            second = complete(stub, SYSTEM + [7, 8, 9] + list(first.output_ids) + [11, 12], 8)
            assert second.cached_tokens == 96
            sub.wait_for(lambda: system <= sub.cached[common_pb2.KV_CACHE_TIER_DEVICE])
            assert sub.media == {"GPU", "CPU"}
            stats = server.app.engine.request(ReadKvState())
            assert len(sub.cached[common_pb2.KV_CACHE_TIER_DEVICE]) == stats.cached
            assert len(sub.cached[common_pb2.KV_CACHE_TIER_HOST]) == stats.host.cached
        finally:
            sub.stop()
        _, samples = scrape(server.app.metrics_port)
    assert samples["graphserve_kv_host_cache_hits_total", ()] == 96
    assert samples["graphserve_kv_host_cache_bytes", (("state", "capacity"),)] == 64 * BLOCK_BYTES
    assert samples["graphserve_kv_host_cache_bytes", (("state", "used"),)] == stats.host.cached * BLOCK_BYTES


class TieredSubscriber(Subscriber):
    """A subscriber that keeps one set of block hashes per tier."""

    def __init__(self, server) -> None:  # noqa: ANN001
        super().__init__(server)
        self.cached = collections.defaultdict(set)
        self.media: set[str] = set()

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        self.batches.append(batch)
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                self.media.add(event.stored.medium)
                self.cached[event.stored.tier].update(b.block_hash for b in event.stored.blocks)
            elif kind == "removed":
                self.cached[event.removed.tier].difference_update(event.removed.block_hashes)
            else:
                self.cached.clear()
        self.last = batch.sequence_number
