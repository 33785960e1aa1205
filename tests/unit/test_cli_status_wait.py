"""`squall status --wait-normal`: when a rolling procedure may take the next node down.

Goal: the group counts as normal only when every node is back, in one group and epoch,
with one master streaming to every slave within the lag bound; each way it falls short
is named, so an operator whose wait timed out reads why.
"""

from __future__ import annotations

import dataclasses
import io

from squall import ClusterStatus, NodeStatus, Unavailable
from squall._types import SlaveProgress
from squall_server.cli.status_wait import group_problems, wait_until_normal


def slave(node_id: str, state: str = "streaming", lag: int = 0) -> SlaveProgress:
    return SlaveProgress(
        node_id=node_id,
        state=state,
        received_lsn=100 - lag,
        written_lsn=100 - lag,
        synced_lsn=100 - lag,
        lag_entries=lag,
        catch_up_entries_per_s=0.0,
        eta_s=-1.0,
        snapshot_lsn=0,
    )


def node(node_id: str, role: str, **changes: object) -> NodeStatus:
    row = NodeStatus(
        node_id=node_id,
        coordinator_id="n1",
        group_name="n1:abc",
        state="normal",
        group=("n2", "n3") if node_id == "n1" else (),
        max_seen=3,
        epoch=7,
        role=role,
        last_change_reason="",
        last_lsn=100,
        commit_lsn=100,
        store_state="dirty",
        reachable=True,
        error="",
        replica_address="",
        slaves=(slave("n2"), slave("n3")) if role == "master" else (),
    )
    return dataclasses.replace(row, **changes)  # type: ignore[arg-type]


def normal() -> list[NodeStatus]:
    return [node("n1", "master"), node("n2", "slave"), node("n3", "slave")]


def status(nodes: list[NodeStatus], master: str = "n1") -> ClusterStatus:
    return ClusterStatus(nodes=tuple(nodes), master_id=master, epoch=7)


def test_a_normal_group_has_no_problems() -> None:
    assert group_problems(status(normal()), max_lag_entries=1000) == []


def test_a_restarted_node_not_back_yet() -> None:
    nodes = normal()
    nodes[2] = node("n3", "", reachable=False, error="UNAVAILABLE: connection refused")
    nodes[0] = node("n1", "master", slaves=(slave("n2"),))
    assert group_problems(status(nodes), 1000) == [
        "n3 unreachable (UNAVAILABLE: connection refused)",
        "n1 does not replicate to n3",
    ]


def test_a_node_in_its_own_group_or_another_epoch() -> None:
    nodes = normal()
    nodes[2] = node("n3", "inactive", state="election", coordinator_id="n3", epoch=8)
    problems = group_problems(status(nodes), 1000)
    assert problems == [
        "n3 is election",
        "n3 follows n3",
        "n3's replica is inactive, not slave",
        "nodes in different epochs (7, 8)",
    ]


def test_a_slave_still_catching_up_or_lagging() -> None:
    nodes = normal()
    nodes[0] = node("n1", "master", slaves=(slave("n2", "snapshotting"), slave("n3", lag=5000)))
    assert group_problems(status(nodes), 1000) == ["n2 is snapshotting", "n3 lags 5000 entries"]
    assert group_problems(status(nodes), 5000) == ["n2 is snapshotting"]


def test_no_master() -> None:
    nodes = [node(n.node_id, "inactive", state="reorganization") for n in normal()]
    problems = group_problems(status(nodes, master=""), 1000)
    assert problems[0] == "no master"
    assert "n1 is reorganization" in problems


def test_wait_reports_why_at_the_deadline() -> None:
    class Stuck:
        def status(self) -> ClusterStatus:
            nodes = normal()
            nodes[1] = node("n2", "slave", reachable=False, error="down")
            return status(nodes)

    err = io.StringIO()
    assert wait_until_normal(Stuck(), 0.01, 1000, err) == 1  # type: ignore[arg-type]
    assert "not normal after 0.01s: n2 unreachable (down)" in err.getvalue()


def test_wait_rides_out_an_unreachable_gateway_until_normal() -> None:
    class Recovering:
        calls = 0

        def status(self) -> ClusterStatus:
            self.calls += 1
            if self.calls == 1:
                raise Unavailable("gateway restarting")
            if self.calls == 2:
                return status(normal(), master="")
            return status(normal())

    client = Recovering()
    err = io.StringIO()
    assert wait_until_normal(client, 30, 1000, err) == 0  # type: ignore[arg-type]
    assert (client.calls, err.getvalue()) == (3, "")
