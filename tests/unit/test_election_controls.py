"""Operator controls in the pure election: leadership transfer, quarantine, and the quorum
override's audit trail and automatic revert.

Goal: each control does what an operator expects, refuses what would be wrong with a
sentence naming the problem, and a refused request changes nothing. The transcripts
tests/unit/scenarios/{transfer,quarantine,override_revert}.txt show whole runs.
"""

from __future__ import annotations

import pytest

from squall_server.coordinator.election import Election
from squall_server.coordinator.messages import (
    AreYouCoordinator,
    AreYouCoordinatorReply,
    Invitation,
    LeadershipTransfer,
    LogLevel,
    NodeState,
    OperatorRecord,
    PeerMessage,
    RejectCode,
    Role,
)
from tests.unit.test_election_scenarios import Cluster, make, run_cluster


def _election(cluster: Cluster, node: str) -> Election:
    election = cluster.nodes[node]
    assert election is not None
    return election


def _leader(cluster: Cluster) -> str:
    leaders = {
        s.coordinator_id
        for e in cluster.nodes.values()
        if e is not None and (s := e.status()).state is NodeState.NORMAL
    }
    assert len(leaders) == 1, leaders
    return leaders.pop()


# --------------------------------------------------------------------------- transfer


def test_transfer_hands_the_group_to_the_target_in_a_new_epoch() -> None:
    """After a transfer the target leads every node in an epoch above the old one; the old
    master is a slave and does not take the leadership back while nothing fails."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    old_epoch = _election(cluster, "1").status().epoch
    ready = _election(cluster, "1").transfer_leadership("3", "alice", cluster.now_ms, "patch")
    assert ready.rejection is None
    assert [type(m.body) for m in ready.messages] == [LeadershipTransfer]
    cluster.apply("1", ready, "transfer")
    cluster.deliver_all()
    cluster.run(2000)
    assert _leader(cluster) == "3"
    statuses = {n: _election(cluster, n).status() for n in "123"}
    assert statuses["3"].role is Role.MASTER and statuses["1"].role is Role.SLAVE
    assert {s.epoch for s in statuses.values()} == {old_epoch + 1}
    assert statuses["3"].members == ("1", "2", "3")
    assert statuses["3"].sync_source_id == "3"
    assert statuses["3"].invited == ("1", "2")
    assert statuses["1"].audit[-1] == OperatorRecord(500, "alice", "transfer to 3", "patch")


@pytest.mark.parametrize(
    ("node", "target", "code", "phrase"),
    [
        ("1", "9", RejectCode.INVALID_ARGUMENT, "not a configured node"),
        ("2", "3", RejectCode.FAILED_PRECONDITION, "not the master"),
        ("1", "1", RejectCode.FAILED_PRECONDITION, "already leads"),
        ("1", "4", RejectCode.FAILED_PRECONDITION, "priority 0"),
    ],
)
def test_transfer_refusals_name_the_problem_and_change_nothing(
    node: str, target: str, code: RejectCode, phrase: str
) -> None:
    """A transfer from a non-master, to itself, to an unknown or priority-0 node is refused."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1, "4": 0}, 500)
    election = _election(cluster, node)
    before = election.status()
    assert election.transfer_refusal(target) is not None
    ready = election.transfer_leadership(target, "alice", cluster.now_ms)
    assert ready.rejection is not None
    assert ready.rejection.code is code
    assert phrase in ready.rejection.message
    assert ready.messages == () and ready.persist is None and ready.role_command is None
    assert election.status() == before


def test_transfer_to_a_node_outside_the_group_is_refused() -> None:
    """Only a member can take over: a node that failed was dropped from the group."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    cluster.crash("3")
    cluster.run(1000)
    assert _election(cluster, "1").status().members == ("1", "2")
    refusal = _election(cluster, "1").transfer_refusal("3")
    assert refusal is not None and "not a member" in refusal.message


def test_a_second_transfer_waits_for_the_first() -> None:
    """While one transfer is under way another is refused; it times out if never taken."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    leader = _election(cluster, "1")
    first = leader.transfer_leadership("3", "alice", 500)  # never delivered: 3 never hears
    assert first.rejection is None
    assert leader.status().transfer_target == "3"
    second = leader.transfer_leadership("2", "bob", 501)
    assert second.rejection is not None and "in progress" in second.rejection.message
    cluster.out = []
    cluster.run(2 * 400 + 10)
    assert any("transfer-timeout" in line for line in cluster.out)
    assert leader.status().transfer_target == ""
    assert leader.status().state is NodeState.NORMAL and leader.status().role is Role.MASTER


