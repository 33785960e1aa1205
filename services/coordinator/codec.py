"""Maps the election's dataclasses to and from ``squall.v1.coordinator_pb2`` messages.

The only module of the coordinator's core that imports protobuf. Decoding checks structure
(a body is set, required strings are present, enums are specified) and raises ``ValueError``
naming the bad field (``accept.report.store_state``); the meaning (is the sender a configured
node, is the group name well formed, is the epoch new) is the election's to judge, so it is
logged and answered there.
"""

from __future__ import annotations

from squall.v1 import common_pb2, coordinator_pb2
from squall_server.common.loss import loss_to_proto
from squall_server.coordinator.membership import (
    MEMBERS_MAX,
    ChangeKind,
    Member,
    Membership,
    MembershipChange,
)
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

_STORE_TO_PB: dict[StoreState, common_pb2.StoreState.ValueType] = {
    StoreState.EMPTY: common_pb2.STORE_STATE_EMPTY,
    StoreState.CLEAN: common_pb2.STORE_STATE_CLEAN,
    StoreState.DIRTY: common_pb2.STORE_STATE_DIRTY,
}
_STORE_FROM_PB = {v: k for k, v in _STORE_TO_PB.items()}
_STATE_TO_PB: dict[NodeState, common_pb2.NodeState.ValueType] = {
    NodeState.INACTIVE: common_pb2.NODE_STATE_INACTIVE,
    NodeState.ELECTION: common_pb2.NODE_STATE_ELECTION,
    NodeState.REORGANIZATION: common_pb2.NODE_STATE_REORGANIZATION,
    NodeState.NORMAL: common_pb2.NODE_STATE_NORMAL,
}
_ROLE_TO_PB: dict[Role, common_pb2.Role.ValueType] = {
    Role.INACTIVE: common_pb2.ROLE_INACTIVE,
    Role.MASTER: common_pb2.ROLE_MASTER,
    Role.SLAVE: common_pb2.ROLE_SLAVE,
}


def _require(value: str, field: str) -> str:
    """Return a required string, or raise ValueError naming the empty field."""
    if not value:
        raise ValueError(f"{field}: required, but empty")
    return value


def set_to_pb(membership: Membership) -> coordinator_pb2.NodeSet:
    """A node set as protobuf."""
    return coordinator_pb2.NodeSet(
        version=membership.version,
        epoch=membership.epoch,
        members=[
            coordinator_pb2.MemberSpec(
                node_id=m.node_id,
                priority=m.priority,
                coordinator_address=m.coordinator_address,
                replica_address=m.replica_address,
                learner=m.learner,
            )
            for m in membership.members
        ],
    )


def _set_from_pb(pb: coordinator_pb2.NodeSet, field: str) -> Membership:
    """A node set from protobuf; ValueError names the bad field."""
    if not 1 <= len(pb.members) <= MEMBERS_MAX:
        raise ValueError(f"{field}.members: 1 to {MEMBERS_MAX} nodes, got {len(pb.members)}")
    members = tuple(
        Member(
            _require(m.node_id, f"{field}.members[{i}].node_id"),
            m.priority,
            m.coordinator_address,
            m.replica_address,
            m.learner,
        )
        for i, m in enumerate(pb.members)
    )
    if len({m.node_id for m in members}) != len(members):
        raise ValueError(f"{field}.members: a node id appears twice")
    return Membership(pb.version, pb.epoch, members)


def _optional_set(pb: object, field: str) -> Membership | None:
    """The message's ``membership`` node set, None when unset."""
    if not pb.HasField("membership"):  # type: ignore[attr-defined]
        return None
    return _set_from_pb(pb.membership, field)  # type: ignore[attr-defined]


_CHANGE_FROM_PB = {
    coordinator_pb2.MEMBERSHIP_CHANGE_KIND_ADD_NODE: ChangeKind.ADD,
    coordinator_pb2.MEMBERSHIP_CHANGE_KIND_REMOVE_NODE: ChangeKind.REMOVE,
    coordinator_pb2.MEMBERSHIP_CHANGE_KIND_REPLACE_NODE: ChangeKind.REPLACE,
    coordinator_pb2.MEMBERSHIP_CHANGE_KIND_SET_PRIORITY: ChangeKind.SET_PRIORITY,
}
CHANGE_TO_PB = {v: k for k, v in _CHANGE_FROM_PB.items()}


