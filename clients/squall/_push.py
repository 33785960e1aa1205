"""Push subscribers, IceStorm style: the master calls the app's own gRPC service.

An app subscribes with `Topic.subscribe_push(subscriber_id, endpoint, ...)` (IceStorm's
`subscribeAndGetPublisher`); from then on the cluster's master calls
`squall.v1.PushSubscriber/Deliver` at `endpoint` with batches of the topic's committed
events. `PushEndpoint` serves that service in this process and hands each delivery to a
callback, so apps and tests need not write a gRPC server:

    with squall.PushEndpoint() as endpoint, squall.connect(gateway) as client:
        topic = client.topic("orders")
        topic.subscribe_push("billing", endpoint, on_delivery=handle, retry_count=-1)

The callback returns normally once the batch is handled (the master then moves the
subscriber's durable cursor past it); raising fails the delivery (INTERNAL), which counts
against the subscriber's `retry_count`. An endpoint answers NOT_FOUND for a subscriber id
it does not hold, which removes that subscription at once (IceStorm's "no such
subscriber"): `PushEndpoint.remove(id)` is the app's way to say "stop sending". Delivery
is at-least-once; `PushDelivery.messages` carry offsets to tell duplicates apart. See
docs/push-subscribers.md for QoS and guarantees.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import grpc

from squall._tls import TlsOptions
from squall._types import Message, messages_from_events
from squall.v1 import broker_pb2, push_pb2, push_pb2_grpc
from squall.wire import stages as _stages

log = logging.getLogger("squall")

Reliability = Literal["", "ordered"]
PushStart = Literal["earliest", "latest"] | int

# The details of a DeliverStream an endpoint refuses for want of threads.
STREAMS_REFUSED = "no thread free for another delivery stream; call Deliver"

# The broker bounds its batches (limits.push_batch_max_bytes, 3 MiB by default); an
# endpoint accepts more so a cluster configured larger still gets through.
ENDPOINT_MESSAGE_BYTES_MAX = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class PushSubscriberInfo:
    """A push subscriber as the cluster reports it."""

    topic: str
    subscriber_id: str
    endpoint: str
    qos: Mapping[str, str] = dataclasses.field(hash=False)
    """The QoS in canonical form: "reliability" and "retryCount"."""
    cursor: int
    """The next offset it will be offered (durable, replicated)."""
    created_ms: int
    consecutive_failures: int
    """Failed deliveries in a row on the current master (0 when read from another node)."""
    last_error: str

    @property
    def ordered(self) -> bool:
        """True for QoS reliability=ordered."""
        return self.qos.get("reliability") == "ordered"

    @property
    def retry_count(self) -> int:
        """QoS retryCount: -1 retries forever, 0 removes on the first failure, n after n
        failures in a row."""
        return int(self.qos.get("retryCount", "0"))

    @classmethod
    def from_pb(cls, info: broker_pb2.PushSubscriberInfo) -> PushSubscriberInfo:
        """Builds one from the wire message."""
        return cls(
            topic=info.topic,
            subscriber_id=info.subscriber_id,
            endpoint=info.endpoint,
            qos=dict(info.qos),
            cursor=info.cursor,
            created_ms=info.created_ms,
            consecutive_failures=info.consecutive_failures,
            last_error=info.last_error,
        )


def subscribe_push_request(
    topic: str,
    subscriber_id: str,
    endpoint: str,
    reliability: Reliability,
    retry_count: int,
    start: PushStart,
    qos: Mapping[str, str] | None,
) -> broker_pb2.SubscribeAndGetPublisherRequest:
    """The request for Topic.subscribe_push; ValueError for a bad start.

    `qos` entries are sent as given, after `reliability` and `retryCount`, so the cluster
    judges every key and value (an unknown key is refused there, by name).
    """
    request = broker_pb2.SubscribeAndGetPublisherRequest(
        topic=topic, subscriber_id=subscriber_id, endpoint=endpoint
    )
    given = dict(qos or {})
    request.qos["reliability"] = reliability
    if "retry_count" not in given:  # the other spelling: the cluster takes one of them
        request.qos["retryCount"] = str(retry_count)
    request.qos.update(given)
    if start == "latest":
        request.start = broker_pb2.START_POSITION_LATEST
    elif start == "earliest":
        request.start = broker_pb2.START_POSITION_EARLIEST
    elif isinstance(start, int) and not isinstance(start, bool) and start >= 0:
        request.start = broker_pb2.START_POSITION_OFFSET
        request.offset = start
    else:
        raise ValueError(f"start must be 'earliest', 'latest' or an offset >= 0, not {start!r}")
    return request


@dataclasses.dataclass(frozen=True, slots=True)
class PushDelivery:
    """One batch the master delivered to a push subscriber."""

    topic: str
    subscriber_id: str
    messages: list[Message]
    """In offset order; with reliability=ordered, each batch follows the last one handled
    (or repeats one that failed)."""
    attempt: int
    """How often this master offered these events before (0: the first time)."""
    master_id: str
    epoch: int


DeliveryCallback = Callable[[PushDelivery], None]


def not_hosted(request: push_pb2.PushDeliverRequest) -> str:
    """The NOT_FOUND details for a subscriber id the endpoint does not host (the master
    then removes that subscription)."""
    return f"no push subscriber '{request.subscriber_id}' at this endpoint"


def callback_failed(
    request: push_pb2.PushDeliverRequest, exc: Exception
) -> tuple[grpc.StatusCode, str]:
    """The failed delivery a raising callback makes (logged): INTERNAL, naming the error."""
    log.warning("push subscriber '%s': the delivery callback raised %r", request.subscriber_id, exc)
    return grpc.StatusCode.INTERNAL, f"the delivery callback raised {exc!r}"


def result_pb(code: grpc.StatusCode, details: str) -> push_pb2.PushDeliverResult:
    """One DeliverStream result: the status Deliver would have answered with."""
    return push_pb2.PushDeliverResult(code=code.value[0], details=details)


def delivery_key(request: push_pb2.PushDeliverRequest) -> str:
    """A delivery's key in the latency budget's stage marks (squall.wire.stages): its
    first event's, as the master marks it."""
    return f"off/{request.topic}/{request.events[0].offset}"


