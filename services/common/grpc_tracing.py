"""Tracing interceptors for the services' asyncio gRPC servers and channels.

The server interceptor opens a SERVER span per call, continuing the trace the caller sent
in its metadata (`traceparent`), and makes it the current span while the handler runs,
so the handler's own spans (a publish, its commit wait) are its children. The client
interceptor opens a CLIENT span per outgoing call and sends its context on, replacing any
trace headers already in the metadata (the gateway forwards an app's metadata).

Only the calls worth a trace are traced (`traced_method`): the broker API and the cluster
status. Heartbeats, role renewals, health checks and the long-lived replication streams
would be noise; replication is traced per batch by the master instead
(`squall_server.replica.telemetry`). Neither interceptor is installed while tracing is off
(`server_interceptors`, `client_interceptors`), so then a call costs nothing extra.

Written here rather than taken from opentelemetry-instrumentation-grpc: its asyncio server
interceptor fails on stream-stream handlers in the versions we can install (upstream
issue 3066), it would trace every call, and these ~200 lines are all we need.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from squall.wire.trace_context import (
    end_call_span,
    end_server_span,
    extract,
    method_name,
    rpc_attributes,
    span_name,
    with_context,
)
from squall_server.common import telemetry

if TYPE_CHECKING:  # grpc's classes are generic in the stubs only
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnary = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _StreamStream = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor
    _StreamUnary = grpc.aio.StreamUnaryClientInterceptor
    _StreamStream = grpc.aio.StreamStreamClientInterceptor

# Services whose every call is traced, and single methods traced elsewhere.
TRACED_SERVICES = frozenset(
    {
        "squall.v1.TopicManager",
        "squall.v1.Publisher",
        "squall.v1.Subscriber",
        "squall.v1.ClusterAdmin",
    }
)


def traced_method(method: str) -> bool:
    """True for the calls a trace is recorded for."""
    service = method.lstrip("/").partition("/")[0]
    return service in TRACED_SERVICES


def server_interceptors() -> list[Any]:
    """The interceptors a service's server takes now ([] while tracing is off)."""
    current = telemetry.current()
    return [ServerTracing(current.tracer)] if current.tracing else []


def client_interceptors() -> list[Any]:
    """The interceptors a service's channel takes now ([] while tracing is off)."""
    current = telemetry.current()
    return [ClientTracing(current.tracer)] if current.tracing else []


async def _end_client_span(span: trace.Span, call: Any) -> None:
    """Ends a client span with the status of its (finished) call."""
    try:
        code = await call.code()
        details = await call.details()
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        code, details = grpc.StatusCode.CANCELLED, "cancelled"
    end_call_span(span, code.name if code is not None else None, details or "")


def _end_server_span(span: trace.Span, context: Any, error: BaseException | None) -> None:
    """Ends a server span with the status the handler set (or the error that ended it)."""
    code: grpc.StatusCode | None = None
    details = ""
    try:
        code = context.code()
        details = context.details() or ""
    except (AttributeError, RuntimeError):
        code = None
    if isinstance(code, int):  # some grpc versions hand back the number
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    if code is None:
        code = grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
        if error is not None:
            details = str(error)
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    end_server_span(span, code.name, details)


class ServerTracing(_ServerInterceptor):
    """A SERVER span around each traced call's handler."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """Wraps the handler of a traced method; others pass untouched."""
        handler = await continuation(handler_call_details)
        method = method_name(handler_call_details.method)
        if handler is None or not traced_method(method):
            return handler
        parent = extract(handler_call_details.invocation_metadata)
        tracer = self._tracer
        name = span_name(method)
        attributes = rpc_attributes(method)

        def start() -> tuple[trace.Span, object]:
            span = tracer.start_span(
                name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
            )
            token = otel_context.attach(trace.set_span_in_context(span, parent))
            return span, token

        if handler.response_streaming:
            behaviour: Any = (
                handler.stream_stream if handler.request_streaming else handler.unary_stream
            )

            async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
                span, token = start()
                error: BaseException | None = None
                try:
                    result = behaviour(request, context)
                    if inspect.isasyncgen(result):
                        async for response in result:
                            yield response
                    else:  # a handler that writes with context.write()
                        await result
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    otel_context.detach(token)  # type: ignore[arg-type]
                    _end_server_span(span, context, error)

            make = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )
            return make(
                streaming,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        unary: Any = handler.stream_unary if handler.request_streaming else handler.unary_unary

        async def single(request: Any, context: Any) -> Any:
            span, token = start()
            error: BaseException | None = None
            try:
                return await unary(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                otel_context.detach(token)  # type: ignore[arg-type]
                _end_server_span(span, context, error)

        make_single = (
            grpc.stream_unary_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make_single(
            single,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class ClientTracing(_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream):
    """A CLIENT span per traced outgoing call, its context sent as `traceparent`."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _start(self, details: grpc.aio.ClientCallDetails) -> tuple[trace.Span | None, Any]:
        method = method_name(details.method)
        if not traced_method(method):
            return None, details
        span = self._tracer.start_span(
            span_name(method), kind=trace.SpanKind.CLIENT, attributes=rpc_attributes(method)
        )
        if not span.get_span_context().is_valid:
            return span, details
        metadata = grpc.aio.Metadata(*with_context(details.metadata, span))
        return span, grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    @staticmethod
    def _finish(span: trace.Span | None, call: Any) -> Any:
        if span is None:
            return call

        def done(finished: Any) -> None:
            # An asyncio call's status is read with await, so the span ends in a task.
            try:
                asyncio.get_running_loop().create_task(_end_client_span(span, finished))
            except RuntimeError:  # the loop is gone: end it without a status
                end_call_span(span, None)

        call.add_done_callback(done)
        return call

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        """A unary call."""
        span, details = self._start(client_call_details)
        return self._finish(span, await continuation(details, request))

    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        """A response stream (a forwarded subscription)."""
        span, details = self._start(client_call_details)
        return self._finish(span, await continuation(details, request))

    async def intercept_stream_unary(
        self,
        continuation: Any,
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        """A request stream with one response."""
        span, details = self._start(client_call_details)
        return self._finish(span, await continuation(details, request_iterator))

    async def intercept_stream_stream(
        self,
        continuation: Any,
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        """A bidirectional stream (a forwarded publish stream)."""
        span, details = self._start(client_call_details)
        return self._finish(span, await continuation(details, request_iterator))
