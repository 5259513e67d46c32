"""Requests whose bytes do not decode (a foreign .proto, invalid UTF-8 in a string field) end with
INVALID_ARGUMENT and a plain message, are logged (throttled) and counted, instead of reaching the
client as UNKNOWN with an internal exception name.

A server interceptor: it wraps each unary-request handler's deserializer so that a decoding error
becomes a marker value, and the handler so that the marker is rejected before the servicer runs.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from service.telemetry.log import LogThrottle

log = structlog.get_logger("graphserve.server")


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's bad bytes
            return _Undecodable(f"{exc}"[:200])

    return safe


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, on_invalid: Callable[[], None] | None) -> None:
        self._on_invalid = on_invalid  # e.g. a rejection counter
        self._log_throttle = LogThrottle()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        name = method.rsplit("/", 1)[-1]
        message = (f"the request bytes do not decode as the {name} request message: check that the client uses "
                   "this server's .proto files and that string fields are valid UTF-8")

        async def reject(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
            if self._on_invalid is not None:
                self._on_invalid()
            skipped = self._log_throttle.due()
            if skipped is not None:
                log.warning("request_undecodable", method=method, error=request.error, not_logged_since_last=skipped)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        streaming = handler.response_streaming
        behavior = handler.unary_stream if streaming else handler.unary_unary
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        if inspect.isasyncgenfunction(behavior):
            async def stream_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                async for response in behavior(request, context):
                    yield response

            wrapped = stream_gen
        else:
            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                return await behavior(request, context)

            wrapped = guarded
        return make(wrapped, request_deserializer=_safe(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
