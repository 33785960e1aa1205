"""Quarantine with real processes: a flipped byte on one slave's disk, found when the slave
serves a read, takes that node out of the cluster until an operator clears it.

Goal: after the damaged record is read, n3 reports the fault to its coordinator, which
quarantines it: n3 leaves the group (the master's group is n1,n2: n3 never counts for
acks), writes go on with the majority, `squall status` shows who quarantined it, when and
why, and the quarantine is persisted. The operator repairs the store (moves the damaged
files away), clears the quarantine, and n3 rejoins and is brought up to date with every
event.
"""

from __future__ import annotations

import json

import grpc
import lmdb
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall_server.replica.faults import FAULT_FILE_NAME
from squall_server.replica.store import DATABASES
from tests.integration.conftest import LocalCluster, run_squall, wait_for
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


def _flip_a_byte_in_an_event(cluster: LocalCluster, node_id: str) -> None:
    """Damages the first stored event record of node_id's store, as bit rot would: through
    a second handle on the live LMDB environment (LMDB allows one writer across processes;
    the replica reads the page from the shared map)."""
    env = lmdb.open(
        str(cluster.config.node(node_id).data_dir),
        max_dbs=len(DATABASES),
        map_size=cluster.config.limits.map_size_bytes,
    )
    try:
        events = env.open_db(b"events", create=False)
        with env.begin(write=True, db=events) as txn:
            cursor = txn.cursor()
            assert cursor.first(), "no event stored"
            key, value = cursor.item()
            txn.put(key, value[:-1] + bytes([value[-1] ^ 0x40]))
    finally:
        env.close()


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

    def quarantined() -> bool:
        status = trio.statuses().get("n3")
        return status is not None and status.HasField("quarantine")

    wait_for(quarantined, 10, "n3 quarantined by its coordinator")
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
