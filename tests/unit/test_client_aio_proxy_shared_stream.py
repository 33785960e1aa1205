"""`squall.aio` publisher proxies share the client's stream to their replica
(squall.aio._publish_mux, `ProxyMuxes`), against one in-memory broker served as a gateway
and three replicas (the cluster of tests/unit/test_client_proxy_shared_stream.py).

Many tasks, each with a proxy of its own, publish one event at a time: the proxies bound
to one replica send on one stream and their concurrent events join into one request, yet
each proxy still moves on its own: a broken stream, a slave's redirect answered inline
(followed by every proxy on that stream) or a stalled master the gateway no longer names
sends that proxy's next attempt to the shared stream of its new replica, opened with its
binding's `squall-unreachable`, with the same id and sequence (stored once, nothing
lost); a non-replicated proxy raises `PublisherLost` instead; a cancelled caller's unsent
event is withdrawn; the streams and channels close with the client.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import grpc
import pytest

import squall
import squall.aio
from squall.aio._publish_mux import ProxyMuxes
from tests.unit.test_client_aio_shared_stream import FILL, _stays, _until
from tests.unit.test_client_failover import FAST, _Cluster
from tests.unit.test_client_proxy_shared_stream import (
    _check_moves,
    _check_stored_once,
    _SharingBroker,
)

_T = TypeVar("_T")


@pytest.fixture
def cluster() -> Iterator[_Cluster]:
    made = _Cluster(replicas=3, broker=_SharingBroker())
    try:
        yield made
    finally:
        if made.broker.gate is not None:
            made.broker.gate.set()
        made.stop()


def _run(
    cluster: _Cluster,
    body: Callable[[squall.aio.Client], Awaitable[_T]],
    timeout_s: float = 5.0,
) -> _T:
    """Runs `body` with a client of the cluster's gateway (topic "t" made) on a fresh loop."""

    async def main() -> _T:
        async with squall.aio.connect(cluster.gateway, timeout_s=timeout_s, **FAST) as client:
            await client.create_topic("t")
            return await body(client)

    return asyncio.run(main())


async def _publish_each(
    proxies: list[squall.aio.Publisher], count: int
) -> dict[tuple[str, int], squall.Receipt]:
    """Every proxy publishes `count` events one at a time, each in a task of its own."""
    acked: dict[tuple[str, int], squall.Receipt] = {}

    async def publish(proxy: squall.aio.Publisher) -> None:
        for sequence in range(1, count + 1):
            acked[(proxy.publisher_id, sequence)] = await proxy.publish(b"e%d" % sequence)

    await asyncio.gather(*(publish(p) for p in proxies))
    return acked


def test_proxy_tasks_bound_to_one_replica_share_its_stream_and_requests(
    cluster: _Cluster,
) -> None:
    # The first publishes find the window closed, so the later ones wait and join.
    cluster.broker.gate = threading.Event()

    async def body(client: squall.aio.Client) -> dict[tuple[str, int], squall.Receipt]:
        topic = await client.topic("t")
        proxies = [await topic.publisher(f"app-{i}", replicated=True) for i in range(16)]
        publishing = asyncio.create_task(_publish_each(proxies, 10))
        await _until(lambda: cluster.broker.requests_seen >= 1)
        assert cluster.broker.gate is not None
        cluster.broker.gate.set()
        acked = await publishing
        for proxy in proxies:
            assert proxy.endpoint == squall.Endpoint("n1", cluster.addresses["n1"])
            assert proxy.streams_opened == 1
            await proxy.close()
        return acked

    acked = _run(cluster, body)
    assert len(acked) == 16 * 10
    _check_stored_once(cluster.broker, acked)
    # One stream to n1 for all of them, carrying requests with several proxies' events.
    assert cluster.broker.publish_peers == [cluster.addresses["n1"]]
    assert cluster.broker.joined_requests_seen >= 1
    assert cluster.broker.requests_seen < len(acked)


