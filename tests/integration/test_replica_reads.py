"""Reads from slaves (issue 18 item 3), with real processes.

Goal: a subscriber reading from a slave sees committed events only — never one the master
has not committed, though the slave holds it — and sees it once the slave learns that it
committed; and a reader the gateway spread to a slave that is then killed goes on from
another replica with no event lost, none out of order, no gap — also when only the slave's
replica dies and its coordinator lives on (the node leaves its group as one).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import grpc
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, wait_for
from tests.integration.test_gateway import _AppPublisher
from tests.integration.test_replication import STUCK_SLAVE_STAYS, _request, _state

pytestmark = pytest.mark.integration


class _Follower(threading.Thread):
    """A following raw-stub reader of one replica, remembering every offset it got."""

    def __init__(
        self, address: str, topic: str, start: int = broker_pb2.START_POSITION_EARLIEST
    ) -> None:
        super().__init__(daemon=True)
        self.lock = threading.Lock()
        self.events: list[tuple[int, bytes]] = []
        self.error: BaseException | None = None
        self._channel = grpc.insecure_channel(address)
        self._call = broker_pb2_grpc.SubscriberStub(self._channel).Subscribe(
            broker_pb2.SubscribeRequest(topic=topic, start=start, follow=True),
            timeout=120,
        )

    def offsets(self) -> list[int]:
        with self.lock:
            return [offset for offset, _ in self.events]

    def run(self) -> None:
        try:
            for response in self._call:
                with self.lock:
                    self.events.extend((e.offset, e.payload) for e in response.events)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                self.error = exc
        except BaseException as exc:  # reported by the test
            self.error = exc

    def close(self) -> None:
        self._call.cancel()
        self.join(10)
        self._channel.close()


def _read_once(address: str, topic: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(topic=topic, start=broker_pb2.START_POSITION_EARLIEST),
            timeout=10,
        )
        return [e.offset for response in stream for e in response.events]


@pytest.fixture(scope="module")
def all_acks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three nodes whose master commits only what every member holds; a slave whose replica
    is stopped stays a member (so it holds commits back). Shared by this module's tests, in
    order: the last one kills a node."""
    cluster = make_cluster(
        ROOT / "deploy" / "cluster.example.toml",
        tmp_path_factory.mktemp("replica-reads"),
        durability={"acks": "all"},
        timeouts=dict(STUCK_SLAVE_STAYS),
    )
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


def _slaves(cluster: LocalCluster, master: str) -> list[str]:
    slaves = sorted(n.id for n in cluster.config.nodes if n.id != master)
    for slave in slaves:
        wait_for(
            lambda s=slave: cluster.replica_role(s) == common_pb2.ROLE_SLAVE,  # type: ignore[misc]
            15,
            f"{slave} is a slave",
        )
    return slaves


