"""Open Generate streams of every protocol: admission, back-pressure, the stall timeout, abort on exit, drain.

Both servicers (graphserve.v1 and vllm.grpc.engine) serve their streams through one `Streams`, so the
limits count every stream whatever protocol opened it, and a drain ends them all. A servicer brings
only what is its own: how to check and map its request (`prepare`) and how to write the engine's
events as its messages (`StreamWriter`).

The event loop never waits on the engine: each step's events arrive from the engine process in one
message (see service/engine_client/process.py), and each stream drains its own queue. A client that falls behind
gets the tokens that piled up merged into one message instead of one message per token.

Writes are paced: the loop writes at most `stream_message_rate` messages per second across the open
streams, so with S streams each gets a message at most every S / rate seconds (each sample of an
n-sample stream its own) and the tokens of the steps in between go out merged. A write is most of
what this process does per token; unpaced, a loop that saturates reads the engine's pipe late, the
pipe fills and the engine waits on it. A stream's first message (its first token) and its finish
are never held.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
import structlog

from service.engine.interfaces import EngineStopped
from service.engine.request import (
    AdapterGone,
    ConstraintFailed,
    EngineBusy,
    EngineError,
    Finish,
    FinishReason,
    GenerationRequest,
    RequestEvent,
    TokenDelta,
)
from service.engine.validation import MAX_SAMPLES, Fields, InvalidRequest, constraint_message, request_id_of
from service.engine_client.client import EngineClient

log = structlog.get_logger("graphserve.server")


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_waiting_tokens: int
    max_concurrent_streams: int
    stream_stall_timeout: float = 30.0  # seconds a client may accept no data before its stream is aborted
    max_stream_backlog_tokens: int = 128  # undelivered tokens per stream before its sequence is paused
    stream_message_rate: float = 0.0  # messages per second across all streams (0: every step's tokens at once)
    max_running_seqs: int = 0  # with max_waiting_requests, the most samples that can run or wait at once (0: unchecked)


class _Stalled(Exception):
    """The client accepted no data for stream_stall_timeout seconds."""


class Rejected(Exception):
    """A call refused with a status: raised by `Streams.reject`, answered by `@answers_rejections`.

    Not `context.abort`: grpc keeps the exception abort raises in the call's state, and its traceback
    holds every frame up to the handler, the request with them. That cycle lives until the garbage
    collector runs, so a flood of large refused requests (a 4 MiB chat parses to ~20 MB) piled up.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def answers_rejections(method: Handler) -> Handler:
    """A servicer method (a coroutine) whose `Rejected` ends the call with its status."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except Rejected as exc:
            context.set_code(exc.code)
            context.set_details(exc.message)
            return None

    return handler  # type: ignore[return-value]


class Stream:
    """One open Generate stream: its queue of engine events, and the back-pressure on its sequences
    (one per sample: a request for n samples runs n sequences, its events tagged with their index).

    `put` runs on the event loop (the engine process's events are delivered there). When more than
    `max_backlog` tokens wait in the queue (the client reads slower than the engine generates, or not
    at all), the sequences are paused in the engine: they keep their KV blocks but are not scheduled,
    so an unread stream costs neither device steps nor memory beyond the bound. They resume once the
    queue is drained.
    """

    def __init__(self, engine: EngineClient, max_backlog: int, arrival: float) -> None:
        self.engine = engine
        self.max_backlog = max_backlog
        self.arrival = arrival
        self.queue: asyncio.Queue[tuple[int, RequestEvent]] = asyncio.Queue()
        self.keys: list[str] = []  # the engine's key of each sample's sequence, once submitted
        self.ended: set[int] = set()  # samples whose terminal event arrived
        self.prompt_tokens = 0
        self.sent: dict[int, int] = {}  # tokens delivered (taken, or queued) per sample
        self.backlog = 0  # tokens queued, not yet written, of every sample
        self.paused = False
        self.aborted = False  # an abort came before the request reached the engine
        self.last_chunk_at: dict[int, float] = {}  # per sample: loop time of its last chunk written (pacing)
        self.woken: asyncio.Future[None] | None = None  # set while a chunk is held: a sample's end wakes it
        # Where a first token's time goes in this process (monotonic): when the engine's event for it
        # arrived here, and when its message was written (request_finished logs both)
        self.first_token_in: float | None = None
        self.first_written: float | None = None

    def sink(self, index: int) -> Callable[[RequestEvent], None]:
        return lambda event: self.put(event, index)

    def put(self, event: RequestEvent, index: int = 0) -> None:
        self.queue.put_nowait((index, event))
        if not isinstance(event, TokenDelta):
            _wake(self.woken)
        else:
            if self.first_token_in is None:
                self.first_token_in = time.monotonic()
            self.backlog += len(event.token_ids)
            self.sent[index] = self.sent.get(index, 0) + len(event.token_ids)
            if self.backlog > self.max_backlog and not self.paused and self.keys:
                self.paused = True
                for key in self.keys:
                    self.engine.pause(key, True)

    def taken(self, delta: TokenDelta) -> None:
        self.backlog -= len(delta.token_ids)
        if self.paused and self.queue.empty() and self.keys:
            self.paused = False
            for key in self.keys:
                self.engine.pause(key, False)

    def abort(self) -> None:
        """Ask the engine to end this stream's sequences (finish_reason abort); before submit, remembered:
        the stream then ends with an abort instead of being submitted."""
        self.aborted = True
        for index, key in enumerate(self.keys):
            if index not in self.ended:
                self.engine.abort(key)

    def local_abort(self, samples: int = 1) -> None:
        """End the stream with finish_reason abort without the engine (it does not answer, or never saw
        the request)."""
        for index in range(max(samples, len(self.keys))):
            if index not in self.ended:
                self.queue.put_nowait((index, Finish(FinishReason.ABORT, self.prompt_tokens, self.sent.get(index, 0),
                                                     total_seconds=max(0.0, time.monotonic() - self.arrival))))


def _first_token_times(stream: Stream) -> dict[str, float]:
    """Seconds from the stream's arrival until its first token's event reached this process
    (`first_token_in_s`: the engine's time to first token plus the pipe) and until that token's
    message was written (`first_written_s`: plus this process's queue and the write)."""
    out = {}
    if stream.first_token_in is not None:
        out["first_token_in_s"] = round(stream.first_token_in - stream.arrival, 4)
    if stream.first_written is not None:
        out["first_written_s"] = round(stream.first_written - stream.arrival, 4)
    return out


class StreamWriter(Protocol):
    """A protocol's messages for the engine's events."""

    def chunk(self, delta: TokenDelta, index: int) -> Any | None: ...

    def finished(self, finish: Finish, index: int) -> list[Any]: ...


# A servicer's checks and mapping: the validated, tokenized request for the engine (one per sample),
# or InvalidRequest.
Prepare = Callable[[Stream], Awaitable[list[GenerationRequest]]]


class Streams:
    """Every open stream, the engine they run on, and the admission and drain rules they share.

    Before `attach` (model loading) calls get UNAVAILABLE. `serving` follows the health status: while
    the watchdog reports NOT_SERVING (a hung engine) new streams are refused rather than left to hang.
    """

    def __init__(self, admission: AdmissionLimits, metrics: Any = None) -> None:
        self.admission = admission
        self.metrics = metrics
        self.engine: EngineClient | None = None
        self.draining = False
        self.serving = False
        self.active: dict[tuple[str, str], Stream] = {}  # (scope, request id) -> stream
        self.idle = asyncio.Event()
        self.idle.set()
        self.last_received = 0.0  # time.time() of the latest Generate
        self.on_first_token: Callable[[], None] | None = None  # once, when the server's first token is written

    def attach(self, engine: EngineClient) -> None:
        self.engine = engine

    def abort_all(self) -> None:
        """Ask the engine to abort every open stream (end of the drain)."""
        for stream in list(self.active.values()):
            stream.abort()

    def end_all_locally(self) -> int:
        """End every open stream with finish_reason abort here, for an engine that does not answer."""
        streams = list(self.active.values())
        for stream in streams:
            stream.local_abort()
        return len(streams)

    # ---- checks before a stream opens ----------------------------------------------------------

    async def reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str,
                     message: str) -> NoReturn:
        """Count and raise Rejected (the method must be @answers_rejections)."""
        if self.metrics is not None:
            self.metrics.rejected(reason)
        raise Rejected(code, message)

    async def abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str,
                    message: str) -> NoReturn:
        """Count and abort the call (for methods of small requests, not @answers_rejections)."""
        if self.metrics is not None:
            self.metrics.rejected(reason)
        await context.abort(code, message)

    async def check_available(self, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE (retry on another replica) while loading, draining, hung or down."""
        self.last_received = time.time()
        if self.engine is None:
            await self.reject(context, grpc.StatusCode.UNAVAILABLE, "loading", "the model is still loading; retry shortly")
        if self.draining:
            await self.reject(context, grpc.StatusCode.UNAVAILABLE, "draining",
                              "the server is shutting down; retry on another replica")
        if not self.engine.alive:
            await self.reject(context, grpc.StatusCode.UNAVAILABLE, "engine_down",
                              "the engine is not running; retry on another replica")
        if not self.serving:
            await self.reject(context, grpc.StatusCode.UNAVAILABLE, "not_serving",
                              "the engine makes no progress (health NOT_SERVING); retry on another replica")

    async def admit(self, context: grpc.aio.ServicerContext, estimated_prompt_tokens: Callable[[], int],
                    samples: int = 1) -> None:
        """Overload checks, before any tokenization: a rejected request costs almost nothing. A
        request for n samples counts as n waiting requests of its prompt."""
        a, engine = self.admission, self.engine
        can_hold = a.max_waiting_requests + a.max_running_seqs
        if a.max_running_seqs and samples > can_hold:
            await self.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument",
                              f"{samples} samples can never be admitted: at most {can_hold} requests run or wait at once "
                              "(--max-running-seqs + --max-waiting-requests): ask for fewer")
        if len(self.active) >= a.max_concurrent_streams:
            await self.reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "concurrent_streams",
                              f"{len(self.active)} streams are open, the limit is {a.max_concurrent_streams}: retry later")
        if engine.waiting_after(samples) > a.max_waiting_requests:  # samples that find a free slot do not wait
            await self.reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full",
                              f"{engine.num_waiting} requests are waiting, the limit is "
                              f"{a.max_waiting_requests}: retry later")
        if engine.num_waiting == 0:
            return
        if engine.waiting_prompt_tokens + samples * estimated_prompt_tokens() > a.max_waiting_tokens:
            await self.reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_tokens",
                              f"the waiting queue holds {engine.waiting_prompt_tokens} prompt tokens, the "
                              f"limit is {a.max_waiting_tokens}: retry later")

    async def begin(self, context: grpc.aio.ServicerContext, given_id: str, estimated_prompt_tokens: Callable[[], int],
                    samples: int = 1) -> str:
        """Every protocol's checks before its own: available, admitted, a valid request id (returned).
        samples: the request's n (clamped to the limit; the limit itself is checked with the request)."""
        await self.check_available(context)
        await self.admit(context, estimated_prompt_tokens, max(1, min(samples, MAX_SAMPLES)))
        try:
            return request_id_of(given_id)
        except InvalidRequest as exc:
            await self.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))

    # ---- one stream ----------------------------------------------------------------------------

    async def serve(self, context: grpc.aio.ServicerContext, scope: tuple[str, str], prepare: Prepare,
                    writer: StreamWriter, fields: Fields) -> None:
        """Open the stream, run `prepare`, submit, and write the engine's events until the finish.

        A stream that ends any other way (cancelled, deadline, disconnect, stall) is aborted in the
        engine, so its slot is freed at the next step.
        """
        request_id = scope[1]
        if scope in self.active:
            await self.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "duplicate_request_id",
                              f"request_id {request_id!r} is already streaming: use a unique id or leave it empty")
        # Counted from here, before any await: admission and drain see the stream while it tokenizes.
        stream = self.active[scope] = Stream(self.engine, self.admission.max_stream_backlog_tokens, time.monotonic())
        self.idle.clear()
        finished = stalled = False
        try:
            try:
                gens = await prepare(stream)
            except InvalidRequest as exc:
                await self.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
            if self.draining:
                await self.reject(context, grpc.StatusCode.UNAVAILABLE, "draining",
                                  "the server is shutting down; retry on another replica")
            stream.prompt_tokens = len(gens[0].prompt_token_ids)
            if stream.aborted:  # aborted while it was prepared (tokenized): the engine never sees it
                stream.local_abort(len(gens))
            try:
                for index, gen in enumerate(gens if not stream.aborted else ()):
                    stream.keys.append(self.engine.submit(gen, stream.sink(index)))
            except EngineStopped:
                stream.abort()
                await self.reject(context, grpc.StatusCode.UNAVAILABLE, "engine_down",
                                  "the engine is not running; retry on another replica")
            while True:
                index, event = await stream.queue.get()
                if isinstance(event, TokenDelta):
                    await self._pace(stream, index)
                    event = _merge_ready(event, index, stream.queue)
                if isinstance(event, TokenDelta):
                    stream.taken(event)
                    message = writer.chunk(event, index)
                    if message is not None:
                        stream.last_chunk_at[index] = asyncio.get_running_loop().time()
                        await self._write(context, message)
                        if stream.first_written is None:
                            stream.first_written = time.monotonic()
                            self._tokens_written()
                elif isinstance(event, Finish):
                    stream.ended.add(index)
                    for message in writer.finished(event, index):
                        await self._write(context, message)
                    if event.completion_tokens:  # a finish can carry the only tokens (max_tokens 1)
                        self._tokens_written()
                    log.info("request_finished", request_id=request_id, reason=event.reason.value,
                             prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                             queue_s=round(event.queue_seconds, 4), ttft_s=round(event.time_to_first_token_seconds, 4),
                             total_s=round(event.total_seconds, 4), **_first_token_times(stream),
                             **({"sample": index} if len(gens) > 1 else {}))
                    if len(stream.ended) == len(gens):
                        finished = True
                        return
                elif isinstance(event, EngineError):
                    stream.ended.add(index)
                    stream.abort()  # the other samples end with the call
                    finished = True
                    code, message = _status_of(event, fields)
                    await context.abort(code, message)
        except _Stalled:
            finished, stalled = False, True
            log.warning("stream_stalled", request_id=request_id, seconds=self.admission.stream_stall_timeout)
        finally:
            if not finished:
                stream.abort()
                if stream.keys:
                    log.info("request_cancelled", request_id=request_id)
            del self.active[scope]
            if not self.active:
                self.idle.set()
        if stalled:  # after the slot is freed: the status may never reach a client that reads nothing
            await self.reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "stream_stalled",
                              f"the client accepted no data for {self.admission.stream_stall_timeout:g} s "
                              "(--stream-stall-timeout): the stream was aborted")

    def _tokens_written(self) -> None:
        """A message with tokens went out: the server's first one calls on_first_token."""
        if self.on_first_token is not None:
            first, self.on_first_token = self.on_first_token, None
            first()

    async def _pace(self, stream: Stream, index: int) -> None:
        """Hold a sample's next chunk until its share of the message rate allows it (its tokens that
        arrive meanwhile join it); not when an end is already queued: the finish is never held. Each
        sample of an n-sample stream has its own share."""
        rate = self.admission.stream_message_rate
        if not rate or index not in stream.last_chunk_at:
            return
        loop = asyncio.get_running_loop()
        wait = stream.last_chunk_at[index] + len(self.active) / rate - loop.time()
        if wait <= 0 or _end_queued(stream.queue):
            return
        stream.woken = loop.create_future()
        timer = loop.call_later(wait, _wake, stream.woken)  # a timer and a future: no task per message
        try:
            await stream.woken
        finally:
            timer.cancel()
            stream.woken = None

    async def _write(self, context: grpc.aio.ServicerContext, message: Any) -> None:
        """Send one message; a client that accepts none of it (HTTP/2 window closed) for the stall
        timeout loses the stream."""
        try:
            async with asyncio.timeout(self.admission.stream_stall_timeout):  # a timer, not a task per message
                await context.write(message)
        except TimeoutError:
            raise _Stalled from None


