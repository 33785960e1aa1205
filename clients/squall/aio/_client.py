"""The asyncio connection to a Squall gateway, and its topic handles.

`connect()` takes the keyword arguments of `squall.connect` and validates them the same
way, at once; the client is opened with `await` or `async with`. Everything a client
hands out (topics, publishers, subscriptions) shares its one `grpc.aio` channel;
publisher proxies open their own channels to the replicas, and the client one per
replica for the stream its proxies bound there share (`squall.aio._publish_mux`).
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import grpc
import grpc.aio
from opentelemetry.trace import TracerProvider

from squall._client import ChannelOptions, channel_options, check_client_args, proxy_endpoints
from squall._errors import (
    AlreadyExists,
    AlreadySubscribed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    from_rpc_error,
)
from squall._proxy import Binding, GatewayBinding, ProxyBinding, RebindCallback
from squall._publish_rules import INFLIGHT_BATCHES_MAX_DEFAULT, new_publisher_id
from squall._push import PushStart, PushSubscriberInfo, Reliability, subscribe_push_request
from squall._seek import (
    SeekResult,
    SeekTarget,
    SubscriptionInfo,
    seek_request,
    subscription_named,
)
from squall._shared import SharedSettings, create_request
from squall._subscriber import ReadFrom, Start, subscribe_request
from squall._tls import TlsOptions
from squall._types import ClusterStatus, LinkInfo, TopicInfo, kind_to_pb
from squall.aio._channel import open_channel
from squall.aio._publish_mux import ProxyMuxes, PublishMux
from squall.aio._publisher import Publisher
from squall.aio._push import AsyncDeliveryCallback, PushEndpoint
from squall.aio._shared import AsyncSharedConsumer
from squall.aio._stall_watch import MasterCheck
from squall.aio._subscriber import Subscription
from squall.v1 import broker_pb2, broker_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from squall.wire.auth import resolve_token
from squall.wire.retry import (
    RETRY_ATTEMPTS_MAX_DEFAULT,
    RETRY_BACKOFF_INITIAL_MS_DEFAULT,
    RETRY_BACKOFF_MAX_MS_DEFAULT,
    RETRY_TOTAL_MS_MAX_DEFAULT,
    RetryPolicy,
)


class _Closable(Protocol):
    async def close(self) -> None: ...


_T = TypeVar("_T", bound=_Closable)


class Opening(Generic[_T]):
    """Something being opened: `await` it for the object, or `async with` it (closed on exit)."""

    def __init__(self, opener: Callable[[], Awaitable[_T]]) -> None:
        self._opener = opener
        self._opened: _T | None = None

    def __await__(self) -> Generator[Any, None, _T]:
        return self._opener().__await__()

    async def __aenter__(self) -> _T:
        self._opened = await self._opener()
        return self._opened

    async def __aexit__(self, *exc: object) -> None:
        if self._opened is not None:
            await self._opened.close()


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
) -> Opening[Client]:
    """Opens an asyncio client to the gateway at `address`: `await` it or `async with` it.

    Same keyword arguments, defaults and meanings as `squall.connect` (the retry time
    budget `retry_total_ms_max`, the backoff bounds, an optional attempt cap, TLS, the
    bearer token, the tracer provider). ValueError names a value out of bounds, raised
    here, before anything is opened. `share_publish_stream` as in `squall.connect`: the
    lone `publish()` calls of all the client's gateway publishers share one stream, and
    those of its publisher proxies one stream per replica they are bound to
    (`squall.aio._publish_mux`); False gives each publisher its own.
    """
    retry = RetryPolicy(
        attempts_max=retry_attempts_max,
        backoff_initial_ms=retry_backoff_initial_ms,
        backoff_max_ms=retry_backoff_max_ms,
        total_ms_max=retry_total_ms_max,
    )
    check_client_args(address, timeout_s, retry)
    # Read now: a missing or broken file fails here, naming it.
    credentials = tls.credentials() if tls is not None else None
    resolved = resolve_token(token)

    async def opener() -> Client:
        return Client(
            address,
            timeout_s=timeout_s,
            options=options,
            retry=retry,
            tracer_provider=tracer_provider,
            tls=tls,
            token=resolved,
            share_publish_stream=share_publish_stream,
            _credentials=credentials,
        )

    return Opening(opener)


class Client:
    """An asyncio connection to a Squall gateway: topics, cluster status, topic handles.

    Made inside a running event loop (by `connect`); close it with `await close()`.
    """

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
        _credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._retry = check_client_args(address, timeout_s, retry)
        self._address = address
        self._timeout_s = timeout_s
        self._options = list(options or ())
        self._tracer_provider = tracer_provider
        self._tls = tls
        self._credentials = _credentials or (tls.credentials() if tls is not None else None)
        self._token = resolve_token(token)
        self._channel = open_channel(
            address,
            channel_options(options, self._retry),
            tls,
            self._credentials,
            tls.server_name if tls is not None else None,
            self._token,
            tracer_provider,
        )
        self._topic_manager = broker_pb2_grpc.TopicManagerStub(self._channel)
        self._publisher_stub = broker_pb2_grpc.PublisherStub(self._channel)
        self._subscriber_stub = broker_pb2_grpc.SubscriberStub(self._channel)
        self._push_stub = broker_pb2_grpc.PushSubscriptionsStub(self._channel)
        self._admin = gateway_pb2_grpc.ClusterAdminStub(self._channel)
        self._closed = False
        self._publishers: set[Publisher] = set()
        # The stream every gateway publisher's lone publishes share (squall.aio._publish_mux).
        self._publish_mux = (
            PublishMux(self._publisher_stub, timeout_s=timeout_s) if share_publish_stream else None
        )
        # The streams the lone publishes of its publisher proxies share, one per replica
        # address (squall.aio._publish_mux.ProxyMuxes).
        self._proxy_muxes = ProxyMuxes(timeout_s=timeout_s) if share_publish_stream else None
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()

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
        """How publishers and subscriptions of this client retry."""
        return self._retry

    @property
    def channel(self) -> grpc.aio.Channel:
        """The underlying asyncio gRPC channel, for calling the generated stubs directly."""
        return self._channel

    async def _call(self, method: Any, request: Any, wait_s: float = 0.0) -> Any:
        """One call within timeout_s, plus wait_s the request asks the server to wait."""
        self._check_open()
        try:
            return await method(request, timeout=self._timeout_s + wait_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the client is closed")

    async def create_topic(self, name: str, kind: str = "replicated") -> TopicInfo:
        """Creates a topic ("replicated" or "transient"); AlreadyExists if it exists."""
        request = broker_pb2.CreateTopicRequest(name=name, kind=kind_to_pb(kind))
        response = await self._call(self._topic_manager.CreateTopic, request)
        return TopicInfo.from_pb(response.topic)

    async def topic(self, name: str) -> Topic:
        """Retrieves a topic's handle; NotFound if it does not exist."""
        request = broker_pb2.RetrieveTopicRequest(name=name)
        response = await self._call(self._topic_manager.RetrieveTopic, request)
        return Topic(self, TopicInfo.from_pb(response.topic))

    async def topics(self) -> list[TopicInfo]:
        """Every topic, ordered by name."""
        response = await self._call(self._topic_manager.ListTopics, broker_pb2.ListTopicsRequest())
        return [TopicInfo.from_pb(t) for t in response.topics]

    async def destroy_topic(self, name: str) -> None:
        """Destroys a topic with its events and subscriptions; NotFound if it does not exist."""
        request = broker_pb2.DestroyTopicRequest(name=name)
        await self._call(self._topic_manager.DestroyTopic, request)

    async def links(self) -> list[LinkInfo]:
        """Every topic link of the cluster, ordered by source then destination."""
        request = broker_pb2.GetLinkInfoRequest()
        response = await self._call(self._topic_manager.GetLinkInfo, request)
        return [LinkInfo.from_pb(link) for link in response.links]

    async def status(self) -> ClusterStatus:
        """The cluster status table as the gateway sees it."""
        request = gateway_pb2.GetClusterStatusRequest()
        return ClusterStatus.from_pb(await self._call(self._admin.GetClusterStatus, request))

    async def close(self) -> None:
        """Flushes and closes publishers, cancels subscriptions, closes the channel."""
        if self._closed:
            return
        for publisher in list(self._publishers):
            await publisher.close()
        for subscription in list(self._subscriptions):
            await subscription.close()
        if self._publish_mux is not None:
            await self._publish_mux.close()
        if self._proxy_muxes is not None:
            await self._proxy_muxes.close()
        self._closed = True
        await self._channel.close(None)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"aio.Client({self._address!r})"

    # -- used by Topic ----------------------------------------------------------------

    async def _new_publisher(
        self,
        topic: str,
        publisher_id: str,
        start_sequence: int,
        inflight_batches_max: int,
        replicated: bool | None,
        on_rebind: RebindCallback | None,
    ) -> Publisher:
        self._check_open()
        binding: Binding
        check_master: MasterCheck | None = None
        if replicated is None:
            if on_rebind is not None:
                raise ValueError(
                    "on_rebind needs a publisher proxy (replicated=True); through the "
                    "gateway the publisher never binds to a replica"
                )
            binding = GatewayBinding(self._publisher_stub)
        else:
            binding = await self._proxy(topic, replicated)
            check_master = self._master_check(topic)
        publisher = Publisher(
            binding,
            topic,
            publisher_id,
            start_sequence=start_sequence,
            timeout_s=self._timeout_s,
            inflight_batches_max=inflight_batches_max,
            on_close=self._publishers.discard,
            retry=self._retry,
            on_rebind=on_rebind,
            check_master=check_master,
            mux=self._publish_mux,
            proxy_muxes=self._proxy_muxes,
        )
        self._publishers.add(publisher)
        return publisher

    async def _proxy(self, topic: str, replicated: bool) -> ProxyBinding:
        """Asks the gateway for a publisher proxy (GetPublisher or GetNonReplicatedPublisher)."""
        request = broker_pb2.GetPublisherRequest(topic=topic)
        method = (
            self._topic_manager.GetPublisher
            if replicated
            else self._topic_manager.GetNonReplicatedPublisher
        )
        endpoints = proxy_endpoints(await self._call(method, request), topic)
        options, retry, tls, credentials = self._options, self._retry, self._tls, self._credentials
        token, tracer_provider = self._token, self._tracer_provider
        # With TLS, a replica's certificate must name the node the gateway said it is.
        names = {e.address: e.node_id for e in endpoints}

        def make_channel(address: str) -> grpc.aio.Channel:
            return open_channel(
                address,
                channel_options(options, retry),
                tls,
                credentials,
                names.get(address),
                token,
                tracer_provider,
            )

        return ProxyBinding(endpoints, replicated=replicated, make_channel=make_channel)

    def _master_check(self, topic: str) -> MasterCheck:
        """How a proxy asks which replica is master: GetPublisher lists it first (the
        gateway forwards the call to the master its group views name)."""
        request = broker_pb2.GetPublisherRequest(topic=topic)

        async def master_of(timeout_s: float) -> str:
            answer = await self._topic_manager.GetPublisher(request, timeout=timeout_s)
            return next((e.replica_address for e in answer.endpoints if e.replica_address), "")

        return master_of

    def _new_subscription(self, request: broker_pb2.SubscribeRequest, dedupe: bool) -> Subscription:
        self._check_open()
        subscription = Subscription(
            self._subscriber_stub,
            request,
            timeout_s=self._timeout_s,
            retry=self._retry,
            dedupe=dedupe,
            on_close=self._subscriptions.discard,
        )
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

    async def refresh(self) -> TopicInfo:
        """Fetches the topic again (offsets move as events arrive); NotFound once destroyed."""
        self._info = (await self._client.topic(self.name)).info
        return self._info

    def publisher(
        self,
        publisher_id: str | None = None,
        *,
        start_sequence: int = 1,
        inflight_batches_max: int = INFLIGHT_BATCHES_MAX_DEFAULT,
        replicated: bool | None = None,
        on_rebind: RebindCallback | None = None,
    ) -> Opening[Publisher]:
        """A publisher for this topic (`await` it, or `async with` it); a random id unless
        given, sequences from start_sequence.

        `replicated` as in `squall.Topic.publisher`: None (the default) goes through the
        gateway; True is a replicated proxy (straight to a replica, failing over to the
        others and following a slave's redirect; `on_rebind(old, new)` on a move); False
        a non-replicated proxy (the master only; `PublisherLost` on master loss).
        """
        publisher_id = publisher_id or new_publisher_id()

        async def opener() -> Publisher:
            return await self._client._new_publisher(
                self.name,
                publisher_id,
                start_sequence,
                inflight_batches_max,
                replicated,
                on_rebind,
            )

        return Opening(opener)

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
        """Streams messages from `start` (or a durable subscription's cursor): `async for`.

        As `squall.Topic.subscribe`: with `follow=False` iteration ends after the events
        committed when it started; `end_offset` (exclusive) stops it earlier. A broken
        stream is reopened (bounded by the client's retry settings) from the durable
        cursor or the last offset delivered + 1; `dedupe=True` drops redelivered offsets.
        `read_from`: as in `squall.Topic.subscribe`.
        """
        request = subscribe_request(
            self.name, subscription, start, follow, max_batch_events, end_offset, read_from
        )
        return self._client._new_subscription(request, dedupe)

    async def subscriptions(self) -> list[tuple[str, int]]:
        """The topic's durable subscriptions as (name, cursor), ordered by name."""
        return [(s.name, s.cursor) for s in await self.subscription_infos()]

    async def subscription_infos(self) -> list[SubscriptionInfo]:
        """The topic's durable subscriptions with cursor, backlog and seek generation."""
        request = broker_pb2.ListSubscriptionsRequest(topic=self.name)
        response = await self._client._call(
            self._client._subscriber_stub.ListSubscriptions, request
        )
        return [SubscriptionInfo.from_pb(self.name, s) for s in response.subscriptions]

    async def subscription_info(self, name: str) -> SubscriptionInfo:
        """One durable subscription; NotFound if the topic has none of that name."""
        return subscription_named(await self.subscription_infos(), self.name, name)

    async def seek(self, subscription: str, to: SeekTarget) -> SeekResult:
        """Moves a durable subscription's cursor to `to` (as `squall.Topic.seek`)."""
        request = seek_request(self.name, subscription, to)
        response = await self._client._call(self._client._subscriber_stub.Seek, request)
        return SeekResult.from_pb(request, response)

    async def delete_subscription(self, name: str) -> None:
        """Deletes a durable subscription; NotFound if it does not exist."""
        request = broker_pb2.DeleteSubscriptionRequest(topic=self.name, subscription=name)
        await self._client._call(self._client._subscriber_stub.DeleteSubscription, request)

    async def create_shared_subscription(
        self,
        name: str,
        *,
        ack_deadline_ms: int = 30_000,
        max_deliveries: int = 5,
        dead_letter_topic: str = "",
        exclusive: bool = False,
        exclusive_takeover_ms: int = 0,
    ) -> bool:
        """Creates a shared subscription (as `squall.Topic.create_shared_subscription`)."""
        settings = SharedSettings(
            ack_deadline_ms, max_deliveries, dead_letter_topic, exclusive, exclusive_takeover_ms
        )
        request = create_request(self.name, name, settings)
        call = self._client._subscriber_stub.CreateSharedSubscription
        return bool((await self._client._call(call, request)).created)

    def shared(
        self,
        name: str,
        *,
        consumer_id: str | None = None,
        max_messages: int = 10,
        wait_ms: int = 1_000,
        max_outstanding: int = 100,
        max_outstanding_bytes: int = 0,
    ) -> AsyncSharedConsumer:
        """A consumer of the shared subscription `name` (as `squall.Topic.shared`)."""
        return AsyncSharedConsumer(
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

    async def subscribe_push(
        self,
        subscriber_id: str,
        endpoint: str | PushEndpoint,
        *,
        reliability: Reliability = "",
        retry_count: int = 0,
        start: PushStart = "latest",
        qos: Mapping[str, str] | None = None,
        on_delivery: AsyncDeliveryCallback | None = None,
    ) -> PushSubscriberInfo:
        """Registers a push subscriber, as `squall.Topic.subscribe_push`; `endpoint` is a
        host:port or a `squall.aio.PushEndpoint`, whose `on_delivery` is a coroutine
        function. Raises AlreadySubscribed, InvalidArgument, NotFound, FailedPrecondition
        as the threaded client does; nothing is registered then."""
        address = endpoint.address if isinstance(endpoint, PushEndpoint) else endpoint
        request = subscribe_push_request(
            self.name, subscriber_id, address, reliability, retry_count, start, qos
        )
        host = endpoint if isinstance(endpoint, PushEndpoint) else None
        previous = host.callback(subscriber_id) if host is not None else None
        if host is not None and on_delivery is not None:
            host.add(subscriber_id, on_delivery)
        try:
            response = await self._client._call(
                self._client._push_stub.SubscribeAndGetPublisher, request
            )
        except (
            AlreadyExists,
            InvalidArgument,
            NotFound,
            FailedPrecondition,
            ResourceExhausted,
        ) as exc:
            # As the threaded client: refused, the id keeps the callback it had; newly
            # hosted and AlreadySubscribed, the new one stays (it may be this app's own).
            if host is not None and on_delivery is not None:
                if previous is not None:
                    host.add(subscriber_id, previous)
                elif not isinstance(exc, AlreadyExists):
                    host.remove(subscriber_id)
            if isinstance(exc, AlreadyExists):
                raise AlreadySubscribed(exc.details, exc.code) from None
            raise
        return PushSubscriberInfo.from_pb(response.subscriber)

    async def unsubscribe_push(self, subscriber_id: str) -> None:
        """Removes a push subscriber; NotFound if it is not subscribed (any more)."""
        request = broker_pb2.UnsubscribeRequest(topic=self.name, subscriber_id=subscriber_id)
        await self._client._call(self._client._push_stub.Unsubscribe, request)

    async def push_subscribers(self) -> list[PushSubscriberInfo]:
        """The topic's push subscribers, ordered by id (IceStorm's getSubscribers)."""
        request = broker_pb2.GetSubscribersRequest(topic=self.name)
        response = await self._client._call(self._client._push_stub.GetSubscribers, request)
        return [PushSubscriberInfo.from_pb(s) for s in response.subscribers]

    async def link(self, to: str | Topic, cost: int = 0, cluster: str = "") -> LinkInfo:
        """Links this topic to another (see the sync `Topic.link`)."""
        request = broker_pb2.LinkTopicRequest(
            from_topic=self.name,
            to_topic=to if isinstance(to, str) else to.name,
            cost=cost,
            to_cluster=cluster,
        )
        response = await self._client._call(self._client._topic_manager.LinkTopic, request)
        return LinkInfo.from_pb(response.link)

    async def unlink(self, to: str | Topic, cluster: str = "") -> None:
        """Removes the link to another topic; NotFound if there is none."""
        request = broker_pb2.UnlinkTopicRequest(
            from_topic=self.name,
            to_topic=to if isinstance(to, str) else to.name,
            to_cluster=cluster,
        )
        await self._client._call(self._client._topic_manager.UnlinkTopic, request)

    async def retry_link(self, to: str | Topic, cluster: str = "") -> tuple[LinkInfo, bool]:
        """Forwards again a link to another cluster that stopped on a refusal for good
        (`LinkInfo.stopped_reason`), from its committed position, once the cause is fixed.
        Returns the link and whether it was stopped (False: it was forwarding, nothing
        changed); NotFound if there is no such link."""
        request = broker_pb2.RetryLinkRequest(
            from_topic=self.name,
            to_topic=to if isinstance(to, str) else to.name,
            to_cluster=cluster,
        )
        response = await self._client._call(self._client._topic_manager.RetryLink, request)
        return LinkInfo.from_pb(response.link), response.was_stopped

    async def links(self) -> list[LinkInfo]:
        """This topic's links, ordered by destination (IceStorm's getLinkInfoSeq)."""
        request = broker_pb2.GetLinkInfoRequest(topic=self.name)
        response = await self._client._call(self._client._topic_manager.GetLinkInfo, request)
        return [LinkInfo.from_pb(link) for link in response.links]

    def __repr__(self) -> str:
        return f"aio.Topic({self.name!r})"
