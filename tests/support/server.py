"""A real graphserve server on a loopback port, run in-process on its own event-loop thread."""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from service.config import load_config
from service.proto import inference_pb2, inference_pb2_grpc
from service.server.app import App


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """GRAPHSERVE_TEST_ARGS (e.g. "--device cuda --dtype bfloat16") is appended to every test server's
    flags: the same integration tests then run on a GPU."""

    def __init__(self, argv: list[str], environ: dict[str, str] | None = None) -> None:
        extra = shlex.split(os.environ.get("GRAPHSERVE_TEST_ARGS", ""))
        self.config = load_config(["--host", "127.0.0.1", "--port", "0", "--metrics-port", str(free_port()),
                                   "--admin-port", "0", *argv, *extra], environ or {})
        self.app = App(self.config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        self._run(self.app.start())
        self._run(self.app.load(), timeout=300)
        return self

    def _run(self, coro, timeout: float = 60):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    def stop(self) -> None:
        self._run(self.app.shutdown(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel())


@contextmanager
def running_server(argv: list[str], environ: dict[str, str] | None = None) -> Iterator[ServerThread]:
    server = ServerThread(argv, environ).start()
    try:
        yield server
    finally:
        server.stop()


def generate(stub: inference_pb2_grpc.InferenceStub, timeout: float = 60, **fields) -> tuple[list, inference_pb2.Finished]:  # noqa: ANN003
    """Run one Generate call; returns (chunks, finished)."""
    chunks, finished = [], None
    for response in stub.Generate(inference_pb2.GenerateRequest(**fields), timeout=timeout):
        kind = response.WhichOneof("kind")
        assert finished is None, "a message arrived after the finished message"
        if kind == "chunk":
            chunks.append(response.chunk)
        else:
            finished = response.finished
    assert finished is not None, "the stream ended without a finished message"
    return chunks, finished


def generate_samples(stub: inference_pb2_grpc.InferenceStub, n: int, timeout: float = 60, **fields
                     ) -> tuple[list, list[inference_pb2.Finished]]:  # noqa: ANN003
    """Run one Generate call for n samples; returns (chunks, each sample's finished, by index)."""
    chunks, finished = [], {}
    for response in stub.Generate(inference_pb2.GenerateRequest(n=n, **fields), timeout=timeout):
        if response.WhichOneof("kind") == "chunk":
            assert response.chunk.index not in finished, "a chunk arrived after its sample's finished message"
            chunks.append(response.chunk)
        else:
            assert response.finished.index not in finished, "two finished messages for one sample"
            finished[response.finished.index] = response.finished
    assert sorted(finished) == list(range(n)), f"finished messages for samples {sorted(finished)} of {n}"
    return chunks, [finished[i] for i in range(n)]


def greedy(prompt: str, max_tokens: int, **extra) -> dict:  # noqa: ANN003
    return dict(
        text=prompt,
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **extra,
    )