def delivery_from_pb(request: push_pb2.PushDeliverRequest) -> PushDelivery:
    """The app's view of one Deliver call."""
    return PushDelivery(
        topic=request.topic,
        subscriber_id=request.subscriber_id,
        messages=messages_from_events(request.events),
        attempt=request.attempt,
        master_id=request.master_id,
        epoch=request.epoch,
    )


def endpoint_bind_options(bind: str, max_message_bytes: int) -> tuple[str, list[tuple[str, Any]]]:
    """The host of a push endpoint's bind address and its server options; ValueError for a
    bind address that is not host:port."""
    host, sep, _ = bind.rpartition(":")
    if not sep or not host:
        raise ValueError(f"bind must be host:port, not {bind!r}")
    return host, [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class _Servicer(push_pb2_grpc.PushSubscriberServicer):
    def __init__(self, endpoint: PushEndpoint) -> None:
        self._endpoint = endpoint

    def _outcome(self, request: push_pb2.PushDeliverRequest) -> tuple[grpc.StatusCode, str]:
        """Hands one request to its callback: the status Deliver answers with."""
        if _stages.ENABLED and request.events:
            _stages.mark("e.in", delivery_key(request))
        callback = self._endpoint.callback(request.subscriber_id)
        if callback is None:
            return grpc.StatusCode.NOT_FOUND, not_hosted(request)
        if request.probe:
            return grpc.StatusCode.OK, ""
        delivery = delivery_from_pb(request)
        if _stages.ENABLED and request.events:
            _stages.mark("e.cb", delivery_key(request))
        try:
            callback(delivery)
        except Exception as exc:  # the app's failure: the master retries per retry_count
            return callback_failed(request, exc)
        return grpc.StatusCode.OK, ""

    def Deliver(
        self, request: push_pb2.PushDeliverRequest, context: grpc.ServicerContext
    ) -> push_pb2.PushDeliverResponse:
        code, details = self._outcome(request)
        if code != grpc.StatusCode.OK:
            context.abort(code, details)
        return push_pb2.PushDeliverResponse()

    def DeliverStream(
        self, request_iterator: Iterator[push_pb2.PushDeliverRequest], context: grpc.ServicerContext
    ) -> Iterator[push_pb2.PushDeliverResult]:
        # A stream holds one of the server's threads while open: refused (the master then
        # calls Deliver) when it would leave none for Deliver calls.
        endpoint = self._endpoint
        if not endpoint._open_stream():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, STREAMS_REFUSED)
        requests = iter(request_iterator)
        try:
            while endpoint._wait_on_stream(context):
                try:
                    request = next(requests)
                except StopIteration:
                    return
                finally:
                    endpoint._stream_busy(context)
                yield result_pb(*self._outcome(request))
        finally:
            endpoint._close_stream()