def test_proxies_move_to_the_next_replicas_stream_losing_and_doubling_nothing(
    cluster: _Cluster,
) -> None:
    """Every 9th request is stored and its answer lost with its stream: every proxy with
    an event on that stream moves to the next replica (its own binding) and resends there
    with the same id and sequence; the master's deduplication answers the stored ones."""
    assert isinstance(cluster.broker, _SharingBroker)
    cluster.broker.lose_every = 9
    moves: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)

    def on_rebind_of(name: str) -> squall.RebindCallback:
        return lambda old, new: moves[name].append((old.node_id, new.node_id))

    async def body(client: squall.aio.Client) -> None:
        topic = await client.topic("t")
        proxies = [
            await topic.publisher(f"app-{i}", replicated=True, on_rebind=on_rebind_of(f"app-{i}"))
            for i in range(8)
        ]
        acked = await _publish_each(proxies, 20)
        assert len(acked) == 8 * 20
        _check_stored_once(cluster.broker, acked)
        assert any(r.duplicate for r in acked.values())
        assert sum(p.resends for p in proxies) > 0
        _check_moves(proxies, moves, acked)
        for proxy in proxies:
            await proxy.close()
        # Streams were shared: far fewer than events, and than proxies times their moves.
        assert cluster.broker.publish_stream_calls <= 1 + len(acked) // 9 + 3

    _run(cluster, body)


def test_a_non_replicated_proxy_on_a_shared_stream_is_lost_while_a_replicated_one_moves(
    cluster: _Cluster,
) -> None:
    async def body(client: squall.aio.Client) -> None:
        topic = await client.topic("t")
        fixed = await topic.publisher("fixed", replicated=False)
        moving = await topic.publisher("moving", replicated=True)
        await fixed.publish(b"1")
        await moving.publish(b"1")
        # One stream to n1 served both.
        assert cluster.broker.publish_peers == [cluster.addresses["n1"]]
        # Both proxies' next events are on that stream when it ends (before storing them).
        cluster.broker.break_stream_after = 2
        cluster.broker.gate = threading.Event()
        lost_task = asyncio.create_task(fixed.publish(b"2"))
        moved_task = asyncio.create_task(moving.publish(b"2"))
        await _until(lambda: fixed.next_sequence == 3 and moving.next_sequence == 3)
        cluster.broker.gate.set()
        with pytest.raises(squall.PublisherLost) as lost:
            await lost_task
        assert "new publisher" in lost.value.details
        # The next publish is refused before anything is sent.
        with pytest.raises(squall.PublisherLost) as again:
            await fixed.publish(b"3")
        assert not again.value.maybe_stored
        receipt = await moved_task
        assert moving.endpoint == squall.Endpoint("n2", cluster.addresses["n2"])
        assert receipt.rebound
        await fixed.close()
        await moving.close()

    _run(cluster, body)
    stored = {(e.publisher_id, e.sequence) for e in cluster.broker.topics["t"].events}
    assert stored == {("fixed", 1), ("moving", 1), ("moving", 2)}


def test_proxies_on_one_stream_all_follow_a_redirect_answered_inline(cluster: _Cluster) -> None:
    """Concurrent proxies' events on n1's stream, n1 answering inline as a slave naming n3
    (n2 would be next in the list): the redirect answered to one request is followed by
    every proxy whose event was on that stream, none of them round robin; a
    non-replicated proxy is lost instead."""
    assert isinstance(cluster.broker, _SharingBroker)
    n1, n3 = cluster.addresses["n1"], cluster.addresses["n3"]
    cluster.broker.inline_slaves[n1] = n3

    async def body(client: squall.aio.Client) -> dict[tuple[str, int], squall.Receipt]:
        topic = await client.topic("t")
        proxies = [await topic.publisher(f"app-{i}", replicated=True) for i in range(8)]
        acked = await _publish_each(proxies, 5)
        for proxy in proxies:
            assert proxy.endpoint == squall.Endpoint("n3", n3)
            await proxy.close()
        fixed = await topic.publisher("fixed", replicated=False)
        with pytest.raises(squall.PublisherLost):
            await fixed.publish(b"z")
        await fixed.close()
        return acked

    acked = _run(cluster, body)
    _check_stored_once(cluster.broker, acked)
    assert cluster.addresses["n2"] not in cluster.broker.publish_peers


def test_a_new_replica_stream_names_the_replica_the_proxy_could_not_reach(
    cluster: _Cluster,
) -> None:
    # So a slave of the dead master holds the call for the next master instead of
    # redirecting it back (services/replica/server.py, Publisher._hold): the shared
    # stream to n2, opened by the proxy's retry, carries its binding's metadata.
    cluster.broker.break_stream_after = 1

    async def body(client: squall.aio.Client) -> list[squall.Receipt]:
        topic = await client.topic("t")
        async with topic.publisher("p", replicated=True) as proxy:
            return [await proxy.publish(b"1"), await proxy.publish(b"2")]

    receipts = _run(cluster, body)
    assert [r.rebound for r in receipts] == [False, True]
    n1, n2 = cluster.addresses["n1"], cluster.addresses["n2"]
    assert cluster.broker.publish_peers == [n1, n2]
    assert cluster.broker.publish_unreachable == ["", n1]


