"""Replication across three real nodes: acknowledged writes survive the master's kill -9.

Goal: what ack-tracked replication promises a publisher — an acknowledged event is held
by a majority, so when the master dies mid-flight the new master has it at the same
offset, the restarted node catches up, and every replica ends with the same events — and
that a slave obeys only the master of its current epoch.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator

import grpc
import pytest

from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from tests.integration.conftest import LocalCluster
from tests.integration.conftest import wait_for as _wait_for

_RETRIED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


@pytest.fixture
def trio(cluster_factory: object) -> LocalCluster:
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    return cluster


def _call_with_retry(call: object, request: object, deadline_s: float) -> object:
    """Retries an indeterminate call with the same request until deadline_s passes."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call(request, timeout=5)  # type: ignore[operator]
        except grpc.RpcError as exc:
            if exc.code() not in _RETRIED or time.monotonic() > deadline:  # type: ignore[attr-defined]
                raise
        time.sleep(0.05)  # backoff between retries, not synchronisation


class _Publisher(threading.Thread):
    """Publishes numbered events through the gateway, retrying with the same sequence."""

    def __init__(self, address: str, topic: str, publisher_id: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.topic = topic
        self.publisher_id = publisher_id
        self.stop = threading.Event()
        self.acked: dict[bytes, int] = {}  # payload -> offset
        self.holders: list[int] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def count(self) -> int:
        with self._lock:
            return len(self.acked)

    def run(self) -> None:
        sequence = 1
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = broker_pb2_grpc.PublisherStub(channel)
                # Bounded: the test stops it within its own deadline.
                for _ in range(100_000):
                    if self.stop.is_set():
                        return
                    events = [
                        common_pb2.EventData(
                            payload=f"{self.publisher_id}-{sequence + i}".encode(),
                            sequence=sequence + i,
                        )
                        for i in range(5)
                    ]
                    request = broker_pb2.PublishRequest(
                        topic=self.topic, publisher_id=self.publisher_id, events=events
                    )
                    response = _call_with_retry(stub.Publish, request, deadline_s=20)
                    assert isinstance(response, broker_pb2.PublishResponse)
                    with self._lock:
                        for event, receipt in zip(events, response.receipts, strict=True):
                            self.acked[event.payload] = receipt.offset
                            self.holders.append(len(receipt.holders))
                    sequence += len(events)
        except BaseException as exc:  # reported by the test
            self.error = exc


def _read_replica(address: str, topic: str, timeout_s: float = 10) -> list[tuple[int, bytes]]:
    """Every committed event one replica serves (a non-follow subscription)."""
    with grpc.insecure_channel(address) as channel:
        subscriber = broker_pb2_grpc.SubscriberStub(channel)
        events: list[tuple[int, bytes]] = []
        try:
            for response in subscriber.Subscribe(
                broker_pb2.SubscribeRequest(
                    topic=topic,
                    start=broker_pb2.START_POSITION_EARLIEST,
                    # Within the client's default 4 MiB message limit for large events.
                    max_batch_events=256,
                ),
                timeout=timeout_s,
            ):
                events.extend((e.offset, e.payload) for e in response.events)
        except grpc.RpcError:
            return []  # not reachable or the topic not there yet
        return events


def _stop_and_check_every_replica(
    cluster: LocalCluster, publishers: list[_Publisher], topic: str
) -> None:
    """Stops the publishers, then waits until every replica holds every acknowledged
    event at its offset and all replicas serve the same events."""
    for publisher in publishers:
        publisher.stop.set()
    for publisher in publishers:
        publisher.join(timeout=30)
        assert publisher.error is None, repr(publisher.error)
    expected = {offset: payload for p in publishers for payload, offset in p.acked.items()}
    assert len(expected) == sum(p.count() for p in publishers), "two events at one offset"

    def every_replica_holds_every_ack() -> bool:
        views = [
            dict(_read_replica(cluster.replica_address(n.id), topic)) for n in cluster.config.nodes
        ]
        return all(
            all(view.get(offset) == payload for offset, payload in expected.items())
            for view in views
        ) and all(view == views[0] for view in views)

    _wait_for(every_replica_holds_every_ack, 30, "every replica holds every acknowledged event")


@pytest.fixture
def publishers(trio: LocalCluster) -> Iterator[list[_Publisher]]:
    started: list[_Publisher] = []
    yield started
    for publisher in started:
        publisher.stop.set()
    for publisher in started:
        publisher.join(timeout=30)


def test_acknowledged_events_survive_a_master_kill_on_every_replica(
    trio: LocalCluster, publishers: list[_Publisher]
) -> None:
    assert trio.wait_for_master() == "n1"
    with trio.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        _call_with_retry(
            topics.CreateTopic, broker_pb2.CreateTopicRequest(name="replicated"), deadline_s=10
        )
    publishers.extend(_Publisher(trio.gateway_address, "replicated", f"pub{i}") for i in range(2))
    for publisher in publishers:
        publisher.start()

    def acked() -> int:
        return sum(p.count() for p in publishers)

    _wait_for(lambda: acked() >= 100, 15, "100 events acknowledged by the first master")
    # Acks=majority of three: every acknowledged event was held by the master and a slave.
    assert min(min(p.holders) for p in publishers if p.holders) >= 2
    trio.kill_node("n1")
    before = acked()
    assert trio.wait_for_master(exclude="n1") in ("n2", "n3")
    _wait_for(lambda: acked() >= before + 100, 20, "100 more events after the failover")
    trio.start_node("n1")
    _wait_for(
        lambda: trio.replica_role("n1") in (common_pb2.ROLE_MASTER, common_pb2.ROLE_SLAVE),
        20,
        "n1 rejoined the group",
    )
    before = acked()
    _wait_for(lambda: acked() >= before + 50, 20, "50 more events after n1 rejoined")
    _stop_and_check_every_replica(trio, publishers, "replicated")
    views = [_read_replica(trio.replica_address(n.id), "replicated") for n in trio.config.nodes]
    offsets = [offset for offset, _ in views[0]]
    assert offsets == list(range(len(offsets))), "a replica's offsets have a gap"


def test_a_slave_refuses_a_stream_from_an_older_epoch(trio: LocalCluster) -> None:
    master = trio.wait_for_master()
    slave = next(n.id for n in trio.config.nodes if n.id != master)
    with grpc.insecure_channel(trio.replica_address(slave)) as channel:
        control = replica_pb2_grpc.ReplicaControlStub(channel)
        _wait_for(
            lambda: (
                control.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=5).role
                == common_pb2.ROLE_SLAVE
            ),
            10,
            f"{slave} follows {master}",
        )
        state = control.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=5)
        assert state.epoch >= 1
        stream = replica_pb2_grpc.ReplicationStub(channel)
        entry_op = replica_pb2.Operation(
            destroy_topic=replica_pb2.DestroyTopicOp(name="nothing")
        ).SerializeToString()
        stale = [
            replica_pb2.ReplicateRequest(
                hello=replica_pb2.ReplicationHello(
                    master_id=master, epoch=state.epoch - 1, cluster_id=state.cluster_id
                )
            ),
            replica_pb2.ReplicateRequest(
                entries=replica_pb2.EntryBatch(
                    epoch=state.epoch - 1,
                    entries=[
                        replica_pb2.LogEntry(
                            lsn=state.last_lsn + 1,
                            epoch=state.epoch - 1,
                            checksum=zlib.crc32(entry_op),
                            operation=entry_op,
                        )
                    ],
                )
            ),
        ]
        with pytest.raises(grpc.RpcError) as raised:
            list(stream.Replicate(iter(stale), timeout=5))
        error = raised.value
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        details = error.details() or ""  # type: ignore[attr-defined]
        assert slave in details and f"epoch {state.epoch}" in details, details
        trailing = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
        assert trailing.get("squall-epoch") == str(state.epoch)
        # A Hello naming the wrong master of the current epoch is refused too.
        impostor = next(n.id for n in trio.config.nodes if n.id not in (master, slave))
        hello = replica_pb2.ReplicateRequest(
            hello=replica_pb2.ReplicationHello(
                master_id=impostor, epoch=state.epoch, cluster_id=state.cluster_id
            )
        )
        with pytest.raises(grpc.RpcError) as raised:
            list(stream.Replicate(iter([hello]), timeout=5))
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        after = control.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=5)
        assert after.last_lsn >= state.last_lsn
        assert (after.role, after.epoch, after.master_id) == (
            common_pb2.ROLE_SLAVE,
            state.epoch,
            master,
        )


