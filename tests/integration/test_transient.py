"""Transient topics with real processes (issue 5, item 7).

A transient topic follows IceStorm's event model: its metadata is replicated and durable
like any topic's, but its events go live to whoever is subscribed now and are never
stored. Goals, on a one-node cluster and on the three-node example cluster:

* a following subscriber gets every event published while it is subscribed, in order,
  with the offsets the publisher's receipts named;
* a subscriber that starts later does not get the events published before it;
* nothing is stored: publishing does not move the replication log, and after a replica
  restart the topic is still there (metadata is durable) but has no events;
* on three nodes the topic's metadata is on every replica and survives a kill -9 of the
  master, and the new master delivers the topic's events live;
* a durable subscription name on a transient topic is refused with INVALID_ARGUMENT,
  and nothing is registered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest

import squall
from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    replica_pb2,
    replica_pb2_grpc,
)
from tests.integration.conftest import LocalCluster

# Each wait for a delivery or a replica is bounded by this.
WAIT_S = 20.0
PROBES_MAX = 200


class _Follower(threading.Thread):
    """A following subscriber on its own thread, collecting what the app loop receives."""

    def __init__(self, subscription: squall.Subscription) -> None:
        super().__init__(daemon=True)
        self.subscription = subscription
        self.cond = threading.Condition()
        self.messages: list[squall.Message] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for message in self.subscription:
                with self.cond:
                    self.messages.append(message)
                    self.cond.notify_all()
        except BaseException as exc:  # reported by the test
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def wait_for(self, predicate: Callable[[list[squall.Message]], bool], what: str) -> None:
        """Waits (on the delivery signal) until predicate(messages) holds."""
        with self.cond:
            held = self.cond.wait_for(
                lambda: self.error is not None or predicate(self.messages), WAIT_S
            )
            assert self.error is None, repr(self.error)
            assert held, f"not within {WAIT_S}s: {what}; got {len(self.messages)} messages"

    def payloads(self) -> list[bytes]:
        """The payloads received so far, in arrival order."""
        with self.cond:
            return [m.payload for m in self.messages]

    def stop(self) -> None:
        """Closes the subscription and waits for the thread."""
        self.subscription.close()
        self.join(10)


def _follow_live(topic: squall.Topic, publisher: squall.Publisher) -> tuple[_Follower, int]:
    """A follower from `latest` that is known to be live: it has received a probe event.

    A Subscribe call is set up asynchronously, so probes are published one at a time until
    the first arrives; returns the follower and the offset the events after the probes get.
    """
    follower = _Follower(topic.subscribe(start="latest", follow=True))
    follower.start()
    for probe in range(PROBES_MAX):  # bounded; the first or second probe normally arrives
        publisher.publish(b"probe %d" % probe)
        with follower.cond:
            if follower.cond.wait_for(lambda: bool(follower.messages), 0.2):
                break
    follower.wait_for(bool, "a probe event")
    # Every probe published so far arrives; the events after them follow on.
    last_probe = publisher.publish(b"last probe")
    follower.wait_for(lambda ms: ms[-1].offset == last_probe.offset, "the last probe")
    return follower, last_probe.offset + 1


def _last_lsn(address: str) -> int:
    """The replica's last log position."""
    with grpc.insecure_channel(address) as channel:
        state = replica_pb2_grpc.ReplicaControlStub(channel).GetReplicaState(
            replica_pb2.GetReplicaStateRequest(), timeout=5
        )
    return int(state.last_lsn)


