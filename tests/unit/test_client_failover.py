"""Publisher proxies fail over (or refuse to), and subscriptions resume, against fake brokers.

Goal (issue 5, items 1, 4 and 5), with one in-memory broker served on several ports so
each port plays a replica of the same data:

* a replicated proxy moves to the next endpoint when its stream breaks, keeps its id and
  sequences (each event stored once), reports the move (on_rebind, Receipt.rebound) and
  starts a new session token; it follows a slave's `squall-master-address` redirect;
* a non-replicated proxy never moves: it raises `PublisherLost` (maybe_stored for the
  batch in flight), and a new publisher from the topic works;
* a subscription whose stream breaks reopens it from the last offset + 1 (non-durable)
  or its cursor (durable), and the app sees every offset once, in order, unless
  `dedupe=False`; a definite error and running out of retries still raise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

import squall
import squall._publish_rules as publish_rules_module
from squall._proxy import ProxyBinding
from squall.v1 import broker_pb2, common_pb2
from tests.unit.test_client import FakeBroker, serve_fake

FAST = {"retry_backoff_initial_ms": 1, "retry_backoff_max_ms": 5}


class ReplicaBroker(FakeBroker):
    """The fake broker, with publisher proxies, scripted subscribe breaks and a redirect."""

    def __init__(self) -> None:
        super().__init__()
        self.endpoints: list[tuple[str, str]] = []  # (node_id, address), master first
        self.subscribe_requests: list[broker_pb2.SubscribeRequest] = []
        # The next `break_subscribes` Subscribe streams end with UNAVAILABLE after
        # `break_after_responses` responses.
        self.break_subscribes = 0
        self.break_after_responses = 0
        self.break_code = grpc.StatusCode.UNAVAILABLE
        # PublishStream calls arriving on these addresses are refused as a slave would.
        self.slave_addresses: dict[str, str] = {}  # slave address -> master address
        self.publish_peers: list[str] = []
        # Each PublishStream's squall-unreachable request metadata ("" when absent).
        self.publish_unreachable: list[str] = []
        # PublishStream calls arriving on these addresses are never answered (a hung
        # master) until the caller gives up on them.
        self.hung_addresses: set[str] = set()

    def GetPublisher(
        self, request: broker_pb2.GetPublisherRequest, context: grpc.ServicerContext
    ) -> broker_pb2.GetPublisherResponse:
        self._topic(request.topic, context)
        return broker_pb2.GetPublisherResponse(
            topic=request.topic,
            endpoints=[
                common_pb2.NodeEndpoint(node_id=n, replica_address=a) for n, a in self.endpoints
            ],
            replicated=True,
        )

    def GetNonReplicatedPublisher(
        self, request: broker_pb2.GetPublisherRequest, context: grpc.ServicerContext
    ) -> broker_pb2.GetPublisherResponse:
        response = self.GetPublisher(request, context)
        del response.endpoints[1:]
        response.replicated = False
        return response

    def publish_stream_at(
        self,
        local: str,
        request_iterator: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        """PublishStream as the replica at `local` serves it."""
        with self.cond:
            self.publish_peers.append(local)
            self.publish_unreachable.append(
                dict(context.invocation_metadata()).get("squall-unreachable", "")
            )
        if local in self.hung_addresses:
            gave_up = threading.Event()
            context.add_callback(gave_up.set)
            gave_up.wait(120)
            return
        master = self.slave_addresses.get(local)
        if master is not None:
            context.set_trailing_metadata((("squall-master-address", master),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "a slave; the master is elsewhere")
        yield from self.PublishStream(request_iterator, context)

    def Subscribe(
        self, request: broker_pb2.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[broker_pb2.SubscribeResponse]:
        with self.cond:
            self.subscribe_requests.append(request)
            breaking = self.break_subscribes > 0
            self.break_subscribes -= breaking
        for i, response in enumerate(super().Subscribe(request, context)):
            if breaking and i >= self.break_after_responses:
                context.abort(self.break_code, "the replica went away")
            yield response
        if breaking:
            context.abort(self.break_code, "the replica went away")


class _Port:
    """The shared broker as served on one replica's port (so a call knows where it landed)."""

    def __init__(self, broker: ReplicaBroker) -> None:
        self.broker = broker
        self.address = ""

    def __getattr__(self, name: str) -> object:
        return getattr(self.broker, name)

    def PublishStream(
        self,
        request_iterator: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        return self.broker.publish_stream_at(self.address, request_iterator, context)


class _Cluster:
    """One ReplicaBroker served as a gateway and as replicas n1..nN on their own ports."""

    def __init__(self, replicas: int, broker: ReplicaBroker | None = None) -> None:
        self.broker = broker if broker is not None else ReplicaBroker()
        self.servers: dict[str, grpc.Server] = {}
        server, self.gateway = serve_fake(self.broker)
        self.servers["gateway"] = server
        self.addresses: dict[str, str] = {}
        for i in range(1, replicas + 1):
            port = _Port(self.broker)
            server, address = serve_fake(port)
            port.address = address
            self.servers[f"n{i}"] = server
            self.addresses[f"n{i}"] = address
        self.broker.endpoints = list(self.addresses.items())

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop(grace=None)


@pytest.fixture
def cluster() -> Iterator[_Cluster]:
    made = _Cluster(replicas=3)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def client(cluster: _Cluster) -> Iterator[squall.Client]:
    with squall.connect(cluster.gateway, timeout_s=5.0, **FAST) as c:
        c.create_topic("t")
        yield c


def _stored(broker: FakeBroker, topic: str) -> list[tuple[str, int, str]]:
    with broker.cond:
        return [(e.publisher_id, e.sequence, e.session_token) for e in broker.topics[topic].events]


# -- replicated proxies -----------------------------------------------------------------


def test_replicated_proxy_binds_to_the_first_endpoint(
    cluster: _Cluster, client: squall.Client
) -> None:
    with client.topic("t").publisher("p", replicated=True) as publisher:
        receipt = publisher.publish(b"one")
        assert publisher.replicated
        assert publisher.endpoint == squall.Endpoint("n1", cluster.addresses["n1"])
    assert not receipt.rebound
    assert publisher.rebinds == 0


def test_replicated_proxy_fails_over_and_reports_the_move(
    cluster: _Cluster, client: squall.Client
) -> None:
    moves: list[tuple[squall.Endpoint, squall.Endpoint]] = []
    # Each stream answers 3 requests, then ends with UNAVAILABLE before storing the 4th.
    cluster.broker.break_stream_after = 3
    with client.topic("t").publisher(
        "p", replicated=True, on_rebind=lambda old, new: moves.append((old, new))
    ) as publisher:
        receipts = [publisher.publish(b"%d" % i) for i in range(1, 6)]
    assert [r.rebound for r in receipts] == [False, False, False, True, False]
    assert moves == [
        (
            squall.Endpoint("n1", cluster.addresses["n1"]),
            squall.Endpoint("n2", cluster.addresses["n2"]),
        )
    ]
    assert publisher.rebinds == 1
    stored = _stored(cluster.broker, "t")
    assert [(p, s) for p, s, _ in stored] == [("p", s) for s in range(1, 6)]
    tokens = [token for _, _, token in stored]
    assert len(set(tokens[:3])) == 1 and len(set(tokens[3:])) == 1 and tokens[2] != tokens[3]


def test_replicated_proxy_skips_a_dead_endpoint(cluster: _Cluster, client: squall.Client) -> None:
    cluster.servers["n1"].stop(grace=None)
    with client.topic("t").publisher("p", replicated=True) as publisher:
        receipt = publisher.publish(b"x")
        assert publisher.endpoint is not None and publisher.endpoint.node_id == "n2"
    # Nothing answered on n1, so this is the first binding, not a move.
    assert not receipt.rebound
    assert [(p, s) for p, s, _ in _stored(cluster.broker, "t")] == [("p", 1)]


def test_replicated_proxy_tells_the_next_replica_which_it_could_not_reach(
    cluster: _Cluster, client: squall.Client
) -> None:
    # So a slave of the dead master holds the call for the next master instead of
    # redirecting it back (services/replica/server.py, Publisher._hold).
    cluster.servers["n1"].stop(grace=None)
    with client.topic("t").publisher("p", replicated=True) as publisher:
        publisher.publish(b"x")
    assert cluster.broker.publish_peers == [cluster.addresses["n2"]]
    assert cluster.broker.publish_unreachable == [cluster.addresses["n1"]]


def test_a_replica_that_answers_again_is_no_longer_named_unreachable() -> None:
    n1, n2 = squall.Endpoint("n1", "127.0.0.1:1"), squall.Endpoint("n2", "127.0.0.1:2")
    binding = ProxyBinding([n1, n2], replicated=True, make_channel=grpc.insecure_channel)
    assert binding.metadata() == ()
    binding.stream_failed(n1, grpc.StatusCode.UNAVAILABLE, None)
    assert binding.metadata() == (("squall-unreachable", "127.0.0.1:1"),)
    # A slave's redirect means it is alive: not named.
    binding.stream_failed(n2, grpc.StatusCode.UNAVAILABLE, (("squall-master-address", "x"),))
    assert binding.metadata() == (("squall-unreachable", "127.0.0.1:1"),)
    binding.stream_answered(n1)
    assert binding.metadata() == ()
    binding.close()


def test_a_stream_that_answers_clears_marks_from_an_older_failover() -> None:
    # Issue 14: a mark kept from the failover before made the next replica hold the call
    # for a master that had come back (a restarted node taking the lead back).
    n1, n2, n3 = (squall.Endpoint(f"n{i}", f"127.0.0.1:{i}") for i in (1, 2, 3))
    binding = ProxyBinding([n1, n2, n3], replicated=True, make_channel=grpc.insecure_channel)
    binding.stream_failed(n1, grpc.StatusCode.UNAVAILABLE, None)
    binding.stream_answered(n2)
    binding.stream_failed(n2, grpc.StatusCode.UNKNOWN, None)
    assert binding.metadata() == (("squall-unreachable", "127.0.0.1:2"),)
    binding.close()


def test_replicated_proxy_leaves_a_hung_master_for_the_one_the_gateway_names(
    cluster: _Cluster,
) -> None:
    # Issue 14: n1 hangs (paused) after the group elected n2. The receipt would be waited
    # for until the timeout (60 s here); a late receipt makes the proxy ask the gateway,
    # which names n2 first, and the batch goes there with the same id and sequence.
    with squall.connect(cluster.gateway, timeout_s=60.0, **FAST) as client:
        client.create_topic("t")
        publisher = client.topic("t").publisher("p", replicated=True)
        cluster.broker.hung_addresses.add(cluster.addresses["n1"])
        cluster.broker.endpoints = [
            ("n2", cluster.addresses["n2"]),
            ("n1", cluster.addresses["n1"]),
            ("n3", cluster.addresses["n3"]),
        ]
        result: list[squall.Receipt] = []
        worker = threading.Thread(target=lambda: result.append(publisher.publish(b"x")))
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the proxy waited for its receipt timeout"
        assert publisher.endpoint == squall.Endpoint("n2", cluster.addresses["n2"])
        publisher.close()
    assert result and not result[0].duplicate
    assert cluster.broker.publish_peers == [cluster.addresses["n1"], cluster.addresses["n2"]]
    assert [(p, s) for p, s, _ in _stored(cluster.broker, "t")] == [("p", 1)]


def test_replicated_proxy_moves_publish_async_batches_off_a_hung_master(
    cluster: _Cluster,
) -> None:
    # Nobody waits on publish() here: the app only queued events and holds their futures.
    # The stream's watchdog, not a waiting caller, must notice the late receipt; before it
    # did, such batches waited the whole receipt timeout (60 s here).
    with squall.connect(cluster.gateway, timeout_s=60.0, **FAST) as client:
        client.create_topic("t")
        publisher = client.topic("t").publisher("p", replicated=True)
        cluster.broker.hung_addresses.add(cluster.addresses["n1"])
        cluster.broker.endpoints = [
            ("n2", cluster.addresses["n2"]),
            ("n1", cluster.addresses["n1"]),
            ("n3", cluster.addresses["n3"]),
        ]
        futures = [publisher.publish_async(b"e%d" % i) for i in range(5)]
        receipts = [future.result(30) for future in futures]
        assert publisher.endpoint == squall.Endpoint("n2", cluster.addresses["n2"])
        publisher.close()
    assert len(receipts) == 5 and not any(r.duplicate for r in receipts)
    assert cluster.broker.publish_peers == [cluster.addresses["n1"], cluster.addresses["n2"]]
    stored = [(p, s) for p, s, _ in _stored(cluster.broker, "t")]
    assert stored == [("p", s) for s in range(1, 6)]


def test_a_stall_watchdog_ends_with_its_stream_not_after_its_check_interval(
    cluster: _Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between two checks of the master the watchdog waits on its stream's wake event, so
    # it ends as soon as the stream does; it used to sleep the interval out. With a
    # 60 s interval: the gateway keeps naming the hung n1 (no move), the caller gives up
    # on its receipt after its 3 s timeout and abandons the stream. (A lone publish goes on
    # the client's shared stream to n1, whose watchdog is the mux's.)
    # One loop watches both kinds of stream (squall._publish_rules.watch_stalls).
    monkeypatch.setattr(publish_rules_module, "RECEIPT_STALL_CHECK_S", 60.0)
    with squall.connect(cluster.gateway, timeout_s=3.0, **FAST) as client:
        client.create_topic("t")
        publisher = client.topic("t").publisher("p", replicated=True)
        cluster.broker.hung_addresses.add(cluster.addresses["n1"])
        outcome: list[object] = []
        # An earlier test's watchdog may still be ending with its stream.
        earlier = set(threading.enumerate())

        def publish() -> None:
            try:
                outcome.append(publisher.publish(b"x"))
            except squall.SquallError as exc:
                outcome.append(exc)

        worker = threading.Thread(target=publish, daemon=True)
        worker.start()

        def watchdogs() -> list[threading.Thread]:
            return [
                t
                for t in threading.enumerate()
                if t.name.startswith("squall-publish-watch") and t not in earlier
            ]

        deadline = time.monotonic() + 10
        found = watchdogs()
        while not found and time.monotonic() < deadline:
            time.sleep(0.01)
            found = watchdogs()
        # The oldest (threading.enumerate keeps start order): the retry after the caller
        # abandons the stream starts another, which a slow machine may already list.
        assert found, "no watchdog started"
        first = found[0]
        # The caller abandons the stream after its 3 s timeout (the first check of the
        # master was 0.3 s in); the watchdog ends with it, not 60 s later.
        for _ in range(500):  # bounded
            try:
                first.join(15)
                break
            except RuntimeError:
                # threading.enumerate() lists a thread from start() on, a moment before
                # it can be joined.
                time.sleep(0.01)
        assert not first.is_alive(), "the watchdog outlived its stream"
        worker.join(30)
        publisher.close()
    # The batch itself went on as before (retried on a fresh stream, or failed): the
    # caller got an answer.
    assert not worker.is_alive() and len(outcome) == 1


def test_replicated_proxy_follows_a_slaves_redirect(
    cluster: _Cluster, client: squall.Client
) -> None:
    # n1 is a slave naming n3 as master; n2 would be next in the list: the redirect wins.
    cluster.broker.slave_addresses[cluster.addresses["n1"]] = cluster.addresses["n3"]
    with client.topic("t").publisher("p", replicated=True) as publisher:
        publisher.publish(b"x")
        assert publisher.endpoint == squall.Endpoint("n3", cluster.addresses["n3"])


# -- non-replicated proxies -------------------------------------------------------------


def test_non_replicated_proxy_raises_on_master_loss_and_a_new_one_works(
    cluster: _Cluster, client: squall.Client
) -> None:
    topic = client.topic("t")
    cluster.broker.break_stream_after = 2
    publisher = topic.publisher("p", replicated=False)
    assert not publisher.replicated
    publisher.publish(b"1")
    publisher.publish(b"2")
    with pytest.raises(squall.PublisherLost) as lost:
        publisher.publish(b"3")
    assert isinstance(lost.value, squall.Unavailable)
    assert lost.value.maybe_stored  # it was sent when the master went
    assert "new publisher" in lost.value.details
    with pytest.raises(squall.PublisherLost) as again:
        publisher.publish(b"4")
    assert not again.value.maybe_stored  # never sent
    publisher.close()
    assert cluster.broker.publish_peers == [cluster.addresses["n1"]]  # no silent failover
    cluster.broker.break_stream_after = 0
    with topic.publisher("p", replicated=False, start_sequence=3) as fresh:
        fresh.publish(b"3")
    assert [(p, s) for p, s, _ in _stored(cluster.broker, "t")] == [("p", 1), ("p", 2), ("p", 3)]


def test_non_replicated_proxy_does_not_follow_a_redirect(
    cluster: _Cluster, client: squall.Client
) -> None:
    cluster.broker.slave_addresses[cluster.addresses["n1"]] = cluster.addresses["n2"]
    with (
        client.topic("t").publisher("p", replicated=False) as publisher,
        pytest.raises(squall.PublisherLost),
    ):
        publisher.publish(b"x")
    assert _stored(cluster.broker, "t") == []


def test_on_rebind_needs_a_proxy(client: squall.Client) -> None:
    with pytest.raises(ValueError, match="on_rebind"):
        client.topic("t").publisher(on_rebind=lambda old, new: None)


# -- subscriptions ----------------------------------------------------------------------


def _fill(client: squall.Client, count: int) -> None:
    with client.topic("t").publisher("filler") as publisher:
        publisher.publish_many(b"%d" % i for i in range(count))


def test_non_durable_subscription_resumes_after_the_last_offset(
    cluster: _Cluster, client: squall.Client
) -> None:
    _fill(client, 10)
    cluster.broker.break_subscribes = 2
    cluster.broker.break_after_responses = 2
    with client.topic("t").subscribe(follow=False, max_batch_events=2) as subscription:
        offsets = [m.offset for m in subscription]
    assert offsets == list(range(10))
    assert subscription.reconnects == 2
    resumed = cluster.broker.subscribe_requests[1:]
    assert [(r.start, r.offset) for r in resumed] == [
        (broker_pb2.START_POSITION_OFFSET, 4),
        (broker_pb2.START_POSITION_OFFSET, 8),
    ]


def test_durable_subscription_resumes_from_its_cursor_without_duplicates(
    cluster: _Cluster, client: squall.Client
) -> None:
    _fill(client, 10)
    cluster.broker.break_subscribes = 1
    cluster.broker.break_after_responses = 2
    with client.topic("t").subscribe("billing", follow=False, max_batch_events=2) as sub:
        offsets = []
        for message in sub:
            offsets.append(message.offset)
            if message.offset == 1:
                sub.ack(message)
    # The cursor was at 2 when the stream broke: 2 and 3 came again and were dropped.
    assert offsets == list(range(10))
    assert sub.duplicates_dropped == 2
    assert cluster.broker.subscribe_requests[1].subscription == "billing"


def test_dedupe_off_hands_redelivered_events_to_the_app(
    cluster: _Cluster, client: squall.Client
) -> None:
    _fill(client, 6)
    cluster.broker.break_subscribes = 1
    cluster.broker.break_after_responses = 2
    with client.topic("t").subscribe(
        "billing", follow=False, max_batch_events=2, dedupe=False
    ) as sub:
        offsets = [m.offset for m in sub]
    assert offsets == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]


def test_subscription_gives_up_after_the_retry_budget(cluster: _Cluster) -> None:
    with squall.connect(
        cluster.gateway,
        timeout_s=5.0,
        retry_attempts_max=3,
        **FAST,
    ) as client:
        client.create_topic("t")
        _fill(client, 4)
        cluster.broker.break_subscribes = 100
        cluster.broker.break_after_responses = 0
        subscription = client.topic("t").subscribe(follow=False)
        with pytest.raises(squall.Unavailable):
            list(subscription)
    assert subscription.reconnects == 2
    assert len(cluster.broker.subscribe_requests) == 3


def test_subscription_does_not_reconnect_on_a_definite_error(
    cluster: _Cluster, client: squall.Client
) -> None:
    _fill(client, 4)
    cluster.broker.break_subscribes = 1
    cluster.broker.break_code = grpc.StatusCode.PERMISSION_DENIED
    subscription = client.topic("t").subscribe(follow=False)
    with pytest.raises(squall.PermissionDenied):
        list(subscription)
    assert subscription.reconnects == 0


def test_close_during_reconnect_backoff_ends_iteration(cluster: _Cluster) -> None:
    with squall.connect(
        cluster.gateway,
        timeout_s=5.0,
        retry_backoff_initial_ms=30_000,
        retry_backoff_max_ms=60_000,
    ) as client:
        client.create_topic("t")
        cluster.broker.break_subscribes = 100
        subscription = client.topic("t").subscribe(follow=True)
        done = threading.Event()
        seen: list[squall.Message] = []

        def drain() -> None:
            seen.extend(subscription)
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        # Wait until the first stream broke and the reader sits in its (long) backoff.
        # (polled: bounded)
        for _ in range(1000):
            if cluster.broker.subscribe_requests:
                break
            done.wait(0.01)
        subscription.close()
        assert done.wait(5), "close() did not end a subscription waiting to reconnect"
    assert seen == []
