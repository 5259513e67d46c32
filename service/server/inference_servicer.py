"""The Inference servicer: protobuf in, validated domain request to the engine, protobuf out.

The event loop never waits on the engine: each step's events arrive from the engine process in one
message (see engine_process.py), and each stream drains its own queue. A client that falls
behind gets the tokens that piled up merged into one message instead of one message per token.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from service.engine.engine import Engine, EngineStopped
from service.engine.request import EngineError, Finish, FinishReason, RequestEvent, TokenDelta
from service.proto import inference_pb2, inference_pb2_grpc
from service.server.validation import (
    InvalidRequest,
    Limits,
    check_adapter,
    check_prompt_size,
    prompt_bytes,
    prompt_ids,
    request_id_of,
    to_generation_request,
)

log = structlog.get_logger("graphserve.server")

# Prompts above this many bytes are tokenized off the event loop.
_INLINE_TOKENIZE_BYTES = 16 * 1024

_FINISH_REASONS = {
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: inference_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: inference_pb2.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_waiting_tokens: int
    max_concurrent_streams: int
    stream_stall_timeout: float = 30.0  # seconds a client may accept no data before its stream is aborted
    max_stream_backlog_tokens: int = 128  # undelivered tokens per stream before its sequence is paused


class _Stalled(Exception):
    """The client accepted no data for stream_stall_timeout seconds."""


class _Stream:
    """One open Generate stream: its queue of engine events, and the back-pressure on its sequence.

    `put` runs on the event loop (the engine process's events are delivered there). When more than
    `max_backlog` tokens wait in the queue (the client reads slower than the engine generates, or not
    at all), the sequence is paused in the engine: it keeps its KV slot but is not scheduled, so an
    unread stream costs neither device steps nor memory beyond the bound. It resumes once the queue
    is drained.
    """

    def __init__(self, engine: Any, max_backlog: int, arrival: float) -> None:
        self.engine = engine
        self.max_backlog = max_backlog
        self.arrival = arrival
        self.queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.key: str | None = None
        self.prompt_tokens = 0
        self.sent_tokens = 0
        self.backlog = 0
        self.paused = False

    def put(self, event: RequestEvent) -> None:
        self.queue.put_nowait(event)
        if isinstance(event, TokenDelta):
            self.backlog += len(event.token_ids)
            if self.backlog > self.max_backlog and not self.paused and self.key is not None:
                self.paused = True
                self.engine.pause(self.key, True)

    def taken(self, delta: TokenDelta) -> None:
        self.backlog -= len(delta.token_ids)
        self.sent_tokens += len(delta.token_ids)
        if self.paused and self.queue.empty() and self.key is not None:
            self.paused = False
            self.engine.pause(self.key, False)

    def local_abort(self) -> None:
        """End the stream with finish_reason abort without the engine (it does not answer)."""
        self.queue.put_nowait(Finish(FinishReason.ABORT, self.prompt_tokens, self.sent_tokens + self.backlog,
                                     total_seconds=max(0.0, time.monotonic() - self.arrival)))


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves Generate once `attach` gave it an engine; before that (model loading) calls get UNAVAILABLE.

    Request ids are scoped to the client's connection: an id is refused as a duplicate only while
    the same connection streams it, so no client can probe which ids another client uses.
    """

    def __init__(self, admission: AdmissionLimits, metrics: Any = None) -> None:
        self.engine: Engine | None = None
        self.tokenizer: Any = None
        self.limits: Limits | None = None
        self.model_info = inference_pb2.ModelInfo()
        self.admission = admission
        self.metrics = metrics
        self.draining = False
        self.active: dict[tuple[str, str], _Stream] = {}  # open streams: (peer, request id) -> stream
        self.adapter_names: set[str] = set()  # the LoRA adapters loaded now (admin load/unload updates it)
        self.streams_idle = asyncio.Event()
        self.streams_idle.set()

    def attach(self, engine: Engine, tokenizer: Any, limits: Limits, model_info: inference_pb2.ModelInfo) -> None:
        self.engine, self.tokenizer, self.limits, self.model_info = engine, tokenizer, limits, model_info

    def abort_all(self) -> None:
        """Ask the engine to abort every open stream (end of the drain)."""
        for stream in list(self.active.values()):
            if stream.key is not None:
                self.engine.abort(stream.key)

    def end_all_locally(self) -> int:
        """End every open stream with finish_reason abort here, for an engine that does not answer."""
        streams = list(self.active.values())
        for stream in streams:
            stream.local_abort()
        return len(streams)

    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> inference_pb2.ModelInfo:
        if self.engine is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "loading", "the model is still loading; retry shortly")
        return self.model_info

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if self.engine is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "loading", "the model is still loading; retry shortly")
        if self.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "draining",
                               "the server is shutting down; retry on another replica")
        if not self.engine.alive:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "engine_down",
                               "the engine is not running; retry on another replica")
        await self._admit(request, context)
        try:
            request_id = request_id_of(request)
        except InvalidRequest as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
        scope = (context.peer(), request_id)
        if scope in self.active:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "duplicate_request_id",
                               f"request_id {request_id!r} is already streaming: use a unique id or leave it empty")
        # Counted from here, before any await: admission and drain see the stream while it tokenizes.
        stream = self.active[scope] = _Stream(self.engine, self.admission.max_stream_backlog_tokens, time.monotonic())
        self.streams_idle.clear()
        finished = stalled = False
        try:
            try:
                size = check_prompt_size(request, self.limits)
                check_adapter(request, self.adapter_names)  # a set lookup: before any tokenization
                if size > _INLINE_TOKENIZE_BYTES:
                    prompt = await asyncio.to_thread(prompt_ids, request, self.tokenizer, self.limits)
                else:
                    prompt = prompt_ids(request, self.tokenizer, self.limits)
                gen = to_generation_request(request, request_id, prompt, self.limits, arrival_time=stream.arrival)
            except InvalidRequest as exc:
                await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
            if self.draining:
                await self._reject(context, grpc.StatusCode.UNAVAILABLE, "draining",
                                   "the server is shutting down; retry on another replica")
            stream.prompt_tokens = len(prompt)
            try:
                stream.key = self.engine.submit(gen, stream.put)
            except EngineStopped:
                await self._reject(context, grpc.StatusCode.UNAVAILABLE, "engine_down",
                                   "the engine is not running; retry on another replica")
            while True:
                event = await stream.queue.get()
                if isinstance(event, TokenDelta):
                    event = _merge_ready(event, stream.queue)
                if isinstance(event, TokenDelta):
                    stream.taken(event)
                    await self._write(context, _chunk(request_id, event))
                elif isinstance(event, Finish):
                    finished = True
                    if event.final_delta is not None:
                        await self._write(context, _chunk(request_id, event.final_delta))
                    await self._write(context, _finished(request_id, event))
                    log.info("request_finished", request_id=request_id, reason=event.reason.value,
                             prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                             queue_s=round(event.queue_seconds, 4), ttft_s=round(event.time_to_first_token_seconds, 4),
                             total_s=round(event.total_seconds, 4))
                    return
                elif isinstance(event, EngineError):
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, event.message)
        except _Stalled:
            finished, stalled = False, True
            log.warning("stream_stalled", request_id=request_id, seconds=self.admission.stream_stall_timeout)
        finally:
            if stream.key is not None and not finished:
                # Cancelled, deadline exceeded, disconnected or stalled: free the slot at the next step.
                self.engine.abort(stream.key)
                log.info("request_cancelled", request_id=request_id)
            del self.active[scope]
            if not self.active:
                self.streams_idle.set()
        if stalled:  # after the slot is freed: the status may never reach a client that reads nothing
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "stream_stalled",
                               f"the client accepted no data for {self.admission.stream_stall_timeout:g} s "
                               "(--stream-stall-timeout): the stream was aborted")

    async def _write(self, context: grpc.aio.ServicerContext, message: inference_pb2.GenerateResponse) -> None:
        """Send one message; a client that accepts none of it (HTTP/2 window closed) for the stall
        timeout loses the stream."""
        try:
            async with asyncio.timeout(self.admission.stream_stall_timeout):  # a timer, not a task per message
                await context.write(message)
        except TimeoutError:
            raise _Stalled from None

    async def _admit(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Overload checks, before any tokenization: a rejected request costs almost nothing."""
        a = self.admission
        if len(self.active) >= a.max_concurrent_streams:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "concurrent_streams",
                               f"{len(self.active)} streams are open, the limit is {a.max_concurrent_streams}: retry later")
        if self.engine.num_waiting >= a.max_waiting_requests:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full",
                               f"{self.engine.num_waiting} requests are waiting, the limit is "
                               f"{a.max_waiting_requests}: retry later")
        if self.engine.num_waiting == 0:
            return
        # Estimated prompt tokens: exact for token ids, at most one token per byte for text.
        estimate = len(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else prompt_bytes(request)
        if self.engine.waiting_prompt_tokens + estimate > a.max_waiting_tokens:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_tokens",
                               f"the waiting queue holds {self.engine.waiting_prompt_tokens} prompt tokens, the "
                               f"limit is {a.max_waiting_tokens}: retry later")

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)
        await context.abort(code, message)


def _merge_ready(first: TokenDelta, queue: asyncio.Queue[RequestEvent]) -> RequestEvent | TokenDelta:
    """Merge the deltas already queued behind `first`; stop at (and keep) anything else."""
    if queue.empty():
        return first
    ids, text = list(first.token_ids), first.text
    while not queue.empty():
        nxt = queue._queue[0]  # noqa: SLF001 - peek: a Finish must stay queued for the next get()
        if not isinstance(nxt, TokenDelta):
            break
        queue.get_nowait()
        ids += nxt.token_ids
        text += nxt.text
    return TokenDelta(ids, text)


def _chunk(request_id: str, delta: TokenDelta) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        request_id=request_id, chunk=inference_pb2.Chunk(token_ids=delta.token_ids, text=delta.text)
    )


def _finished(request_id: str, f: Finish) -> inference_pb2.GenerateResponse:
    msg = inference_pb2.Finished(
        finish_reason=_FINISH_REASONS[f.reason],
        usage=inference_pb2.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens),
        timings=inference_pb2.Timings(
            queue_seconds=f.queue_seconds,
            time_to_first_token_seconds=f.time_to_first_token_seconds,
            total_seconds=f.total_seconds,
        ),
        seed=f.seed,
    )
    if isinstance(f.matched_stop, str):
        msg.stop_string = f.matched_stop
    elif isinstance(f.matched_stop, int):
        msg.stop_token_id = f.matched_stop
    return inference_pb2.GenerateResponse(request_id=request_id, finished=msg)