def test_a_lower_invitation_naming_another_group_is_not_a_transfer() -> None:
    """Members accept a lower inviter only for the group they are in now."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    member = _election(cluster, "2")
    group = member.status().group_name
    ready = member.step(
        PeerMessage("3", "2", Invitation("3:x", 1, member.status().epoch, "1:other")), 501
    )
    assert ready.role_command is None and member.status().group_name == group


@pytest.mark.parametrize(
    ("body", "phrase"),
    [
        (LeadershipTransfer("1:g2", 1, "3", ("1", "2", "3")), "to the receiver"),
        (LeadershipTransfer("3:g2", 1, "2", ("1", "2", "3")), "only a group's coordinator"),
        (LeadershipTransfer("1:g2", 1, "2", ("1", "2", "9")), "configured nodes"),
    ],
)
def test_bad_transfer_messages_are_refused(body: LeadershipTransfer, phrase: str) -> None:
    """A hand-over naming another target, a group the sender does not lead, or unknown
    members is refused and changes nothing."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    member = _election(cluster, "2")
    before = member.status()
    ready = member.step(PeerMessage("1", "2", body), 501)
    assert ready.rejection is not None and phrase in ready.rejection.message
    assert member.status() == before


def test_priority_zero_refuses_a_hand_over() -> None:
    """A priority-0 node never leads, so it refuses a hand-over addressed to it."""
    cluster = run_cluster({"1": 3, "2": 0, "3": 1}, 500)
    member = _election(cluster, "2")
    group = member.status().group_name
    ready = member.step(
        PeerMessage("1", "2", LeadershipTransfer(group, member.status().epoch, "2", ("1", "2"))),
        501,
    )
    assert ready.rejection is not None
    assert ready.rejection.code is RejectCode.FAILED_PRECONDITION


# --------------------------------------------------------------------------- quarantine


def test_a_replica_fault_quarantines_once_and_an_operator_clears_it() -> None:
    """A fault quarantines the node (persisted, audited, loud); the same fault again does
    nothing; a cleared fault does not quarantine again; a new fault does."""
    election = make()
    ready = election.replica_fault("f1", "checksum error in log/7", 10)
    assert ready.persist is not None and ready.persist.quarantine is not None
    assert ready.persist.quarantine_fault_id == "f1"
    assert any(e.level is LogLevel.ERROR and "QUARANTINED" in e.message for e in ready.events)
    status = election.status()
    assert status.quarantine == OperatorRecord(
        10, "replica", "quarantine", "replica fault: checksum error in log/7"
    )
    assert election.replica_fault("f1", "checksum error in log/7", 20).persist is None
    cleared = election.set_quarantine(False, "bob", 30, "store restored")
    assert cleared.persist is not None and cleared.persist.quarantine is None
    assert cleared.persist.cleared_fault_id == "f1"
    assert election.replica_fault("f1", "checksum error in log/7", 40).persist is None
    again = election.replica_fault("f2", "store write failed", 50)
    assert again.persist is not None and again.persist.quarantine is not None
    assert [r.action for r in election.status().audit] == [
        "quarantine",
        "unquarantine",
        "quarantine",
    ]


def test_a_quarantined_node_joins_no_group_and_is_not_a_merge_candidate() -> None:
    """It refuses invitations, does not probe, and answers probes as a non-coordinator."""
    election = make()
    election.set_quarantine(True, "carol", 5, "disk replacement")
    ready = election.step(PeerMessage("3", "1", Invitation("3:a", 3, 0)), 10)
    assert ready.role_command is None and election.status().coordinator_id == "1"
    for now in range(20, 2000, 50):
        ticked = election.tick(now)
        assert ticked.messages == ()
    answer = election.step(PeerMessage("2", "1", AreYouCoordinator("2:a", 2)), 2000)
    replies = [m.body for m in answer.messages]
    assert len(replies) == 1 and isinstance(replies[0], AreYouCoordinatorReply)
    assert not replies[0].is_coordinator


def test_quarantine_survives_a_restart() -> None:
    """The quarantine is persisted: a restarted node is still out of every group."""
    election = make()
    election.set_quarantine(True, "carol", 5, "disk replacement")
    restarted = make(persisted=election.persisted)
    assert restarted.status().quarantine is not None
    ready = restarted.step(PeerMessage("3", "1", Invitation("3:a", 3, 0)), 10)
    assert ready.role_command is None