# --- flow control and catch-up (a stopped slave, a compacted log)


def _state(address: str) -> replica_pb2.ReplicaState:
    with grpc.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.ReplicaControlStub(channel)
        state = stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=5)
        assert isinstance(state, replica_pb2.ReplicaState)
        return state


def _rss_anon_kb(pid: int) -> int:
    """A process's anonymous resident memory (heap, stacks), in KiB.

    VmRSS also counts the LMDB map's file pages the process touched, which grow with the
    data written and are the page cache's to reclaim; a leak shows in RssAnon.
    """
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def _started_trio(cluster_factory: object, **overrides: dict[str, object]) -> LocalCluster:
    cluster = cluster_factory("cluster.example.toml", **overrides)  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    return cluster


def _slave_of(cluster: LocalCluster, master: str) -> str:
    slave = next(n.id for n in cluster.config.nodes if n.id != master)
    _wait_for(
        lambda: cluster.replica_role(slave) == common_pb2.ROLE_SLAVE, 15, f"{slave} is a slave"
    )
    return slave


def _request(topic: str, publisher_id: str, sequence: int, sizes: list[int]) -> object:
    return broker_pb2.PublishRequest(
        topic=topic,
        publisher_id=publisher_id,
        events=[
            common_pb2.EventData(
                payload=f"{publisher_id}-{sequence + i}-".encode().ljust(size, b"x"),
                sequence=sequence + i,
            )
            for i, size in enumerate(sizes)
        ],
    )


