"""Bearer-token check for every call on the admin port, as a grpc.aio server interceptor.

The token is compared in constant time and never logged or echoed: a rejected call learns only
that the token was missing or wrong.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from service.telemetry.log import LogThrottle

log = structlog.get_logger("graphserve.admin")

UNAUTHENTICATED_MESSAGE = "missing or invalid admin token: send 'authorization: Bearer <token>' metadata"


def _presented_token(metadata: Any) -> bytes | None:
    """The token of the first `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        return token.strip().encode() if scheme.lower() == "bearer" else None
    return None


async def _reject(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary or streaming) whose only behavior is UNAUTHENTICATED."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(_reject, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <token>` metadata matching `token`."""

    def __init__(self, token: str, on_failure: Callable[[], None] | None = None) -> None:
        if not token:
            raise ValueError("an admin token is required")
        self._token = token.encode()
        self._on_failure = on_failure  # e.g. a counter metric
        self._log_throttle = LogThrottle()  # an unauthenticated peer can call as fast as it likes

    def authorized(self, metadata: Any) -> bool:
        presented = _presented_token(metadata)
        # compare_digest also runs for a missing token, so timing does not tell missing from wrong.
        return hmac.compare_digest(presented or b"", self._token) and presented is not None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self.authorized(handler_call_details.invocation_metadata):
            return handler
        self._failed(handler_call_details.method)
        return _rejecting(handler)

    def _failed(self, method: str) -> None:
        if self._on_failure is not None:
            self._on_failure()
        skipped = self._log_throttle.due()
        if skipped is not None:
            log.warning("admin_unauthenticated", method=method, not_logged_since_last=skipped)