def test_quarantining_the_master_hands_the_group_to_the_others() -> None:
    """The quarantined master leaves; the next node in rank leads the remaining majority."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    ready = _election(cluster, "1").set_quarantine(True, "carol", cluster.now_ms, "bad disk")
    cluster.apply("1", ready, "quarantine")
    cluster.deliver_all()
    cluster.run(2000)
    assert _election(cluster, "1").status().state is NodeState.INACTIVE
    assert _election(cluster, "2").status().role is Role.MASTER
    assert _election(cluster, "2").status().members == ("2", "3")


# --------------------------------------------------------------------------- override


def test_quorum_override_is_recorded_with_who_when_and_why() -> None:
    """Setting the override keeps who, when and why; clearing it by hand drops the record."""
    election = make()
    ready = election.set_quorum_override(1, "carol", 42, "site A lost")
    assert ready.persist is not None
    assert ready.persist.quorum_override_record == OperatorRecord(
        42, "carol", "quorum-override 1", "site A lost"
    )
    assert election.status().quorum_override_record is not None
    assert any("(site A lost)" in e.message for e in ready.events)
    cleared = election.set_quorum_override(0, "carol", 50)
    assert cleared.persist is not None and cleared.persist.quorum_override_record is None
    assert [r.action for r in election.status().audit] == [
        "quorum-override 1",
        "quorum-override cleared",
    ]


def test_quorum_override_reverts_itself_when_a_majority_is_back() -> None:
    """A lone node running under an override clears it once a majority group forms."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    cluster.crash("1")
    cluster.crash("2")
    cluster.run(600)
    survivor = _election(cluster, "3")
    cluster.apply("3", survivor.set_quorum_override(1, "carol", cluster.now_ms, "dr"), "o")
    cluster.run(300)
    assert survivor.status().role is Role.MASTER and survivor.status().quorum_override == 1
    cluster.start("2")
    cluster.run(1000)
    status = survivor.status()
    assert status.quorum_override == 0 and status.quorum_override_record is None
    cleared = [r for r in status.audit if r.action == "quorum-override cleared"]
    assert [r.operator for r in cleared] == ["auto"]
    assert "a majority" in cleared[0].reason
    # Node 3 served: node 2 joined it to catch up, then node 3 handed the group over.
    assert status.audit[-1].operator == "auto" and status.audit[-1].action == "transfer to 2"
    assert _leader(cluster) == "2"


def test_a_lone_group_under_override_keeps_it() -> None:
    """The override stays while the group is below a majority (it is still needed)."""
    election = make()
    election.set_quorum_override(1, "carol", 5)
    election.tick(200)
    assert election.status().state is NodeState.NORMAL
    assert election.status().quorum_override == 1


# --------------------------------------------------------------------------- one fate per node


def test_a_node_whose_replica_is_silent_joins_no_group_until_it_answers() -> None:
    """Out of every group like a quarantined node, and back (probing again) once the replica
    answers; nothing happens before replica_timeout_ms (300 ms by default)."""
    election = make()
    election.replica_silent(0, 0)
    assert election.tick(299).events == ()
    lost = election.tick(300)
    assert [e.event for e in lost.events] == ["replica-unreachable", "recovery"]
    assert lost.events[0].level is LogLevel.WARNING
    assert "has not answered for 300 ms" in lost.events[0].message
    assert election.status().replica_unreachable_since_ms == 0
    ready = election.step(PeerMessage("3", "1", Invitation("3:a", 3, 0)), 310)
    assert ready.role_command is None and election.status().coordinator_id == "1"
    for now in range(320, 2000, 50):
        assert election.tick(now).messages == ()
    answer = election.step(PeerMessage("2", "1", AreYouCoordinator("2:a", 2)), 2000)
    replies = [m.body for m in answer.messages]
    assert len(replies) == 1 and isinstance(replies[0], AreYouCoordinatorReply)
    assert not replies[0].is_coordinator
    back = election.replica_answered(2100)
    assert [e.event for e in back.events] == ["replica-back", "recovery"]
    assert back.role_command is not None  # the replica's state is read afresh
    assert election.status().replica_unreachable_since_ms is None


def test_a_short_silence_changes_nothing_and_a_silence_from_the_future_is_refused() -> None:
    election = make()
    election.replica_silent(100, 150)
    election.replica_answered(350)
    ticked = election.tick(1000)
    assert all(e.event != "replica-unreachable" for e in ticked.events)
    assert election.status().replica_unreachable_since_ms is None
    refused = election.replica_silent(5000, 1100)
    assert refused.rejection is not None
    assert refused.rejection.code is RejectCode.INVALID_ARGUMENT
    assert "after now" in refused.rejection.message