def _caught_up(cluster: LocalCluster, master: str, node_id: str) -> bool:
    try:
        target = _state(cluster.replica_address(master)).last_lsn
        return _state(cluster.replica_address(node_id)).last_lsn >= target
    except grpc.RpcError:
        return False


_LIMITS = {
    # A small window, so a stopped slave's share of the master's memory is small next to
    # what the test publishes.
    "replication_inflight_bytes_max": 1 << 20,
}


# These tests stop a slave's replica process alone to get a slave that cannot keep up yet
# stays a member of the group: its node must not leave, which with the default
# replica_timeout_ms it would after 0.3 s (one fate per node: tests/integration/
# test_node_fate.py covers that). What they look at is the replication layer's flow
# control for a member that does not acknowledge.
STUCK_SLAVE_STAYS = {"replica_timeout_ms": 60_000}


def test_a_stopped_slave_with_majority_acks_neither_stalls_publishers_nor_grows_memory(
    cluster_factory: object,
) -> None:
    trio = _started_trio(cluster_factory, limits=dict(_LIMITS), timeouts=dict(STUCK_SLAVE_STAYS))
    master = trio.wait_for_master()
    slave = _slave_of(trio, master)
    slave_pid = trio.services[("replica", slave)].pid
    master_pid = trio.services[("replica", master)].pid
    event_bytes, per_request, requests = 8192, 8, 512  # 32 MiB of events
    published_mb = event_bytes * per_request * requests / (1 << 20)
    offsets: dict[bytes, int] = {}
    with trio.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        _call_with_retry(topics.CreateTopic, broker_pb2.CreateTopicRequest(name="t"), 10)
        sequence = 1
        # Warm-up: the master's buffers reach their working size before the baseline.
        for _ in range(64):
            request = _request("t", "p", sequence, [event_bytes] * per_request)
            response = _call_with_retry(publisher.Publish, request, 20)
            assert isinstance(response, broker_pb2.PublishResponse)
            sequence += per_request
        before_kb = _rss_anon_kb(master_pid)
        os.kill(slave_pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(requests):
                request = _request("t", "p", sequence, [event_bytes] * per_request)
                response = _call_with_retry(publisher.Publish, request, 20)
                assert isinstance(response, broker_pb2.PublishResponse)
                for event, receipt in zip(request.events, response.receipts, strict=True):  # type: ignore[attr-defined]
                    offsets[event.payload] = receipt.offset
                    # Held by the master and the live slave: the stopped one never counts.
                    assert slave not in [h.node_id for h in receipt.holders]
                sequence += per_request
            elapsed_s = time.monotonic() - started
            grown_mb = (_rss_anon_kb(master_pid) - before_kb) / 1024
            status = {s.node_id: s for s in _state(trio.replica_address(master)).slaves}
            assert status[slave].lag_entries >= requests // 2, status[slave]
            # The gateway's cluster status carries the master's view of its slaves.
            admin = gateway_pb2_grpc.ClusterAdminStub(channel)
            rows = admin.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=5).nodes
            (master_row,) = [row for row in rows if row.node_id == master]
            lags = {p.node_id: p.lag_entries for p in master_row.slaves}
            assert lags[slave] >= requests // 2 and set(lags) == {
                n.id for n in trio.config.nodes if n.id != master
            }
        finally:
            os.kill(slave_pid, signal.SIGCONT)
    # Publishing went on while the slave was stopped, and the master's memory did not take
    # in what it could not send: a window's worth at most, not the 32 MiB published.
    assert elapsed_s < 60
    assert grown_mb < published_mb / 4, f"master grew {grown_mb:.1f} MiB of {published_mb} MiB"
    _wait_for(lambda: _caught_up(trio, master, slave), 60, f"{slave} caught up after SIGCONT")

    def holds_every_ack() -> bool:
        held = dict(_read_replica(trio.replica_address(slave), "t", timeout_s=30))
        return all(held.get(offset) == payload for payload, offset in offsets.items())

    _wait_for(holds_every_ack, 30, f"{slave} holds every acknowledged event")