def test_proxies_leave_a_hung_masters_stream_for_the_one_the_gateway_names(
    cluster: _Cluster,
) -> None:
    # n1 hangs after the group elected n2: the receipts would be waited for until the
    # timeout (60 s); the shared stream's watchdog asks the gateway, which names n2
    # first, and abandons the stream naming it: every proxy on it goes to n2's stream.
    n1, n2, n3 = (cluster.addresses[n] for n in ("n1", "n2", "n3"))

    async def body(client: squall.aio.Client) -> list[squall.Receipt]:
        topic = await client.topic("t")
        proxies = [await topic.publisher(f"app-{i}", replicated=True) for i in range(4)]
        cluster.broker.hung_addresses.add(n1)
        cluster.broker.endpoints = [("n2", n2), ("n1", n1), ("n3", n3)]
        receipts = await asyncio.wait_for(asyncio.gather(*(p.publish(b"x") for p in proxies)), 30)
        for proxy in proxies:
            assert proxy.endpoint == squall.Endpoint("n2", n2)
            await proxy.close()
        return list(receipts)

    receipts = _run(cluster, body, timeout_s=60.0)
    assert not any(r.duplicate for r in receipts)
    assert cluster.broker.publish_peers == [n1, n2]
    stored = sorted((e.publisher_id, e.sequence) for e in cluster.broker.topics["t"].events)
    assert stored == [(f"app-{i}", 1) for i in range(4)]


def test_a_cancelled_proxy_publish_is_withdrawn_if_unsent(cluster: _Cluster) -> None:
    cluster.broker.gate = threading.Event()

    async def body(client: squall.aio.Client) -> squall.Receipt:
        topic = await client.topic("t")
        fillers = [await topic.publisher(f"fill-{i}", replicated=True) for i in range(FILL)]
        waiting = await topic.publisher("waiting", replicated=True)
        # The window to n1 fills with the fillers' events, each sent in a turn of its own
        # (the publishes of one turn go as one request; a publish's sequence is taken in
        # its turn and its request sent at the turn's end); "waiting"'s event waits.
        filling = []
        for filler in fillers:
            filling.append(asyncio.create_task(filler.publish(b"fill")))
            await _until(lambda filler=filler: filler.next_sequence == 2)
        await _until(lambda: cluster.broker.requests_seen >= 1)
        unsent = asyncio.create_task(waiting.publish(b"never"))
        await _until(lambda: waiting.next_sequence == 2)
        unsent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unsent
        assert await _stays(lambda: cluster.broker.requests_seen <= FILL, duration_s=0.2)
        assert cluster.broker.gate is not None
        cluster.broker.gate.set()
        await asyncio.gather(*filling)
        return await waiting.publish(b"waiting-2")

    receipt = _run(cluster, body)
    events = cluster.broker.topics["t"].events
    # The withdrawn event was never sent; the proxy's next one took the next sequence.
    assert [
        (e.publisher_id, e.sequence, e.payload) for e in events if e.publisher_id == "waiting"
    ] == [("waiting", 2, b"waiting-2")]
    assert events[receipt.offset].payload == b"waiting-2"


def test_closing_the_client_closes_its_replica_streams_and_channels(cluster: _Cluster) -> None:
    async def main() -> None:
        client = await squall.aio.connect(cluster.gateway, timeout_s=5.0, **FAST)
        await client.create_topic("t")
        proxy = await (await client.topic("t")).publisher("p", replicated=True)
        await proxy.publish(b"1")
        muxes: ProxyMuxes = client._proxy_muxes  # type: ignore[assignment]
        assert muxes.addresses() == [cluster.addresses["n1"]]
        [(channel, mux)] = list(muxes._muxes.values())
        stream = mux._stream
        assert stream is not None and stream.reader is not None
        await client.close()
        # The stream was half-closed and ended; its channel takes no more calls.
        assert stream.reader.done() and stream.dead
        assert muxes.addresses() == []
        with pytest.raises(grpc.aio.UsageError):
            await channel.unary_unary("/squall.v1.Publisher/Nothing")(b"")
        with pytest.raises(ValueError, match="closed"):
            await proxy.publish(b"2")

    asyncio.run(main())