def test_a_silence_after_slow_answers_is_allowed_twice_their_length_more() -> None:
    """A busy replica answers late though it is well: a silence after answers that took up
    to 60 ms gets 120 ms on top of replica_timeout_ms (300 ms), never more than 300 ms
    more; the reasons name the allowance. One whose answers were quick gets next to none."""
    busy = make()
    busy.replica_silent(0, 0, answer_ms=60)
    assert busy.tick(419).events == ()
    lost = busy.tick(420)
    assert [e.event for e in lost.events] == ["replica-unreachable", "recovery"]
    said = lost.events[0].message
    assert "replica_timeout_ms 300 + 120 allowed for its slow answers" in said

    very_busy = make()
    very_busy.replica_silent(0, 0, answer_ms=2000)
    assert very_busy.tick(599).events == ()
    assert [e.event for e in very_busy.tick(600).events] == ["replica-unreachable", "recovery"]

    quick = make()
    quick.replica_silent(0, 0, answer_ms=0)
    lost = quick.tick(300)
    assert [e.event for e in lost.events] == ["replica-unreachable", "recovery"]
    assert "allowed" not in lost.events[0].message


def test_the_allowance_is_fixed_when_the_silence_begins_and_ends_with_it() -> None:
    """A later report of the same silence moves nothing (a hung replica's last answers are
    all there is); an answer ends the silence, and the next one gets its own allowance."""
    election = make()
    election.replica_silent(0, 0, answer_ms=0)
    election.replica_silent(0, 100, answer_ms=100)
    assert [e.event for e in election.tick(300).events] == ["replica-unreachable", "recovery"]

    election = make()
    election.replica_silent(0, 0, answer_ms=100)
    election.replica_answered(200)
    election.replica_silent(400, 400)
    assert [e.event for e in election.tick(700).events] == ["replica-unreachable", "recovery"]


def test_a_stalled_store_and_a_negative_answer_time_get_no_allowance() -> None:
    stalled = make()
    lost = stalled.replica_silent(0, 2100, store_stalled=True, answer_ms=100)
    assert [e.event for e in lost.events] == ["replica-store-stalled", "recovery"]
    refused = make().replica_silent(0, 0, answer_ms=-1)
    assert refused.rejection is not None
    assert refused.rejection.code is RejectCode.INVALID_ARGUMENT


def test_a_master_whose_store_stalls_leaves_its_group_and_rejoins_once_writes_complete() -> None:
    """A stuck disk: the replica answers, but the driver reports its store stalled (since
    the stall's start). The master leaves at once, telling its group; the others elect a
    new master without it, the reasons name the store; a cleared stall brings it back."""
    cluster = run_cluster({"1": 3, "2": 2, "3": 1}, 500)
    assert _leader(cluster) == "1"
    stalled_since = cluster.now_ms - 2500
    ready = _election(cluster, "1").replica_silent(
        stalled_since, cluster.now_ms, store_stalled=True
    )
    cluster.apply("1", ready, "store stalled")
    cluster.run(1000)
    n1, n2 = _election(cluster, "1").status(), _election(cluster, "2").status()
    assert n2.role is Role.MASTER and n2.state is NodeState.NORMAL
    assert "1" not in n2.members and set(n2.members) == {"2", "3"}
    assert n1.replica_unreachable_since_ms is not None
    assert n1.last_change_reason.startswith("replica store stalled: no write completed for")
    assert "until its writes complete" in n1.last_change_reason
    cluster.apply("1", _election(cluster, "1").replica_answered(cluster.now_ms), "writes back")
    cluster.run(3000)
    statuses = {n: _election(cluster, n).status() for n in "123"}
    assert statuses["1"].replica_unreachable_since_ms is None
    assert all(s.state is NodeState.NORMAL for s in statuses.values())
    leader = _leader(cluster)
    assert set(statuses[leader].members) == {"1", "2", "3"}


def test_a_store_stall_is_named_in_the_leave_and_its_end_in_the_rejoin() -> None:
    election = make()
    # Reported once the stall passed the driver's timeout: the node leaves at once.
    lost = election.replica_silent(0, 2100, store_stalled=True)
    assert [e.event for e in lost.events] == ["replica-store-stalled", "recovery"]
    assert "replica store stalled: no write completed for 2100 ms" in lost.events[0].message
    back = election.replica_answered(4000)
    assert [e.event for e in back.events] == ["replica-back", "recovery"]
    assert "replica store writes complete again after 4000 ms stalled" in back.events[0].message
    assert election.status().replica_unreachable_since_ms is None
