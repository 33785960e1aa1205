"""A coordinator ranked below members of its group (one that joined to catch up, or after a
transfer) hands the group over to the highest of them once caught up, and does not scatter
them when it re-forms the group meanwhile.

Goal: the election simulator's seed 50084 (seven nodes) converges. Its priority-1 node led
the others after a transfer; every merge of its own (to take in a higher-ranked node found
alone) answered a member's heartbeat naming the group it had just left with "no" before the
member had the invitation, so the member, ranked above it, recovered and refused the
invitation from below: five re-formations in 2.4 s. Then its hand-over to the caught-up
priority-8 node was refused because a merge had begun, and was not asked for again for
``2 * member_timeout_ms`` although the re-formed group held the node caught up: the lead
moved past the liveness deadline. Each step is replayed here on the transcripts' cluster of
three nodes (tests/unit/test_election_scenarios.py), with one message held back.
"""

from __future__ import annotations

import pytest

from squall_server.coordinator.election import Election, ElectionConfig
from squall_server.coordinator.messages import (
    AreYouThere,
    AreYouThereReply,
    Invitation,
    NodeState,
    PeerMessage,
    RejectCode,
)
from tests.unit.test_election_scenarios import Cluster, execute

MEMBER_TIMEOUT_MS = ElectionConfig.member_timeout_ms  # the default, which the transcripts run with


def _node_2_serving_node_1_catching_up() -> tuple[Cluster, Election]:
    """Priorities 3, 2, 1. Node 1 crashed, node 2 leads node 3; node 1 restarts and joins node
    2's group to catch up (its replica is still fetching, so the master reports no lag for
    it and the cluster's own renewals ask for no hand-over)."""
    cluster: Cluster | None = None
    for line in (
        "cluster 1:3 2:2 3:1",
        "start 1 2 3",
        "run ms=300",
        "crash 1",
        "run ms=800",
        "catchup 1 hold",
        "restart 1",
        "run ms=600",
    ):
        cluster, _ = execute(cluster, line)
    assert cluster is not None
    node2 = cluster.nodes["2"]
    assert node2 is not None
    status = node2.status()
    assert status.state is NodeState.NORMAL and status.coordinator_id == "2", status
    assert status.members == ("1", "2", "3"), status
    return cluster, node2


def test_a_hand_over_refused_while_the_group_re_formed_is_asked_again_in_the_new_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node 2's replica reports node 1 caught up: the election asks for the hand-over. Before
    the driver's PrepareHandoff is done, node 2 merges node 3 back; the transfer, called
    during the merge, is refused (not the master). Nothing of it is under way in the new
    group, which still holds node 1 caught up: the next renewal asks again, rather than
    ``2 * member_timeout_ms`` after the first ask. Within one group the limit stands."""
    cluster, node2 = _node_2_serving_node_1_catching_up()
    asked_at = cluster.now_ms
    asked = node2.slave_lags({"1": 0, "3": 0}, asked_at)
    assert asked.hand_over_to == "1", asked
    epoch = node2.status().epoch
    refusals: list[str] = []
    deliver = cluster.deliver

    def transfer_during_the_merge(message: PeerMessage) -> None:
        if message.from_node == "2" and isinstance(message.body, Invitation) and not refusals:
            # The driver's PrepareHandoff is over: it calls transfer_leadership.
            ready = node2.transfer_leadership("1", "auto", cluster.now_ms, "caught up")
            assert ready.rejection is not None
            assert ready.rejection.code is RejectCode.FAILED_PRECONDITION
            refusals.append(ready.rejection.message)
        deliver(message)

    monkeypatch.setattr(cluster, "deliver", transfer_during_the_merge)
    # Node 3 restarts: alone, it is merged back by node 2 into a new group (new epoch).
    for line in ("crash 3", "restart 3", "run ms=300"):
        execute(cluster, line)
    assert refusals and "not the master (state election" in refusals[0], refusals
    status = node2.status()
    assert status.state is NodeState.NORMAL and status.epoch > epoch, status
    assert status.members == ("1", "2", "3"), status
    assert cluster.now_ms < asked_at + 2 * MEMBER_TIMEOUT_MS  # the old limit still runs

    again = node2.slave_lags({"1": 0, "3": 0}, cluster.now_ms)
    assert again.hand_over_to == "1", again
    assert any(e.event == "caught-up" for e in again.events)
    # Asked in this group now: not asked again until the transfer's own limit has passed.
    assert not node2.slave_lags({"1": 0, "3": 0}, cluster.now_ms).hand_over_to
    cluster.run(2 * MEMBER_TIMEOUT_MS)
    assert node2.status().epoch == status.epoch
    assert node2.slave_lags({"1": 0, "3": 0}, cluster.now_ms).hand_over_to == "1"


def test_a_merge_does_not_tell_a_member_ranked_above_it_no_before_its_invitation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator hands node 1's group to node 3, ranked lowest: nodes 1 and 2 follow it.
    Node 2 restarts and is alone; node 3, which serves, merges it back to catch up, with
    node 1. Node 1's heartbeat naming the group node 3 just left reaches it before node 1
    has the invitation. A "no" would send node 1 to recovery, and from its own group it
    refuses the invitation of node 3, ranked below it: the group would form without it
    after ``member_timeout_ms`` and merge it back later. Node 3 leaves the question
    unanswered, node 1 takes the invitation, and the group re-forms once, with every node.
    The silence lasts ``member_timeout_ms`` (by then the member's last "yes" is that old:
    it has recovered anyway)."""
    cluster: Cluster | None = None
    for line in ("cluster 1:3 2:2 3:1", "start 1 2 3", "run ms=300", "transfer 1 to=3"):
        cluster, _ = execute(cluster, line)
    assert cluster is not None
    cluster.run(300)
    node3 = cluster.nodes["3"]
    assert node3 is not None
    status = node3.status()
    assert status.state is NodeState.NORMAL and status.coordinator_id == "3", status
    assert status.members == ("1", "2", "3"), status
    old_group, epoch = status.group_name, status.epoch
    answers: list[PeerMessage] = []
    deliver = cluster.deliver

    def heartbeat_overtakes_the_invitation(message: PeerMessage) -> None:
        if (
            message.from_node == "3"
            and message.to_node == "1"
            and isinstance(message.body, Invitation)
            and not answers
        ):
            question = PeerMessage("1", "3", AreYouThere(old_group))
            ready = node3.step(question, cluster.now_ms)
            assert ready.rejection is None, ready
            answers.append(question)
            for answer in ready.messages:
                answers.append(answer)
                deliver(answer)
        deliver(message)

    monkeypatch.setattr(cluster, "deliver", heartbeat_overtakes_the_invitation)
    # Node 2's replica is still fetching: no hand-over to it within the run.
    for line in ("crash 2", "catchup 2 hold", "restart 2", "run ms=300"):
        execute(cluster, line)
    assert answers, "node 3 sent node 1 no invitation"
    for node in ("1", "2", "3"):
        election = cluster.nodes[node]
        assert election is not None
        status = election.status()
        assert status.state is NodeState.NORMAL and status.coordinator_id == "3", (node, status)
        assert status.members == ("1", "2", "3") and status.epoch == epoch + 1, (node, status)
    assert answers[1:] == [], f"node 3 answered the old group's heartbeat: {answers[1:]}"

    # Past member_timeout_ms the old group's heartbeat is told "no" again.
    late = PeerMessage("1", "3", AreYouThere(old_group))
    ready = node3.step(late, cluster.now_ms + MEMBER_TIMEOUT_MS)
    assert [m.body for m in ready.messages] == [AreYouThereReply(old_group, False)], ready
