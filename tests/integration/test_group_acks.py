"""`acks = "group"` on real processes: a member that cannot hold the log holds no write back.

Under `group` a commit waits for a majority and for every member that has caught up. A
slave whose store fills (its map full: each batch refused with RESOURCE_EXHAUSTED, reads
still served) cannot hold what comes next; before, every write waited for it until an
operator freed room, since it still answered and was never dropped. The chaos suite
found it (seed 57 under `--acks group`: no acknowledgement for the whole 4.4 s the fault
lasted). Now the master stops waiting for it until it has caught up again, receipts name
the nodes that hold each event, and once room is back it catches up and is waited for
again; every acknowledged event is readable at its receipt's offset.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import squall
from squall.v1 import replica_pb2, replica_pb2_grpc
from tests.integration.conftest import wait_for
from tests.integration.test_stuck_disk import _FaultControlledCluster

# Bounds on the waits: a loaded 2-core machine is slow, never wrong.
_WAIT_S = 60.0


@pytest.fixture
def controlled(tmp_path: Path) -> Iterator[_FaultControlledCluster]:
    """Three nodes under acks group whose replicas read a fault-control file each."""
    cluster = _FaultControlledCluster.three_nodes(tmp_path, durability={"acks": "group"})
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


def _slaves(cluster: _FaultControlledCluster, master: str) -> dict[str, object]:
    with grpc.insecure_channel(cluster.replica_address(master)) as channel:
        state = replica_pb2_grpc.ReplicaControlStub(channel).GetReplicaState(
            replica_pb2.GetReplicaStateRequest(), timeout=5
        )
    return {s.node_id: s for s in state.slaves}


def _holders(receipt: squall.Receipt) -> set[str]:
    return {h.node_id for h in receipt.holders}


def test_under_acks_group_a_slave_whose_store_fills_holds_no_write_back(
    controlled: _FaultControlledCluster,
) -> None:
    master = controlled.wait_for_master()
    full, other = (n.id for n in controlled.config.nodes if n.id != master)
    everyone = {master, full, other}
    acked: dict[str, squall.Receipt] = {}
    with squall.connect(controlled.gateway_address, timeout_s=20) as client:
        client.create_topic("orders")
        with client.topic("orders").publisher() as publisher:

            def publish(label: str) -> squall.Receipt:
                receipt = publisher.publish(label.encode())
                acked[label] = receipt
                return receipt

            wait_for(
                lambda: _holders(publish(f"before-{len(acked)}")) == everyone,
                _WAIT_S,
                "a receipt naming all three nodes",
            )
            controlled.set_fault_control(full, map_full=True)
            wait_for(
                lambda: (
                    bool(publish(f"filling-{len(acked)}"))
                    and "map_full=True" in controlled.log("replica", full)
                ),
                _WAIT_S,
                f"{full} injects a full store",
            )
            # Every publish is acknowledged, by the master and the other slave.
            during = [publish(f"during-{i}") for i in range(30)]
            assert _holders(during[-1]) == {master, other}, during[-1]
            assert _slaves(controlled, master)[full].catching_up
            assert "cannot store the log" in controlled.log("replica", master)
            controlled.set_fault_control(full, map_full=False)
            deadline = time.monotonic() + _WAIT_S
            after = publish("after-0")
            while _holders(after) != everyone and time.monotonic() < deadline:
                time.sleep(0.02)
                after = publish(f"after-{len(acked)}")
            assert _holders(after) == everyone, f"{full} did not catch up: {after}"
            assert not _slaves(controlled, master)[full].catching_up
    with (
        squall.connect(controlled.gateway_address, timeout_s=20) as client,
        client.topic("orders").subscribe(start=0, follow=False) as subscription,
    ):
        stored = {m.offset: m.payload for m in subscription}
    missing = [label for label, r in acked.items() if stored.get(r.offset) != label.encode()]
    assert not missing, f"acknowledged events not at their offsets: {missing[:5]}"