def change_from_proto(pb: coordinator_pb2.ChangeMembershipRequest) -> MembershipChange:
    """A membership change request; ValueError names the bad field."""
    kind = _CHANGE_FROM_PB.get(pb.kind)
    if kind is None:
        raise ValueError(
            f"kind: {pb.kind} is not ADD_NODE, REMOVE_NODE, REPLACE_NODE or SET_PRIORITY"
        )
    return MembershipChange(
        kind,
        _require(pb.node_id, "node_id"),
        pb.priority,
        pb.coordinator_address,
        pb.replica_address,
    )


def _report_to_pb(report: MemberReport) -> coordinator_pb2.MemberReport:
    """A member report as protobuf."""
    return coordinator_pb2.MemberReport(
        node_id=report.node_id,
        cluster_id=report.cluster_id,
        last_epoch=report.last_epoch,
        last_lsn=report.last_lsn,
        store_state=_STORE_TO_PB[report.store_state],
        max_seen=report.max_seen,
        epoch=report.epoch,
        shutdown_id=report.shutdown_id,
        joined=report.joined,
        membership=set_to_pb(report.membership) if report.membership is not None else None,
    )


def _report_from_pb(pb: coordinator_pb2.MemberReport, field: str) -> MemberReport:
    """A member report from protobuf; ValueError names the bad field."""
    store_state = _STORE_FROM_PB.get(pb.store_state)
    if store_state is None:
        raise ValueError(f"{field}.store_state: {pb.store_state} is not EMPTY, CLEAN or DIRTY")
    return MemberReport(
        node_id=_require(pb.node_id, f"{field}.node_id"),
        cluster_id=pb.cluster_id,
        last_epoch=pb.last_epoch,
        last_lsn=pb.last_lsn,
        store_state=store_state,
        max_seen=pb.max_seen,
        epoch=pb.epoch,
        shutdown_id=pb.shutdown_id,
        joined=pb.joined,
        membership=_optional_set(pb, f"{field}.membership"),
    )


def to_proto(msg: PeerMessage) -> coordinator_pb2.PeerMessage:
    """Encode one peer message."""
    pb = coordinator_pb2.PeerMessage(from_node=msg.from_node, to_node=msg.to_node)
    body = msg.body
    if isinstance(body, AreYouCoordinator):
        pb.are_you_coordinator.CopyFrom(
            coordinator_pb2.AreYouCoordinator(
                group_name=body.group_name,
                priority=body.priority,
                designated_primary=body.designated_primary,
                cluster_id=body.cluster_id,
                serving=body.serving,
                settings_digest=body.settings_digest,
                settings=[coordinator_pb2.AgreedSetting(key=k, value=v) for k, v in body.settings],
                membership_version=body.membership_version,
                membership_epoch=body.membership_epoch,
                base_digest=body.base_digest,
            )
        )
    elif isinstance(body, AreYouCoordinatorReply):
        pb.are_you_coordinator_reply.CopyFrom(
            coordinator_pb2.AreYouCoordinatorReply(
                is_coordinator=body.is_coordinator,
                group_name=body.group_name,
                priority=body.priority,
                designated_primary=body.designated_primary,
                cluster_id=body.cluster_id,
                serving=body.serving,
                settings_digest=body.settings_digest,
                settings=[coordinator_pb2.AgreedSetting(key=k, value=v) for k, v in body.settings],
                membership_version=body.membership_version,
                membership_epoch=body.membership_epoch,
                base_digest=body.base_digest,
            )
        )
    elif isinstance(body, AreYouThere):
        pb.are_you_there.CopyFrom(coordinator_pb2.AreYouThere(group_name=body.group_name))
    elif isinstance(body, AreYouThereReply):
        pb.are_you_there_reply.CopyFrom(
            coordinator_pb2.AreYouThereReply(
                group_name=body.group_name, yes=body.yes, held_reason=body.held_reason
            )
        )
    elif isinstance(body, Invitation):
        pb.invitation.CopyFrom(
            coordinator_pb2.Invitation(
                group_name=body.group_name,
                priority=body.priority,
                epoch=body.epoch,
                cluster_id=body.cluster_id,
                transfer_group=body.transfer_group,
                catch_up=body.catch_up,
                settings_digest=body.settings_digest,
                base_digest=body.base_digest,
                membership=set_to_pb(body.membership) if body.membership is not None else None,
            )
        )
    elif isinstance(body, Accept):
        pb.accept.CopyFrom(
            coordinator_pb2.Accept(
                group_name=body.group_name,
                report=_report_to_pb(body.report),
                forwarded_to=list(body.forwarded_to),
            )
        )
    elif isinstance(body, GroupReady):
        pb.ready.CopyFrom(
            coordinator_pb2.Ready(
                group_name=body.group_name,
                epoch=body.epoch,
                members=list(body.members),
                sync_source_id=body.sync_source_id,
                coordinator_id=body.coordinator_id,
                max_seen=body.max_seen,
                cluster_id=body.cluster_id,
                membership=set_to_pb(body.membership) if body.membership is not None else None,
            )
        )
    elif isinstance(body, LeadershipTransfer):
        pb.leadership_transfer.CopyFrom(
            coordinator_pb2.LeadershipTransfer(
                group_name=body.group_name,
                epoch=body.epoch,
                target=body.target,
                members=list(body.members),
            )
        )
    elif isinstance(body, Leave):
        pb.leave.CopyFrom(coordinator_pb2.Leave(group_name=body.group_name, reason=body.reason))
    elif isinstance(body, StepAside):
        pb.step_aside.CopyFrom(
            coordinator_pb2.StepAside(
                group_name=body.group_name,
                epoch=body.epoch,
                silent_ms=body.silent_ms,
                bound_ms=body.bound_ms,
            )
        )
    else:
        pb.ready_ack.CopyFrom(
            coordinator_pb2.ReadyAck(group_name=body.group_name, epoch=body.epoch)
        )
    return pb


