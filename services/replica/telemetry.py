"""The replica's spans and metrics: publish, commit wait, replication per batch, delivery.

Spans (each only while tracing is on, and only for sampled traces):

* ``replica.publish`` — one per publish request (unary, or one message of a publish
  stream), child of the call's server span: topic, events, epoch, the LSN of its entry
  (``squall.first_lsn``; a publish request is one log entry) and its first offset.
* ``replica.commit_wait`` — its child, from the local append to the commit (held by the
  replicas the ack policy requires).
* ``replication.send`` — on the master, one per entry batch sent to one slave that holds
  at least one traced write, from the send to the slave's acknowledgement at the replica
  sync policy (a ``received`` event marks the receipt ack): slave, epoch, first/last LSN,
  entries, bytes. Its parent is the commit wait of the batch's first traced write and it
  links to the others' (at most ``_LINKS_MAX``), so a publish trace shows its replication.
* ``subscribe.deliver`` — one per batch of events a subscription sends.
* ``push.deliver`` — on the master, one per ``PushSubscriber.Deliver`` call to an app's
  endpoint; its context goes to the app in the call's ``traceparent`` metadata.

Both delivery spans link to the traces that published their events, as far as this
replica knows them: the master remembers its newest traced publishes (``PublishedTraces``,
a bounded window by topic name and offsets), so deliveries from the master that took the
publishes link to them; a slave's, or a delivery of events older than the window, has no
links (events carry no trace context in the store).

Never one per event. Metrics are listed in ``ReplicaInstruments``; gauges are read on the
node's loop when an exporter collects.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.clock import SYSTEM_CLOCK, PreciseClock
from squall_server.common.telemetry import Telemetry, on_loop

if TYPE_CHECKING:
    from squall_server.replica.control_endpoints import SampledReplica

# Commit latency buckets, in milliseconds: sub-millisecond (no replication, NO_SYNC) to
# seconds (a slave catching up under `all`).
COMMIT_LATENCY_BUCKETS_MS = (
    0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
    10000.0,
)  # fmt: skip
ROLE_NAMES = {
    common_pb2.ROLE_MASTER: "master",
    common_pb2.ROLE_SLAVE: "slave",
    common_pb2.ROLE_INACTIVE: "inactive",
}
# Traced writes the master remembers for linking replication spans: a bounded window of
# the newest (a slave further behind than this gets unlinked root-less spans: none).
_TRACED_WRITES_MAX = 4096
# Links on one replication span (each is a traced write in the batch).
_LINKS_MAX = 32
# Traced publishes the master remembers for linking delivery spans (per request, newest).
_TRACED_PUBLISHES_MAX = 4096
# Gauge readings are shared by the instruments of one collection.
_SAMPLE_MAX_AGE_S = 0.2


@dataclass(frozen=True)
class ReplicaSample:
    """One reading of a replica's state for the gauges."""

    node_id: str
    role: int
    epoch: int
    last_lsn: int
    commit_lsn: int
    store_bytes: int
    lags: tuple[tuple[str, str, int], ...]  # (slave id, slave state, lag in entries)
    # (source topic, destination, events waiting, ms waited) per topic link, on the master.
    link_lags: tuple[tuple[str, str, int, int], ...] = ()


def sample(node: SampledReplica) -> ReplicaSample:
    """Reads the node's state (on its loop)."""
    return ReplicaSample(
        node_id=node.node.id,
        role=node.role,
        epoch=node.epoch,
        last_lsn=node.last_lsn,
        commit_lsn=node.commit_lsn,
        store_bytes=node.store.size_bytes(),
        lags=tuple(
            (s.progress.node_id, s.progress.state.value, s.lag_entries) for s in node.slave_status()
        ),
        link_lags=tuple(node.links.lags()),
    )