def test_a_stopped_slave_with_all_acks_holds_publishers_back_until_it_resumes(
    cluster_factory: object,
) -> None:
    trio = _started_trio(
        cluster_factory,
        limits=dict(_LIMITS),
        durability={"acks": "group"},
        timeouts=dict(STUCK_SLAVE_STAYS),
    )
    master = trio.wait_for_master()
    slave = _slave_of(trio, master)
    slave_pid = trio.services[("replica", slave)].pid
    master_address = trio.replica_address(master)
    with grpc.insecure_channel(master_address) as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        _call_with_retry(topics.CreateTopic, broker_pb2.CreateTopicRequest(name="t"), 10)
        _call_with_retry(publisher.Publish, _request("t", "p", 1, [100]), 20)
        stalled = _request("t", "p", 2, [100])
        os.kill(slave_pid, signal.SIGSTOP)
        try:
            # Straight to the master (no gateway retries): no receipt while a member of
            # the group cannot acknowledge.
            with pytest.raises(grpc.RpcError) as raised:
                publisher.Publish(stalled, timeout=2)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
            assert _state(master_address).commit_lsn < _state(master_address).last_lsn
        finally:
            os.kill(slave_pid, signal.SIGCONT)
    # Resumed: the same request (same publisher id and sequence) is answered, once.
    with trio.channel() as channel:
        publisher = broker_pb2_grpc.PublisherStub(channel)
        response = _call_with_retry(publisher.Publish, stalled, 60)
        assert isinstance(response, broker_pb2.PublishResponse)
        after = _call_with_retry(publisher.Publish, _request("t", "p", 3, [100]), 60)
        assert isinstance(after, broker_pb2.PublishResponse)
        assert after.receipts[0].offset == response.receipts[0].offset + 1


def test_a_slave_behind_the_compacted_log_catches_up_by_snapshot_then_the_tail(
    cluster_factory: object,
) -> None:
    # The smallest retention the configuration allows: one commit batch (256 entries).
    trio = _started_trio(cluster_factory, limits={"log_retention_entries": 256})
    master = trio.wait_for_master()
    victim = next(n.id for n in trio.config.nodes if n.id != master)
    acked: dict[bytes, int] = {}

    def publish(publisher: object, sequence: int, count: int) -> int:
        for _ in range(count):
            request = _request("t", "p", sequence, [100] * 4)
            response = _call_with_retry(publisher.Publish, request, 30)  # type: ignore[attr-defined]
            assert isinstance(response, broker_pb2.PublishResponse)
            for event, receipt in zip(request.events, response.receipts, strict=True):  # type: ignore[attr-defined]
                acked[event.payload] = receipt.offset
            sequence += 4
        return sequence

    with trio.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        _call_with_retry(topics.CreateTopic, broker_pb2.CreateTopicRequest(name="t"), 10)
        sequence = publish(publisher, 1, 50)
        trio.kill_node(victim)
        sequence = publish(publisher, sequence, 1000)  # 1,000 entries: 4x the retention
        master = trio.wait_for_master(exclude=victim)
        assert _state(trio.replica_address(master)).log_start_lsn > 600
        trio.start_node(victim)
        # Writes go on while it catches up: the snapshot is followed by the log tail.
        sequence = publish(publisher, sequence, 100)
        _wait_for(lambda: _caught_up(trio, master, victim), 60, f"{victim} caught up")
    # A staged install reports the replica's old log start until its swap is done (CI once
    # read log_start_lsn 1 with last_lsn already at the master's): wait for the swap.
    _wait_for(
        lambda: _state(trio.replica_address(victim)).log_start_lsn > 1,
        30,
        f"{victim} to catch up from a snapshot (its log to start past LSN 1)",
    )
    assert "installed the snapshot at LSN" in trio.log("replica", victim)
    assert f"sending node {victim} a snapshot" in trio.log("replica", master)

    def holds_every_ack() -> bool:
        view = dict(_read_replica(trio.replica_address(victim), "t"))
        return all(view.get(offset) == payload for payload, offset in acked.items())

    _wait_for(holds_every_ack, 30, f"{victim} holds every acknowledged event")
    views = [_read_replica(trio.replica_address(n.id), "t") for n in trio.config.nodes]
    assert all(view == views[0] for view in views[1:])


