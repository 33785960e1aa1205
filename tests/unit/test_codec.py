"""The coordinator codec: every peer message survives a trip through protobuf, and malformed
protobuf is refused with a ValueError naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from squall.v1 import common_pb2, coordinator_pb2
from squall_server.coordinator.codec import from_proto, status_to_proto, to_proto
from squall_server.coordinator.membership import Member, Membership
from squall_server.coordinator.messages import (
    Accept,
    AreYouCoordinator,
    AreYouCoordinatorReply,
    AreYouThere,
    AreYouThereReply,
    Body,
    ElectionStatus,
    GroupReady,
    GroupReadyAck,
    Invitation,
    LeadershipTransfer,
    Leave,
    MemberReport,
    NodeState,
    OperatorRecord,
    PeerMessage,
    Role,
    StepAside,
    StoreState,
)

REPORT = MemberReport(
    node_id="2",
    cluster_id="c-1",
    last_epoch=4,
    last_lsn=2**40,
    store_state=StoreState.DIRTY,
    max_seen=3,
    epoch=5,
)

_SET = Membership(2, 7, (Member("1", 3, "h1:1", "h1:2"), Member("4", 1, "h4:1", "h4:2")))
BODIES: list[Body] = [
    AreYouCoordinator("1:ab12", 3, designated_primary=True),
    AreYouCoordinatorReply(True, "2:cd34", 2),
    AreYouCoordinatorReply(False, "3:ef56", 0, designated_primary=True),
    AreYouThere("3:ef56"),
    AreYouThereReply("3:ef56", yes=True),
    AreYouThereReply("3:ef56", yes=False),
    Invitation("3:ef56", 3, 9),
    Invitation("3:ef56", 1, 9, transfer_group="1:ab12"),
    LeadershipTransfer("1:ab12", 9, "3", ("1", "2", "3")),
    Accept("3:ef56", REPORT, forwarded_to=("1", "4")),
    Accept("3:ef56", REPORT),
    GroupReady("3:ef56", 10, ("1", "2", "3"), "2", "3", 3),
    GroupReadyAck("3:ef56", 10),
    # The lifecycle fields: cluster ids, shutdown ids, joined replicas, held groups.
    AreYouCoordinator("1:ab12", 3, cluster_id="c-1"),
    AreYouCoordinatorReply(True, "2:cd34", 2, cluster_id="c-1"),
    AreYouThereReply("3:ef56", yes=True, held_reason="refusing to start: no clean store"),
    Invitation("3:ef56", 3, 9, cluster_id="c-1"),
    Accept(
        "3:ef56",
        MemberReport(
            node_id="2",
            cluster_id="c-1",
            last_epoch=4,
            last_lsn=17,
            store_state=StoreState.CLEAN,
            max_seen=3,
            epoch=5,
            shutdown_id="s-1",
            joined=True,
        ),
    ),
    GroupReady("3:ef56", 10, ("1", "2", "3"), "2", "3", 3, cluster_id="c-1"),
    # Consistency at start: the agreed-settings digest, and the values where carried.
    AreYouCoordinator("1:ab12", 3, settings_digest="0123abcd", settings=(("a.b", "1"),)),
    AreYouCoordinatorReply(
        True, "2:cd34", 2, settings_digest="0123abcd", settings=(("durability.acks", "all"),)
    ),
    Invitation("3:ef56", 3, 9, settings_digest="0123abcd"),
    # One fate per node: a node whose replica stopped answering leaves its group.
    Leave("1:ab12", "replica of node 1 has not answered for 300 ms"),
    Leave("1:ab12"),
    # acks "group": a coordinator drops a member whose replica its master cannot hear.
    StepAside("1:ab12", 4, 3051, 3000),
    # Runtime membership: node sets in invitations, Ready and reports; set keys in probes.
    Invitation("3:ef56", 3, 9, base_digest="99ff", membership=_SET),
    GroupReady("3:ef56", 10, ("1", "2", "3"), "2", "3", 3, membership=_SET),
    Accept(
        "3:ef56",
        MemberReport("2", "c-1", 4, 7, StoreState.DIRTY, 3, 9, membership=_SET),
        (),
    ),
    AreYouCoordinator("1:ab12", 3, membership_version=2, membership_epoch=7, base_digest="9f"),
    AreYouCoordinatorReply(True, "2:cd34", 2, membership_version=2, membership_epoch=7),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_round_trip(body: Body) -> None:
    """Encoding then decoding gives back the same message, through bytes too."""
    msg = PeerMessage("2", "3", body)
    wire = to_proto(msg).SerializeToString()
    decoded = from_proto(coordinator_pb2.PeerMessage.FromString(wire))
    assert decoded == msg


def test_store_state_maps_to_the_shared_enum() -> None:
    """The report's store state uses common.proto's StoreState values."""
    pb = to_proto(PeerMessage("2", "3", Accept("3:x", REPORT)))
    assert pb.accept.report.store_state == common_pb2.STORE_STATE_DIRTY


def _accept_pb(**report: object) -> coordinator_pb2.PeerMessage:
    """A valid Accept on the wire, with some report fields overridden."""
    pb = to_proto(PeerMessage("2", "3", Accept("3:x", REPORT)))
    for name, value in report.items():
        setattr(pb.accept.report, name, value)
    return pb


def _bad(mutate: str) -> coordinator_pb2.PeerMessage:
    """Protobuf messages broken in one named way."""
    if mutate == "no body":
        return coordinator_pb2.PeerMessage(from_node="1", to_node="2")
    if mutate == "no sender":
        return coordinator_pb2.PeerMessage(
            to_node="2", are_you_there=coordinator_pb2.AreYouThere(group_name="1:x")
        )
    if mutate == "no recipient":
        return coordinator_pb2.PeerMessage(
            from_node="1", are_you_there=coordinator_pb2.AreYouThere(group_name="1:x")
        )
    if mutate == "empty group":
        return coordinator_pb2.PeerMessage(
            from_node="1", to_node="2", invitation=coordinator_pb2.Invitation(priority=1)
        )
    if mutate == "accept without report":
        return coordinator_pb2.PeerMessage(
            from_node="1", to_node="2", accept=coordinator_pb2.Accept(group_name="2:x")
        )
    if mutate == "unspecified store state":
        return _accept_pb(store_state=common_pb2.STORE_STATE_UNSPECIFIED)
    if mutate == "report without node id":
        return _accept_pb(node_id="")
    if mutate == "ready without members":
        return coordinator_pb2.PeerMessage(
            from_node="1",
            to_node="2",
            ready=coordinator_pb2.Ready(
                group_name="1:x", epoch=2, sync_source_id="1", coordinator_id="1"
            ),
        )
    if mutate == "ready with an empty member":
        return coordinator_pb2.PeerMessage(
            from_node="1",
            to_node="2",
            ready=coordinator_pb2.Ready(
                group_name="1:x",
                epoch=2,
                members=["1", ""],
                sync_source_id="1",
                coordinator_id="1",
            ),
        )
    if mutate == "transfer without target":
        return coordinator_pb2.PeerMessage(
            from_node="1",
            to_node="2",
            leadership_transfer=coordinator_pb2.LeadershipTransfer(
                group_name="1:x", epoch=2, members=["1", "2"]
            ),
        )
    raise AssertionError(mutate)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        ("no body", "body"),
        ("no sender", "from_node"),
        ("no recipient", "to_node"),
        ("empty group", "invitation.group_name"),
        ("accept without report", "accept.report"),
        ("unspecified store state", "accept.report.store_state"),
        ("report without node id", "accept.report.node_id"),
        ("ready without members", "ready.members"),
        ("ready with an empty member", "ready.members[1]"),
        ("transfer without target", "leadership_transfer.target"),
    ],
)
def test_malformed_protobuf_names_the_field(mutate: str, field: str) -> None:
    """Structural problems raise ValueError whose message starts with the field path."""
    with pytest.raises(ValueError) as info:
        from_proto(_bad(mutate))
    assert str(info.value).startswith(f"{field}:")


def test_status_maps_to_coordinator_status() -> None:
    """The status view maps onto CoordinatorStatus with the shared enums."""
    status = ElectionStatus(
        node_id="1",
        coordinator_id="3",
        group_name="3:ab",
        state=NodeState.NORMAL,
        group=(),
        max_seen=3,
        epoch=4,
        role=Role.SLAVE,
        last_change_reason="slave of 3",
        priority=1,
        designated_primary=False,
        quorum_override=0,
        quorum_required=2,
        members=("1", "2", "3"),
    )
    pb = status_to_proto(status)
    assert pb.state == common_pb2.NODE_STATE_NORMAL
    assert pb.role == common_pb2.ROLE_SLAVE
    assert (pb.node_id, pb.coordinator_id, pb.epoch, pb.quorum_required) == ("1", "3", 4, 2)


def test_status_carries_operator_records() -> None:
    """Who set the override, the quarantine and the audit trail reach CoordinatorStatus."""
    record = OperatorRecord(1_700_000_000_000, "carol", "quorum-override 1", "site A lost")
    fault = OperatorRecord(1_700_000_000_500, "replica", "quarantine", "checksum error")
    status = ElectionStatus(
        node_id="1",
        coordinator_id="1",
        group_name="1:ab",
        state=NodeState.INACTIVE,
        group=(),
        max_seen=3,
        epoch=4,
        role=Role.INACTIVE,
        last_change_reason="quarantined",
        priority=1,
        designated_primary=False,
        quorum_override=1,
        quorum_required=1,
        quorum_override_record=record,
        quarantine=fault,
        audit=(record, fault),
        invited=("2", "3"),
        sync_source_id="2",
        transfer_target="3",
    )
    pb = status_to_proto(status)
    assert pb.quorum_override_record.operator == "carol"
    assert pb.quorum_override_record.at_ms == 1_700_000_000_000
    assert pb.quarantine.reason == "checksum error"
    assert [r.action for r in pb.audit] == ["quorum-override 1", "quarantine"]
    assert list(pb.invited) == ["2", "3"]
    assert (pb.sync_source_id, pb.transfer_target) == ("2", "3")
    plain = status_to_proto(replace(status, quorum_override_record=None, quarantine=None))
    assert not plain.HasField("quorum_override_record") and not plain.HasField("quarantine")


def test_status_carries_the_replica_unreachable_time() -> None:
    status = ElectionStatus(
        node_id="1",
        coordinator_id="1",
        group_name="1:ab12",
        state=NodeState.INACTIVE,
        group=(),
        max_seen=3,
        epoch=4,
        role=Role.INACTIVE,
        last_change_reason="replica unreachable",
        priority=3,
        designated_primary=False,
        quorum_override=0,
        quorum_required=2,
        replica_unreachable_since_ms=1_763_780_741_000,
    )
    assert status_to_proto(status).replica_unreachable_since_ms == 1_763_780_741_000
    reachable = replace(status, replica_unreachable_since_ms=None)
    assert status_to_proto(reachable).replica_unreachable_since_ms == 0
    held_off = replace(
        reachable, lead_held_off_until_ms=1_763_780_751_000, lead_held_off_reason="disk full"
    )
    pb = status_to_proto(held_off)
    assert (pb.lead_held_off_until_ms, pb.lead_held_off_reason) == (1_763_780_751_000, "disk full")
    assert status_to_proto(reachable).lead_held_off_until_ms == 0


def test_leave_without_a_group_is_refused() -> None:
    pb = to_proto(PeerMessage("1", "2", Leave("1:ab12", "gone")))
    pb.leave.group_name = ""
    with pytest.raises(ValueError, match=r"leave\.group_name: required"):
        from_proto(pb)


def test_step_aside_without_a_group_is_refused() -> None:
    pb = to_proto(PeerMessage("1", "2", StepAside("1:ab12", 4, 3051, 3000)))
    pb.step_aside.group_name = ""
    with pytest.raises(ValueError, match=r"step_aside\.group_name: required"):
        from_proto(pb)
