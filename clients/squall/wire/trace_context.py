"""Trace context on the wire: OpenTelemetry context carried between processes in gRPC
metadata as the W3C Trace Context headers (`traceparent`, `tracestate`), so a caller's
client span is the parent of the callee's server span (docs/observability.md).

Shared by the client library's interceptors (`squall._tracing`, `squall.aio`) and the
services' (`squall_server.common.grpc_tracing`): the span names and attributes, the headers,
and which status codes mark a span as failed. It imports the OpenTelemetry API only, no
grpc: status codes are their names ("UNAVAILABLE"), as in `squall.wire.retry`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()

# gRPC's status codes, name -> number (the numbers are the protocol's, fixed by gRPC).
STATUS_CODES: Mapping[str, int] = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
# Status codes that mean the server failed (OpenTelemetry's gRPC conventions mark only
# these as errors on a server span; a client span is an error for any non-OK code).
SERVER_ERROR_CODES: frozenset[str] = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)

Metadata = Sequence[tuple[str, str | bytes]]


def method_name(method: str | bytes) -> str:
    """A call's full method name as text ("/squall.v1.Publisher/Publish")."""
    return method.decode() if isinstance(method, bytes) else method


def rpc_attributes(method: str) -> dict[str, str]:
    """The OpenTelemetry RPC attributes of a full method name."""
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def span_name(method: str) -> str:
    """The span name for a call: "squall.v1.Publisher/Publish"."""
    return method.lstrip("/")


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The trace context a caller sent in its metadata (empty if none)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if key in TRACE_HEADERS:
            carrier[key] = value.decode() if isinstance(value, bytes) else value
    return _PROPAGATOR.extract(carrier)


def with_context(metadata: Iterable[tuple[str, Any]] | None, span: trace.Span) -> list[Any]:
    """metadata with any trace headers replaced by span's context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    kept = [(k, v) for k, v in (metadata or ()) if k not in TRACE_HEADERS]
    return kept + list(carrier.items())


def end_call_span(span: trace.Span, code: str | None, details: str = "") -> None:
    """Ends a client span with the call's status (`code` is its name; None: not known)."""
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", STATUS_CODES.get(code, STATUS_CODES["UNKNOWN"]))
        if code != "OK":
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {details}"))
    span.end()


def end_server_span(span: trace.Span, code: str, details: str = "") -> None:
    """Ends a server span with the status its handler set (`code` is its name)."""
    span.set_attribute("rpc.grpc.status_code", STATUS_CODES.get(code, STATUS_CODES["UNKNOWN"]))
    if code in SERVER_ERROR_CODES:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {details}"))
    span.end()
