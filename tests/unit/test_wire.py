"""`squall.wire`: the rules the client library and the services share across the wire
(retry outcomes, the bearer token's metadata, trace context) live in one public, grpc-free
module that both import, and no service reaches into the client's private modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from squall.wire import auth, retry, trace_context
from squall_server.common.auth import bearer_token
from squall_server.gateway import retry as gateway_retry

ROOT = Path(__file__).resolve().parents[2]
WIRE = ROOT / "clients" / "squall" / "wire"


def _imports(path: Path) -> set[str]:
    """The modules a file imports (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_wire_modules_import_no_grpc_only_the_standard_library_and_otel_api() -> None:
    modules = sorted(WIRE.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "retry.py", "auth.py", "trace_context.py"}
    for path in modules:
        for name in _imports(path):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names or name.startswith("squall.wire")
            allowed |= top == "opentelemetry" and not name.startswith("opentelemetry.sdk")
            assert allowed, f"{path.name} imports {name}"


def test_no_service_imports_a_private_module_of_the_client_library() -> None:
    offenders = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "squall" and any(part.startswith("_") for part in parts[1:]):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


def test_the_gateway_decides_retries_with_the_clients_own_rules() -> None:
    import squall

    gateway = vars(gateway_retry)
    assert gateway["classify_code"] is retry.classify is squall.classify_code
    assert gateway["overall"] is retry.overall is squall.overall
    assert squall.RetryPolicy is retry.RetryPolicy


@pytest.mark.parametrize("token", ["s3cret", "a.b-c_d~E"])
def test_the_servers_reading_of_the_token_metadata_is_the_clients_writing(token: str) -> None:
    assert bearer_token(auth.token_metadata(token)) == token
    assert auth.token_metadata(None) == ()


def test_a_token_from_the_environment_is_checked_naming_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, "has space")
    with pytest.raises(ValueError, match=r"\$SQUALL_TOKEN holds a space"):
        auth.resolve_token()


def test_trace_context_round_trips_through_metadata_and_spans_carry_the_status() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    method = trace_context.method_name(b"/squall.v1.Publisher/Publish")
    client = tracer.start_span(
        trace_context.span_name(method), attributes=trace_context.rpc_attributes(method)
    )
    metadata = trace_context.with_context([("traceparent", "stale"), ("x", "1")], client)
    assert ("x", "1") in metadata and ("traceparent", "stale") not in metadata
    context = trace_context.extract(metadata)
    server = tracer.start_span("server", context=context)
    trace_context.end_server_span(server, "NOT_FOUND", "no topic")  # the caller's fault
    trace_context.end_call_span(client, "UNAVAILABLE", "gone")
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    served, called = by_name["server"], by_name["squall.v1.Publisher/Publish"]
    assert served.parent is not None
    assert served.parent.span_id == called.context.span_id
    assert served.attributes is not None and served.attributes["rpc.grpc.status_code"] == 5
    assert served.status.is_ok
    assert called.attributes is not None and called.attributes["rpc.grpc.status_code"] == 14
    assert called.attributes["rpc.method"] == "Publish"
    assert not called.status.is_ok and called.status.description == "UNAVAILABLE: gone"


def test_the_status_code_table_is_grpcs() -> None:
    import grpc

    assert trace_context.STATUS_CODES == {c.name: c.value[0] for c in grpc.StatusCode}
