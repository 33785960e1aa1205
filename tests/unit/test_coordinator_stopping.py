"""A coordinator stopping in order (SIGTERM) tells its group it leaves before it goes
silent (``CoordinatorDriver.stopping``, called by ``CoordinatorNode.quiesce``): its
coordinator drops it, or its members elect, at once instead of after member_timeout_ms.

Chaos seed 97: a member that had caught up behind the group's coordinator was stopped,
and 88 ms later the coordinator, still counting it a member, handed it the group: writes
froze for the hand-over, and nothing was acknowledged for 2.1 s."""

from __future__ import annotations

import logging

import pytest

from squall_server.coordinator.messages import Leave
from tests.unit.test_coordinator_master_refusals import HEARTBEAT_MS, STEP_MS, Cluster

# ElectionConfig's default, which the harness's drivers keep.
MEMBER_TIMEOUT_MS = 400


def _formed() -> Cluster:
    cluster = Cluster()
    cluster.run(2000)
    assert cluster.master_now() == "1"
    assert cluster.drivers["1"].election.status().members == ("1", "2", "3")
    return cluster


def _gone(cluster: Cluster, node: str, *, stopping: bool) -> int:
    """Node's coordinator goes away, in order (told first) or killed; returns when."""
    if stopping:
        ready = cluster.drivers[node].stopping(f"the coordinator of node {node} is stopping")
        assert {m.to_node for m in ready.messages if isinstance(m.body, Leave)}, ready
        cluster._deliver()
    cluster.down.add(node)
    return cluster.clock.monotonic_ms()


@pytest.mark.parametrize("stopping", [True, False], ids=["stopped", "killed"])
def test_a_stopping_member_is_dropped_at_once(stopping: bool) -> None:
    cluster = _formed()
    gone_ms = _gone(cluster, "3", stopping=stopping)
    master = cluster.drivers["1"].election
    dropped_ms = None
    for _ in range(2 * MEMBER_TIMEOUT_MS // STEP_MS):  # bounded: a killed one within this
        cluster.run(cluster.clock.monotonic_ms() + STEP_MS)
        if "3" not in master.status().members:
            dropped_ms = cluster.clock.monotonic_ms() - gone_ms
            break
    assert dropped_ms is not None, "the master never dropped node 3"
    if stopping:
        assert dropped_ms <= STEP_MS, f"dropped {dropped_ms} ms after it said it stopped"
    else:
        # A killed one says nothing: it is dropped once silent for member_timeout_ms (from
        # its last heartbeat, up to one before the kill).
        assert dropped_ms > MEMBER_TIMEOUT_MS - HEARTBEAT_MS - 2 * STEP_MS
    assert cluster.master_now() == "1"  # the master keeps its role either way


@pytest.mark.parametrize("stopping", [True, False], ids=["stopped", "killed"])
def test_when_the_groups_coordinator_stops_the_next_node_leads_at_once(
    stopping: bool, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = _formed()
    with caplog.at_level(logging.INFO, logger="squall.coordinator"):
        gone_ms = _gone(cluster, "1", stopping=stopping)
        # Its replica's lease runs out in time; until then it serves the old epoch, which
        # its slaves leave as their coordinators give them the new one.
        cluster.twins["1"].role = cluster.twins["2"].role
        cluster.run(gone_ms + 2 * MEMBER_TIMEOUT_MS)
    taken = [t - gone_ms for t, n, _ in cluster.masters if n == "2" and t >= gone_ms]
    assert taken, "node 2 never took the master role"
    if stopping:
        assert taken[0] <= 5 * STEP_MS, f"node 2 took over {taken[0]} ms after node 1 stopped"
        said = [r.getMessage() for r in caplog.records if "told 2,3" in r.getMessage()]
        assert said and "is stopping" in said[0], said
    else:
        assert taken[0] > MEMBER_TIMEOUT_MS - HEARTBEAT_MS - 2 * STEP_MS
    assert cluster.master_now() == "2"


def test_a_transfer_whose_target_goes_silent_is_given_up_when_it_is_dropped() -> None:
    """A hand-over began to a member that was then killed (no Leave: it says nothing).
    Once the coordinator drops it as silent, the transfer is given up and the driver is
    told to lift the replica's write fence (``Ready.transfer_dropped``) at once, rather
    than leave writes fenced until the fence's deadline (rpc_timeout_ms)."""
    cluster = _formed()
    master = cluster.drivers["1"]
    dropped: list[tuple[int, str]] = []
    master._transfer_dropped = lambda target: dropped.append((cluster.clock.monotonic_ms(), target))
    cluster.down.add("3")  # killed: its LeadershipTransfer is lost too
    gone_ms = cluster.clock.monotonic_ms()
    ready = master.transfer_leadership("3", "operator", "test")
    assert ready.rejection is None and master.election.status().transfer_target == "3"
    cluster._deliver()
    cluster.run(gone_ms + 2 * MEMBER_TIMEOUT_MS)
    assert dropped, "the transfer to a dropped member was not given up"
    at_ms, target = dropped[0]
    assert target == "3" and at_ms - gone_ms <= MEMBER_TIMEOUT_MS + STEP_MS, dropped
    status = master.election.status()
    assert status.transfer_target == "" and "3" not in status.members
    assert "given up" in status.last_change_reason
    assert cluster.master_now() == "1"


def test_a_transfer_to_a_member_that_stays_is_not_given_up_by_others_leaving() -> None:
    cluster = Cluster()
    cluster.run(2000)
    master = cluster.drivers["1"]
    dropped: list[str] = []
    master._transfer_dropped = dropped.append
    master.transfer_leadership("2", "operator", "test")
    cluster.down.add("3")  # another member goes: the transfer to 2 goes on
    cluster.run(cluster.clock.monotonic_ms() + 2 * MEMBER_TIMEOUT_MS)
    assert dropped == []
    assert cluster.master_now() == "2"
