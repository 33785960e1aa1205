"""A replica cut off from the other replicas alone, on real processes.

Each node runs in its own network namespace with an address per process
(chaos/netns.py), so the master's replica loses its links to the other replicas while
every coordinator still reaches the others and sees its own replica answer. Nothing
commits there and only that replica knows: its role answers say how long it has heard
from no majority (`quorum_silent_ms`), and past the bound its coordinator steps aside.
The test checks what a user sees: publishes are acknowledged again by another master
while the cut still holds, the old master's status says why it stepped aside, and after
the heal it rejoins; every acknowledged event is then on every replica at the offset its
receipt gave.

A slave's replica cut off alone costs nothing while the master stays (it commits with
the other slave), but if the master's node goes down the cut node (next in rank) leads
the group left, and its replica cannot fetch the newer log it must start from. The
second test checks that node steps aside, so the others serve once the old master is
back, while the cut holds.

Under acks "group" every commit waits for every member that has caught up, so the same
slave's cut stalls every write. The third test checks the master's coordinator drops that
member (it hears a majority, so it is not the one cut off) and the group commits without
it. The fourth restarts a slave node with its replica cut off: its coordinator rejoins
the group, but its replica never catches up, so no commit waits for it and it is not
dropped (before, each such rejoin stalled every write until the drop).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import squall
from chaos.cluster import DEFAULT_SETTINGS, ChaosCluster
from chaos.netns import Topology
from tests.requirements import netns_missing

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))

# Bounds on the waits (a loaded 2-core machine is slow, never wrong): a failover after the
# step-aside bound (3 s with the chaos settings' 1 s member timeout) and the election.
FAILOVER_WAIT_S = 60.0
NORMAL_WAIT_S = 90.0


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ChaosCluster]:
    """Three nodes in namespaces; ``@pytest.mark.acks("group")`` sets the ack policy."""
    marker = request.node.get_closest_marker("acks")
    settings = None
    if marker is not None:
        settings = {"durability": {**DEFAULT_SETTINGS["durability"], "acks": marker.args[0]}}
    topology = Topology.plan(["n1", "n2", "n3"])
    topology.create()
    built: ChaosCluster | None = None
    try:
        built = ChaosCluster.build(tmp_path / "run", 3, topology, settings)
        built.start_all()
        built.wait_normal(NORMAL_WAIT_S)
        yield built
    finally:
        if built is not None:
            built.stop_all()
        assert topology.teardown() == []


@contextlib.contextmanager
def _publisher_of_t(cluster: ChaosCluster) -> Iterator[squall.Publisher]:
    """A publisher of the new topic "t", through the first gateway."""
    with squall.connect(cluster.gateway_addresses[0], timeout_s=5.0) as client:
        client.create_topic("t")
        yield client.topic("t").publisher()


def _publish_until(
    publisher: squall.Publisher, acked: dict[str, squall.Receipt], label: str, count: int
) -> list[squall.Receipt]:
    """Publishes until ``count`` are acknowledged or FAILOVER_WAIT_S pass; the receipts."""
    deadline = time.monotonic() + FAILOVER_WAIT_S
    receipts: list[squall.Receipt] = []
    for i in range(100_000):  # bounded by the deadline too
        receipt = _publish(publisher, f"{label}-{i}")
        if receipt is not None:
            acked[f"{label}-{i}"] = receipt
            receipts.append(receipt)
        if len(receipts) >= count or time.monotonic() > deadline:
            break
    return receipts


def _every_acked_event_everywhere(cluster: ChaosCluster, acked: dict[str, squall.Receipt]) -> None:
    """After a clean shutdown: each acknowledged event on every replica at its offset."""
    cluster.shutdown()
    logs = {r["node"]: r for r in cluster.final_logs(["t"])}
    assert set(logs) == {"n1", "n2", "n3"}
    for node, record in logs.items():
        stored = {offset: payload for offset, payload in record["events"]}  # type: ignore[attr-defined]
        missing = [
            (payload, r.offset) for payload, r in acked.items() if stored.get(r.offset) != payload
        ]
        assert not missing, f"{node} lacks acknowledged events at their offsets: {missing[:5]}"


def _publish(publisher: squall.Publisher, payload: str) -> squall.Receipt | None:
    """One publish; None when it was not acknowledged (refused or indeterminate)."""
    try:
        return publisher.publish(payload.encode())
    except squall.SquallError:
        return None


def test_a_master_whose_replica_is_cut_off_alone_steps_aside_and_another_serves(
    cluster: ChaosCluster,
) -> None:
    assert cluster.topology is not None
    old = cluster.master()
    assert old is not None
    acked: dict[str, squall.Receipt] = {}
    with _publisher_of_t(cluster) as publisher:
        for i in range(20):
            receipt = _publish(publisher, f"before-{i}")
            assert receipt is not None, f"publish {i} before the cut was not acknowledged"
            acked[f"before-{i}"] = receipt
        cluster.topology.partition_process(old, "replica")
        deadline = time.monotonic() + FAILOVER_WAIT_S
        during = 0
        for i in range(100_000):  # bounded by the deadline too
            receipt = _publish(publisher, f"during-{i}")
            if receipt is not None:
                acked[f"during-{i}"] = receipt
                if receipt.master_id != old:
                    during += 1
            if during >= 20 or time.monotonic() > deadline:
                break
        assert during >= 20, (
            f"no other master acknowledged publishes within {FAILOVER_WAIT_S:.0f}s while "
            f"{old}'s replica was cut off: {cluster.normal_problem()}"
        )
        # The old master says why it stepped aside (its hold-off, a second, may be over:
        # it is then back as a slave that cannot catch up while the cut lasts).
        said = cluster.log_path("coordinator", old).read_text(errors="replace")
        assert "heard from no majority" in said and "steps aside from leading" in said
        assert cluster.master() != old
        cluster.topology.heal()
        cluster.wait_normal(NORMAL_WAIT_S)  # the old master catches up and leads again
        for i in range(20):
            receipt = _publish(publisher, f"after-{i}")
            assert receipt is not None, f"publish {i} after the heal was not acknowledged"
            acked[f"after-{i}"] = receipt
    _every_acked_event_everywhere(cluster, acked)


def test_a_leader_whose_replica_is_cut_off_steps_aside_so_the_others_serve(
    cluster: ChaosCluster,
) -> None:
    assert cluster.topology is not None
    assert cluster.master() == "n1"  # the highest priority; n2 ranks next
    acked: dict[str, squall.Receipt] = {}
    with _publisher_of_t(cluster) as publisher:
        cluster.topology.partition_process("n2", "replica")
        before = _publish_until(publisher, acked, "before", 20)
        assert len(before) == 20, "the master did not commit with n3 while n2 was cut off"
        cluster.kill_node("n1")
        # n2 leads n3 and must fetch n3's newer log first, which it cannot reach.
        deadline = time.monotonic() + FAILOVER_WAIT_S
        reason = ""
        while "failed to take the master role" not in reason and time.monotonic() < deadline:
            status = cluster.coordinator_status("n2")
            reason = "" if status is None else status.lead_held_off_reason
            time.sleep(0.1)
        assert "failed to take the master role" in reason, (
            f"n2 did not step aside within {FAILOVER_WAIT_S:.0f}s: {cluster.normal_problem()}"
        )
        assert "sync source" in reason, reason
        cluster.start_node("n1")
        during = _publish_until(publisher, acked, "during", 20)
        assert len(during) == 20, (
            f"nobody acknowledged publishes within {FAILOVER_WAIT_S:.0f}s of n1's restart "
            f"while n2's replica was cut off: {cluster.normal_problem()}"
        )
        assert {r.master_id for r in during} == {"n1"}
        cluster.topology.heal()
        cluster.wait_normal(NORMAL_WAIT_S)
        after = _publish_until(publisher, acked, "after", 20)
        assert len(after) == 20, "publishes after the heal were not acknowledged"
    _every_acked_event_everywhere(cluster, acked)


@pytest.mark.acks("group")
def test_under_acks_group_a_member_whose_replica_is_cut_off_is_dropped(
    cluster: ChaosCluster,
) -> None:
    assert cluster.topology is not None
    assert cluster.master() == "n1"
    acked: dict[str, squall.Receipt] = {}
    with _publisher_of_t(cluster) as publisher:
        before = _publish_until(publisher, acked, "before", 20)
        assert len(before) == 20
        assert all(len(r.holders) == 3 for r in before), before[0]
        cluster.topology.partition_process("n2", "replica")
        during = _publish_until(publisher, acked, "during", 20)
        assert len(during) == 20, (
            f"nothing was acknowledged within {FAILOVER_WAIT_S:.0f}s of n2's replica being "
            f"cut off: {cluster.normal_problem()}"
        )
        assert {r.master_id for r in during} == {"n1"}  # no failover: n1 hears n3
        # Each receipt says where its event is: n1 and n3, the group without n2.
        assert {h.node_id for h in during[-1].holders} == {"n1", "n3"}, during[-1]
        # n2 says why it is out (its hold-off, a second, may be over by now).
        said = cluster.log_path("coordinator", "n2").read_text(errors="replace")
        assert "dropped it from" in said and "has heard nothing from this node's replica" in said
        cluster.topology.heal()
        cluster.wait_normal(NORMAL_WAIT_S)  # n2 rejoins after its hold-off and catches up
        after = _publish_until(publisher, acked, "after", 20)
        assert len(after) == 20, "publishes after the heal were not acknowledged"
        _held_by_all_three(publisher, acked)
    _every_acked_event_everywhere(cluster, acked)


@pytest.mark.acks("group")
def test_under_acks_group_a_member_that_rejoins_cut_off_holds_no_commit_back(
    cluster: ChaosCluster,
) -> None:
    assert cluster.topology is not None
    assert cluster.master() == "n1"
    acked: dict[str, squall.Receipt] = {}
    with _publisher_of_t(cluster) as publisher:
        assert len(_publish_until(publisher, acked, "before", 20)) == 20
        cluster.kill_node("n2")
        down = _publish_until(publisher, acked, "down", 50)  # n2 will be behind these
        assert len(down) == 50, f"n1 and n3 did not commit: {cluster.normal_problem()}"
        cluster.topology.partition_process("n2", "replica")
        cluster.start_node("n2")
        deadline = time.monotonic() + NORMAL_WAIT_S
        group: list[str] = []
        while "n2" not in group and time.monotonic() < deadline:
            status = cluster.coordinator_status("n1")
            group = [] if status is None else list(status.group)
            time.sleep(0.05)
        assert "n2" in group, f"n2 did not rejoin n1's group: {cluster.normal_problem()}"
        # Past the bound after which a member that commits wait for is dropped (3 s with
        # the chaos settings), publishes are acknowledged all along, by n1 and n3.
        until = time.monotonic() + 4.0
        rejoined: list[squall.Receipt] = []
        for i in range(100_000):  # bounded by the time too
            receipt = _publish(publisher, f"rejoined-{i}")
            assert receipt is not None, (
                f"publish {i} after n2 rejoined with its replica cut off was not "
                f"acknowledged: {cluster.normal_problem()}"
            )
            acked[f"rejoined-{i}"] = receipt
            rejoined.append(receipt)
            if time.monotonic() > until:
                break
        assert {r.master_id for r in rejoined} == {"n1"}
        assert {h.node_id for h in rejoined[-1].holders} == {"n1", "n3"}, rejoined[-1]
        # n2 is kept: it holds nothing back, and the master says it is catching up.
        status = cluster.coordinator_status("n1")
        assert status is not None and "n2" in status.group, status
        n2 = cluster.coordinator_status("n2")
        assert n2 is not None and not n2.lead_held_off_reason, n2
        master = cluster.replica_state("n1")
        assert master is not None
        slaves = {s.node_id: s for s in master.slaves}
        assert slaves["n2"].catching_up and not slaves["n3"].catching_up, master.slaves
        cluster.topology.heal()
        _held_by_all_three(publisher, acked)
    _every_acked_event_everywhere(cluster, acked)


def _held_by_all_three(publisher: squall.Publisher, acked: dict[str, squall.Receipt]) -> None:
    """Publishes until a receipt names every node as a holder (a member that rejoined
    catches up first; commits wait for it from then on)."""
    receipts = _publish_until(publisher, acked, "healed", 1)
    for _ in range(1000):  # bounded: _publish_until has a deadline too
        if receipts and {h.node_id for h in receipts[-1].holders} == {"n1", "n2", "n3"}:
            return
        time.sleep(0.02)
        receipts = _publish_until(publisher, acked, f"healed-{len(acked)}", 1)
    raise AssertionError(f"no receipt names all three nodes after the heal: {receipts[-1:]}")