def test_a_slave_serves_only_what_the_master_committed_and_more_as_it_learns_commits(
    all_acks: LocalCluster,
) -> None:
    master = all_acks.wait_for_master()
    reader, stopped = _slaves(all_acks, master)
    reader_address = all_acks.replica_address(reader)
    with squall.connect(all_acks.gateway_address, timeout_s=10) as client:
        client.create_topic("t")
        publisher = client.topic("t").publisher("before")
        for i in range(5):
            publisher.publish(b"committed %d" % i)
        publisher.close()
    # A transient topic's events are only in the master's memory: a slave refuses to
    # serve it and names the master.
    with squall.connect(all_acks.gateway_address, timeout_s=10) as client:
        client.create_topic("live", kind="transient")
    with pytest.raises(grpc.RpcError) as refused:
        _read_once(reader_address, "live")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "transient" in refused.value.details()  # type: ignore[attr-defined]
    trailers = dict(refused.value.trailing_metadata())  # type: ignore[attr-defined]
    assert trailers["squall-master-address"] == all_acks.replica_address(master)
    follower = _Follower(reader_address, "t")
    follower.start()
    latest: _Follower | None = None
    try:
        wait_for(lambda: len(follower.offsets()) == 5, 20, "the slave's follower reads 0..4")
        os.kill(all_acks.services[("replica", stopped)].pid, signal.SIGSTOP)
        try:
            with grpc.insecure_channel(all_acks.replica_address(master)) as channel:
                withheld = _request("t", "p", 1, [100, 100, 100])
                # acks = all with a member stopped: held by the master and `reader`, not
                # committed, so the publish gets no receipt.
                with pytest.raises(grpc.RpcError) as raised:
                    broker_pb2_grpc.PublisherStub(channel).Publish(withheld, timeout=2)
                assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
            wait_for(
                lambda: _state(reader_address).last_lsn > _state(reader_address).commit_lsn,
                10,
                f"{reader} holds the uncommitted publish",
            )
            # A reader starting at the latest offset starts at the committed end, not past
            # the held events: they may be truncated and their offsets reused.
            latest = _Follower(reader_address, "t", broker_pb2.START_POSITION_LATEST)
            latest.start()
            seen_now = _read_once(reader_address, "t")
            still_withheld = _state(reader_address)
            # The slave holds the events (its log is past its commit LSN) and the commit was
            # still withheld after the read: serving any of them would have been a read of
            # an event the master never committed.
            assert still_withheld.commit_lsn < still_withheld.last_lsn
            assert seen_now == [0, 1, 2, 3, 4]
            assert follower.offsets() == [0, 1, 2, 3, 4]
        finally:
            os.kill(all_acks.services[("replica", stopped)].pid, signal.SIGCONT)
        # The stopped member acknowledges, the master commits, the slave learns it: its
        # follower gets the three events without subscribing again.
        wait_for(lambda: len(follower.offsets()) == 8, 30, "the follower reads 5..7")
        assert follower.offsets() == list(range(8))
        assert follower.error is None, repr(follower.error)
        assert latest is not None
        started_late = latest
        wait_for(lambda: started_late.offsets() == [5, 6, 7], 30, "the latest reader reads 5..7")
        assert started_late.error is None, repr(started_late.error)
    finally:
        follower.close()
        if latest is not None:
            latest.close()


def test_a_reader_spread_to_a_slave_that_is_killed_goes_on_without_loss_or_gap(
    all_acks: LocalCluster,
) -> None:
    master = all_acks.wait_for_master()
    first, second = _slaves(all_acks, master)
    with squall.connect(all_acks.gateway_address, timeout_s=10) as client:
        client.create_topic("u")
        topic = client.topic("u")
        # The durable subscription exists before the reader starts, so a slave serves it
        # (only the master creates one); acks = all: every replica holds it once this
        # returns.
        topic.seek("app", "earliest")
        publisher = topic.publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"event %d" % sequence))
        for i in range(5):
            publisher.publish(b"first %d" % i)
        got: list[int] = []
        subscription = topic.subscribe("app", follow=True, read_from="replicas")

        def read() -> None:
            for message in subscription:
                got.append(message.offset)
                subscription.ack(message)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(lambda: len(got) == 5, 20, "the reader's first events")
        # That first read went to the lowest-id slave; the next ones spread: the other
        # slave, then the master (the gateway names the node in the initial metadata).
        with grpc.insecure_channel(all_acks.gateway_address) as channel:
            stub = broker_pb2_grpc.SubscriberStub(channel)
            spread = []
            calls = []
            for _ in range(2):
                call = stub.Subscribe(
                    broker_pb2.SubscribeRequest(
                        topic="u", follow=True, read_from=broker_pb2.READ_FROM_REPLICAS
                    ),
                    timeout=30,
                )
                calls.append(call)
                spread.append(dict(call.initial_metadata()).get("squall-read-node"))
            # A durable subscription that does not exist yet: only the master can create
            # it, so a slave refuses and the gateway has the master serve the stream.
            created = stub.Subscribe(
                broker_pb2.SubscribeRequest(
                    topic="u",
                    subscription="new",
                    follow=True,
                    read_from=broker_pb2.READ_FROM_REPLICAS,
                ),
                timeout=30,
            )
            calls.append(created)
            spread.append(dict(created.initial_metadata()).get("squall-read-node"))
            assert [e.offset for e in next(created).events] == [0, 1, 2, 3, 4]
            # A transient topic is served by the master only.
            client.create_topic("live-u", kind="transient")
            live = stub.Subscribe(
                broker_pb2.SubscribeRequest(
                    topic="live-u", read_from=broker_pb2.READ_FROM_REPLICAS
                ),
                timeout=30,
            )
            assert list(live) == []
            spread.append(dict(live.initial_metadata()).get("squall-read-node"))
            for call in calls:
                call.cancel()
        assert spread == [second, master, master, master]
        app.start()
        try:
            wait_for(lambda: len(got) >= 30, 30, "30 events read from a slave")
            before_kill = subscription.reconnects
            all_acks.kill_node(first)
            wait_for(lambda: len(app.acked) >= len(got) + 30, 30, "30 more events published")
        finally:
            app.stop.set()
            app.join(30)
        assert app.error is None, repr(app.error)
        acked = {receipt.offset for receipt in app.acked.values()}
        wait_for(lambda: set(got) >= acked, 30, "the reader got every acknowledged event")
        subscription.close()
        reader.join(10)
        publisher.close()
        # In offset order, each once, from 0 with no gap; the stream broke once at least
        # (its slave died) and was taken up elsewhere from the durable cursor.
        assert got == list(range(len(got))), got
        assert subscription.reconnects > before_kill
        wait_for(
            lambda: topic.subscription_info("app").cursor == got[-1] + 1,
            10,
            "the cursor (moved by acks to the master) is past the last event read",
        )