class _Source:
    """A registered node and its last reading."""

    def __init__(
        self, node: SampledReplica, loop: asyncio.AbstractEventLoop, clock: PreciseClock
    ) -> None:
        self.node = weakref.ref(node)
        self.loop = loop
        self.clock = clock
        self.reading: ReplicaSample | None = None
        self.read_at = 0.0

    def read(self) -> ReplicaSample | None:
        # The metrics exporter's thread asks; samples age in real time, not the node's.
        now = self.clock.monotonic_ns() / 1e9
        if self.reading is None or now - self.read_at > _SAMPLE_MAX_AGE_S:
            node = self.node()
            if node is None:
                return None
            self.reading = on_loop(self.loop, lambda: sample(node))
            self.read_at = now
        return self.reading


class ReplicaInstruments:
    """Every replica metric, made once per Telemetry; nodes register for the gauges."""

    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.commit_latency = meter.create_histogram(
            "squall.replica.commit.latency",
            unit="ms",
            description="Time from a write reaching the master to its commit (held by the "
            "replicas the ack policy requires), per request",
            explicit_bucket_boundaries_advisory=COMMIT_LATENCY_BUCKETS_MS,
        )
        self.events_in = meter.create_counter(
            "squall.replica.events.in",
            unit="{event}",
            description="Events acknowledged to publishers by this master",
        )
        self.events_out = meter.create_counter(
            "squall.replica.events.out",
            unit="{event}",
            description="Events sent to subscribers by this replica",
        )
        self.role_changes = meter.create_counter(
            "squall.replica.role.changes",
            unit="{change}",
            description="Role changes of this replica, by the role taken",
        )
        self.loss_reports = meter.create_counter(
            "squall.replica.loss.reports",
            unit="{report}",
            description="Loss reports this replica recorded: acknowledged events it discarded "
            "(SQUALL-LOSS-001), by cause",
        )
        self.loss_events = meter.create_counter(
            "squall.replica.loss.events",
            unit="{event}",
            description="Acknowledged events this replica discarded (truncations below the "
            "commit LSN it knew)",
        )
        self._sources: dict[int, _Source] = {}
        gauges = (
            ("squall.replica.role", "", "1 for the role this replica holds, 0 for the others",
             self._observe_role),
            ("squall.replica.epoch", "", "The epoch this replica is in", self._observe_epoch),
            ("squall.replica.last_lsn", "", "LSN of the last entry in the local log",
             self._observe_last_lsn),
            ("squall.replica.commit_lsn", "", "Highest LSN committed reads serve here",
             self._observe_commit_lsn),
            ("squall.replica.store.size", "By", "Bytes the store's data file uses",
             self._observe_store_size),
            ("squall.replica.replication.lag", "{entry}",
             "Log entries a slave lacks at the replica sync policy (reported by the master)",
             self._observe_lag),
            ("squall.replica.link.lag", "{event}",
             "Events of a linked topic its link has not forwarded yet (reported by the master)",
             self._observe_link_lag),
            ("squall.replica.link.lag_time", "ms",
             "How long the oldest event a link has not forwarded yet has waited",
             self._observe_link_lag_time),
        )  # fmt: skip
        for name, unit, description, callback in gauges:
            meter.create_observable_gauge(
                name, callbacks=[callback], unit=unit, description=description
            )

    def watch(self, node: SampledReplica) -> None:
        """Reports node's state in the gauges (call on its loop)."""
        self._sources[id(node)] = _Source(node, asyncio.get_running_loop(), SYSTEM_CLOCK)

    def unwatch(self, node: SampledReplica) -> None:
        """Stops reporting node."""
        self._sources.pop(id(node), None)

    def _readings(self) -> list[ReplicaSample]:
        readings = []
        for source in list(self._sources.values()):
            reading = source.read()
            if reading is not None:
                readings.append(reading)
        return readings

    def _observe_role(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for r in self._readings():
            for role, name in ROLE_NAMES.items():
                yield metrics.Observation(int(r.role == role), {"node": r.node_id, "role": name})

    def _observe_epoch(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(r.epoch, {"node": r.node_id}) for r in self._readings()]

    def _observe_last_lsn(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(r.last_lsn, {"node": r.node_id}) for r in self._readings()]

    def _observe_commit_lsn(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(r.commit_lsn, {"node": r.node_id}) for r in self._readings()]

    def _observe_store_size(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(r.store_bytes, {"node": r.node_id}) for r in self._readings()]

    def _observe_lag(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for r in self._readings():
            for slave, state, lag in r.lags:
                yield metrics.Observation(
                    lag, {"node": r.node_id, "replica": slave, "state": state}
                )

    def _observe_link_lag(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for r in self._readings():
            for source, target, events, _ms in r.link_lags:
                yield metrics.Observation(events, _link_labels(r.node_id, source, target))

    def _observe_link_lag_time(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for r in self._readings():
            for source, target, _events, lag_ms in r.link_lags:
                yield metrics.Observation(lag_ms, _link_labels(r.node_id, source, target))


def _link_labels(node_id: str, source: str, target: str) -> dict[str, str]:
    return {"node": node_id, "topic": source, "link": target}


def instruments(telemetry: Telemetry) -> ReplicaInstruments:
    """The replica instruments of this telemetry."""
    return telemetry.instruments("replica", ReplicaInstruments)


class PublishedTraces:
    """The master's newest traced publishes, (topic, first offset, events) -> the publish
    span's context, so a delivery span can link to the traces that published its events."""

    def __init__(self, limit: int = _TRACED_PUBLISHES_MAX) -> None:
        self._entries: deque[tuple[str, int, int, trace.SpanContext]] = deque(maxlen=limit)

    def note(self, topic: str, first_offset: int, count: int, context: trace.SpanContext) -> None:
        """A traced publish of count events from first_offset was acknowledged."""
        if count > 0:
            self._entries.append((topic, first_offset, first_offset + count, context))

    def clear(self) -> None:
        """Forgets every publish (a truncation: their offsets may be reused)."""
        self._entries.clear()

    def links(self, topic: str, first: int, end: int) -> list[trace.Link]:
        """Links to the publishes of offsets first..end-1 of topic (at most _LINKS_MAX)."""
        out: list[trace.Link] = []
        for name, start, stop, context in reversed(self._entries):
            if name == topic and start < end and first < stop:
                out.append(trace.Link(context, {"squall.first_offset": start}))
                if len(out) >= _LINKS_MAX:
                    break
        out.reverse()
        return out


class PublishWatch:
    """One publish request's spans and metrics (made only while telemetry is on)."""

    __slots__ = ("_clock", "_commit_span", "_events", "_instruments", "_node_id", "_published",
                 "_span", "_started_ns", "_topic", "_tracer")  # fmt: skip

    def __init__(
        self,
        telemetry: Telemetry,
        request: broker_pb2.PublishRequest,
        node_id: str,
        epoch: int,
        clock: PreciseClock = SYSTEM_CLOCK,
        published: PublishedTraces | None = None,
    ) -> None:
        """clock: the publish's latency is read from it (sub-millisecond); published: where
        a traced publish is remembered for delivery spans to link to."""
        self._clock = clock
        self._topic = request.topic
        self._published = published
        self._started_ns = clock.monotonic_ns()
        self._events = len(request.events)
        self._node_id = node_id
        self._instruments = instruments(telemetry) if telemetry.metering else None
        self._tracer = telemetry.tracer
        self._span: trace.Span | None = None
        self._commit_span: trace.Span | None = None
        if telemetry.tracing:
            span = self._tracer.start_span(
                "replica.publish",
                attributes={
                    "squall.node": node_id,
                    "squall.topic": request.topic,
                    "squall.events": self._events,
                    "squall.epoch": epoch,
                },
            )
            self._span = span if span.is_recording() else None

    @property
    def traced(self) -> PublishWatch | None:
        """Itself when its trace is recorded (the node then reports the append to it)."""
        return self if self._span is not None else None

    def appended(
        self, lsn: int, epoch: int, receipt: common_pb2.BatchReceipt | None = None
    ) -> trace.SpanContext | None:
        """The entry is in the local log at lsn: the commit wait starts. A traced publish
        is remembered now (before its commit can wake a delivery) for delivery links."""
        span = self._span
        if span is None:
            return None
        span.set_attribute("squall.first_lsn", lsn)
        span.set_attribute("squall.epoch", epoch)
        if self._published is not None and receipt is not None and receipt.count:
            self._published.note(
                self._topic, receipt.first_offset, receipt.count, span.get_span_context()
            )
        self._commit_span = self._tracer.start_span(
            "replica.commit_wait",
            context=trace.set_span_in_context(span),
            attributes={"squall.lsn": lsn, "squall.epoch": epoch},
        )
        return self._commit_span.get_span_context()

    def done(self, receipt: common_pb2.BatchReceipt) -> None:
        """The events are acknowledged to the publisher."""
        if self._instruments is not None:
            attributes = {"node": self._node_id}
            self._instruments.commit_latency.record(
                (self._clock.monotonic_ns() - self._started_ns) / 1e6, attributes
            )
            self._instruments.events_in.add(self._events, attributes)
        if self._span is not None:
            if receipt.count:
                self._span.set_attribute("squall.first_offset", receipt.first_offset)
            self._end(None)

    def failed(self, error: BaseException) -> None:
        """The publish was refused or its outcome is unknown."""
        if self._span is not None:
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        for span in (self._commit_span, self._span):
            if span is None:
                continue
            if error is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            span.end()


class JoinedWatch:
    """A joined request's metrics while metering is on and tracing off: each part
    acknowledged counts as ``PublishWatch.done`` counts a publish of its own (its latency
    is the request's: the parts are answered together), so turning metrics on keeps a
    joined request on the one-write path."""

    __slots__ = ("_attributes", "_clock", "_instruments", "_started_ns")

    def __init__(
        self, telemetry: Telemetry, node_id: str, clock: PreciseClock = SYSTEM_CLOCK
    ) -> None:
        self._clock = clock
        self._instruments = instruments(telemetry)
        self._attributes = {"node": node_id}
        self._started_ns = clock.monotonic_ns()

    def done(self, events: int) -> None:
        """A part of `events` events is acknowledged to the publisher."""
        latency_ms = (self._clock.monotonic_ns() - self._started_ns) / 1e6
        self._instruments.commit_latency.record(latency_ms, self._attributes)
        self._instruments.events_in.add(events, self._attributes)


class ReplicationTracer:
    """The master's replication spans: one per traced batch sent to a slave, ended by its ack."""

    def __init__(self, tracer: trace.Tracer, master_id: str, epoch: int) -> None:
        self._tracer = tracer
        self._master_id = master_id
        self._epoch = epoch
        # (lsn, commit-wait span context) of traced writes, in LSN order.
        self._writes: deque[tuple[int, trace.SpanContext]] = deque(maxlen=_TRACED_WRITES_MAX)
        # Per slave: (last LSN, span, received) of batches sent and not yet acknowledged.
        self._inflight: dict[str, deque[tuple[int, trace.Span, bool]]] = {}

    def note(self, writes: Iterable[tuple[int, trace.SpanContext | None]]) -> None:
        """Traced writes just appended (before they are sent)."""
        for lsn, span_context in writes:
            if span_context is not None:
                self._writes.append((lsn, span_context))

    def _traced_in(self, first_lsn: int, last_lsn: int) -> list[trace.SpanContext]:
        found: list[trace.SpanContext] = []
        # Newest first: an up-to-date slave's batch is at the end of the window.
        for lsn, span_context in reversed(self._writes):
            if lsn < first_lsn:
                break
            if lsn <= last_lsn:
                found.append(span_context)
        found.reverse()
        return found

    def sent(self, node_id: str, first_lsn: int, last_lsn: int, size_bytes: int) -> None:
        """A batch of entries left for node_id; traced if it carries a traced write."""
        if not self._writes or last_lsn < first_lsn:
            return
        traced = self._traced_in(first_lsn, last_lsn)
        if not traced:
            return
        parent = trace.set_span_in_context(trace.NonRecordingSpan(traced[0]))
        span = self._tracer.start_span(
            "replication.send",
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            links=[trace.Link(c) for c in traced[1:_LINKS_MAX]],
            attributes={
                "squall.node": self._master_id,
                "squall.replica": node_id,
                "squall.epoch": self._epoch,
                "squall.first_lsn": first_lsn,
                "squall.last_lsn": last_lsn,
                "squall.entries": last_lsn - first_lsn + 1,
                "squall.bytes": size_bytes,
                "squall.traced_writes": len(traced),
            },
        )
        self._inflight.setdefault(node_id, deque()).append((last_lsn, span, False))

    def acked(self, node_id: str, received_lsn: int, durable_lsn: int) -> None:
        """node_id acknowledged: batches it holds at the replica sync policy end."""
        inflight = self._inflight.get(node_id)
        if not inflight:
            return
        # Bounded by the batches in flight (the replication window).
        while inflight and inflight[0][0] <= durable_lsn:
            last_lsn, span, received = inflight.popleft()
            if not received:
                span.add_event("received", {"squall.lsn": received_lsn})
            span.set_attribute("squall.acked_lsn", durable_lsn)
            span.end()
        for index, (last_lsn, span, received) in enumerate(inflight):
            if received or last_lsn > received_lsn:
                break
            span.add_event("received", {"squall.lsn": received_lsn})
            inflight[index] = (last_lsn, span, True)

    def closed(self, node_id: str, reason: str) -> None:
        """The stream to node_id ended: its unacknowledged batches end unacknowledged."""
        for _, span, _ in self._inflight.pop(node_id, ()):
            span.set_status(trace.Status(trace.StatusCode.ERROR, reason or "stream closed"))
            span.end()

    def close(self, reason: str) -> None:
        """The epoch ended: every open span ends."""
        for node_id in list(self._inflight):
            self.closed(node_id, reason)


class DeliveryWatch:
    """A subscription's delivery spans and the events-out counter."""

    def __init__(
        self,
        telemetry: Telemetry,
        node_id: str,
        topic: str,
        published: PublishedTraces | None = None,
    ) -> None:
        self._topic = topic
        self._published = published
        self._tracer = telemetry.tracer if telemetry.tracing else None
        self._counter = instruments(telemetry).events_out if telemetry.metering else None
        self._attributes = {"node": node_id}
        self._span_attributes: dict[str, str | int] = {
            "squall.node": node_id,
            "squall.topic": topic,
        }

    def start(self, events: Sequence[common_pb2.Event]) -> trace.Span | None:
        """A batch is about to be sent; returns its span (end it once sent)."""
        if self._counter is not None:
            self._counter.add(len(events), self._attributes)
        if self._tracer is None:
            return None
        first, end = events[0].offset, events[-1].offset + 1
        return self._tracer.start_span(
            "subscribe.deliver",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                **self._span_attributes,
                "squall.first_offset": first,
                "squall.events": len(events),
            },
            links=self._published.links(self._topic, first, end) if self._published else None,
        )


def push_span(
    telemetry: Telemetry,
    published: PublishedTraces | None,
    node_id: str,
    subscriber_id: str,
    topic: str,
    events: Sequence[common_pb2.Event],
    attempt: int,
) -> trace.Span | None:
    """A push delivery's span (None while tracing is off): one Deliver call to an app's
    endpoint, linked to the publishes of its events; end it with the call's status."""
    if not telemetry.tracing:
        return None
    first, end = events[0].offset, events[-1].offset + 1
    return telemetry.tracer.start_span(
        "push.deliver",
        kind=trace.SpanKind.PRODUCER,
        attributes={
            "squall.node": node_id,
            "squall.topic": topic,
            "squall.subscriber": subscriber_id,
            "squall.first_offset": first,
            "squall.events": len(events),
            "squall.attempt": attempt,
        },
        links=published.links(topic, first, end) if published else None,
    )