def _retrieve_on(address: str, name: str) -> common_pb2.Topic | None:
    """RetrieveTopic straight on one replica (None: not there, or not answering)."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = broker_pb2_grpc.TopicManagerStub(channel).RetrieveTopic(
                broker_pb2.RetrieveTopicRequest(name=name), timeout=5
            )
        except grpc.RpcError:
            return None
    return response.topic


def _wait_on_every_replica(cluster: LocalCluster, name: str, node_ids: list[str]) -> None:
    """Polls each replica until it has the topic, as a transient one."""
    deadline = time.monotonic() + WAIT_S
    missing = list(node_ids)
    while missing and time.monotonic() < deadline:
        missing = [
            n
            for n in missing
            if (t := _retrieve_on(cluster.replica_address(n), name)) is None
            or t.kind != common_pb2.TOPIC_KIND_TRANSIENT
        ]
        if missing:
            time.sleep(0.05)
    assert not missing, f"transient topic {name!r} not on replicas {missing}"


def test_following_subscriber_gets_transient_events_live_in_order(
    shared_single: LocalCluster,
) -> None:
    with squall.connect(shared_single.gateway_address, timeout_s=10.0) as client:
        info = client.create_topic("ticks-live", kind="transient")
        assert info.kind == "transient"
        topic = client.topic("ticks-live")
        with topic.publisher() as publisher:
            follower, first = _follow_live(topic, publisher)
            try:
                receipts = [publisher.publish(b"tick %d" % i) for i in range(50)]
                follower.wait_for(lambda ms: ms[-1].offset >= receipts[-1].offset, "the 50 ticks")
            finally:
                follower.stop()
    live = [m for m in follower.messages if m.offset >= first]
    assert [m.payload for m in live] == [b"tick %d" % i for i in range(50)]
    assert [m.offset for m in live] == [r.offset for r in receipts]
    assert [r.offset for r in receipts] == list(range(first, first + 50))
    # Not stored: the receipts name no log position.
    assert {r.lsn for r in receipts} == {0}


def test_a_later_subscriber_does_not_get_earlier_events(shared_single: LocalCluster) -> None:
    with squall.connect(shared_single.gateway_address, timeout_s=10.0) as client:
        client.create_topic("ticks-later", kind="transient")
        topic = client.topic("ticks-later")
        with topic.publisher() as publisher:
            early, _ = _follow_live(topic, publisher)
            try:
                before = [publisher.publish(b"before %d" % i) for i in range(20)]
                early.wait_for(lambda ms: ms[-1].offset == before[-1].offset, "the early events")
                late, first_late = _follow_live(topic, publisher)
                try:
                    after = [publisher.publish(b"after %d" % i) for i in range(20)]
                    late.wait_for(lambda ms: ms[-1].offset == after[-1].offset, "the later events")
                    early.wait_for(lambda ms: ms[-1].offset == after[-1].offset, "every event")
                finally:
                    late.stop()
            finally:
                early.stop()
    late_payloads = late.payloads()
    assert not [p for p in late_payloads if p.startswith(b"before")], late_payloads[:5]
    assert [m.payload for m in late.messages if m.offset >= first_late] == [
        b"after %d" % i for i in range(20)
    ]
    # The subscriber that was there all along got both.
    assert [p for p in early.payloads() if not p.startswith(b"probe") and p != b"last probe"] == [
        b"before %d" % i for i in range(20)
    ] + [b"after %d" % i for i in range(20)]


def test_a_later_subscriber_from_earliest_does_not_get_earlier_events(
    shared_single: LocalCluster,
) -> None:
    """The default start ("earliest") on a transient topic must not replay past events."""
    with squall.connect(shared_single.gateway_address, timeout_s=10.0) as client:
        client.create_topic("ticks-earliest", kind="transient")
        topic = client.topic("ticks-earliest")
        with topic.publisher() as publisher:
            for i in range(20):
                publisher.publish(b"before %d" % i)
        with topic.subscribe(follow=False) as subscription:
            replayed = [m.payload for m in subscription]
    assert replayed == [], f"{len(replayed)} past events replayed, e.g. {replayed[:3]}"


def test_transient_events_are_not_stored_and_the_topic_survives_a_restart(
    single: LocalCluster,
) -> None:
    address = single.replica_address("n1")
    with squall.connect(single.gateway_address, timeout_s=10.0) as client:
        client.create_topic("ticks", kind="transient")
        topic = client.topic("ticks")
        lsn_before = _last_lsn(address)
        with topic.publisher() as publisher:
            receipts = publisher.publish_many([b"tick %d" % i for i in range(500)], 100)
        assert len(receipts) == 500
        # Publishing wrote nothing to the replicated log.
        assert _last_lsn(address) == lsn_before
    single.kill("replica", "n1")
    single.start("replica", "n1")
    single.wait_for_master()
    with squall.connect(single.gateway_address, timeout_s=10.0) as client:
        # The metadata is durable: the topic is still there, still transient.
        topic = client.topic("ticks")
        assert topic.info.kind == "transient"
        assert "ticks" in [t.name for t in client.topics()]
        # The events were not: nothing to read from the start.
        with topic.subscribe(start="earliest", follow=False) as subscription:
            assert [m.payload for m in subscription] == []
        # And the topic works: a live subscriber gets what is published now.
        with topic.publisher() as publisher:
            follower, first = _follow_live(topic, publisher)
            try:
                receipt = publisher.publish(b"after the restart")
                follower.wait_for(lambda ms: ms[-1].offset == receipt.offset, "the new event")
            finally:
                follower.stop()
    assert [m.payload for m in follower.messages if m.offset >= first] == [b"after the restart"]


def test_transient_metadata_is_on_every_replica_and_survives_a_master_kill(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    trio.start_all()
    nodes = [n.id for n in trio.config.nodes]
    old = trio.wait_for_master()
    with squall.connect(trio.gateway_address, timeout_s=10.0) as client:
        client.create_topic("alerts", kind="transient")
    _wait_on_every_replica(trio, "alerts", nodes)
    trio.kill_node(old)
    new = trio.wait_for_master(exclude=old)
    survivors = [n for n in nodes if n != old]
    _wait_on_every_replica(trio, "alerts", survivors)
    with squall.connect(trio.gateway_address, timeout_s=10.0) as client:
        topic = client.topic("alerts")
        assert topic.info.kind == "transient"
        with topic.publisher() as publisher:
            follower, first = _follow_live(topic, publisher)
            try:
                receipts = [publisher.publish(b"alert %d" % i) for i in range(10)]
                follower.wait_for(lambda ms: ms[-1].offset == receipts[-1].offset, "the alerts")
            finally:
                follower.stop()
    assert {r.master_id for r in receipts} == {new}
    assert [m.payload for m in follower.messages if m.offset >= first] == [
        b"alert %d" % i for i in range(10)
    ]
    # The killed node comes back with the topic too: its metadata was stored on it.
    trio.start_node(old)
    _wait_on_every_replica(trio, "alerts", nodes)


def test_following_subscriber_gets_transient_events_after_a_master_kill(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    trio.start_all()
    old = trio.wait_for_master()
    with squall.connect(trio.gateway_address, timeout_s=10.0) as client:
        client.create_topic("alerts", kind="transient")
        topic = client.topic("alerts")
        with topic.publisher() as publisher:
            follower, _ = _follow_live(topic, publisher)
            try:
                before = [publisher.publish(b"before %d" % i) for i in range(50)]
                follower.wait_for(lambda ms: ms[-1].offset == before[-1].offset, "the events")
                trio.kill_node(old)
                trio.wait_for_master(exclude=old)
                # Live delivery resumes: an event published now reaches the follower. (Events
                # published during the failover may be missed: transient means best effort.)
                after = [publisher.publish(b"after %d" % i) for i in range(10)]
                follower.wait_for(
                    lambda ms: any(m.payload == b"after 9" for m in ms), "events after the kill"
                )
            finally:
                follower.stop()
    assert {r.master_id for r in after} != {old}


def test_durable_subscription_on_a_transient_topic_is_refused(shared_single: LocalCluster) -> None:
    with squall.connect(shared_single.gateway_address, timeout_s=10.0) as client:
        client.create_topic("ticks-durable", kind="transient")
        topic = client.topic("ticks-durable")
        with pytest.raises(squall.InvalidArgument, match="transient"):
            with topic.subscribe("billing", follow=True) as subscription:
                next(iter(subscription))
        assert topic.subscriptions() == []
    with shared_single.channel() as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(topic="ticks-durable", subscription="billing"), timeout=10
        )
        with pytest.raises(grpc.RpcError) as raised:
            next(iter(stream))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "transient" in (raised.value.details() or "")