def test_a_follow_stream_on_a_slave_that_loses_its_role_ends_so_its_reader_moves(
    all_acks: LocalCluster,
) -> None:
    """Runs last: its slave's coordinator is killed, so the replica loses its role (a slave
    cut off from its master would otherwise keep its followers waiting for ever)."""
    master = all_acks.wait_for_master()
    others = [n.id for n in all_acks.config.nodes if n.id != master]

    def slaves() -> list[str]:
        return [n for n in others if all_acks.replica_role(n) == common_pb2.ROLE_SLAVE]

    wait_for(slaves, 15, "a slave")
    slave = slaves()[0]
    with squall.connect(all_acks.gateway_address, timeout_s=10) as client:
        client.create_topic("v")
        with client.topic("v").publisher("v") as publisher:
            publisher.publish_many([b"v"] * 3)
    follower = _Follower(all_acks.replica_address(slave), "v")
    follower.start()
    try:
        wait_for(lambda: len(follower.offsets()) == 3, 20, "the follower reads what is there")
        all_acks.kill("coordinator", slave)
        follower.join(15)
        assert not follower.is_alive(), "the stream did not end"
        assert isinstance(follower.error, grpc.RpcError)
        assert follower.error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert "lost its slave role" in follower.error.details()  # type: ignore[attr-defined]
    finally:
        follower.close()