def test_a_deposed_master_with_a_compacted_divergent_log_takes_the_lead_back_after_catching_up(
    cluster_factory: object,
) -> None:
    """n1 (highest priority) keeps an uncommitted suffix when it dies, every log is
    compacted meanwhile, and n1 comes back. It does not lead at once: the serving master
    takes it in as a slave, whose divergent compacted log cannot be truncated by replay, so
    the master streams it a snapshot while it goes on committing. Only then is the group
    handed over to n1 (the election's catch-up rule), which leads with nothing left to
    fetch; every acknowledged event is on every replica."""
    trio = _started_trio(cluster_factory, limits={"log_retention_entries": 256})
    assert trio.wait_for_master() == "n1"
    slaves = ["n2", "n3"]
    for slave in slaves:
        _wait_for(
            lambda: trio.replica_role(slave) == common_pb2.ROLE_SLAVE,  # noqa: B023
            15,
            f"{slave} is a slave",
        )
    acked: dict[bytes, int] = {}

    def publish(publisher: object, sequence: int, count: int) -> int:
        for _ in range(count):
            request = _request("t", "p", sequence, [100] * 4)
            response = _call_with_retry(publisher.Publish, request, 30)  # type: ignore[attr-defined]
            assert isinstance(response, broker_pb2.PublishResponse)
            for event, receipt in zip(request.events, response.receipts, strict=True):  # type: ignore[attr-defined]
                acked[event.payload] = receipt.offset
            sequence += 4
        return sequence

    with trio.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        _call_with_retry(topics.CreateTopic, broker_pb2.CreateTopicRequest(name="t"), 10)
        sequence = publish(publisher, 1, 400)  # 400 entries: n1's log is compacted
    _wait_for(lambda: all(_caught_up(trio, "n1", s) for s in slaves), 30, "slaves caught up")
    assert _state(trio.replica_address("n1")).log_start_lsn > 1
    # The divergent suffix: with both slaves' replicas stopped, n1 stores these requests
    # but cannot commit them (never acknowledged: they time out).
    pids = [trio.services[("replica", s)].pid for s in slaves]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with grpc.insecure_channel(trio.replica_address("n1")) as channel:
            direct = broker_pb2_grpc.PublisherStub(channel)
            pending = [
                direct.Publish.future(_request("t", "lost", 1 + 4 * i, [100] * 4), timeout=2)
                for i in range(3)
            ]
            for future in pending:
                with pytest.raises(grpc.RpcError):
                    future.result()
            n1 = _state(trio.replica_address("n1"))
        assert n1.last_lsn > n1.commit_lsn, "n1 was expected to hold an uncommitted suffix"
        trio.kill_node("n1")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    new_master = trio.wait_for_master(timeout_s=30, exclude="n1")
    with trio.channel() as channel:
        publisher = broker_pb2_grpc.PublisherStub(channel)
        # 400 entries more: every survivor's log starts above what n1 lacks.
        sequence = publish(publisher, sequence, 400)
    _wait_for(
        lambda: all(
            _state(trio.replica_address(s)).log_start_lsn > n1.last_lsn + 1 for s in slaves
        ),
        30,
        "both survivors compacted their logs past n1's",
    )
    trio.start_node("n1")

    def n1_leads() -> bool:
        status = trio.statuses().get("n1")
        return (
            status is not None
            and status.state == common_pb2.NODE_STATE_NORMAL
            and status.coordinator_id == "n1"
            and trio.replica_role("n1") == common_pb2.ROLE_MASTER
        )

    _wait_for(n1_leads, 60, "n1 is master again after catching up as a slave")
    leads = "replica n1 is master: epoch="

    def led_after_the_install() -> bool:
        # The role shows before the line is written (after the epoch's entry is appended).
        log = trio.log("replica", "n1")
        installed = log.rfind("installed the snapshot at LSN")
        return installed >= 0 and log.find(leads, installed) >= 0

    _wait_for(led_after_the_install, 10, "n1's log says it leads after the snapshot")
    replica_log = trio.log("replica", "n1")
    restarted = replica_log.rfind("replica n1 opened store:")
    installed = replica_log.rfind("installed the snapshot at LSN")
    assert replica_log[installed:].split("\n", 1)[0].find(f"from master {new_master}") >= 0, (
        "n1 was to install the snapshot as a slave of the serving master, not while leading"
    )
    assert 0 <= restarted < installed
    assert leads not in replica_log[restarted:installed], "n1 led before it caught up"
    assert "it needs a snapshot" not in replica_log, "a truncation by replay was attempted"
    assert _state(trio.replica_address("n1")).log_start_lsn > n1.last_lsn
    assert "sending node n1 a snapshot" in trio.log("replica", new_master)
    coordinator_log = trio.log("coordinator", new_master)
    assert "joined" in coordinator_log and "handing the group over to it" in coordinator_log
    with trio.channel() as channel:
        publisher = broker_pb2_grpc.PublisherStub(channel)
        publish(publisher, sequence, 20)  # the group commits under n1

    def every_replica_holds_every_ack() -> bool:
        views = [dict(_read_replica(trio.replica_address(n.id), "t")) for n in trio.config.nodes]
        return all(
            all(view.get(offset) == payload for payload, offset in acked.items()) for view in views
        ) and all(view == views[0] for view in views)

    _wait_for(every_replica_holds_every_ack, 30, "every replica holds every acknowledged event")


