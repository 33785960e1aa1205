"""Quarantine with real processes: a flipped byte on one slave's disk, found when the slave
serves a read, takes that node out of the cluster until an operator clears it.

Goal: after the damaged record is read, n3 reports the fault to its coordinator, which
quarantines it: n3 leaves the group (the master's group is n1,n2: n3 never counts for
acks), writes go on with the majority, `squall status` shows who quarantined it, when and
why, and the quarantine is persisted. The operator repairs the store (moves the damaged
files away), clears the quarantine, and n3 rejoins and is brought up to date with every
event.

A master whose own log fails its checksum where a lagging slave needs it reports the
fault too: its coordinator quarantines it, the next node leads from its sound copy and
brings the slave up to date with every acknowledged event.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import grpc
import lmdb
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2, replica_pb2, replica_pb2_grpc
from squall_server.replica.faults import FAULT_FILE_NAME
from squall_server.replica.store import DATABASES, Store
from tests.integration.conftest import LocalCluster, run_squall, stored_events, wait_for
from tests.integration.test_gateway import trio  # noqa: F401  (the fixture)

_EVENTS = 50


def _read_all(address: str, topic: str) -> list[common_pb2.Event]:
    """Every committed event of topic, read from one replica (raises grpc.RpcError)."""
    events: list[common_pb2.Event] = []
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=topic, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=10,
        )
        for response in stream:
            events.extend(response.events)
    return events


@contextlib.contextmanager
def _second_handle(cluster: LocalCluster, node_id: str) -> Iterator[lmdb.Environment]:
    """A second handle on node_id's LMDB environment, live or not (LMDB allows one writer
    across processes; a running replica reads the pages from the shared map)."""
    env = lmdb.open(
        str(cluster.config.node(node_id).data_dir),
        max_dbs=len(DATABASES),
        map_size=cluster.config.limits.map_size_bytes,
    )
    try:
        yield env
    finally:
        env.close()


def _flip_a_byte_in_an_event(cluster: LocalCluster, node_id: str) -> None:
    """Damages the first stored event record of node_id's store, as bit rot would."""
    with _second_handle(cluster, node_id) as env:
        events = env.open_db(b"events", create=False)
        with env.begin(write=True, db=events) as txn:
            cursor = txn.cursor()
            assert cursor.first(), "no event stored"
            key, value = cursor.item()
            txn.put(key, value[:-1] + bytes([value[-1] ^ 0x40]))


def _flip_a_byte_in_a_log_entry(cluster: LocalCluster, node_id: str, lsn: int) -> None:
    """Damages node_id's log entry at lsn, as bit rot would."""
    with _second_handle(cluster, node_id) as env:
        log_db = env.open_db(b"log", create=False)
        with env.begin(write=True, db=log_db) as txn:
            key = lsn.to_bytes(8, "big")
            value = txn.get(key)
            assert value is not None, f"no log entry at LSN {lsn} on {node_id}"
            txn.put(key, value[:-1] + bytes([value[-1] ^ 0x40]))


def _quarantined(cluster: LocalCluster, node_id: str, within_s: float = 20) -> str:
    """Waits until node_id's coordinator reports it quarantined; the reason."""

    def quarantined() -> bool:
        status = cluster.statuses().get(node_id)
        return status is not None and status.HasField("quarantine")

    wait_for(quarantined, within_s, f"{node_id} quarantined by its coordinator")
    return cluster.statuses()[node_id].quarantine.reason


def _every_receipt_served(
    cluster: LocalCluster, node_ids: tuple[str, ...], published: list[tuple[squall.Receipt, bytes]]
) -> None:
    """Each node serves every published payload at its receipt's offset and LSN (a slave
    serves what it knows committed: the master's next heartbeat tells it the last)."""
    last = max(receipt.offset for receipt, _ in published)
    for node_id in node_ids:
        wait_for(
            lambda n=node_id: len(stored_events(cluster, n, "orders")) > last,
            20,
            f"{node_id} serves every event",
        )
        events = stored_events(cluster, node_id, "orders")
        for receipt, payload in published:
            event = events[receipt.offset]
            assert (event.lsn, event.payload) == (receipt.lsn, payload), node_id


