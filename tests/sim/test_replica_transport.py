"""Three shipped ReplicaNodes replicating over the simulated replica transport, no gRPC.

The master's streams (``MasterDriver``), the slaves' servicer logic and a new master's
reorganization fetch (``_sync_from``) all run as they ship, over
``tests/sim/replica_transport.py``, with in-memory stores. A partition isolates the
master mid-epoch; the next epoch's master fetches what it lacks from its sync source; the
old master, healed, is refused by a slave of the newer epoch (the refusal carries the
epoch through the transport) and steps down. Every acknowledged publish is in the new
master's log and is readable there. A master whose log a lagging slave needs fails its
checksum reports the fault and sends none of it; a master with a sound copy brings the
slave up to date.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import commands
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.master_streams import RECONNECT_BACKOFF_MIN_MS, ReconnectBackoff
from squall_server.replica.node import ReplicaNode
from tests.example_config import example_config
from tests.sim.replica_transport import SimReplicaNetwork, flip_a_byte

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
CLUSTER_ID = "c-sim-transport"
WAIT_S = 20.0  # generous: the machine is shared


def _endpoint(node_id: str) -> common_pb2.NodeEndpoint:
    return common_pb2.NodeEndpoint(node_id=node_id)


def _master(epoch: int, seq: int, members: list[str], source: str) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        seq=seq,
        epoch=epoch,
        role=common_pb2.ROLE_MASTER,
        master=_endpoint(members[0]),
        members=[_endpoint(m) for m in members],
        sync_source_id=source,
        lease_ms=60_000,
        cluster_id=CLUSTER_ID,
    )


def _slave(epoch: int, seq: int, master: str) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        seq=seq,
        epoch=epoch,
        role=common_pb2.ROLE_SLAVE,
        master=_endpoint(master),
        lease_ms=60_000,
        cluster_id=CLUSTER_ID,
    )


async def _until(what: str, check: object) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _publish(node: ReplicaNode, payload: bytes) -> common_pb2.BatchReceipt:
    request = broker_pb2.PublishRequest(
        topic="orders", events=[common_pb2.EventData(payload=payload)]
    )
    return await asyncio.wait_for(node.start_publish(request), WAIT_S)


async def _started(
    network: SimReplicaNetwork, node_ids: tuple[str, ...], config: ClusterConfig
) -> dict[str, ReplicaNode]:
    return await network.start_replicas(config, node_ids)


@contextlib.asynccontextmanager
async def _running(
    network: SimReplicaNetwork, node_ids: tuple[str, ...], config: ClusterConfig
) -> AsyncIterator[dict[str, ReplicaNode]]:
    """The shipped replicas of node_ids over the network, started; stopped on the way out
    (a node's stop raises what one of its tasks died of)."""
    nodes = await network.start_replicas(config, node_ids)
    try:
        yield nodes
    finally:
        for node in nodes.values():
            await node.stop()


def _operations(node: ReplicaNode) -> list[tuple[int, int, bytes]]:
    return [(e.lsn, e.epoch, e.operation) for e in node.store.read_log(1, 10_000)]


async def _n1_masters_epoch_one(nodes: dict[str, ReplicaNode]) -> None:
    """Epoch 1: n1 masters the other nodes (slaves first); a write commits once a slave
    holds it."""
    n1 = nodes["n1"]
    for node_id, node in nodes.items():
        if node_id != "n1":
            await node.apply_role(_slave(1, 1, "n1"))
    await n1.apply_role(_master(1, 1, list(nodes), "n1"))
    await _until("n1 master", lambda: n1.role == common_pb2.ROLE_MASTER)


async def _create_orders(node: ReplicaNode) -> None:
    await asyncio.wait_for(
        node.write(commands.CreateTopic("orders", common_pb2.TOPIC_KIND_REPLICATED)), WAIT_S
    )


def test_replicas_replicate_reorganize_and_depose_over_the_simulated_transport(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        network = SimReplicaNetwork()
        async with _running(network, ("n1", "n2", "n3"), example_config(tmp_path)) as nodes:
            n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
            # Epoch 1: n1 masters n2 and n3; a write commits once a slave holds it.
            await _n1_masters_epoch_one(nodes)
            await _create_orders(n1)
            acked = [await _publish(n1, b"a%d" % i) for i in range(5)]
            await _until("n2 and n3 caught up", lambda: n2.last_lsn == n3.last_lsn == n1.last_lsn)
            assert _operations(n2) == _operations(n1) == _operations(n3)

            # n3 is cut off: writes still commit with n2 alone (a majority with n1).
            network.cut("n1", "n3", both=True)
            acked += [await _publish(n1, b"b%d" % i) for i in range(5)]
            await _until("n2 caught up", lambda: n2.last_lsn == n1.last_lsn)
            assert n3.last_lsn < n1.last_lsn

            # n1 is cut off from everyone; epoch 2 is n3's, synced from n2 (it lacks the
            # b events: the reorganization fetch brings them over the transport).
            network.cut("n1", "n2", both=True)
            await n2.apply_role(_slave(2, 2, "n3"))
            await n3.apply_role(_master(2, 2, ["n3", "n2"], "n2"))
            await _until("n3 master", lambda: n3.role == common_pb2.ROLE_MASTER)
            acked += [await _publish(n3, b"c%d" % i) for i in range(3)]
            log3 = _operations(n3)
            assert log3[: n1.last_lsn] == _operations(n1)  # all of epoch 1, b events too
            await _until("n2 caught up with n3", lambda: n2.last_lsn == n3.last_lsn)
            assert _operations(n2) == _operations(n3)
            assert all(r.master_id in ("n1", "n3") for r in acked)
            events = n3.store.read_events("orders", 0, 100)
            assert [e.payload for e in events] == (
                [b"a%d" % i for i in range(5)]
                + [b"b%d" % i for i in range(5)]
                + [b"c%d" % i for i in range(3)]
            )

            # Healed, n1 (still master of epoch 1) reconnects to n2, which refuses it with
            # epoch 2 in the refusal's metadata: n1 steps down.
            network.heal()
            await _until("n1 deposed", lambda: n1.role != common_pb2.ROLE_MASTER)
            # n1's epoch transport (closed by the deposed master's own task, a few loop
            # turns after its role changed) and n3's sync transport.
            await _until("both transports closed", lambda: network.closed >= 2)

    asyncio.run(scenario())


def test_a_slave_whose_opened_stream_breaks_is_reconnected_at_the_shortest_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream the slave answered ends in an error (a connection reset), never cleanly:
    it still counts as opened, so repeated breaks never push the master's next try to
    the 1 s bound (before: the fifth break onwards waited 800 ms, then 1 s each)."""
    waits: list[tuple[bool, int]] = []
    after = ReconnectBackoff.after

    def recorded(self: ReconnectBackoff, *, opened: bool) -> int:
        wait_ms = after(self, opened=opened)
        waits.append((opened, wait_ms))
        return wait_ms

    monkeypatch.setattr(ReconnectBackoff, "after", recorded)

    async def scenario() -> None:
        network = SimReplicaNetwork()
        async with _running(network, ("n1", "n2"), example_config(tmp_path)) as nodes:
            n1, n2 = nodes["n1"], nodes["n2"]
            await _n1_masters_epoch_one(nodes)
            await _create_orders(n1)
            for i in range(7):
                # The reset fails the open stream; the link is back before the retry.
                network.cut("n1", "n2", both=True)
                network.heal()
                # Acknowledged only through n2 (a majority of two): the stream reopened.
                await _publish(n1, b"e%d" % i)
                await _until("n2 caught up", lambda: n2.last_lsn == n1.last_lsn)
            assert len(waits) == 7
            assert waits == [(True, RECONNECT_BACKOFF_MIN_MS)] * 7

    asyncio.run(scenario())


def test_a_master_that_cannot_read_the_log_a_slave_lacks_reports_it_and_a_sound_copy_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bit rot in the master's log above a lagging slave's end: before, the master's stream
    task to that slave died with the CorruptRecordError, nothing was reported, and the
    slave stayed behind for good. Now the master reports a fault (its coordinator
    quarantines it), sends nothing of the damaged entry, goes on committing with the other
    slave, and the next master, from a sound copy, brings the lagging slave up to date."""

    async def scenario() -> None:
        network = SimReplicaNetwork()
        async with _running(network, ("n1", "n2", "n3"), example_config(tmp_path)) as nodes:
            n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
            await _n1_masters_epoch_one(nodes)
            await _create_orders(n1)
            await _until("n3 has the topic", lambda: n3.last_lsn == n1.last_lsn)
            network.cut("n1", "n3", both=True)
            acked = [await _publish(n1, b"a%d" % i) for i in range(10)]
            # A new epoch of the same master: its tail cache starts empty, so what n3
            # lacks is read from the store.
            await n2.apply_role(_slave(2, 2, "n1"))
            await n3.apply_role(_slave(2, 2, "n1"))
            await n1.apply_role(_master(2, 2, ["n1", "n2", "n3"], "n1"))
            await _until(
                "n1 master of epoch 2", lambda: n1.epoch == 2 and n1.role == common_pb2.ROLE_MASTER
            )
            damaged = n3.last_lsn + 3
            key = damaged.to_bytes(8, "big")
            flip_a_byte(n1.store, "log", key)
            before = n3.last_lsn
            network.heal()
            await _until("n1 reports a fault", lambda: n1.fault is not None)
            assert n1.fault is not None
            assert "checksum error reading the log for node n3" in n1.fault.reason
            assert key.hex() in n1.fault.reason
            # Writes still commit with n2; n3 got nothing from the damaged batch on.
            acked.append(await _publish(n1, b"after the fault"))
            assert n3.last_lsn == before < damaged
            assert any("FAULT" in r.getMessage() for r in caplog.records)

            # The coordinator quarantines n1 and n2 leads, from its sound copy.
            await n3.apply_role(_slave(3, 3, "n2"))
            await n2.apply_role(_master(3, 3, ["n2", "n3"], "n2"))
            await _until("n2 master", lambda: n2.role == common_pb2.ROLE_MASTER)
            acked.append(await _publish(n2, b"under n2"))
            await _until("n3 caught up", lambda: n3.last_lsn == n2.last_lsn)
            assert _operations(n3) == _operations(n2)
            for node in (n2, n3):
                events = node.store.read_events("orders", 0, 100)
                for receipt in acked:
                    assert events[receipt.first_offset].lsn == receipt.lsn
            assert [e.payload for e in n3.store.read_events("orders", 0, 100)] == (
                [b"a%d" % i for i in range(10)] + [b"after the fault", b"under n2"]
            )

    asyncio.run(scenario())


def test_a_master_whose_snapshot_for_a_slave_meets_a_damaged_record_reports_it(
    tmp_path: Path,
) -> None:
    """A slave behind the compacted log needs a snapshot; an event record of the master's
    store fails its checksum: the export stops there (nothing damaged is sent), the master
    reports the fault as it does for its log, and goes on committing with the other slave."""

    async def scenario() -> None:
        config = example_config(tmp_path)
        config = dataclasses.replace(
            config, limits=dataclasses.replace(config.limits, log_retention_entries=4)
        )
        network = SimReplicaNetwork()
        async with _running(network, ("n1", "n2", "n3"), config) as nodes:
            n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
            await _n1_masters_epoch_one(nodes)
            network.cut("n1", "n3", both=True)
            await _create_orders(n1)
            for i in range(20):
                await _publish(n1, b"a%d" % i)
            await _until("n1's log compacted", lambda: n1.store.log_start_lsn() > n3.last_lsn + 1)
            flip_a_byte(n1.store, "events")
            before = n3.last_lsn
            network.heal()
            await _until("n1 reports a fault", lambda: n1.fault is not None)
            assert n1.fault is not None
            assert "checksum error taking a snapshot for node n3" in n1.fault.reason
            receipt = await _publish(n1, b"after the fault")
            await _until("n2 has it", lambda: n2.last_lsn >= receipt.lsn)
            assert n3.last_lsn == before

    asyncio.run(scenario())


def test_a_new_master_whose_sync_source_fails_a_checksum_refuses_the_role(tmp_path: Path) -> None:
    """The sync source's log fails its checksum where the new master lacks it: the source
    reports the fault and ends the fetch with DATA_LOSS, and the new master refuses the
    role (FAILED_PRECONDITION, which its coordinator's step-aside rule counts, so a new
    epoch picks another source) rather than answering UNAVAILABLE and being asked again
    for good."""

    async def scenario() -> None:
        network = SimReplicaNetwork()
        async with _running(network, ("n1", "n2", "n3"), example_config(tmp_path)) as nodes:
            n1, n2 = nodes["n1"], nodes["n2"]
            await _n1_masters_epoch_one(nodes)
            await _create_orders(n1)
            await _until("n2 has the topic", lambda: n2.last_lsn == n1.last_lsn)
            network.cut("n1", "n2", both=True)
            for i in range(5):
                await _publish(n1, b"a%d" % i)  # committed with n3
            # n1 stops serving (no stream would send n2 its cache), then rots.
            await n1.apply_role(
                replica_pb2.RoleCommand(seq=2, role=common_pb2.ROLE_INACTIVE, cluster_id=CLUSTER_ID)
            )
            flip_a_byte(n1.store, "log", (n2.last_lsn + 2).to_bytes(8, "big"))
            network.heal()
            refusal: ServiceError | None = None
            for _ in range(200):  # bounded: each call waits at most a heartbeat
                try:
                    await n2.apply_role(_master(2, 2, ["n2", "n1"], "n1"))
                except ServiceError as exc:
                    refusal = exc
                    break
                await asyncio.sleep(0.01)
            assert refusal is not None, "the new master never answered its taking"
            assert refusal.code == Code.FAILED_PRECONDITION, refusal
            assert "fetching the log from sync source n1 failed: DATA_LOSS" in refusal.message
            assert n1.fault is not None and "checksum error serving a fetch" in n1.fault.reason
            assert n2.role != common_pb2.ROLE_MASTER

    asyncio.run(scenario())


def _gate_damaged(node: ReplicaNode, below_end: int) -> int:
    """Leaves the node's store as a replica's that had not yet recorded the commit of its
    newest entries (recording it trails the writes), with one of them rotted; returns the
    rotted entry's LSN. Rebuilding the commit gate reads exactly those entries."""
    node.store.set_commit_lsn(node.last_lsn - below_end)
    damaged = node.last_lsn - 1
    flip_a_byte(node.store, "log", damaged.to_bytes(8, "big"))
    return damaged


def _assert_serves_nothing(node: ReplicaNode, damaged: int, why: str) -> None:
    """The replica that cannot rebuild its commit gate is quarantined by its fault, refuses
    every read (it cannot tell committed events from others) and every role."""
    me = node.node.id
    assert node.fault is not None and f"({why})" in node.fault.reason, node.fault
    assert f"log at key {damaged:016x}" in node.fault.reason, node.fault.reason
    assert node.failed_reason and node.role == common_pb2.ROLE_INACTIVE
    with pytest.raises(ServiceError) as read:
        node.visible_end("orders")
    assert read.value.code == Code.UNAVAILABLE
    assert f"replica {me} serves no reads" in read.value.message
    assert "repair its store" in read.value.message


def test_a_replica_whose_uncommitted_tail_fails_its_checksum_starts_refusing_reads(
    tmp_path: Path,
) -> None:
    """At start-up the replica rebuilds its commit gate from the entries above the commit
    LSN it recorded; one of them fails its checksum. It starts (it used to exit, and its
    coordinator saw it down, not why), reports the fault, serves no read and takes no role;
    the others run on with every acknowledged event."""

    async def scenario() -> None:
        network = SimReplicaNetwork()
        config = example_config(tmp_path)
        nodes = await _started(network, ("n1", "n2", "n3"), config)
        n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
        restarted: ReplicaNode | None = None
        try:
            await _n1_masters_epoch_one(nodes)
            await _create_orders(n1)
            acked = [await _publish(n1, b"a%d" % i) for i in range(5)]
            await _until("n3 caught up", lambda: n3.last_lsn == n1.last_lsn)
            await network.down("n3").stop()  # killed
            damaged = _gate_damaged(n3, 3)

            restarted = build_replica_node(
                config, config.node("n3"), n3.store, transport=network.transport_for("n3")
            )
            network.add(restarted)
            await restarted.start()
            _assert_serves_nothing(restarted, damaged, "start-up")
            with pytest.raises(ServiceError) as role:
                await restarted.apply_role(_slave(2, 2, "n1"))
            assert role.value.code == Code.FAILED_PRECONDITION
            assert "fail-stopped" in role.value.message

            acked.append(await _publish(n1, b"after"))  # n1 and n2 still commit
            for receipt, payload in zip(
                acked, [b"a%d" % i for i in range(5)] + [b"after"], strict=True
            ):
                for node in (n1, n2):
                    await _until(
                        f"{node.node.id} commits it",
                        lambda n=node, r=receipt: n.commit_lsn >= r.lsn,
                    )
                    (event,) = node.store.read_events("orders", receipt.first_offset, 1)
                    assert (event.lsn, event.payload) == (receipt.lsn, payload)
        finally:
            for node in (n1, n2, restarted or n3):
                await node.stop()

    asyncio.run(scenario())


def test_a_checksum_error_rebuilding_the_gate_after_an_abandoned_taking_fail_stops(
    tmp_path: Path,
) -> None:
    """n2 starts taking the master role, waits for its sync source, and is told to stop
    (a newer command). Rebuilding its commit gate from the store then meets a record that
    fails its checksum: the replica reports the fault, refuses reads and roles, and the
    role command is answered (it used to answer UNKNOWN: the error escaped and killed the
    lease watch)."""

    async def scenario() -> None:
        network = SimReplicaNetwork()
        async with _running(network, ("n1", "n2", "n3"), example_config(tmp_path)) as nodes:
            n1, n2 = nodes["n1"], nodes["n2"]
            await _n1_masters_epoch_one(nodes)
            await _create_orders(n1)
            for i in range(5):
                await _publish(n1, b"a%d" % i)
            await _until("n2 caught up", lambda: n2.last_lsn == n1.last_lsn)
            # Until n2 has recorded the commit of every entry, a heartbeat could record it
            # over the damage (on a loaded machine one did: no fault, the gate rebuilt).
            await _until(
                "n2 recorded every commit", lambda: n2.store.meta().commit_lsn == n1.last_lsn
            )
            damaged = _gate_damaged(n2, 3)
            # Not a wait for anything: it lets n1's heartbeats run over the damage, so that
            # without the wait above one records the commit and the test fails every time.
            await asyncio.sleep(0.5)
            await n1.apply_role(  # n1 stops serving: a sync source's log must not grow
                replica_pb2.RoleCommand(seq=2, role=common_pb2.ROLE_INACTIVE, cluster_id=CLUSTER_ID)
            )
            network.delay_s = 3600.0  # the sync source's answer is on its way for good
            with contextlib.suppress(ServiceError):  # answered before the taking ends
                await n2.apply_role(_master(2, 2, ["n2", "n1", "n3"], "n1"))
            await _until("n2 taking", lambda: n2.reorganization_progress() is not None)
            await n2.apply_role(
                replica_pb2.RoleCommand(seq=3, role=common_pb2.ROLE_INACTIVE, cluster_id=CLUSTER_ID)
            )
            await n2.taking.wait_stopped()
            _assert_serves_nothing(n2, damaged, "reorganization interrupted")
            assert "fail-stop" in n2.fault.reason  # type: ignore[union-attr]

    asyncio.run(scenario())