def _current_master(cluster: LocalCluster, timeout_s: float = 20) -> str:
    return cluster.wait_for_master(timeout_s=timeout_s)


def _all_three_in_one_group(cluster: LocalCluster) -> str:
    """Waits until every node is NORMAL under one coordinator whose replica is master."""

    def settled() -> bool:
        statuses = cluster.statuses()
        coordinators = {s.coordinator_id for s in statuses.values()}
        return (
            len(statuses) == 3
            and len(coordinators) == 1
            and all(s.state == common_pb2.NODE_STATE_NORMAL for s in statuses.values())
            and cluster.replica_role(coordinators.pop()) == common_pb2.ROLE_MASTER
        )

    _wait_for(settled, 30, "all three nodes in one normal group")
    return cluster.wait_for_master()


def test_repeated_master_kills_and_a_paused_slave_lose_no_acknowledged_event(
    trio: LocalCluster, publishers: list[_Publisher]
) -> None:
    """kill -9 whoever is master three times, SIGSTOP/SIGCONT a slave, restart every victim:
    every acknowledged event ends on every replica at its offset, and the stores agree."""
    trio.wait_for_master()
    with trio.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        _call_with_retry(
            topics.CreateTopic, broker_pb2.CreateTopicRequest(name="churn"), deadline_s=10
        )
    publishers.extend(_Publisher(trio.gateway_address, "churn", f"churn{i}") for i in range(2))
    for publisher in publishers:
        publisher.start()

    def acked() -> int:
        return sum(p.count() for p in publishers)

    for round_ in range(3):
        target = acked() + 50
        _wait_for(lambda: acked() >= target, 30, f"50 events acknowledged in round {round_}")  # noqa: B023
        victim = _current_master(trio)
        trio.kill_node(victim)
        _current_master(trio)  # a new master among the survivors
        trio.start_node(victim)
        if round_ == 1:
            # With all three back, pause one slave: the master and the other slave are
            # still a majority, so publishing goes on while it is stopped.
            master = _all_three_in_one_group(trio)
            slave = _slave_of(trio, master)
            pid = trio.services[("replica", slave)].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                resume_at = acked() + 20
                _wait_for(lambda: acked() >= resume_at, 30, "publishing past a paused slave")  # noqa: B023
            finally:
                os.kill(pid, signal.SIGCONT)
    _all_three_in_one_group(trio)
    final = acked()
    _wait_for(lambda: acked() >= final + 50, 30, "50 events acknowledged after the last restart")
    _stop_and_check_every_replica(trio, publishers, "churn")