def _holds(cluster: LocalCluster, node_id: str, count: int) -> bool:
    """Does node_id serve exactly count events of the topic (False while it cannot)?"""
    try:
        return len(_read_all(cluster.replica_address(node_id), "orders")) == count
    except grpc.RpcError:
        return False


def test_a_corrupt_record_quarantines_the_slave_until_an_operator_clears_it(
    trio: LocalCluster,  # noqa: F811
) -> None:
    assert trio.wait_for_master() == "n1"
    config = str(trio.config_path)
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        with client.topic("orders").publisher("app-1") as publisher:
            publisher.publish_many([b"order %d" % i for i in range(_EVENTS)])
    wait_for(lambda: _holds(trio, "n3", _EVENTS), 20, "n3 holds every event")

    # Bit rot on n3's disk, found when n3 serves a read.
    _flip_a_byte_in_an_event(trio, "n3")
    with pytest.raises(grpc.RpcError) as damaged:
        _read_all(trio.replica_address("n3"), "orders")
    assert damaged.value.code() == grpc.StatusCode.DATA_LOSS

    _quarantined(trio, "n3", 10)
    n3 = trio.statuses()["n3"]
    assert n3.quarantine.operator == "replica"
    assert "checksum error serving a read" in n3.quarantine.reason
    assert n3.state == common_pb2.NODE_STATE_INACTIVE and n3.role == common_pb2.ROLE_INACTIVE
    wait_for(lambda: list(trio.statuses()["n1"].group) == ["n2"], 10, "the master drops n3")
    assert "QUARANTINED" in trio.log("coordinator", "n3")

    # The majority keeps writing; n3 is not among the replicas that hold the new write.
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        receipt = client.topic("orders").publisher("app-2").publish(b"after")
    assert receipt.master_id == "n1"
    assert "n3" not in {h.node_id for h in receipt.holders}

    status = run_squall("status", "--config", config)
    assert status.returncode == 0, status.stderr
    assert "n3: QUARANTINED by replica at " in status.stdout, status.stdout
    assert "squall cluster unquarantine n3" in status.stdout

    # Persisted (a restart keeps it: tests/unit/test_election_controls.py).
    state = json.loads((trio.config.node("n3").data_dir / "coordinator-state.json").read_text())
    assert state["quarantine"]["operator"] == "replica"

    # Repair: move the damaged store away (the coordinator's state stays), restart the
    # replica empty, clear the quarantine: n3 rejoins and is brought up to date.
    trio.stop("replica", "n3")
    data_dir = trio.config.node("n3").data_dir
    aside = trio.run_dir / "n3-damaged"
    aside.mkdir()
    for name in ("data.mdb", "lock.mdb", FAULT_FILE_NAME):
        (data_dir / name).rename(aside / name)
    trio.start("replica", "n3")
    cleared = run_squall(
        "cluster", "unquarantine", "n3", "--reason", "store rebuilt", "--config", config
    )
    assert cleared.returncode == 0, cleared.stderr
    assert "n3: not quarantined" in cleared.stdout
    wait_for(lambda: "n3" in trio.statuses()["n1"].group, 30, "n3 rejoins the group")
    wait_for(lambda: _holds(trio, "n3", _EVENTS + 1), 30, "n3 holds every event again")
    audit = [(r.operator, r.action) for r in trio.statuses()["n3"].audit]
    assert audit[-2:] == [("replica", "quarantine"), (audit[-1][0], "unquarantine")]


def _last_lsn(cluster: LocalCluster, node_id: str) -> int:
    with cluster.dial(cluster.replica_address(node_id)) as channel:
        state = replica_pb2_grpc.ReplicaControlStub(channel).GetReplicaState(
            replica_pb2.GetReplicaStateRequest(), timeout=5
        )
    return int(state.last_lsn)