def from_proto(pb: coordinator_pb2.PeerMessage) -> PeerMessage:
    """Decode one peer message; ValueError names the first bad field."""
    from_node = _require(pb.from_node, "from_node")
    to_node = _require(pb.to_node, "to_node")
    kind = pb.WhichOneof("body")
    body: Body
    if kind == "are_you_coordinator":
        m = pb.are_you_coordinator
        body = AreYouCoordinator(
            group_name=_require(m.group_name, "are_you_coordinator.group_name"),
            priority=m.priority,
            designated_primary=m.designated_primary,
            cluster_id=m.cluster_id,
            serving=m.serving,
            settings_digest=m.settings_digest,
            settings=tuple((s.key, s.value) for s in m.settings),
            membership_version=m.membership_version,
            membership_epoch=m.membership_epoch,
            base_digest=m.base_digest,
        )
    elif kind == "are_you_coordinator_reply":
        r = pb.are_you_coordinator_reply
        body = AreYouCoordinatorReply(
            is_coordinator=r.is_coordinator,
            group_name=_require(r.group_name, "are_you_coordinator_reply.group_name"),
            priority=r.priority,
            designated_primary=r.designated_primary,
            cluster_id=r.cluster_id,
            serving=r.serving,
            settings_digest=r.settings_digest,
            settings=tuple((s.key, s.value) for s in r.settings),
            membership_version=r.membership_version,
            membership_epoch=r.membership_epoch,
            base_digest=r.base_digest,
        )
    elif kind == "are_you_there":
        body = AreYouThere(
            group_name=_require(pb.are_you_there.group_name, "are_you_there.group_name")
        )
    elif kind == "are_you_there_reply":
        t = pb.are_you_there_reply
        body = AreYouThereReply(
            group_name=_require(t.group_name, "are_you_there_reply.group_name"),
            yes=t.yes,
            held_reason=t.held_reason,
        )
    elif kind == "invitation":
        i = pb.invitation
        body = Invitation(
            group_name=_require(i.group_name, "invitation.group_name"),
            priority=i.priority,
            epoch=i.epoch,
            cluster_id=i.cluster_id,
            transfer_group=i.transfer_group,
            catch_up=tuple(i.catch_up),
            settings_digest=i.settings_digest,
            base_digest=i.base_digest,
            membership=_optional_set(i, "invitation.membership"),
        )
    elif kind == "accept":
        a = pb.accept
        if not a.HasField("report"):
            raise ValueError("accept.report: required, but missing")
        for index, node in enumerate(a.forwarded_to):
            _require(node, f"accept.forwarded_to[{index}]")
        body = Accept(
            group_name=_require(a.group_name, "accept.group_name"),
            report=_report_from_pb(a.report, "accept.report"),
            forwarded_to=tuple(a.forwarded_to),
        )
    elif kind == "ready":
        g = pb.ready
        if not g.members:
            raise ValueError("ready.members: required, but empty")
        for index, node in enumerate(g.members):
            _require(node, f"ready.members[{index}]")
        body = GroupReady(
            group_name=_require(g.group_name, "ready.group_name"),
            epoch=g.epoch,
            members=tuple(g.members),
            sync_source_id=_require(g.sync_source_id, "ready.sync_source_id"),
            coordinator_id=_require(g.coordinator_id, "ready.coordinator_id"),
            max_seen=g.max_seen,
            cluster_id=g.cluster_id,
            membership=_optional_set(g, "ready.membership"),
        )
    elif kind == "ready_ack":
        k = pb.ready_ack
        body = GroupReadyAck(
            group_name=_require(k.group_name, "ready_ack.group_name"), epoch=k.epoch
        )
    elif kind == "leadership_transfer":
        t2 = pb.leadership_transfer
        for index, node in enumerate(t2.members):
            _require(node, f"leadership_transfer.members[{index}]")
        body = LeadershipTransfer(
            group_name=_require(t2.group_name, "leadership_transfer.group_name"),
            epoch=t2.epoch,
            target=_require(t2.target, "leadership_transfer.target"),
            members=tuple(t2.members),
        )
    elif kind == "leave":
        body = Leave(
            group_name=_require(pb.leave.group_name, "leave.group_name"),
            reason=pb.leave.reason,
        )
    elif kind == "step_aside":
        body = StepAside(
            group_name=_require(pb.step_aside.group_name, "step_aside.group_name"),
            epoch=pb.step_aside.epoch,
            silent_ms=pb.step_aside.silent_ms,
            bound_ms=pb.step_aside.bound_ms,
        )
    else:
        raise ValueError(
            "body: no message set (expected one of are_you_coordinator ... step_aside)"
        )
    return PeerMessage(from_node=from_node, to_node=to_node, body=body)