def _status_of(error: EngineError, fields: Fields) -> tuple[grpc.StatusCode, str]:
    """The status that ends a stream the engine failed."""
    if isinstance(error, ConstraintFailed):  # its constraint's fault, mid-stream or before the first token
        return grpc.StatusCode.INVALID_ARGUMENT, constraint_message(error.kind, error.message, fields)
    if isinstance(error, EngineBusy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, error.message
    if isinstance(error, AdapterGone):  # unloaded after the check (a race): retrying elsewhere won't help
        return grpc.StatusCode.NOT_FOUND, error.message
    return grpc.StatusCode.UNAVAILABLE, error.message


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _end_queued(queue: asyncio.Queue[tuple[int, RequestEvent]]) -> bool:
    """Whether the newest queued event ends a sample (a stream's queue is short: a few steps' deltas)."""
    return not queue.empty() and not isinstance(queue._queue[-1][1], TokenDelta)  # noqa: SLF001 - peek


def _merge_ready(first: TokenDelta, index: int, queue: asyncio.Queue[tuple[int, RequestEvent]]) -> TokenDelta:
    """Merge into `first` the deltas of the same sample already queued, up to that sample's next other
    event (a finish or an error, which stays queued); the other samples' events keep their order."""
    if queue.empty():
        return first
    ids, text = list(first.token_ids), first.text
    logprobs = None if first.logprobs is None else list(first.logprobs)
    items = queue._queue  # noqa: SLF001 - a deque; asyncio.Queue has no way to take from its middle
    kept = []
    while items:
        nxt_index, nxt = items[0]
        if nxt_index == index and not isinstance(nxt, TokenDelta):
            break
        items.popleft()
        if nxt_index != index:
            kept.append((nxt_index, nxt))
            continue
        ids += nxt.token_ids
        text += nxt.text
        if logprobs is not None:
            logprobs += nxt.logprobs or ()
    items.extendleft(reversed(kept))
    return TokenDelta(ids, text, logprobs, first.prompt_logprobs)  # only a sample's first delta has them
