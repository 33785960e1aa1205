"""`acks = "group"` on real processes: a member that cannot hold the log holds no write back.

Two ways a member cannot: its store is full, or its replica alone was killed and restarts
behind (its coordinator up all along).

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

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import squall
from squall.v1 import replica_pb2, replica_pb2_grpc
from tests.integration.conftest import wait_for
from tests.integration.test_replication import _read_replica
from tests.integration.test_stuck_disk import _FaultControlledCluster

# Bounds on the waits: a loaded 2-core machine is slow, never wrong.
_WAIT_S = 60.0
# Events published while a slave's replica is down: enough that its catch-up spans many
# one-at-a-time publishes (each a few milliseconds) and the master's state is seen saying
# so, few enough to fill in seconds.
_BEHIND = 100_000


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


def test_under_acks_group_a_slaves_replica_killed_mid_flight_rejoins_behind_without_holding_writes(
    controlled: _FaultControlledCluster,
) -> None:
    """Only the replica dies (an OOM kill, -9) while a publisher publishes one event at a
    time; its coordinator stays up. The others take many more events before the replica
    restarts; then the restarted slave is a member catching up, and publishes go on,
    acknowledged by the master and the other slave, until it has caught up and receipts
    name all three again. Every acknowledged event is at its receipt's offset, on the
    restarted slave too."""
    master = controlled.wait_for_master()
    victim, other = (n.id for n in controlled.config.nodes if n.id != master)
    everyone = {master, victim, other}
    acked: dict[bytes, squall.Receipt] = {}
    answered: list[tuple[float, set[str]]] = []  # (when, holders) of each receipt
    stop = threading.Event()
    errors: list[BaseException] = []

    with squall.connect(controlled.gateway_address, timeout_s=20) as client:
        client.create_topic("orders")
        topic = client.topic("orders")

        def publish_one_at_a_time() -> None:
            try:
                with topic.publisher("one-at-a-time") as publisher:
                    for i in range(1_000_000):  # bounded: stopped long before
                        if stop.is_set():
                            return
                        payload = b"one-%d" % i
                        receipt = publisher.publish(payload)
                        acked[payload] = receipt
                        answered.append((time.monotonic(), _holders(receipt)))
            except BaseException as exc:  # the test reports it
                errors.append(exc)

        worker = threading.Thread(target=publish_one_at_a_time, daemon=True)
        worker.start()
        try:
            wait_for(
                lambda: any(h == everyone for _, h in list(answered)),
                _WAIT_S,
                "a receipt naming all three nodes",
            )
            controlled.kill("replica", victim)
            with topic.publisher("bulk") as bulk:
                for start in range(0, _BEHIND, 10_000):
                    payloads = [b"bulk-%d" % i for i in range(start, start + 10_000)]
                    for payload, receipt in zip(payloads, bulk.publish_many(payloads), strict=True):
                        acked[payload] = receipt
            controlled.start("replica", victim)
            # When the master first names it a member catching up, when it last did (the
            # moment that question was sent: every receipt answered before then was
            # committed while it was still catching up), and when caught up.
            catching_up_at = still_catching_up_at = caught_up_at = 0.0
            deadline = time.monotonic() + _WAIT_S
            while not caught_up_at and time.monotonic() < deadline:
                asked = time.monotonic()
                progress = _slaves(controlled, master).get(victim)
                now = time.monotonic()
                if progress is not None and progress.catching_up:  # type: ignore[attr-defined]
                    catching_up_at = catching_up_at or now
                    still_catching_up_at = asked
                elif progress is not None and catching_up_at:
                    caught_up_at = now
                time.sleep(0.005)
            assert catching_up_at, f"{victim} was never seen catching up: raise _BEHIND"
            assert caught_up_at, f"{victim} did not catch up within {_WAIT_S} s"
            wait_for(
                lambda: answered[-1][1] == everyone,
                _WAIT_S,
                f"{victim} waited for again: a receipt naming all three",
            )
        finally:
            stop.set()
            worker.join(_WAIT_S)
    assert not errors, errors
    assert not worker.is_alive()
    # While the restarted slave caught up, publishes went on without it.
    during = [h for t, h in answered if catching_up_at < t < still_catching_up_at]
    assert len(during) >= 3 and all(h == {master, other} for h in during), during[:5]
    for where, address in (
        ("gateway", controlled.gateway_address),
        (victim, controlled.replica_address(victim)),
    ):
        stored = dict(_read_replica(address, "orders", timeout_s=30))
        missing = [p for p, r in acked.items() if stored.get(r.offset) != p]
        assert not missing, f"{where}: acknowledged events not at their offsets: {missing[:5]}"