def test_a_master_whose_log_fails_its_checksum_for_a_lagging_slave_is_quarantined(
    cluster_factory: object,
) -> None:
    # A small in-flight window keeps the master's tail cache (twice the window) small,
    # so what the slave lacks is read from the store, where the damage is.
    cluster = cluster_factory(  # type: ignore[operator]
        "cluster.example.toml", limits={"replication_inflight_bytes_max": 1024}
    )
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    assert cluster.wait_for_master() == "n1"
    with squall.connect(cluster.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        wait_for(
            lambda: _last_lsn(cluster, "n3") == _last_lsn(cluster, "n1"), 20, "n3 has the topic"
        )
        cluster.kill("replica", "n3")  # down (OOM-killed, say) while events are acknowledged
        lagging = _last_lsn(cluster, "n1")
        with client.topic("orders").publisher("app-1") as publisher:
            receipts = [publisher.publish(b"order %d" % i) for i in range(20)]
    assert {r.master_id for r in receipts} == {"n1"}

    # Bit rot in n1's log entry just above n3's end (the replica reads the page from the
    # shared map).
    _flip_a_byte_in_a_log_entry(cluster, "n1", lagging + 1)

    cluster.start("replica", "n3")

    reason = _quarantined(cluster, "n1")
    assert "checksum error reading the log for node n3" in reason, reason
    assert cluster.wait_for_master(exclude="n1") == "n2"
    wait_for(lambda: _last_lsn(cluster, "n3") >= _last_lsn(cluster, "n2"), 30, "n3 caught up")
    with squall.connect(cluster.gateway_address, timeout_s=5.0) as client:
        after = client.topic("orders").publisher("app-2").publish(b"after")
    assert after.master_id == "n2"
    published = [(r, b"order %d" % i) for i, r in enumerate(receipts)] + [(after, b"after")]
    _every_receipt_served(cluster, ("n2", "n3"), published)
    assert "FAULT: checksum error reading the log for node n3" in cluster.log("replica", "n1")


def test_a_replica_whose_uncommitted_tail_fails_its_checksum_starts_and_is_quarantined(
    cluster_factory: object,
) -> None:
    """A replica rebuilds, at start-up, which publishes above its recorded commit LSN to
    hide; one of those entries fails its checksum. It used to exit (its coordinator saw it
    down and not why); now it starts, reports the fault, is quarantined with the reason,
    refuses reads and roles, and the others serve every acknowledged event."""
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    assert cluster.wait_for_master() == "n1"
    with squall.connect(cluster.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        with client.topic("orders").publisher("app-1") as publisher:
            receipts = [publisher.publish(b"order %d" % i) for i in range(20)]
    wait_for(
        lambda: _last_lsn(cluster, "n3") == _last_lsn(cluster, "n1"), 20, "n3 holds every entry"
    )
    cluster.kill("replica", "n3")  # OOM-killed, say
    # Its commit record trailed its log (it is written after the entries), and one of the
    # entries above it rotted.
    store = Store.open_lmdb(
        cluster.config.node("n3").data_dir, cluster.config.limits.map_size_bytes
    )
    try:
        last = store.meta().last_lsn
        store.set_commit_lsn(last - 5, sync=True)
    finally:
        store.close()
    damaged = last - 2
    _flip_a_byte_in_a_log_entry(cluster, "n3", damaged)

    cluster.start("replica", "n3")

    reason = _quarantined(cluster, "n3")
    assert "its log fails its checksum rebuilding the commit gate (start-up)" in reason, reason
    assert f"log at key {damaged:016x}" in reason, reason
    with pytest.raises(grpc.RpcError) as refused:
        _read_all(cluster.replica_address("n3"), "orders")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "replica n3 serves no reads" in str(refused.value.details())

    with squall.connect(cluster.gateway_address, timeout_s=5.0) as client:
        after = client.topic("orders").publisher("app-2").publish(b"after")
    assert after.master_id == "n1"
    published = [(r, b"order %d" % i) for i, r in enumerate(receipts)] + [(after, b"after")]
    _every_receipt_served(cluster, ("n1", "n2"), published)
    assert "FAIL-STOP: its log fails its checksum" in cluster.log("replica", "n3")
