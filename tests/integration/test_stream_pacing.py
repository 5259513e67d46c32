"""--stream-message-rate: a server that writes few messages merges each stream's tokens, loses none,
never holds a stream's first token or its finish, and frees what a cancelled held stream had."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from service.proto import inference_pb2
from tests.support.server import ServerThread, generate, generate_samples, greedy

RATE = 4.0  # messages per second across all streams: one open stream gets one every 0.25 s


@pytest.fixture(scope="module")
def paced(model_cache_dir) -> ServerThread:  # noqa: ANN001
    srv = ServerThread(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "8", "--max-seq-len", "512",
                        "--stream-message-rate", str(RATE)]).start()
    yield srv
    srv.stop()


def _timed(stub, request: dict) -> tuple[list[float], list, inference_pb2.Finished, float]:  # noqa: ANN001
    """(arrival time of each chunk, the chunks, the finished message, the call's whole time)."""
    start, times, chunks, finished = time.monotonic(), [], [], None
    for response in stub.Generate(inference_pb2.GenerateRequest(**request), timeout=60):
        if response.WhichOneof("kind") == "chunk":
            times.append(time.monotonic())
            chunks.append(response.chunk)
        else:
            finished = response.finished
    return times, chunks, finished, time.monotonic() - start


def test_a_paced_stream_gets_every_token_once_in_fewer_messages(paced, server) -> None:
    request = greedy("Once upon a time", 200)
    expected = [t for c in generate(server.stub(), **request)[0] for t in c.token_ids]
    times, chunks, finished, _ = _timed(paced.stub(), request)
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == expected and finished.usage.completion_tokens == 200
    assert "".join(c.text for c in chunks) == paced.app.tokenizer.decode(ids, skip_special_tokens=True)
    assert len(chunks) < 200 / 4, f"{len(chunks)} messages for 200 tokens at {RATE:g} messages/s"
    assert len(chunks[0].token_ids) == 1, "the first token is sent at once, alone"
    # Between chunks at least the stream's share of the rate (1 / RATE s), but at the end: the finish
    # releases the held chunk at once, and its own last delta follows.
    gaps = [b - a for a, b in zip(times, times[1:])][:-2]
    assert gaps
    assert all(gap > 0.8 / RATE for gap in gaps), gaps


def test_the_finish_of_a_paced_stream_is_not_held(paced) -> None:
    # Four streams: each may get a message every second, so a held finish would arrive up to 1 s late.
    requests = [greedy(p, 24) for p in ("hello", "a b c d e f", "graphs and caches", "The quick brown fox")]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda r: _timed(paced.stub(), r), requests))
    for _, chunks, finished, elapsed in results:
        assert sum(len(c.token_ids) for c in chunks) == 24
        assert elapsed - finished.timings.total_seconds < 0.5, (elapsed, finished.timings.total_seconds)


def test_cancelling_held_streams_frees_their_sequences_and_others_finish(paced, server) -> None:
    stub = paced.stub()
    requests = [greedy(p, 120) for p in ("hello", "a b c d e f", "graphs and caches", "The quick brown fox")]
    expected = [[t for c in generate(server.stub(), **r)[0] for t in c.token_ids] for r in requests]

    def consume(i: int) -> object:
        call = stub.Generate(inference_pb2.GenerateRequest(**requests[i]), timeout=60)
        ids: list[int] = []
        try:
            for response in call:
                ids += response.chunk.token_ids
                if i % 2 and ids:  # cancel right after the first token: the next chunk is being held
                    call.cancel()
            return ids
        except grpc.RpcError as exc:
            return exc.code()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(consume, range(4)))
    assert results[0] == expected[0] and results[2] == expected[2]
    assert results[1] == results[3] == grpc.StatusCode.CANCELLED
    engine = paced.app.engine
    deadline = time.monotonic() + 10
    while (engine.num_running or engine.num_waiting or engine.num_free_slots != 8) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (engine.num_running, engine.num_waiting, engine.num_free_slots) == (0, 0, 8)
    assert not paced.app.streams.active


def test_each_sample_of_an_n_sample_stream_is_paced_and_merged_on_its_own(paced, server) -> None:
    """Samples' deltas interleave in one stream: each sample still gets its share of messages with its
    own tokens merged, so an n-sample stream is not held back (nor paused for its backlog)."""
    request = dict(text="Once upon a time", sampling=inference_pb2.SamplingParams(temperature=1.0, seed=9),
                   stopping=inference_pb2.StoppingCriteria(max_tokens=150, ignore_eos=True))
    expected, _ = generate_samples(server.stub(), 4, **request)
    start = time.monotonic()
    chunks, finished = generate_samples(paced.stub(), 4, **request)
    elapsed = time.monotonic() - start
    for i in range(4):
        ids = [t for c in chunks if c.index == i for t in c.token_ids]
        assert ids == [t for c in expected if c.index == i for t in c.token_ids] and len(ids) == 150
        assert len([c for c in chunks if c.index == i]) < 150 / 4  # merged
    # Not slowed to one message per sample per 4 gaps (~40 s for 150 tokens): the engine's pace
    assert elapsed < max(10.0, 3 * max(f.timings.total_seconds for f in finished))
