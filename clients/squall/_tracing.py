"""The client library's tracing interceptor for sync channels: one CLIENT span per call.

It records spans through the OpenTelemetry API: with no tracer provider configured by the
app the API's tracer records nothing and sends no header, so an app that does not use
OpenTelemetry pays one function call per RPC (a publish stream is one RPC, whatever it
carries). The headers, span names and attributes are `squall.wire.trace_context`, shared
with the services.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from squall.wire.trace_context import (
    end_call_span,
    method_name,
    rpc_attributes,
    span_name,
    with_context,
)

if TYPE_CHECKING:  # grpc's classes are generic in the stubs only
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnary = grpc.StreamUnaryClientInterceptor[Any, Any]
    _StreamStream = grpc.StreamStreamClientInterceptor[Any, Any]
else:
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.UnaryStreamClientInterceptor
    _StreamUnary = grpc.StreamUnaryClientInterceptor
    _StreamStream = grpc.StreamStreamClientInterceptor


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """Call details with new metadata (grpc's own type cannot be built by apps)."""


class ClientTracing(_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream):
    """A CLIENT span per call of a sync channel, its context sent as `traceparent`."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("squall.client", tracer_provider=tracer_provider)

    def _start(self, details: grpc.ClientCallDetails) -> tuple[trace.Span, _Details]:
        method = method_name(details.method)
        span = self._tracer.start_span(
            span_name(method), kind=trace.SpanKind.CLIENT, attributes=rpc_attributes(method)
        )
        metadata: Any = details.metadata
        if span.get_span_context().is_valid:
            metadata = with_context(details.metadata, span)
        new = _Details(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )
        return span, new

    def _finish(self, span: trace.Span, call: Any) -> Callable[..., None]:
        def done(*_: object) -> None:
            try:
                code, text = call.code(), call.details() or ""
            except Exception:  # a call that failed before it started has no status
                code, text = grpc.StatusCode.UNKNOWN, "the call did not start"
            end_call_span(span, code.name if code is not None else None, text)

        return done

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        """A unary call: the span ends when the outcome is known."""
        span, details = self._start(client_call_details)
        outcome = continuation(details, request)
        outcome.add_done_callback(self._finish(span, outcome))
        return outcome

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        """A response stream: the span ends when the stream ends."""
        span, details = self._start(client_call_details)
        call = continuation(details, request)
        _on_end(call, self._finish(span, call))
        return call

    def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: Any,
        request_iterator: Iterator[Any],
    ) -> Any:
        """A request stream with one response."""
        span, details = self._start(client_call_details)
        outcome = continuation(details, request_iterator)
        outcome.add_done_callback(self._finish(span, outcome))
        return outcome

    def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: Any,
        request_iterator: Iterator[Any],
    ) -> Any:
        """A bidirectional stream (pipelined publishing): one span for the stream."""
        span, details = self._start(client_call_details)
        call = continuation(details, request_iterator)
        _on_end(call, self._finish(span, call))
        return call


def _on_end(call: Any, callback: Callable[[], None]) -> None:
    """Runs callback once the call has ended (now, if it already has)."""
    if not call.add_callback(callback):
        callback()


def traced_channel(
    channel: grpc.Channel, tracer_provider: trace.TracerProvider | None = None
) -> grpc.Channel:
    """channel with the library's tracing interceptor."""
    return grpc.intercept_channel(channel, ClientTracing(tracer_provider))
