"""Publisher proxies and streaming subscribers across a kill -9 of the master (issue 5: 1, 4, 5).

A real three-node cluster (deploy/cluster.example.toml) and its gateway. Goals:

* a replicated proxy (`replicated=True`) publishes straight to the master and, when the
  master is killed, moves to the new one by itself: every acknowledged event is stored
  exactly once, the first receipt from the new master says `rebound`, `on_rebind` fired
  once with (old, new), and the stored events' session token changes at the move;
* a non-replicated proxy (`replicated=False`) raises `PublisherLost` when its master dies
  instead of moving, and a new proxy (same id, the lost sequence again) works, storing
  each sequence once;
* a following subscriber reading through the gateway survives the kill and hands the app
  every acknowledged event exactly once, in offset order (deduplication on).
"""

from __future__ import annotations

import collections
import threading

import grpc
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.integration.conftest import LocalCluster
from tests.integration.test_gateway import (
    _AppPublisher,
    _check_exactly_once,
    _kill_master_while_publishing,
    _wait_for,
    trio,  # noqa: F401  (the fixture)
)


def _events_on(address: str, topic: str) -> list[common_pb2.Event]:
    """Every committed event of a topic, read from one replica."""
    events: list[common_pb2.Event] = []
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=topic, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=20,
        )
        for response in stream:
            events.extend(response.events)
    return events


def test_replicated_proxy_moves_to_the_new_master_and_says_so(trio: LocalCluster) -> None:  # noqa: F811
    moves: list[tuple[squall.Endpoint, squall.Endpoint]] = []
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        publisher = client.topic("orders").publisher(
            "app-1", replicated=True, on_rebind=lambda old, new: moves.append((old, new))
        )
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        old, new = _kill_master_while_publishing(trio, app)
        bound = publisher.endpoint
        publisher.close()
    assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}
    _check_exactly_once(trio, new, "orders", app)
    # The proxy went straight to the replicas, and moved once, from the old to the new.
    assert bound is not None and bound.node_id == new
    assert [(o.node_id, n.node_id) for o, n in moves] == [(old, new)]
    in_order = sorted(app.acked.items())
    flagged = [sequence for sequence, receipt in in_order if receipt.rebound]
    first_from_new = next(s for s, r in in_order if r.master_id == new)
    assert flagged == [first_from_new], (flagged, first_from_new)
    # Subscribers see the move: the session token of this publisher's events changes there.
    # (A batch in flight at the kill may be stored under the old token and acknowledged by
    # the new master as a duplicate: it was stored before the move, so it keeps that token.)
    events = sorted(_events_on(trio.replica_address(new), "orders"), key=lambda e: e.offset)
    stored_by = {
        s: r.master_id for s, r in app.acked.items() if r.master_id == old or not r.duplicate
    }
    tokens_old = {e.session_token for e in events if stored_by.get(e.sequence) == old}
    tokens_new = {e.session_token for e in events if stored_by.get(e.sequence) == new}
    assert tokens_old and tokens_new and not tokens_old & tokens_new
    # In offset order, each token is one unbroken run: order holds within a token.
    runs = [
        t
        for i, t in enumerate(e.session_token for e in events)
        if i == 0 or t != events[i - 1].session_token
    ]
    assert len(runs) == len(set(runs)), runs


def test_non_replicated_proxy_raises_on_master_loss_and_a_new_proxy_works(
    trio: LocalCluster,  # noqa: F811
) -> None:
    old = trio.wait_for_master()
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("ledger")
        topic = client.topic("ledger")
        publisher = topic.publisher("app-1", replicated=False)
        assert publisher.publish(b"1").master_id == old
        trio.kill_node(old)
        lost: squall.PublisherLost | None = None
        for sequence in range(2, 1000):  # bounded: the first publish after the kill fails
            try:
                publisher.publish(b"%d" % sequence)
            except squall.PublisherLost as error:
                lost, lost_sequence = error, sequence
                break
        assert lost is not None, "a non-replicated publisher moved silently"
        assert isinstance(lost, squall.Unavailable)
        with pytest.raises(squall.PublisherLost):
            publisher.publish(b"again")  # lost for good: the app must ask for a new one
        publisher.close()
        new = trio.wait_for_master(exclude=old)
        # The lost event may be stored; resending it under the same id and sequence is safe.
        fresh = topic.publisher("app-1", replicated=False, start_sequence=lost_sequence)
        receipts = [fresh.publish(b"%d" % s) for s in range(lost_sequence, lost_sequence + 5)]
        fresh.close()
    assert {r.master_id for r in receipts} == {new}
    stored = collections.Counter(
        (e.publisher_id, e.sequence) for e in _events_on(trio.replica_address(new), "ledger")
    )
    assert all(count == 1 for count in stored.values()), stored
    assert set(range(1, lost_sequence + 5)) == {s for _, s in stored}


def test_following_subscriber_delivers_every_acknowledged_event_once_across_a_kill(
    trio: LocalCluster,  # noqa: F811
) -> None:
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        topic = client.topic("orders")
        subscription = topic.subscribe("billing", follow=True)
        delivered: list[squall.Message] = []
        lock = threading.Lock()
        reader_error: list[BaseException] = []

        def consume() -> None:
            try:
                for message in subscription:
                    with lock:
                        delivered.append(message)
                    if message.offset % 10 == 9:
                        try:
                            subscription.ack(message)
                        except squall.SquallError:
                            pass  # an ack lost in the failover: the cursor lags, no more
            except BaseException as exc:  # reported by the test
                reader_error.append(exc)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        publisher = topic.publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        _old, _new = _kill_master_while_publishing(trio, app)
        publisher.close()

        def seen_all() -> bool:
            with lock:
                seen = {m.sequence for m in delivered}
            return seen >= set(app.acked)

        _wait_for(lambda: seen_all() or bool(reader_error), 30, "every acked event delivered")
        subscription.close()
        reader.join(10)
    assert not reader_error, repr(reader_error[0])
    offsets = [m.offset for m in delivered]
    assert offsets == sorted(set(offsets)), "out of order or delivered twice"
    counts = collections.Counter(m.sequence for m in delivered)
    assert all(counts[s] == 1 for s in app.acked)
    assert subscription.reconnects >= 1
