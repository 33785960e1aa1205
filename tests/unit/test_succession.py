"""`squall status --explain`'s pure core: why the master leads, and who would lead if a node
failed, from the election's own rules.

Goal: the verdicts match what the election does. Where it can, a test checks the predicted
successor against a simulated cluster of real Election machines (the transcript harness).
"""

from __future__ import annotations

from squall_server.coordinator.messages import NodeState
from squall_server.coordinator.succession import NodeFacts, explain_master, if_failed, succession
from tests.unit.test_election_scenarios import Cluster, run_cluster


def _facts(cluster: Cluster) -> list[NodeFacts]:
    """The status view of a simulated cluster, as the CLI would build it."""
    out = []
    for node, election in cluster.nodes.items():
        store = cluster.stores[node]
        if election is None:
            out.append(NodeFacts(node, cluster.priorities[node], up=False))
            continue
        s = election.status()
        out.append(
            NodeFacts(
                node_id=node,
                priority=s.priority,
                up=True,
                quarantined=s.quarantine is not None,
                last_epoch=store.last_epoch,
                last_lsn=store.last_lsn,
                max_seen=s.max_seen,
                quorum_override=s.quorum_override,
                designated_primary=s.designated_primary,
                state=s.state.value,
                coordinator_id=s.coordinator_id,
                group_name=s.group_name,
                epoch=s.epoch,
                group=s.group,
                invited=s.invited,
                sync_source_id=s.sync_source_id,
            )
        )
    return out


def _master(cluster: Cluster) -> str:
    for node, election in cluster.nodes.items():
        if election is not None:
            s = election.status()
            if s.state is NodeState.NORMAL and s.coordinator_id == node:
                return node
    return ""


def test_prediction_matches_the_election_for_every_failed_node() -> None:
    """For each node: predict, then crash it in the simulated cluster and compare."""
    priorities = {"1": 2, "2": 5, "3": 3, "4": 0, "5": 1}
    base = run_cluster(priorities, 1000)
    master = _master(base)
    assert master == "2"
    for verdict in succession(_facts(base), master):
        cluster = run_cluster(priorities, 1000)
        cluster.crash(verdict.failed)
        cluster.run(3000)
        assert _master(cluster) == verdict.leader, verdict


def test_a_member_failing_leaves_the_master_in_place() -> None:
    """Members that fail only shrink the group: the master keeps leading, no election."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    verdict = if_failed(_facts(cluster), "1", "3")
    assert verdict.leader == "1"
    assert "keeps leading" in verdict.why and "no election" in verdict.why


def test_losing_the_quorum_means_no_master() -> None:
    """With one node already down, a second failure leaves no majority: nobody leads."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    cluster.crash("3")
    cluster.run(1000)
    facts = _facts(cluster)
    for failed in ("1", "2"):
        verdict = if_failed(facts, "1", failed)
        assert verdict.leader == "", verdict
        assert "1 of 3 nodes left, 2 required" in verdict.why and "writes stop" in verdict.why


def test_quarantined_nodes_count_as_failed_and_override_counts() -> None:
    """A quarantined node is out already; the candidate's own override lowers the count."""
    facts = [
        NodeFacts(
            "1", 3, up=True, max_seen=3, state="normal", coordinator_id="1", group=("2",), epoch=4
        ),
        NodeFacts(
            "2",
            2,
            up=True,
            max_seen=3,
            quorum_override=1,
            state="normal",
            coordinator_id="1",
            epoch=4,
        ),
        NodeFacts("3", 1, up=True, quarantined=True, max_seen=3, state="inactive"),
    ]
    verdict = if_failed(facts, "1", "1")
    assert verdict.leader == "2"
    assert "operator quorum override" in verdict.why
    assert "3 already out" in verdict.why
    no_override = [f if f.node_id != "2" else NodeFacts("2", 2, up=True, max_seen=3) for f in facts]
    assert if_failed(no_override, "1", "1").leader == ""


def test_sync_source_is_the_survivor_with_the_newest_log() -> None:
    """Priority decides who leads; the newest log decides the sync source."""
    facts = [
        NodeFacts(
            "1",
            3,
            up=True,
            last_epoch=5,
            last_lsn=90,
            max_seen=3,
            state="normal",
            coordinator_id="1",
            group=("2", "3"),
        ),
        NodeFacts("2", 2, up=True, last_epoch=5, last_lsn=80, max_seen=3),
        NodeFacts("3", 1, up=True, last_epoch=5, last_lsn=88, max_seen=3),
    ]
    verdict = if_failed(facts, "1", "1")
    assert (verdict.leader, verdict.sync_source) == ("2", "3")
    assert "sync source 3 (log 5/88)" in verdict.why


def test_full_startup_needs_every_node() -> None:
    """Before any majority was seen together (max below a majority), every node is needed."""
    facts = [NodeFacts(str(i), 1, up=i != 3, max_seen=0) for i in (1, 2, 3)]
    verdict = if_failed(facts, "", "2")
    assert verdict.leader == ""
    assert "full startup" in verdict.why


def test_explain_names_rank_invitees_sync_source_and_quorum() -> None:
    """The master's explanation gives the rank, whom it invited, the sync source, the quorum."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    text = "\n".join(explain_master(_facts(cluster), "1"))
    assert "1 leads group 1:g2 in epoch 1 with 1,2,3 (3 of 3 nodes)." in text
    assert "1 (3) > 2 (2) > 3 (1)" in text
    assert "invited 2,3" in text
    assert "Sync source: 1" in text
    assert "Quorum: 2 of 3 nodes (a majority of 3); the group has 3." in text


def test_explain_says_when_a_transfer_put_a_lower_node_in_charge() -> None:
    """After a transfer a higher-ranked member exists; the explanation says why."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    leader = cluster.nodes["1"]
    assert leader is not None
    cluster.apply("1", leader.transfer_leadership("3", "alice", cluster.now_ms), "t")
    cluster.deliver_all()
    cluster.run(1000)
    assert _master(cluster) == "3"
    text = "\n".join(explain_master(_facts(cluster), "3"))
    assert "1 ranks above 3 but is a member" in text
    assert "lasts until the next election" in text


def test_explain_without_a_master() -> None:
    """With no master the explanation says what the reachable nodes could do."""
    facts = [NodeFacts(str(i), 1, up=i == 1, max_seen=3) for i in (1, 2, 3)]
    lines = explain_master(facts, "")
    assert lines[0] == "No master now."
    assert "1 of 3 nodes left, 2 required" in lines[1]


def test_a_node_refused_for_differing_settings_counts_as_failed() -> None:
    """The master refuses node 3 (its file differs): it is out already, and ranking above
    the master it is named as refused, not as a node that would lead."""
    facts = [
        NodeFacts(
            "1", 2, up=True, max_seen=3, state="normal", coordinator_id="1", group=("2",), epoch=4
        ),
        NodeFacts("2", 1, up=True, max_seen=3, state="normal", coordinator_id="1", epoch=4),
        NodeFacts("3", 3, up=True, config_refused=True, max_seen=3, state="inactive"),
    ]
    verdict = if_failed(facts, "1", "1")
    assert verdict.leader == "" and "3 already out" in verdict.why
    assert any("refused: its configuration differs" in line for line in explain_master(facts, "1"))