def record_to_proto(record: OperatorRecord) -> common_pb2.OperatorRecord:
    """An operator record as protobuf."""
    return common_pb2.OperatorRecord(
        at_ms=record.at_ms, operator=record.operator, action=record.action, reason=record.reason
    )


def status_to_proto(status: ElectionStatus) -> coordinator_pb2.CoordinatorStatus:
    """The election's status as the CoordinatorStatus the gRPC adapter returns."""
    pb = _status_core_to_proto(status)
    if status.quorum_override_record is not None:
        pb.quorum_override_record.CopyFrom(record_to_proto(status.quorum_override_record))
    if status.quarantine is not None:
        pb.quarantine.CopyFrom(record_to_proto(status.quarantine))
    pb.audit.extend(record_to_proto(r) for r in status.audit)
    pb.invited.extend(status.invited)
    pb.sync_source_id = status.sync_source_id
    pb.transfer_target = status.transfer_target
    if status.replica_unreachable_since_ms is not None:
        pb.replica_unreachable_since_ms = status.replica_unreachable_since_ms
    if status.lead_held_off_until_ms is not None:
        pb.lead_held_off_until_ms = status.lead_held_off_until_ms
        pb.lead_held_off_reason = status.lead_held_off_reason
    pb.config_mismatches.extend(
        common_pb2.ConfigMismatch(
            node_id=m.node_id, key=m.key, local_value=m.local_value, peer_value=m.peer_value
        )
        for m in status.config_mismatches
    )
    pb.losses.extend(loss_to_proto(r) for r in status.losses)
    if status.membership is not None:
        pb.membership.CopyFrom(set_to_pb(status.membership))
    pb.membership_change = status.membership_change
    return pb


def _status_core_to_proto(status: ElectionStatus) -> coordinator_pb2.CoordinatorStatus:
    """The IceStorm table fields of the status."""
    return coordinator_pb2.CoordinatorStatus(
        node_id=status.node_id,
        coordinator_id=status.coordinator_id,
        group_name=status.group_name,
        state=_STATE_TO_PB[status.state],
        group=list(status.group),
        max_seen=status.max_seen,
        epoch=status.epoch,
        role=_ROLE_TO_PB[status.role],
        last_change_reason=status.last_change_reason,
        priority=status.priority,
        designated_primary=status.designated_primary,
        quorum_override=status.quorum_override,
        quorum_required=status.quorum_required,
    )
