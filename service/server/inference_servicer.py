"""The Inference servicer: protobuf in, validated domain request to the engine, protobuf out.

The event loop never waits on the engine: each step's events arrive from the engine process in one
message (see engine_process.py), and each stream drains its own queue. A client that falls
behind gets the tokens that piled up merged into one message instead of one message per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves Generate once `attach` gave it an engine; before that (model loading) calls get UNAVAILABLE."""

    def __init__(self, admission: AdmissionLimits, metrics: Any = None) -> None:
        self.engine: Engine | None = None
        self.tokenizer: Any = None
        self.limits: Limits | None = None
        self.model_info = inference_pb2.ModelInfo()
        self.admission = admission
        self.metrics = metrics
        self.draining = False
        self.active: dict[str, str | None] = {}  # open streams: request id -> engine key once submitted
        self.adapter_names: set[str] = set()  # the LoRA adapters loaded now (admin load/unload updates it)
        self.streams_idle = asyncio.Event()
        self.streams_idle.set()

    def attach(self, engine: Engine, tokenizer: Any, limits: Limits, model_info: inference_pb2.ModelInfo) -> None:
        self.engine, self.tokenizer, self.limits, self.model_info = engine, tokenizer, limits, model_info

    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> inference_pb2.ModelInfo:
        if self.engine is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "loading", "the model is still loading; retry shortly")
        return self.model_info

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[inference_pb2.GenerateResponse]:
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
        if request_id in self.active:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "duplicate_request_id",
                               f"request_id {request_id!r} is already streaming: use a unique id or leave it empty")
        # Counted from here, before any await: admission and drain see the stream while it tokenizes.
        self.active[request_id] = None
        self.streams_idle.clear()
        key: str | None = None
        finished = False
        try:
            try:
                check_prompt_size(request, self.limits)
                if prompt_bytes(request) > _INLINE_TOKENIZE_BYTES:
                    prompt = await asyncio.to_thread(prompt_ids, request, self.tokenizer, self.limits)
                else:
                    prompt = prompt_ids(request, self.tokenizer, self.limits)
                gen = to_generation_request(request, request_id, prompt, self.limits)
                check_adapter(request, self.adapter_names)
            except InvalidRequest as exc:
                await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
            if self.draining:
                await self._reject(context, grpc.StatusCode.UNAVAILABLE, "draining",
                                   "the server is shutting down; retry on another replica")
            queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
            try:
                key = self.engine.submit(gen, queue.put_nowait)
            except EngineStopped:
                await self._reject(context, grpc.StatusCode.UNAVAILABLE, "engine_down",
                                   "the engine is not running; retry on another replica")
            self.active[request_id] = key
            while True:
                event = await queue.get()
                if isinstance(event, TokenDelta):
                    event = _merge_ready(event, queue)
                if isinstance(event, TokenDelta):
                    yield _chunk(request_id, event)
                elif isinstance(event, Finish):
                    finished = True
                    if event.final_delta is not None:
                        yield _chunk(request_id, event.final_delta)
                    yield _finished(request_id, event)
                    log.info("request_finished", request_id=request_id, reason=event.reason.value,
                             prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                             queue_s=round(event.queue_seconds, 4), ttft_s=round(event.time_to_first_token_seconds, 4),
                             total_s=round(event.total_seconds, 4))
                    return
                elif isinstance(event, EngineError):
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, event.message)
        finally:
            if key is not None and not finished:
                # Cancelled, deadline exceeded or disconnected: free the slot at the next step.
                self.engine.abort(key)
                log.info("request_cancelled", request_id=request_id)
            del self.active[request_id]
            if not self.active:
                self.streams_idle.set()

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
        # Estimated prompt tokens: exact for token ids, at most one token per byte for text.
        estimate = len(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else prompt_bytes(request)
        if self.engine.num_waiting > 0 and self.engine.waiting_prompt_tokens + estimate > a.max_waiting_tokens:
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
