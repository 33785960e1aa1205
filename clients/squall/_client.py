"""The connection to a Squall gateway, and the topic handle publishers and subscribers hang off.

`connect()` opens one gRPC channel; everything a `Client` hands out (topics, publishers,
subscriptions) shares it. The API is synchronous on purpose: apps and Spark executors
call it from plain threads.

Every call records an OpenTelemetry CLIENT span and sends its context (`traceparent`) to
the gateway, through the app's tracer provider (the global one unless `tracer_provider`
is given); an app that has not configured OpenTelemetry records and sends nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import TracerProvider

from squall._auth import with_token
from squall._errors import (
    AlreadyExists,
    AlreadySubscribed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from squall._proxy import Endpoint, GatewayBinding, ProxyBinding, RebindCallback
from squall._publish_mux import ProxyMuxes, PublishMux
from squall._publisher import INFLIGHT_BATCHES_MAX_DEFAULT, Publisher, new_publisher_id
from squall._push import (
    DeliveryCallback,
    PushEndpoint,
    PushStart,
    PushSubscriberInfo,
    Reliability,
    subscribe_push_request,
)
from squall._seek import SeekResult, SeekTarget, SubscriptionInfo, seek_request, subscription_named
from squall._shared import SharedConsumer, SharedSettings, create_request
from squall._subscriber import ReadFrom, Start, Subscription, subscribe_request
from squall._tls import TlsOptions, open_channel
from squall._tracing import traced_channel
from squall._types import ClusterStatus, LinkInfo, TopicInfo, kind_to_pb
from squall.v1 import broker_pb2, broker_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from squall.wire.auth import resolve_token
from squall.wire.retry import (
    RETRY_ATTEMPTS_MAX_DEFAULT,
    RETRY_BACKOFF_INITIAL_MS_DEFAULT,
    RETRY_BACKOFF_MAX_MS_DEFAULT,
    RETRY_TOTAL_MS_MAX_DEFAULT,
    RetryPolicy,
)

MESSAGE_BYTES_MAX = 64 * 1024 * 1024

ChannelOptions = Sequence[tuple[str, Any]]

_Resp = TypeVar("_Resp")


# A connection attempt (TCP, then TLS) gets at least this long before gRPC gives it up.
# gRPC uses its minimum reconnect backoff as that floor; the library's backoff is far
# shorter (it paces attempts), so the floor is set on its own: long enough for a TLS
# handshake across a slow network.
CONNECT_TIMEOUT_MIN_MS = 1_000


def reconnect_options(retry: RetryPolicy | None = None) -> list[tuple[str, int]]:
    """How fast a channel dials a restarted gateway or replica again: the retry backoff.

    gRPC's own default waits 1 s, then 1.6 times longer after each failure up to 120 s,
    so a publisher proxy whose replica was down a few seconds used to wait seconds more
    after it came back. Bounded like the gateway's channels (services/gateway/master.py):
    first retry after backoff_initial_ms, never more than backoff_max_ms apart.
    """
    policy = retry or RetryPolicy()
    return [
        ("grpc.initial_reconnect_backoff_ms", policy.backoff_initial_ms),
        ("grpc.max_reconnect_backoff_ms", policy.backoff_max_ms),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MIN_MS),
    ]


def channel_options(
    options: ChannelOptions | None = None, retry: RetryPolicy | None = None
) -> list[tuple[str, Any]]:
    """Squall's channel defaults (64 MiB messages, keepalive, bounded reconnect backoff from
    the retry policy), overridden by `options`."""
    merged: dict[str, Any] = {
        "grpc.max_send_message_length": MESSAGE_BYTES_MAX,
        "grpc.max_receive_message_length": MESSAGE_BYTES_MAX,
        # A dead gateway must be noticed by a long-lived publish or subscribe stream
        # without waiting for TCP's own timeouts; the services accept pings this often.
        "grpc.keepalive_time_ms": 10_000,
        "grpc.keepalive_timeout_ms": 5_000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
        **dict(reconnect_options(retry)),
    }
    merged.update(dict(options or ()))
    return list(merged.items())


def check_client_args(address: str, timeout_s: float, retry: RetryPolicy | None) -> RetryPolicy:
    """Validates a client's address, timeout and retry policy; returns the policy to use.

    ValueError names the first value out of bounds (shared by `connect` and
    `squall.aio.connect`).
    """
    if not address:
        raise ValueError("address must be host:port, not empty")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, not {timeout_s}")
    policy = retry if retry is not None else RetryPolicy()
    policy.validate()
    return policy


def proxy_endpoints(response: broker_pb2.GetPublisherResponse, topic: str) -> list[Endpoint]:
    """The replicas a GetPublisher / GetNonReplicatedPublisher answer names.

    Unavailable when it names none (no replica address known to the gateway).
    """
    endpoints = [
        Endpoint(e.node_id, e.replica_address) for e in response.endpoints if e.replica_address
    ]
    if not endpoints:
        raise Unavailable(f"the publisher proxy for topic '{topic}' has no endpoints")
    return endpoints


def connect(
    address: str,
    *,
    timeout_s: float = 10.0,
    options: ChannelOptions | None = None,
    retry_attempts_max: int = RETRY_ATTEMPTS_MAX_DEFAULT,
    retry_backoff_initial_ms: int = RETRY_BACKOFF_INITIAL_MS_DEFAULT,
    retry_backoff_max_ms: int = RETRY_BACKOFF_MAX_MS_DEFAULT,
    retry_total_ms_max: int = RETRY_TOTAL_MS_MAX_DEFAULT,
    tracer_provider: TracerProvider | None = None,
    tls: TlsOptions | None = None,
    token: str | None = None,
    share_publish_stream: bool = True,
) -> Client:
    """Opens a client to the gateway at `address` ("host:port"); use it as a context manager.

    The retry_* parameters bound how an indeterminate publish batch is retried (same
    names, meanings and defaults as the [retry] section of the cluster configuration):
    the budget is time, `retry_total_ms_max`; `retry_attempts_max` is an optional cap on
    attempts (0: none, the default; 1 turns retrying off). The backoff bounds also pace
    how fast every channel of the client dials a restarted gateway or replica again.
    ValueError names a value out of bounds.
    `tracer_provider` records the client's spans (default: OpenTelemetry's global one).
    `tls` connects with TLS (`TlsOptions`: the cluster CA, and a client certificate for
    publisher proxies); plaintext without it.
    `token` is sent as `authorization: Bearer <token>` on every call, publisher proxies'
    included (default: $SQUALL_TOKEN, else the file $SQUALL_TOKEN_FILE names; docs/auth.md).
    `share_publish_stream` (default True) sends the one-at-a-time `publish()` calls of all
    the client's gateway publishers on one shared stream, and those of its publisher
    proxies on one shared stream per replica they are bound to, joining concurrent ones
    into one request (README.md, "Using it from Python"); False gives each publisher
    its own stream for everything.
    """
    retry = RetryPolicy(
        attempts_max=retry_attempts_max,
        backoff_initial_ms=retry_backoff_initial_ms,
        backoff_max_ms=retry_backoff_max_ms,
        total_ms_max=retry_total_ms_max,
    )
    return Client(
        address,
        timeout_s=timeout_s,
        options=options,
        retry=retry,
        tracer_provider=tracer_provider,
        tls=tls,
        token=token,
        share_publish_stream=share_publish_stream,
    )


class Client:
    """A connection to a Squall gateway: topic management, cluster status, and topic handles."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        options: ChannelOptions | None = None,
        retry: RetryPolicy | None = None,
        tracer_provider: TracerProvider | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
        share_publish_stream: bool = True,
    ) -> None:
        self._retry = check_client_args(address, timeout_s, retry)
        self._address = address
        self._timeout_s = timeout_s
        self._options = list(options or ())
        self._tracer_provider = tracer_provider
        self._tls = tls
        # Read once: a missing or broken file fails here, naming it.
        self._credentials = tls.credentials() if tls is not None else None
        self._token = resolve_token(token)
        self._channel = traced_channel(
            with_token(
                open_channel(
                    address,
                    channel_options(options, self._retry),
                    tls,
                    self._credentials,
                    tls.server_name if tls is not None else None,
                ),
                self._token,
            ),
            tracer_provider,
        )
        self._topic_manager = broker_pb2_grpc.TopicManagerStub(self._channel)
        self._publisher_stub = broker_pb2_grpc.PublisherStub(self._channel)
        self._subscriber_stub = broker_pb2_grpc.SubscriberStub(self._channel)
        self._push_stub = broker_pb2_grpc.PushSubscriptionsStub(self._channel)
        self._admin = gateway_pb2_grpc.ClusterAdminStub(self._channel)
        self._lock = threading.Lock()
        self._closed = False
        self._publishers: set[Publisher] = set()
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
        # The stream every gateway publisher's lone publishes share (squall._publish_mux).
        self._publish_mux = PublishMux(self._publisher_stub) if share_publish_stream else None
        # The streams its publisher proxies' lone publishes share, one per replica address.
        self._proxy_muxes = ProxyMuxes() if share_publish_stream else None

    @property
    def address(self) -> str:
        """The gateway address this client talks to."""
        return self._address

    @property
    def timeout_s(self) -> float:
        """The deadline of each unary call, and of each publish batch's receipt."""
        return self._timeout_s

    @property
    def retry(self) -> RetryPolicy:
        """How publishers of this client retry indeterminate batches."""
        return self._retry

    @property
    def channel(self) -> grpc.Channel:
        """The underlying gRPC channel, for calling the generated stubs directly."""
        return self._channel

    def _call(self, method: Callable[..., _Resp], request: Any, wait_s: float = 0.0) -> _Resp:
        """One call within timeout_s, plus wait_s the request asks the server to wait."""
        self._check_open()
        try:
            return method(request, timeout=self._timeout_s + wait_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the client is closed")

    def create_topic(self, name: str, kind: str = "replicated") -> TopicInfo:
        """Creates a topic ("replicated" or "transient"); AlreadyExists if it exists."""
        request = broker_pb2.CreateTopicRequest(name=name, kind=kind_to_pb(kind))
        return TopicInfo.from_pb(self._call(self._topic_manager.CreateTopic, request).topic)

    def topic(self, name: str) -> Topic:
        """Retrieves a topic's handle; NotFound if it does not exist."""
        request = broker_pb2.RetrieveTopicRequest(name=name)
        info = TopicInfo.from_pb(self._call(self._topic_manager.RetrieveTopic, request).topic)
        return Topic(self, info)

    def topics(self) -> list[TopicInfo]:
        """Every topic, ordered by name."""
        response = self._call(self._topic_manager.ListTopics, broker_pb2.ListTopicsRequest())
        return [TopicInfo.from_pb(t) for t in response.topics]

    def destroy_topic(self, name: str) -> None:
        """Destroys a topic with its events and subscriptions; NotFound if it does not exist."""
        self._call(self._topic_manager.DestroyTopic, broker_pb2.DestroyTopicRequest(name=name))

    def links(self) -> list[LinkInfo]:
        """Every topic link of the cluster, ordered by source then destination."""
        response = self._call(self._topic_manager.GetLinkInfo, broker_pb2.GetLinkInfoRequest())
        return [LinkInfo.from_pb(link) for link in response.links]

    def status(self) -> ClusterStatus:
        """The cluster status table as the gateway sees it."""
        request = gateway_pb2.GetClusterStatusRequest()
        return ClusterStatus.from_pb(self._call(self._admin.GetClusterStatus, request))

    def close(self) -> None:
        """Flushes and closes publishers, cancels subscriptions, closes the channel."""
        with self._lock:
            if self._closed:
                return
            publishers = list(self._publishers)
            subscriptions = list(self._subscriptions)
        for publisher in publishers:
            publisher.close()
        for subscription in subscriptions:
            subscription.close()
        if self._publish_mux is not None:
            self._publish_mux.close()
        if self._proxy_muxes is not None:
            self._proxy_muxes.close()
        with self._lock:
            self._closed = True
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self._address!r})"

    # -- used by Topic ----------------------------------------------------------------

    def _new_publisher(
        self,
        topic: str,
        publisher_id: str,
        start_sequence: int,
        inflight_batches_max: int,
        replicated: bool | None = None,
        on_rebind: RebindCallback | None = None,
    ) -> Publisher:
        self._check_open()
        binding: GatewayBinding | ProxyBinding
        if replicated is None:
            if on_rebind is not None:
                raise ValueError(
                    "on_rebind needs a publisher proxy (replicated=True); through the "
                    "gateway the publisher never binds to a replica"
                )
            binding = GatewayBinding(self._publisher_stub)
        else:
            binding = self._proxy(topic, replicated)
        publisher = Publisher(
            binding,
            topic,
            publisher_id,
            start_sequence=start_sequence,
            timeout_s=self._timeout_s,
            inflight_batches_max=inflight_batches_max,
            on_close=self._forget_publisher,
            retry=self._retry,
            on_rebind=on_rebind,
            mux=self._publish_mux,
            proxy_muxes=self._proxy_muxes,
        )
        with self._lock:
            self._publishers.add(publisher)
        return publisher

    def _proxy(self, topic: str, replicated: bool) -> ProxyBinding:
        """Asks the gateway for a publisher proxy (GetPublisher or GetNonReplicatedPublisher)."""
        request = broker_pb2.GetPublisherRequest(topic=topic)
        method = (
            self._topic_manager.GetPublisher
            if replicated
            else self._topic_manager.GetNonReplicatedPublisher
        )
        endpoints = proxy_endpoints(self._call(method, request), topic)
        options = self._options
        retry = self._retry
        tracer_provider = self._tracer_provider
        tls, credentials = self._tls, self._credentials
        token = self._token
        # With TLS, a replica's certificate must name the node the gateway said it is.
        names = {e.address: e.node_id for e in endpoints}

        def make_channel(address: str) -> grpc.Channel:
            return traced_channel(
                with_token(
                    open_channel(
                        address,
                        channel_options(options, retry),
                        tls,
                        credentials,
                        names.get(address),
                    ),
                    token,
                ),
                tracer_provider,
            )

        def master_of(timeout_s: float) -> str:
            # GetPublisher lists the master first; the gateway forwards it to the master
            # its group views name.
            answer = self._topic_manager.GetPublisher(request, timeout=timeout_s)
            return next((e.replica_address for e in answer.endpoints if e.replica_address), "")

        return ProxyBinding(
            endpoints, replicated=replicated, make_channel=make_channel, master_of=master_of
        )

    def _forget_publisher(self, publisher: Publisher) -> None:
        with self._lock:
            self._publishers.discard(publisher)

    def _new_subscription(
        self, request: broker_pb2.SubscribeRequest, dedupe: bool = True
    ) -> Subscription:
        self._check_open()
        subscription = Subscription(
            self._subscriber_stub,
            request,
            timeout_s=self._timeout_s,
            retry=self._retry,
            dedupe=dedupe,
        )
        with self._lock:
            self._subscriptions.add(subscription)
        return subscription


