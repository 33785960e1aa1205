"""The asyncio client's channels: TLS or plaintext, the bearer token and a CLIENT span per call.

The threaded client wraps a finished channel (`grpc.intercept_channel`); an asyncio
channel takes its interceptors when it is made, so both are given here. The token and
trace headers are the same as the threaded client's (`squall.wire.auth`,
`squall.wire.trace_context`): `authorization: Bearer <token>`, and W3C `traceparent`
through the app's tracer provider (nothing is recorded or sent when the app has not
configured OpenTelemetry).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from opentelemetry import trace

from squall._tls import TlsOptions
from squall.wire.auth import token_metadata
from squall.wire.trace_context import (
    end_call_span,
    method_name,
    rpc_attributes,
    span_name,
    with_context,
)

if TYPE_CHECKING:  # grpc's classes are generic in the stubs only
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnary = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _StreamStream = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor
    _StreamUnary = grpc.aio.StreamUnaryClientInterceptor
    _StreamStream = grpc.aio.StreamStreamClientInterceptor


def _with_metadata(details: Any, metadata: Sequence[tuple[str, Any]]) -> Any:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*metadata),
        details.credentials,
        details.wait_for_ready,
    )


class _Token(_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream):
    """Adds the authorization metadata to every call (replacing one the caller set)."""

    def __init__(self, token: str) -> None:
        self._pairs = token_metadata(token)

    def _details(self, details: Any) -> Any:
        kept = [(k, v) for k, v in (details.metadata or ()) if k != "authorization"]
        return _with_metadata(details, [*kept, *self._pairs])

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


async def _end_span(span: trace.Span, call: Any) -> None:
    """Ends a client span with the status of its (finished) call."""
    try:
        code = await call.code()
        details = await call.details()
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        code, details = grpc.StatusCode.CANCELLED, "cancelled"
    end_call_span(span, code.name if code is not None else None, details or "")


class _Tracing(_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream):
    """A CLIENT span per call, its context sent as `traceparent` (`squall.wire.trace_context`)."""

    def __init__(self, tracer_provider: trace.TracerProvider | None) -> None:
        self._tracer = trace.get_tracer("squall.client", tracer_provider=tracer_provider)

    def _start(self, details: Any) -> tuple[trace.Span, Any]:
        method = method_name(details.method)
        span = self._tracer.start_span(
            span_name(method), kind=trace.SpanKind.CLIENT, attributes=rpc_attributes(method)
        )
        if not span.get_span_context().is_valid:
            return span, details
        return span, _with_metadata(details, with_context(details.metadata, span))

    @staticmethod
    def _finish(span: trace.Span, call: Any) -> Any:
        def done(finished: Any) -> None:
            # An asyncio call's status is read with await, so the span ends in a task.
            try:
                asyncio.get_running_loop().create_task(_end_span(span, finished))
            except RuntimeError:  # the loop is gone: end it without a status
                end_call_span(span, None)

        call.add_done_callback(done)
        return call

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        span, details = self._start(details)
        return self._finish(span, await continuation(details, request))

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        span, details = self._start(details)
        return self._finish(span, await continuation(details, request))

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        span, details = self._start(details)
        return self._finish(span, await continuation(details, requests))

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        span, details = self._start(details)
        return self._finish(span, await continuation(details, requests))


def open_channel(
    address: str,
    options: Sequence[tuple[str, Any]],
    tls: TlsOptions | None,
    credentials: grpc.ChannelCredentials | None,
    server_name: str | None,
    token: str | None,
    tracer_provider: trace.TracerProvider | None,
) -> grpc.aio.Channel:
    """An asyncio channel: plaintext without tls, else TLS expecting server_name when given;
    sending the token (if any) and a CLIENT span's context on every call."""
    interceptors: list[Any] = [_Tracing(tracer_provider)]
    if token:
        interceptors.append(_Token(token))
    if tls is None or credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    merged = list(options)
    if server_name:
        merged.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, credentials, options=merged, interceptors=interceptors)
