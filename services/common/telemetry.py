"""OpenTelemetry for every Squall service: providers and exporters from `[telemetry]`, and
the one handle (`current()`) components take their tracer and meter from.

With `exporter = "none"` (the default) nothing is installed: `current()` is `DISABLED`,
whose `tracing` and `metering` flags are False, and every component tests a flag once per
request or batch and skips span and metric work entirely, so an unobserved cluster pays
nothing on the publish path. `start_telemetry` (a service's main) builds the SDK providers
and exporters; tests install in-memory ones with `install()` (the OpenTelemetry globals
are set once per process, so the services never depend on them).

Observable gauges read state owned by an event loop, but exporters call them from their
own threads (the Prometheus scrape thread, the periodic reader): `on_loop` runs the read
on the loop and waits, bounded, so a gauge never sees a half-updated structure.

Metric and span names are listed in docs/observability.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import metrics, trace

from squall_server.common.config import ClusterConfig
from squall_server.common.logs import log_fields

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("squall.telemetry")

# The instrumentation scope of every span and metric Squall records.
SCOPE = "squall"
# Longest an exporter thread waits for the loop to read a gauge; past it, the point is
# skipped for that collection rather than blocking the exporter.
_ON_LOOP_TIMEOUT_S = 1.0
# Longest a shutdown waits for the last spans and metrics to leave.
_SHUTDOWN_TIMEOUT_MS = 2000

_T = TypeVar("_T")


@dataclass(frozen=True, eq=False)
class Telemetry:
    """The tracer and meter components use, and whether each records anything."""

    tracer: trace.Tracer
    meter: metrics.Meter
    tracing: bool
    metering: bool
    # Per-component instrument sets, made once per Telemetry (see `instruments`).
    _instruments: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def active(self) -> bool:
        """True if spans or metrics are recorded."""
        return self.tracing or self.metering

    def instruments(self, name: str, make: Callable[[Telemetry], _T]) -> _T:
        """The instrument set `name`, made by `make` on first use.

        An SDK meter refuses a second instrument of the same name, so nodes that share a
        process (tests) share one set and register themselves with it.
        """
        made = self._instruments.get(name)
        if made is None:
            made = make(self)
            self._instruments[name] = made
        return made


DISABLED = Telemetry(trace.NoOpTracer(), metrics.NoOpMeter(SCOPE), tracing=False, metering=False)

_current = DISABLED


def current() -> Telemetry:
    """The telemetry components constructed now will use."""
    return _current


def install(
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> Telemetry:
    """Makes these providers the current telemetry (None: that signal is off)."""
    global _current
    _current = Telemetry(
        tracer=tracer_provider.get_tracer(SCOPE) if tracer_provider else trace.NoOpTracer(),
        meter=meter_provider.get_meter(SCOPE) if meter_provider else metrics.NoOpMeter(SCOPE),
        tracing=tracer_provider is not None,
        metering=meter_provider is not None,
    )
    return _current


def uninstall() -> None:
    """Turns telemetry off for components constructed from now on."""
    global _current
    _current = DISABLED


def on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], _T]) -> _T | None:
    """read() on loop's thread (directly if this is it); None if the loop cannot run it
    within _ON_LOOP_TIMEOUT_S or is closed."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return read()
    if loop.is_closed() or not loop.is_running():
        return None
    done: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(read())
        except BaseException as exc:  # handed to the waiting thread
            done.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
        return done.result(timeout=_ON_LOOP_TIMEOUT_S)
    except (concurrent.futures.TimeoutError, RuntimeError):
        done.cancel()
        return None


class TelemetryHandle:
    """What `start_telemetry` started: the providers and any scrape endpoint."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        prometheus_server: WSGIServer | None = None,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._prometheus_server = prometheus_server

    @property
    def prometheus_port(self) -> int:
        """The scrape endpoint's port (0: none)."""
        if self._prometheus_server is None:
            return 0
        port: int = self._prometheus_server.server_address[1]
        return port

    def shutdown(self) -> None:
        """Sends what is buffered, stops the exporters and the endpoint, turns telemetry off."""
        uninstall()
        if self._prometheus_server is not None:
            self._prometheus_server.shutdown()
            self._prometheus_server.server_close()
            self._prometheus_server = None
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(_SHUTDOWN_TIMEOUT_MS)
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown(timeout_millis=_SHUTDOWN_TIMEOUT_MS)


def start_telemetry(config: ClusterConfig, service: str, instance: str) -> TelemetryHandle:
    """Builds the providers and exporters `[telemetry]` asks for and installs them.

    service is coordinator, replica or gateway; instance its node or gateway id. With
    exporter "none" nothing is built and nothing is imported beyond the API.
    """
    settings = config.telemetry
    exporter = settings.exporter
    if exporter == "none":
        return TelemetryHandle()

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {
            "service.name": f"squall-{service}",
            "service.namespace": config.name,
            "service.instance.id": instance,
        }
    )
    interval_ms = settings.metrics_interval_ms
    endpoint = settings.otlp_endpoint or None
    span_exporter: SpanExporter | None = None
    reader: MetricReader
    server: WSGIServer | None = None
    if exporter == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        span_exporter = ConsoleSpanExporter(out=sys.stdout)
        reader = PeriodicExportingMetricReader(
            ConsoleMetricExporter(out=sys.stdout), export_interval_millis=interval_ms
        )
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(endpoint=endpoint)
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint), export_interval_millis=interval_ms
        )
    else:  # prometheus: metrics are scraped; traces go to OTLP when an endpoint is set
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)
        host = settings.prometheus_host.strip("[]")
        server, _ = start_http_server(
            settings.prometheus_port(service), addr=host, registry=registry
        )
        port = server.server_address[1]
        log_fields(
            log,
            logging.INFO,
            f"metrics endpoint http://{settings.prometheus_host}:{port}/metrics",
            port=port,
        )
        if endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(endpoint=endpoint)

    tracer_provider: TracerProvider | None = None
    if span_exporter is not None:
        tracer_provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio))
        )
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        trace.set_tracer_provider(tracer_provider)
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
    metrics.set_meter_provider(meter_provider)
    install(tracer_provider, meter_provider)
    return TelemetryHandle(tracer_provider, meter_provider, server)
