"""SubscribeKvEvents, GetLoads' hit rate and the vllm: prefix-cache counters on a real server (the
built-in model, 16-token blocks): what a cache-aware router sees of the engine's prefix cache."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as v

from service.engine.block_pool import chain_hashes
from service.engine_client.calls import ReadKvState
from service.server.vllm_servicer import wire_hash
from tests.integration.test_vllm_metrics import scrape, vllm
from tests.support.server import ServerThread, running_server

BS = 16
BUFFER = 4


@pytest.fixture(scope="module")
def server(model_cache_dir) -> Iterator[ServerThread]:  # noqa: ANN001
    """Its own server: a subscriber is dropped after BUFFER batches it has not read."""
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "512",
                         "--kv-events-buffer", str(BUFFER)]) as srv:
        yield srv


class Subscriber:
    """Reads a SubscribeKvEvents stream on a thread, as smg's monitor does: a set of block hashes,
    the last sequence number applied."""

    def __init__(self, server: ServerThread, start: int = 0, channel: grpc.Channel | None = None) -> None:
        self.channel = channel or server.channel()
        self.call = vllm_engine_pb2_grpc.VllmEngineStub(self.channel).SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
        self.batches: list[common_pb2.KvEventBatch] = []
        self.cached: set[int] = set()
        self.last = 0
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> Subscriber:
        self._thread.start()
        return self

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.apply(batch)
        except grpc.RpcError as exc:
            self.error = exc

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        if self.last and batch.sequence_number <= self.last:
            return  # the one it applied, replayed on resume
        assert not self.last or batch.sequence_number == self.last + 1 or batch.HasField("snapshot"), "a gap"
        self.batches.append(batch)
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                self.cached.update(b.block_hash for b in event.stored.blocks)
            elif kind == "removed":
                self.cached.difference_update(event.removed.block_hashes)
            else:
                self.cached.clear()
        self.last = batch.sequence_number

    def wait_for(self, condition, timeout: float = 30) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out; last batch {self.batches[-1:] if self.batches else None}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.call.cancel()
        self._thread.join(10)


def engine(server: ServerThread) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(server.channel())


def complete(stub: vllm_engine_pb2_grpc.VllmEngineStub, prompt: list[int], max_tokens: int = 1) -> v.GenerateComplete:
    request = v.GenerateRequest(tokenized=v.TokenizedInput(input_ids=prompt), stream=False,
                                sampling_params=v.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    [response] = list(stub.Generate(request, timeout=60))
    return response.complete


def flush(server: ServerThread) -> None:
    assert engine(server).FlushCache(common_pb2.FlushCacheRequest(), timeout=30).success


def test_stored_blocks_carry_their_tokens_and_chain_a_hit_stores_nothing_a_flush_clears(server) -> None:  # noqa: ANN001
    flush(server)
    sub = Subscriber(server).start()
    try:
        sub.wait_for(lambda: sub.batches)
        first = sub.batches[0]
        assert first.HasField("snapshot") and first.events[0].WhichOneof("data") == "cleared"
        prompt = [random.Random(1).randrange(5, 200) for _ in range(3 * BS + 5)]
        stub = engine(server)
        assert complete(stub, prompt).cached_tokens == 0
        hashes = [wire_hash(h) for h in chain_hashes(prompt, BS)]
        sub.wait_for(lambda: set(hashes) <= sub.cached)
        blocks = [b for batch in sub.batches for e in batch.events if e.WhichOneof("data") == "stored"
                  for b in e.stored.blocks]
        by_hash = {b.block_hash: b for b in blocks}
        for i, h in enumerate(hashes):
            assert list(by_hash[h].token_ids) == prompt[i * BS:(i + 1) * BS] and by_hash[h].block_size == BS
        runs = [e.stored for batch in sub.batches for e in batch.events if e.WhichOneof("data") == "stored"]
        assert not runs[0].HasField("parent_block_hash") and runs[0].blocks[0].block_hash == hashes[0]
        assert all(r.parent_block_hash in by_hash for r in runs[1:]), "a later run names a block stored before"
        assert all(e.event_id > 0 for batch in sub.batches[1:] for e in batch.events)

        seen = len(sub.batches)
        assert complete(stub, prompt).cached_tokens == 3 * BS  # a hit: those blocks are not stored again
        time.sleep(0.3)
        assert not [b for batch in sub.batches[seen:] for e in batch.events if e.WhichOneof("data") == "stored"
                    for b in e.stored.blocks if b.block_hash in hashes]
        assert len(sub.cached) == server.app.engine.request(ReadKvState()).cached  # the subscriber's set is the pool's size

        flush(server)
        sub.wait_for(lambda: not sub.cached)
        assert sub.batches[-1].events[-1].WhichOneof("data") == "cleared"
    finally:
        sub.stop()


def test_a_subscriber_resumes_from_its_sequence_number_without_gap_or_duplicate(server) -> None:  # noqa: ANN001
    stub = engine(server)
    rng = random.Random(2)
    first = Subscriber(server).start()
    try:
        complete(stub, [rng.randrange(5, 200) for _ in range(2 * BS + 1)])
        first.wait_for(lambda: len(first.batches) >= 2)
    finally:
        first.stop()
    for _ in range(3):  # steps it misses
        complete(stub, [rng.randrange(5, 200) for _ in range(2 * BS + 1)])
    again = Subscriber(server, start=first.last)
    again.cached, again.last = set(first.cached), first.last
    watcher = Subscriber(server).start()  # a new one, from the current state
    again.start()
    try:
        watcher.wait_for(lambda: watcher.batches)
        again.wait_for(lambda: again.last >= watcher.last)
        assert all(b.sequence_number > first.last and not b.HasField("snapshot") for b in again.batches)
        assert again.cached == watcher.cached
    finally:
        again.stop()
        watcher.stop()


def test_a_slow_subscriber_is_dropped_while_steps_go_on(server) -> None:  # noqa: ANN001
    # A client that reads nothing and grants the server a small flow-control window: the server's
    # writes stop, its queue fills, and the hub drops it.
    stuck_channel = grpc.insecure_channel(server.address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                                  ("grpc.http2.bdp_probe", 0)])
    stuck = Subscriber(server, channel=stuck_channel)  # never started: nobody reads
    follower = Subscriber(server).start()
    dropped_before = server.app.kv_events.num_dropped
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 200) for _ in range(20 * BS)] for _ in range(120)]
    try:
        stub = engine(server)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for done in pool.map(lambda p: complete(stub, p), prompts):
                assert done.completion_tokens == 1
        elapsed = time.monotonic() - started
        assert server.app.kv_events.num_dropped == dropped_before + 1, "the stuck subscriber was not dropped"
        with pytest.raises(grpc.RpcError) as failure:
            for _ in stuck.call:  # what it had in flight, then the end
                pass
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "subscribe again from the last sequence number" in failure.value.details()
        follower.wait_for(lambda: follower.last == server.app.kv_events.last_sequence)
        assert follower.error is None
        print(f"120 prompts of {20 * BS} tokens in {elapsed:.1f} s beside a stuck subscriber")
    finally:
        follower.stop()
        stuck.call.cancel()
        stuck_channel.close()


def test_get_loads_reports_the_prefix_cache_hit_rate(server) -> None:  # noqa: ANN001
    stub = engine(server)
    prompt = [random.Random(4).randrange(5, 200) for _ in range(4 * BS)]
    complete(stub, prompt)
    complete(stub, prompt)
    [load] = stub.GetLoads(v.GetLoadsRequest(), timeout=10).loads
    stats = server.app.engine.request(ReadKvState())
    assert stats.prefix_hits > 0 and load.cache_hit_rate == pytest.approx(stats.prefix_hits / stats.prefix_queries)
    assert 0 < load.cache_hit_rate < 1


def test_metrics_count_the_prefix_cache_as_vllm_names_it(server) -> None:  # noqa: ANN001
    """vllm:prefix_cache_queries / _hits advance by the prompt tokens looked up and found (the same
    counts as GetLoads' rate); vllm:cache_config_info gives the block size and the pool's blocks."""
    port, stub = server.app.metrics_port, engine(server)
    prompt = [random.Random(5).randrange(5, 200) for _ in range(5 * BS + 3)]
    _, before = scrape(port)
    complete(stub, prompt)
    again = complete(stub, prompt)
    _, after = scrape(port)
    stats = server.app.engine.request(ReadKvState())

    def delta(name: str) -> float:
        return vllm(after, name) - vllm(before, name)

    assert delta("vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert delta("vllm:prefix_cache_hits_total") == again.cached_tokens == 5 * BS
    assert (vllm(after, "vllm:prefix_cache_queries_total"), vllm(after, "vllm:prefix_cache_hits_total")) == (
        stats.prefix_queries, stats.prefix_hits)
    [info] = [dict(labels) for (name, labels) in after if name == "vllm:cache_config_info"]
    assert (info["block_size"], info["num_gpu_blocks"]) == (str(BS), str(stats.num_blocks))