class PushEndpoint:
    """Serves squall.v1.PushSubscriber in this process; one callback per subscriber id.

    `bind` is the address to listen on ("127.0.0.1:0" picks a free loopback port);
    `advertise` is the host:port the cluster's master dials (default: the bound address,
    which must then be reachable from the master). Deliveries run on `max_workers`
    threads; a callback may be called from several at once for an unordered subscriber.
    The master delivers on a stream per subscriber (`DeliverStream`) when it can, each
    holding a thread while open: at most `max_workers - 1` at once, so one is always left
    for `Deliver` calls (further streams are refused and the master calls `Deliver`).
    With `tls` (for a cluster with `[tls]` on, where `tls.push = "tls"` is the default) it
    serves TLS with `tls.cert_file`/`key_file`, whose certificate must name the host the
    master dials, and accepts only callers with a certificate from `tls.ca_file` (the
    cluster's replicas). Use it as a context manager, or call close().
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        *,
        advertise: str | None = None,
        max_workers: int = 4,
        max_message_bytes: int = ENDPOINT_MESSAGE_BYTES_MAX,
        tls: TlsOptions | None = None,
    ) -> None:
        host, options = endpoint_bind_options(bind, max_message_bytes)
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, not {max_workers}")
        self._lock = threading.Lock()
        self._callbacks: dict[str, DeliveryCallback] = {}
        self._streams = 0  # DeliverStream calls open
        self._streams_max = max_workers - 1
        # The streams waiting for the master's next request, ended at once by close(): a
        # master keeps one open per subscriber, and left to the server's grace each would
        # hold close() for all of it, with no delivery in progress.
        self._waiting: set[grpc.ServicerContext] = set()
        self._closing = False
        credentials = tls.server_credentials() if tls is not None else None
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="squall-push"
            ),
            options=options,
        )
        push_pb2_grpc.add_PushSubscriberServicer_to_server(_Servicer(self), self._server)
        try:
            if credentials is None:
                port = self._server.add_insecure_port(bind)
            else:
                port = self._server.add_secure_port(bind, credentials)
        except RuntimeError as exc:  # grpc's "failed to bind"
            raise ValueError(f"cannot listen on {bind!r}: {exc}") from None
        if port == 0:
            raise ValueError(f"cannot listen on {bind!r}")
        self._address = advertise or f"{host}:{port}"
        self._server.start()
        self._closed = False

    @property
    def address(self) -> str:
        """The host:port to give the cluster (subscribe_push does it for you)."""
        return self._address

    def add(self, subscriber_id: str, callback: DeliveryCallback) -> None:
        """Hosts a subscriber id here: its deliveries, of every topic it subscribed to
        with this endpoint, go to callback (replacing the one it had)."""
        if not subscriber_id:
            raise ValueError("subscriber_id must not be empty")
        with self._lock:
            self._callbacks[subscriber_id] = callback

    def remove(self, subscriber_id: str) -> bool:
        """Stops hosting a subscriber id; the master removes that subscription on its next
        delivery (NOT_FOUND is a hard failure). Returns whether it was hosted."""
        with self._lock:
            return self._callbacks.pop(subscriber_id, None) is not None

    def callback(self, subscriber_id: str) -> DeliveryCallback | None:
        """The callback hosting a subscriber id here, or None."""
        with self._lock:
            return self._callbacks.get(subscriber_id)

    def _open_stream(self) -> bool:
        with self._lock:
            if self._streams >= self._streams_max:
                return False
            self._streams += 1
            return True

    def _close_stream(self) -> None:
        with self._lock:
            self._streams -= 1

    def _wait_on_stream(self, context: grpc.ServicerContext) -> bool:
        """A stream is about to wait for its next request: False once closing."""
        with self._lock:
            if self._closing:
                return False
            self._waiting.add(context)
            return True

    def _stream_busy(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._waiting.discard(context)

    def close(self, grace_s: float = 1.0) -> None:
        """Stops serving: deliveries in progress get grace_s to finish; delivery streams
        with none in progress end at once (the master opens a new one when it next
        delivers, to wherever the subscriber is hosted then)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._closing = True
            waiting, self._waiting = self._waiting, set()
        for context in waiting:
            context.cancel()  # type: ignore[no-untyped-call]  # (grpc-stubs leave it untyped)
        self._server.stop(grace_s).wait()

    def __enter__(self) -> PushEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PushEndpoint({self._address!r})"
