"""Publisher proxies share the client's stream to their replica (squall._publish_mux,
`ProxyMuxes`), against one in-memory broker served as a gateway and three replicas.

Many threads, each with a proxy of its own, publish one event at a time: the proxies bound
to one replica send on one stream and their concurrent events join into one request, yet
each proxy still moves on its own: a broken stream or a slave's redirect (also one
answered inline on the shared stream, as services/replica/server.py answers a request a
slave refuses) sends that proxy's next attempt to the shared stream of its new replica,
with the same id and sequence (stored once, nothing lost); a non-replicated proxy raises
`PublisherLost` instead.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

import squall
from squall.v1 import broker_pb2
from tests.unit.test_client import wait_until
from tests.unit.test_client_failover import FAST, ReplicaBroker, _Cluster
from tests.unit.test_client_shared_stream import _check_stored_once as check_stored_once
from tests.unit.test_client_shared_stream import _run_threads

MASTER_ADDRESS_KEY = "squall-master-address"


class _SharingBroker(ReplicaBroker):
    """The replicas' broker, answering failures inline as a master does on a stream that
    asks for it; it can also store a request and then lose its answer by ending the stream
    (every `lose_every`-th request), or answer as a slave inline (`inline_slaves`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_every = 0
        self.inline_slaves: dict[str, str] = {}  # slave address -> master address
        self._count = 0

    def publish_stream_at(
        self,
        local: str,
        request_iterator: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        master = self.inline_slaves.get(local)
        if master is None and not self.lose_every:
            yield from super().publish_stream_at(local, request_iterator, context)
            return
        with self.cond:
            self.publish_peers.append(local)
            self.publish_stream_calls += 1
        for request in request_iterator:
            with self.cond:
                self.requests_seen += 1
                self.joined_requests_seen += bool(request.parts)
            if master is not None:
                # As a slave refuses a request, whole or joined (nothing stored): inline,
                # without the request's id, naming the master.
                yield broker_pb2.PublishResponse(
                    error=broker_pb2.PublishError(
                        code="UNAVAILABLE",
                        message=f"a slave; the master is at {master}",
                        metadata={MASTER_ADDRESS_KEY: master},
                    )
                )
                continue
            if request.parts:
                response = broker_pb2.PublishResponse(request_id=request.request_id)
                response.parts.extend(self._apply_inline(part) for part in request.parts)
            else:
                response = self._apply_inline(request)
            with self.cond:
                self._count += 1
                lose = self._count % self.lose_every == 0
            if lose:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away")
            yield response


@pytest.fixture
def cluster() -> Iterator[_Cluster]:
    made = _Cluster(replicas=3, broker=_SharingBroker())
    try:
        yield made
    finally:
        if made.broker.gate is not None:
            made.broker.gate.set()
        made.stop()


@pytest.fixture
def client(cluster: _Cluster) -> Iterator[squall.Client]:
    with squall.connect(cluster.gateway, timeout_s=5.0, **FAST) as c:
        c.create_topic("t")
        yield c


def _check_stored_once(broker: ReplicaBroker, acked: dict[tuple[str, int], squall.Receipt]) -> None:
    """As the gateway stream's check, and nothing stored that was not acknowledged."""
    check_stored_once(broker, "t", acked)
    with broker.cond:
        stored = len(broker.topics["t"].events)
    assert stored == len(acked), "an acknowledged event is missing (or one was added)"


def test_proxies_bound_to_one_replica_share_its_stream_and_requests(
    cluster: _Cluster, client: squall.Client
) -> None:
    topic = client.topic("t")
    proxies = [topic.publisher(f"app-{i}", replicated=True) for i in range(16)]
    acked: dict[tuple[str, int], squall.Receipt] = {}
    # The first publishes find the window closed, so the later ones wait and join.
    cluster.broker.gate = threading.Event()

    def publish(index: int) -> None:
        proxy = proxies[index]
        for sequence in range(1, 11):
            acked[(proxy.publisher_id, sequence)] = proxy.publish(b"event %d" % sequence)

    def release() -> None:
        wait_until(lambda: cluster.broker.requests_seen >= 1)
        assert cluster.broker.gate is not None
        cluster.broker.gate.set()

    threading.Thread(target=release, daemon=True).start()
    _run_threads(len(proxies), publish)
    assert len(acked) == 16 * 10
    _check_stored_once(cluster.broker, acked)
    # One stream to n1 for all of them, carrying requests with several proxies' events.
    assert cluster.broker.publish_peers == [cluster.addresses["n1"]]
    assert cluster.broker.joined_requests_seen >= 1
    assert cluster.broker.requests_seen < len(acked)
    for proxy in proxies:
        assert proxy.endpoint == squall.Endpoint("n1", cluster.addresses["n1"])
        assert proxy.streams_opened == 1
        proxy.close()


def test_proxies_move_to_the_next_replicas_stream_losing_and_doubling_nothing(
    cluster: _Cluster, client: squall.Client
) -> None:
    """Every 9th request is stored and its answer lost with its stream: every proxy with
    an event on that stream moves to the next replica (its own binding) and resends there
    with the same id and sequence; the master's deduplication answers the stored ones."""
    assert isinstance(cluster.broker, _SharingBroker)
    cluster.broker.lose_every = 9
    topic = client.topic("t")
    moves: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)

    def on_rebind_of(name: str) -> squall.RebindCallback:
        return lambda old, new: moves[name].append((old.node_id, new.node_id))

    proxies = [
        topic.publisher(f"app-{i}", replicated=True, on_rebind=on_rebind_of(f"app-{i}"))
        for i in range(8)
    ]
    acked: dict[tuple[str, int], squall.Receipt] = {}

    def publish(index: int) -> None:
        proxy = proxies[index]
        for sequence in range(1, 21):
            acked[(proxy.publisher_id, sequence)] = proxy.publish(b"e%d" % sequence)

    _run_threads(len(proxies), publish)
    assert len(acked) == 8 * 20
    _check_stored_once(cluster.broker, acked)
    assert any(r.duplicate for r in acked.values())
    assert sum(p.resends for p in proxies) > 0
    _check_moves(proxies, moves, acked)
    for proxy in proxies:
        proxy.close()
    # Streams were shared: far fewer than events, and than proxies times their moves.
    assert cluster.broker.publish_stream_calls <= 1 + len(acked) // 9 + 3


def test_a_non_replicated_proxy_on_a_shared_stream_is_lost_while_a_replicated_one_moves(
    cluster: _Cluster, client: squall.Client
) -> None:
    topic = client.topic("t")
    fixed = topic.publisher("fixed", replicated=False)
    moving = topic.publisher("moving", replicated=True)
    fixed.publish(b"1")
    moving.publish(b"1")
    # One stream to n1 served both.
    assert cluster.broker.publish_peers == [cluster.addresses["n1"]]
    # Both proxies' next events are on that stream when it ends (before storing them).
    cluster.broker.break_stream_after = 2
    cluster.broker.gate = threading.Event()
    outcomes: dict[str, squall.Receipt | BaseException] = {}

    def publish(proxy: squall.Publisher) -> None:
        try:
            outcomes[proxy.publisher_id] = proxy.publish(b"2")
        except squall.SquallError as exc:
            outcomes[proxy.publisher_id] = exc

    threads = [threading.Thread(target=publish, args=(p,), daemon=True) for p in (fixed, moving)]
    for thread in threads:
        thread.start()
    wait_until(lambda: fixed.next_sequence == 3 and moving.next_sequence == 3)
    cluster.broker.gate.set()
    for thread in threads:
        thread.join(30)
    lost = outcomes["fixed"]
    assert isinstance(lost, squall.PublisherLost), lost
    assert "new publisher" in lost.details
    # The next publish is refused before anything is sent.
    with pytest.raises(squall.PublisherLost) as again:
        fixed.publish(b"3")
    assert not again.value.maybe_stored
    receipt = outcomes["moving"]
    assert isinstance(receipt, squall.Receipt), receipt
    assert moving.endpoint == squall.Endpoint("n2", cluster.addresses["n2"])
    assert receipt.rebound
    stored = {(e.publisher_id, e.sequence) for e in cluster.broker.topics["t"].events}
    assert stored == {("fixed", 1), ("moving", 1), ("moving", 2)}
    fixed.close()
    moving.close()


def test_a_redirect_answered_inline_moves_the_proxies_on_the_stream(
    cluster: _Cluster, client: squall.Client
) -> None:
    # n1 answers as a slave naming n3 (n2 would be next in the list): inline, on the
    # shared stream, which asks for failures to be answered so.
    assert isinstance(cluster.broker, _SharingBroker)
    n1, n3 = cluster.addresses["n1"], cluster.addresses["n3"]
    cluster.broker.inline_slaves[n1] = n3
    topic = client.topic("t")
    first = topic.publisher("first", replicated=True)
    second = topic.publisher("second", replicated=True)
    fixed = topic.publisher("fixed", replicated=False)
    assert first.publish(b"x").offset == 0
    assert second.publish(b"y").offset == 1
    with pytest.raises(squall.PublisherLost):
        fixed.publish(b"z")
    for proxy in (first, second):
        assert proxy.endpoint == squall.Endpoint("n3", n3)
        proxy.close()
    fixed.close()
    # Each publish met n1's refusal once (the stream it abandoned is reopened for the
    # next proxy still bound there); both then went to one shared stream to n3.
    assert cluster.broker.publish_peers.count(n3) == 1
    assert cluster.broker.publish_peers.count(n1) == 3
    stored = [(e.publisher_id, e.sequence) for e in cluster.broker.topics["t"].events]
    assert stored == [("first", 1), ("second", 1)]


def test_proxies_on_one_stream_all_follow_a_redirect_answered_inline(
    cluster: _Cluster, client: squall.Client
) -> None:
    """Concurrent proxies' events on n1's stream: the redirect answered to one request is
    followed by every proxy whose event was on that stream, none of them round robin."""
    assert isinstance(cluster.broker, _SharingBroker)
    n1, n3 = cluster.addresses["n1"], cluster.addresses["n3"]
    cluster.broker.inline_slaves[n1] = n3
    topic = client.topic("t")
    proxies = [topic.publisher(f"app-{i}", replicated=True) for i in range(8)]
    acked: dict[tuple[str, int], squall.Receipt] = {}

    def publish(index: int) -> None:
        proxy = proxies[index]
        for sequence in range(1, 6):
            acked[(proxy.publisher_id, sequence)] = proxy.publish(b"e%d" % sequence)

    _run_threads(len(proxies), publish)
    _check_stored_once(cluster.broker, acked)
    assert cluster.addresses["n2"] not in cluster.broker.publish_peers
    for proxy in proxies:
        assert proxy.endpoint == squall.Endpoint("n3", n3)
        proxy.close()


def test_a_proxy_that_knows_a_replica_by_address_only_still_moves_off_its_stream(
    cluster: _Cluster, client: squall.Client
) -> None:
    """The stream to n3 is opened by a proxy that knows it as n3; another proxy reaches
    it by a redirect to an address outside its list (node id unknown). That proxy's
    binding still hears that the stream answered and how it ended, under its own name for
    the replica, and moves off it as a stream of its own would make it."""
    assert isinstance(cluster.broker, _SharingBroker)
    n1, n2, n3 = (cluster.addresses[n] for n in ("n1", "n2", "n3"))
    cluster.broker.endpoints = [("n3", n3), ("n1", n1), ("n2", n2)]
    topic = client.topic("t")
    knows = topic.publisher("knows", replicated=True)
    knows.publish(b"1")
    assert knows.endpoint == squall.Endpoint("n3", n3)
    cluster.broker.endpoints = [("n1", n1), ("n2", n2)]
    cluster.broker.inline_slaves[n1] = n3
    redirected = topic.publisher("redirected", replicated=True)
    redirected.publish(b"1")
    assert redirected.endpoint == squall.Endpoint("", n3)
    assert cluster.broker.publish_peers.count(n3) == 1  # the stream "knows" opened
    # n1 is master again, and the stream to n3 ends before storing the next request:
    # the redirected proxy's master failed, so it goes back to its list, at n1.
    del cluster.broker.inline_slaves[n1]
    cluster.broker.break_stream_after = 2
    receipt = redirected.publish(b"2")
    assert redirected.endpoint == squall.Endpoint("n1", n1)
    assert receipt.rebound
    stored = [(e.publisher_id, e.sequence) for e in cluster.broker.topics["t"].events]
    assert stored == [("knows", 1), ("redirected", 1), ("redirected", 2)]
    knows.close()
    redirected.close()


def _check_moves(
    proxies: list[Any], moves: dict[str, list[tuple[str, str]]], acked: dict[Any, Any]
) -> None:
    """Each proxy followed its own binding from one answering replica to another and said
    so once per move (on_rebind, and its first receipt from there flagged rebound)."""
    assert sum(p.rebinds for p in proxies) > 0
    for proxy in proxies:
        name = proxy.publisher_id
        assert len(moves[name]) == proxy.rebinds
        assert all(old != new for old, new in moves[name])
        chain = [new for _, new in moves[name]][:-1]
        assert [old for old, _ in moves[name]][1:] == chain
        if moves[name]:
            assert proxy.endpoint is not None
            assert proxy.endpoint.node_id == moves[name][-1][1]
        rebound = [r for (p, _), r in acked.items() if p == name and r.rebound]
        assert len(rebound) == proxy.rebinds
