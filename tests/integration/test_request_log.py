"""The `request_finished` line an operator reads: where a request's first token spent its time."""

from __future__ import annotations

import structlog

from tests.support.server import ServerThread, generate, greedy


def test_request_finished_splits_the_first_token_into_engine_pipe_and_write(server: ServerThread) -> None:
    with structlog.testing.capture_logs() as logs:
        chunks, finished = generate(server.stub(), **greedy("where does the time go", 6))
    assert finished.usage.completion_tokens == 6 and chunks
    line = next(e for e in logs if e["event"] == "request_finished")
    # the engine's time to first token, then its event's arrival in the gRPC process, then its write:
    # one clock (monotonic) across both processes, so the three only grow
    assert 0 < line["ttft_s"] <= line["first_token_in_s"] <= line["first_written_s"] < 30, line