@pytest.fixture(scope="module")
def one_fate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three nodes with the default replica timeout (all_acks' slave would stay a member
    for a minute with its replica gone); acks = all, so every slave holds a durable
    subscription once it is created."""
    cluster = make_cluster(
        ROOT / "deploy" / "cluster.example.toml",
        tmp_path_factory.mktemp("replica-reads-fate"),
        durability={"acks": "all"},
    )
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


# The pause runs first: its replica is resumed and rejoins, so the kill has two slaves too.
@pytest.mark.parametrize("fault", ["pause", "kill"])
def test_a_reader_on_a_slave_whose_replica_alone_dies_or_hangs_goes_on_from_another_replica(
    one_fate: LocalCluster, fault: str
) -> None:
    # Per-process fault: the slave's coordinator lives on and takes the node out of its
    # group. A killed replica's stream breaks; a hung one's stays open and silent, so the
    # gateway ends it when the node leaves the master's group. Either way the reader must
    # go on elsewhere with every acknowledged event once, in order.
    master = one_fate.wait_for_master()
    first, second = _slaves(one_fate, master)
    name = f"w-{fault}"
    paused: int | None = None
    with squall.connect(one_fate.gateway_address, timeout_s=10) as client:
        client.create_topic(name)
        topic = client.topic(name)
        topic.seek("app", "earliest")
        publisher = topic.publisher("app-w")
        app = _AppPublisher(lambda sequence: publisher.publish(b"event %d" % sequence))
        got: list[int] = []
        subscription = topic.subscribe("app", follow=True, read_from="replicas")

        def read() -> None:
            for message in subscription:
                got.append(message.offset)
                subscription.ack(message)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        app.start()
        try:
            wait_for(lambda: len(got) >= 20, 30, "20 events read")
            # The reader took the lowest-id slave (no reads open anywhere: slaves first,
            # by id); so the next read the gateway spreads goes to the other slave.
            with grpc.insecure_channel(one_fate.gateway_address) as channel:
                probe = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
                    broker_pb2.SubscribeRequest(
                        topic=name, follow=True, read_from=broker_pb2.READ_FROM_REPLICAS
                    ),
                    timeout=30,
                )
                assert dict(probe.initial_metadata()).get("squall-read-node") == second
                probe.cancel()
            before_kill = subscription.reconnects
            if fault == "kill":
                one_fate.kill("replica", first)
            else:
                paused = one_fate.services[("replica", first)].process.pid
                os.kill(paused, signal.SIGSTOP)
            wait_for(lambda: len(app.acked) >= len(got) + 30, 30, "30 more events published")
            acked = {receipt.offset for receipt in app.acked.values()}
            # While the replica is still hung: the reader must not wait for it to return.
            wait_for(lambda: set(got) >= acked, 30, "the reader got every acknowledged event")
        finally:
            app.stop.set()
            app.join(30)
            if paused is not None:
                os.kill(paused, signal.SIGCONT)
        assert app.error is None, repr(app.error)
        acked = {receipt.offset for receipt in app.acked.values()}
        wait_for(lambda: set(got) >= acked, 30, "the reader got every acknowledged event")
        subscription.close()
        reader.join(10)
        publisher.close()
    assert got == list(range(len(got))), got
    assert subscription.reconnects > before_kill
    assert "replica has not answered for" in one_fate.log("coordinator", first)


# A replication heartbeat a hundred times the default, with the timeouts it bounds raised
# to match: a slave hears of a commit from a heartbeat at most every ten seconds. (The
# configuration allows a minute, but the election waits out member_timeout_ms, at least
# two heartbeats, when two coordinators invite the same node at start.)
SLOW_HEARTBEATS = {
    "heartbeat_interval_ms": 10_000,
    "member_timeout_ms": 20_000,
    "replica_timeout_ms": 20_000,
    "store_stall_timeout_ms": 20_000,
}
# How long each event may take to reach the slave's follower: far below the heartbeat
# interval, and the three waits below fit inside one interval, so at most one of their
# events could have ridden a heartbeat.
_NOTICE_WAIT_S = 2.5


def test_a_follower_on_a_slave_gets_each_event_without_waiting_for_a_heartbeat(
    cluster_factory: object,
) -> None:
    """Sparse publishing (one event at a time) to a slave's following reader: the slave
    says it serves one, so the master tells it each commit as soon as it moves, instead of
    at the next heartbeat (ten seconds here) or the next publish's batch."""
    cluster = cluster_factory("cluster.example.toml", timeouts=dict(SLOW_HEARTBEATS))  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all(wait_for_master=False)
    master = cluster.wait_for_master(timeout_s=120)
    reader = _slaves(cluster, master)[0]
    with squall.connect(cluster.gateway_address, timeout_s=10) as client:
        client.create_topic("sparse")
    sequence = 0

    def publish() -> None:
        nonlocal sequence
        sequence += 1
        with grpc.insecure_channel(cluster.replica_address(master)) as channel:
            broker_pb2_grpc.PublisherStub(channel).Publish(
                _request("sparse", "web", sequence, [10]), timeout=10
            )

    # Event 0's commit reaches the slave with event 1's batch: a follower that reads it is
    # open (counted) on the slave. (Event 1's commit too, when the slave lagged and its
    # batch left after the other slave's ack had committed event 1.)
    publish()
    publish()
    follower = _Follower(cluster.replica_address(reader), "sparse")
    follower.start()
    try:
        _until_read(follower, ([0], [0, 1]), 20, "the slave's follower reads event 0")
        # Event 1 may wait for a commit the slave has not heard of; event 2's ack says the
        # slave has a follower, and the commit comes at once, then each later one.
        for last in (2, 3, 4):
            publish()
            _until_read(
                follower,
                (list(range(last + 1)),),
                _NOTICE_WAIT_S,
                f"the slave's follower reads event {last} before a heartbeat could carry it",
            )
    finally:
        follower.close()


def _until_read(
    follower: _Follower, expected: tuple[list[int], ...], timeout_s: float, what: str
) -> None:
    """Waits until the follower has read one of the expected offset lists; fails at once
    if its stream ended, and says what it had read otherwise."""
    try:
        wait_for(
            lambda: follower.offsets() in expected or follower.error is not None, timeout_s, what
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; it read offsets {follower.offsets()}") from None
    assert follower.error is None, f"{what}: its stream ended: {follower.error!r}"