class Topic:
    """A handle on one topic: make publishers and subscriptions, manage its cursors."""

    def __init__(self, client: Client, info: TopicInfo) -> None:
        self._client = client
        self._info = info

    @property
    def name(self) -> str:
        """The topic's name."""
        return self._info.name

    @property
    def info(self) -> TopicInfo:
        """The topic as it was when this handle was retrieved (see refresh())."""
        return self._info

    def refresh(self) -> TopicInfo:
        """Fetches the topic again (offsets move as events arrive); NotFound once destroyed."""
        self._info = self._client.topic(self.name).info
        return self._info

    def publisher(
        self,
        publisher_id: str | None = None,
        *,
        start_sequence: int = 1,
        inflight_batches_max: int = INFLIGHT_BATCHES_MAX_DEFAULT,
        replicated: bool | None = None,
        on_rebind: RebindCallback | None = None,
    ) -> Publisher:
        """A publisher for this topic; a random id unless given, sequences from start_sequence.

        `replicated` picks how it reaches the master:

        * None (the default): every stream goes through the gateway, which follows the
          master; the app needs to reach the gateway only.
        * True: a replicated proxy (GetPublisher): it binds straight to one replica and
          fails over to the others, following a slave's redirect to the master;
          `on_rebind(old, new)` is called, and the next receipt has `rebound=True`,
          when it moves (this publisher's order may change there).
        * False: a non-replicated proxy (GetNonReplicatedPublisher): the master only, no
          silent failover; on master loss it raises `PublisherLost` and the app asks for
          a new publisher (reuse the id with `start_sequence=publisher.next_sequence`).

        To resume a known publisher id after a restart, pass the sequence after the last
        one it used: the master treats reused (publisher_id, sequence) pairs as duplicates.
        """
        return self._client._new_publisher(
            self.name,
            publisher_id or new_publisher_id(),
            start_sequence,
            inflight_batches_max,
            replicated,
            on_rebind,
        )

    def subscribe(
        self,
        subscription: str | None = None,
        start: Start = "earliest",
        follow: bool = True,
        max_batch_events: int = 0,
        *,
        end_offset: int | None = None,
        dedupe: bool = True,
        read_from: ReadFrom | None = None,
    ) -> Subscription:
        """Streams messages from `start` (or a durable subscription's cursor).

        With `follow=False` iteration ends after the events committed when it started;
        `end_offset` (exclusive) stops it earlier. A broken stream is reopened through the
        gateway (bounded by the client's retry settings) from the durable cursor or the
        last offset delivered + 1: delivery is at-least-once, and with `dedupe=True` (the
        default) the library drops redelivered offsets so the app sees each once, in order.
        `read_from="replicas"` lets the gateway serve the stream from any replica of the
        master's group (committed events only; docs/consumers.md), `"master"` only from the
        master; None: the gateway's `read_from` setting. Acks go to the master either way.
        """
        request = subscribe_request(
            self.name, subscription, start, follow, max_batch_events, end_offset, read_from
        )
        return self._client._new_subscription(request, dedupe)

    def subscriptions(self) -> list[tuple[str, int]]:
        """The topic's durable subscriptions as (name, cursor), ordered by name."""
        return [(s.name, s.cursor) for s in self.subscription_infos()]

    def subscription_infos(self) -> list[SubscriptionInfo]:
        """The topic's durable subscriptions with cursor, backlog and seek generation."""
        request = broker_pb2.ListSubscriptionsRequest(topic=self.name)
        response = self._client._call(self._client._subscriber_stub.ListSubscriptions, request)
        return [SubscriptionInfo.from_pb(self.name, s) for s in response.subscriptions]

    def subscription_info(self, name: str) -> SubscriptionInfo:
        """One durable subscription; NotFound if the topic has none of that name."""
        return subscription_named(self.subscription_infos(), self.name, name)

    def seek(self, subscription: str, to: SeekTarget) -> SeekResult:
        """Moves a durable subscription's cursor to `to`, creating it there if needed.

        `to` is "earliest", "latest", an offset, or an aware datetime (the first event
        published at or after it). A time or offset before the oldest event held lands on
        that event (`SeekResult.clamped`, `note`); a time in the future is refused
        (InvalidArgument, OUT_OF_RANGE) and changes nothing. Readers of the subscription
        start again from the new cursor. A seek is replicated: it survives a failover.
        """
        request = seek_request(self.name, subscription, to)
        response = self._client._call(self._client._subscriber_stub.Seek, request)
        return SeekResult.from_pb(request, response)

    def delete_subscription(self, name: str) -> None:
        """Deletes a durable subscription; NotFound if it does not exist."""
        request = broker_pb2.DeleteSubscriptionRequest(topic=self.name, subscription=name)
        self._client._call(self._client._subscriber_stub.DeleteSubscription, request)

    def create_shared_subscription(
        self,
        name: str,
        *,
        ack_deadline_ms: int = 30_000,
        max_deliveries: int = 5,
        dead_letter_topic: str = "",
        exclusive: bool = False,
        exclusive_takeover_ms: int = 0,
    ) -> bool:
        """Creates a shared subscription (competing consumers); False if it existed with
        the same settings. AlreadyExists: a plain subscription of that name, or other
        settings; NotFound: no dead-letter topic of that name; InvalidArgument: bad settings
        or the dead-letter topic is this topic. `exclusive`: one consumer at a time gets
        the events, in offset order; another takes over once the holder has not pulled for
        `exclusive_takeover_ms` (0: the ack deadline) and holds nothing."""
        settings = SharedSettings(
            ack_deadline_ms, max_deliveries, dead_letter_topic, exclusive, exclusive_takeover_ms
        )
        request = create_request(self.name, name, settings)
        call = self._client._subscriber_stub.CreateSharedSubscription
        return bool(self._client._call(call, request).created)

    def shared(
        self,
        name: str,
        *,
        consumer_id: str | None = None,
        max_messages: int = 10,
        wait_ms: int = 1_000,
        max_outstanding: int = 100,
        max_outstanding_bytes: int = 0,
    ) -> SharedConsumer:
        """A consumer of the shared subscription `name`: iterate it for `SharedMessage`s
        and ack or nack each one (docs/consumers.md)."""
        return SharedConsumer(
            self._client._subscriber_stub,
            self._client._call,
            self.name,
            name,
            consumer_id=consumer_id,
            max_messages=max_messages,
            wait_ms=wait_ms,
            max_outstanding=max_outstanding,
            max_outstanding_bytes=max_outstanding_bytes,
        )

    def subscribe_push(
        self,
        subscriber_id: str,
        endpoint: str | PushEndpoint,
        *,
        reliability: Reliability = "",
        retry_count: int = 0,
        start: PushStart = "latest",
        qos: Mapping[str, str] | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> PushSubscriberInfo:
        """Registers a push subscriber (IceStorm's subscribeAndGetPublisher).

        The master calls `squall.v1.PushSubscriber/Deliver` at `endpoint` (host:port, or
        a `PushEndpoint`; with `on_delivery` the endpoint hosts the id first, and keeps
        the callback it had if the subscribe is refused) with the events after `start`.
        QoS: `reliability="ordered"` keeps one batch in flight, in offset order;
        `retry_count` -1 retries forever, 0 removes the subscriber on its first failed
        delivery, n removes it after n failed deliveries in a row (extra keys in `qos`
        are sent as given). Raises
        AlreadySubscribed if the id is already subscribed to this topic, InvalidArgument
        for a bad id, endpoint or QoS, NotFound for a gone topic, FailedPrecondition when
        the cluster cannot reach the endpoint; nothing is registered then. See
        docs/push-subscribers.md.
        """
        address = endpoint.address if isinstance(endpoint, PushEndpoint) else endpoint
        request = subscribe_push_request(
            self.name, subscriber_id, address, reliability, retry_count, start, qos
        )
        host = endpoint if isinstance(endpoint, PushEndpoint) else None
        previous = host.callback(subscriber_id) if host is not None else None
        if host is not None and on_delivery is not None:
            host.add(subscriber_id, on_delivery)
        try:
            response = self._client._call(self._client._push_stub.SubscribeAndGetPublisher, request)
        except (
            AlreadyExists,
            InvalidArgument,
            NotFound,
            FailedPrecondition,
            ResourceExhausted,
        ) as exc:
            # Refused: the id keeps the callback it had. Newly hosted and AlreadySubscribed,
            # the new one stays: the subscription there may be this app's own (a retry after
            # an unknown outcome, IceStorm's advice) and must keep receiving.
            if host is not None and on_delivery is not None:
                if previous is not None:
                    host.add(subscriber_id, previous)
                elif not isinstance(exc, AlreadyExists):
                    host.remove(subscriber_id)
            if isinstance(exc, AlreadyExists):
                raise AlreadySubscribed(exc.details, exc.code) from None
            raise
        return PushSubscriberInfo.from_pb(response.subscriber)

    def unsubscribe_push(self, subscriber_id: str) -> None:
        """Removes a push subscriber; NotFound if it is not subscribed (any more)."""
        request = broker_pb2.UnsubscribeRequest(topic=self.name, subscriber_id=subscriber_id)
        self._client._call(self._client._push_stub.Unsubscribe, request)

    def push_subscribers(self) -> list[PushSubscriberInfo]:
        """The topic's push subscribers, ordered by id (IceStorm's getSubscribers)."""
        request = broker_pb2.GetSubscribersRequest(topic=self.name)
        response = self._client._call(self._client._push_stub.GetSubscribers, request)
        return [PushSubscriberInfo.from_pb(s) for s in response.subscribers]

    def link(self, to: str | Topic, cost: int = 0, cluster: str = "") -> LinkInfo:
        """Links this topic to another of the cluster (IceStorm's Topic.link): its events
        published from now on are forwarded there exactly once, in order, unless the cost
        rules stop them (a link of cost N > 0 forwards events of cost at most N; an event
        that arrived over a link is never forwarded again). AlreadyExists if linked,
        NotFound for a missing topic, InvalidArgument for itself or a negative cost.

        With `cluster`, `to` is a topic of another cluster: the name of a [[remotes]] entry
        of this cluster's file; the remote is checked first (FailedPrecondition names an
        unreachable cluster, a wrong TLS identity or a refused token)."""
        request = broker_pb2.LinkTopicRequest(
            from_topic=self.name,
            to_topic=to if isinstance(to, str) else to.name,
            cost=cost,
            to_cluster=cluster,
        )
        response = self._client._call(self._client._topic_manager.LinkTopic, request)
        return LinkInfo.from_pb(response.link)

    def unlink(self, to: str | Topic, cluster: str = "") -> None:
        """Removes the link to another topic; NotFound if there is none."""
        request = broker_pb2.UnlinkTopicRequest(
            from_topic=self.name,
            to_topic=to if isinstance(to, str) else to.name,
            to_cluster=cluster,
        )
        self._client._call(self._client._topic_manager.UnlinkTopic, request)

    def retry_link(self, to: str | Topic, cluster: str = "") -> tuple[LinkInfo, bool]:
        """Forwards again a link to another cluster that stopped on a refusal for good
        (`LinkInfo.stopped_reason`), from its committed position, once the cause is fixed.
        Returns the link and whether it was stopped (False: it was forwarding, nothing
        changed); NotFound if there is no such link."""
        request = broker_pb2.RetryLinkRequest(
            from_topic=self.name,
            to_topic=to if isinstance(to, str) else to.name,
            to_cluster=cluster,
        )
        response = self._client._call(self._client._topic_manager.RetryLink, request)
        return LinkInfo.from_pb(response.link), response.was_stopped

    def links(self) -> list[LinkInfo]:
        """This topic's links, ordered by destination (IceStorm's getLinkInfoSeq)."""
        request = broker_pb2.GetLinkInfoRequest(topic=self.name)
        response = self._client._call(self._client._topic_manager.GetLinkInfo, request)
        return [LinkInfo.from_pb(link) for link in response.links]

    def __repr__(self) -> str:
        return f"Topic({self.name!r})"
