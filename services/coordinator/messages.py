"""Plain data for the coordinator's election: peer messages, replica reports, persisted state,
the status view and the ``Ready`` record the state machine emits.

Everything here is a frozen dataclass or an enum, so the pure core (``election.py``) and the
simulator share values that cannot change under them. ``codec.py`` maps the peer messages to
and from ``squall.v1.coordinator_pb2.PeerMessage``; nothing here imports protobuf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from squall_server.common.loss_record import LossRecord
from squall_server.coordinator.membership import Membership


class NodeState(enum.Enum):
    """A node's election state (IceStorm's replica states)."""

    INACTIVE = "inactive"
    ELECTION = "election"
    REORGANIZATION = "reorganization"
    NORMAL = "normal"


class Role(enum.Enum):
    """The role this node's replica was last told to take."""

    INACTIVE = "inactive"
    MASTER = "master"
    SLAVE = "slave"


class StoreState(enum.Enum):
    """A store's lifecycle state (Qpid's persistent cluster restart note)."""

    EMPTY = "empty"
    CLEAN = "clean"
    DIRTY = "dirty"


class RoleCommandKind(enum.Enum):
    """What the local replica is told to do."""

    MASTER = "master"
    FOLLOW = "follow"
    DEACTIVATE = "deactivate"


class LogLevel(enum.Enum):
    """Severity of a log event; the driver maps it to the logging module's levels."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class RejectCode(enum.Enum):
    """Why an input was refused; ``status`` names the gRPC status the adapter answers with."""

    UNKNOWN_SENDER = "unknown-sender"
    WRONG_RECIPIENT = "wrong-recipient"
    MALFORMED_GROUP_NAME = "malformed-group-name"
    PRIORITY_MISMATCH = "priority-mismatch"
    INVALID_MESSAGE = "invalid-message"
    STALE_EPOCH = "stale-epoch"
    INVALID_ARGUMENT = "invalid-argument"
    FAILED_PRECONDITION = "failed-precondition"
    NOT_FOUND = "not-found"

    @property
    def status(self) -> str:
        """The gRPC status code name: ``INVALID_ARGUMENT``, ``FAILED_PRECONDITION`` or
        ``NOT_FOUND``."""
        if self in (RejectCode.STALE_EPOCH, RejectCode.FAILED_PRECONDITION):
            return "FAILED_PRECONDITION"
        if self is RejectCode.NOT_FOUND:
            return "NOT_FOUND"
        return "INVALID_ARGUMENT"


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """The local replica's state, as the driver reads it from the replica.

    ``command_seq`` is the ``seq`` of the last role command the replica had applied when the
    report was read, and ``active`` whether it was serving a role. Only a report of a
    stopped replica that has applied the newest command is used to answer an invitation or
    to name a sync source: any other may miss entries, because the log can still grow.
    ``shutdown_id`` is a CLEAN store's; ``joined`` says the replica process has held a
    role since it started (its store is part of the running cluster, not one restarted
    from disk).
    """

    cluster_id: str
    last_epoch: int
    last_lsn: int
    store_state: StoreState
    active: bool = False
    command_seq: int = 0
    shutdown_id: str = ""
    joined: bool = False


@dataclass(frozen=True, slots=True)
class MemberReport:
    """What a member tells the coordinator when it accepts: its data and its epoch."""

    node_id: str
    cluster_id: str
    last_epoch: int
    last_lsn: int
    store_state: StoreState
    max_seen: int
    epoch: int
    shutdown_id: str = ""
    joined: bool = False
    membership: Membership | None = None
    """The node set the member persisted (None: its config file's); the coordinator
    adopts the newest set among the reports (membership.py)."""


@dataclass(frozen=True, slots=True)
class AreYouCoordinator:
    """Coordinator probe, sent periodically to find groups to merge.

    ``serving``: the sender coordinates a NORMAL group (its master takes writes). A
    higher-ranked node alone does not merge such a group; it waits for the group's
    catch-up invitation (``Invitation.catch_up``)."""

    group_name: str
    priority: int
    designated_primary: bool = False
    cluster_id: str = ""
    serving: bool = False
    settings_digest: str = ""
    """The digest of the sender's agreed settings (agreement.py); "" compares nothing."""
    settings: tuple[tuple[str, str], ...] = ()
    """The sender's agreed settings, sent only to a node it knows differs."""
    membership_version: int = 0
    """The version of the sender's node set (0: its config file's)."""
    membership_epoch: int = 0
    """The epoch of the newest group that carried that set (two sets of one version made
    by competing changes differ here)."""
    base_digest: str = ""
    """The digest of the agreed settings without the node set: compared instead of
    ``settings_digest`` when the two nodes hold different versions of the node set."""


@dataclass(frozen=True, slots=True)
class AreYouCoordinatorReply:
    """Answer to a probe: whether the replier coordinates a group that could be merged, and
    whether that group is NORMAL (``serving``, as in ``AreYouCoordinator``)."""

    is_coordinator: bool
    group_name: str
    priority: int
    designated_primary: bool = False
    cluster_id: str = ""
    serving: bool = False
    settings_digest: str = ""
    settings: tuple[tuple[str, str], ...] = ()
    """The replier's agreed settings, sent only when the probe's digest differs from its
    own, so the prober can name what differs."""
    membership_version: int = 0
    membership_epoch: int = 0
    base_digest: str = ""


@dataclass(frozen=True, slots=True)
class AreYouThere:
    """Slave check: is the receiver still the coordinator of this group, with me in it?"""

    group_name: str


@dataclass(frozen=True, slots=True)
class AreYouThereReply:
    """Answer to a slave check; ``held_reason`` says why a held group is not formed."""

    group_name: str
    yes: bool
    held_reason: str = ""


@dataclass(frozen=True, slots=True)
class Invitation:
    """Invitation into a new group; the inviter is the node the group name starts with.

    ``transfer_group`` is set when the inviter takes over that group by a leadership
    transfer its coordinator ordered: the group's members (and its coordinator) accept
    it although the inviter ranks below their coordinator.

    ``catch_up`` names the nodes ranked above the inviter (a serving coordinator) that it
    invites as members to catch up: each accepts it while it coordinates no serving group,
    and its own members accept it when it forwards it. Once one is caught up, the inviter
    hands its group over to it (``Ready.hand_over_to``), so a restarted higher-ranked node
    takes the lead back without truncating or fetching while no master serves.
    """

    group_name: str
    priority: int
    epoch: int
    cluster_id: str = ""
    transfer_group: str = ""
    catch_up: tuple[str, ...] = ()
    settings_digest: str = ""
    """The inviter's agreed-settings digest: a node whose own differs refuses."""
    base_digest: str = ""
    membership: Membership | None = None
    """The node set the group forms under (a change in progress included): an invitee
    that holds an older set uses it for this group, and persists it with the epoch."""


@dataclass(frozen=True, slots=True)
class Accept:
    """Acceptance of an invitation, with the member's report and whom it forwarded to."""

    group_name: str
    report: MemberReport
    forwarded_to: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GroupReady:
    """The group is formed (wire message ``Ready``): its epoch, members and sync source."""

    group_name: str
    epoch: int
    members: tuple[str, ...]
    sync_source_id: str
    coordinator_id: str
    max_seen: int
    cluster_id: str = ""
    membership: Membership | None = None
    """The group's node set, persisted by each member with the epoch."""


@dataclass(frozen=True, slots=True)
class GroupReadyAck:
    """The member persisted the group's epoch (wire message ``ReadyAck``)."""

    group_name: str
    epoch: int


@dataclass(frozen=True, slots=True)
class LeadershipTransfer:
    """A coordinator hands its group to ``target``: invite ``members`` into a group of yours.

    Sent by the coordinator of ``group_name`` in ``epoch`` only after its replica stopped
    taking writes and ``target`` held its whole log (the driver checks both first).
    """

    group_name: str
    epoch: int
    target: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Leave:
    """The sender leaves ``group_name`` now: its replica stopped answering, so it can be
    neither master nor a slave whose acks count (``reason`` says so, for the log).

    A member sends it to its coordinator, a coordinator to its members, so the group reacts
    at once instead of after ``member_timeout_ms`` of silence.
    """

    group_name: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StepAside:
    """The coordinator of ``group_name`` in ``epoch`` dropped the receiver, a member: its
    master's replica has heard nothing from the receiver's replica for too long while every
    commit waits for it (acks ``group``). The receiver steps aside: out of every group for
    a while, so the group commits without it (``Ready.step_aside``)."""

    group_name: str
    epoch: int
    silent_ms: int
    bound_ms: int


Body = (
    AreYouCoordinator
    | AreYouCoordinatorReply
    | AreYouThere
    | AreYouThereReply
    | Invitation
    | Accept
    | GroupReady
    | GroupReadyAck
    | LeadershipTransfer
    | Leave
    | StepAside
)


@dataclass(frozen=True, slots=True)
class PeerMessage:
    """One message between coordinators."""

    from_node: str
    to_node: str
    body: Body


@dataclass(frozen=True, slots=True)
class OperatorRecord:
    """Who did what to a node's election, when and why: the audit trail of operator controls.

    ``at_ms`` is wall-clock time (milliseconds since the Unix epoch) as the driver's clock
    gave it; ``operator`` is the user who asked, ``replica`` for a fault the replica
    reported, or ``auto`` for a control the election reverted itself.
    """

    at_ms: int
    operator: str
    action: str
    reason: str = ""


# Operator records a node keeps (newest last); older ones fall off.
AUDIT_RECORDS_MAX = 32


@dataclass(frozen=True, slots=True)
class PersistedState:
    """What a node keeps across restarts; written by the driver before anything is sent.

    ``epoch`` is the newest epoch the node accepted; ``max_seen`` the most nodes it has
    seen together in one group (IceStorm's ``max``); the operator controls are kept so a
    restart does not silently drop them, with who set them, when and why. ``cluster_id``
    is the cluster the node joined, persisted with the epoch of its first group: a node
    whose store is still empty (its replica never took the role) still knows its
    cluster, so a later group cannot mint another id.

    ``quorum_override_record`` says who set the override in force. ``quarantine`` is set
    while the node is quarantined (it then takes no part in any group);
    ``quarantine_fault_id`` names the replica fault that caused it, and
    ``cleared_fault_id`` the last fault an operator cleared, so the replica reporting that
    same fault again does not quarantine the node again. ``audit`` holds the newest
    ``AUDIT_RECORDS_MAX`` operator actions and automatic reverts.

    ``losses`` holds the loss reports of this node no operator acknowledged yet (its
    replica's, and a designated-primary conflict this election found), ``acked_loss_ids``
    the newest acknowledged ids, so a replica still reporting one does not bring it back.
    ``peer_designated`` names the other node of a two-node cluster when it was last heard
    holding the designated-primary flag (persisted, so a restart does not forget it).
    """

    epoch: int = 0
    max_seen: int = 0
    designated_primary: bool = False
    quorum_override: int = 0
    cluster_id: str = ""
    quorum_override_record: OperatorRecord | None = None
    quarantine: OperatorRecord | None = None
    quarantine_fault_id: str = ""
    cleared_fault_id: str = ""
    audit: tuple[OperatorRecord, ...] = ()
    losses: tuple[LossRecord, ...] = ()
    acked_loss_ids: tuple[str, ...] = ()
    peer_designated: tuple[str, ...] = ()
    membership: Membership | None = None


@dataclass(frozen=True, slots=True)
class RoleCommand:
    """What the local replica must do: take a role in an epoch, or stop serving.

    MASTER: become master of ``epoch`` with ``members``; first bring the store to
    ``sync_source_id``'s state when that is another node. FOLLOW: follow ``master_id`` in
    ``epoch``. DEACTIVATE: stop serving writes and the replication stream now. ``seq``
    grows with every command of this Election instance; the replica's reports carry the
    last one applied (``ReplicaReport.command_seq``). MASTER and FOLLOW carry the group's
    ``cluster_id``: an empty store records it, a store of another cluster refuses the role.
    """

    kind: RoleCommandKind
    seq: int = 0
    epoch: int = 0
    master_id: str = ""
    members: tuple[str, ...] = ()
    sync_source_id: str = ""
    group_name: str = ""
    cluster_id: str = ""
    nodes: tuple[str, ...] = ()
    """MASTER: the voting node set the commit majority is counted from (empty: the
    config file's nodes)."""
    learners: tuple[str, ...] = ()
    """MASTER: the running set's learners: members it streams to whose acks count for no
    commit (membership.py)."""


@dataclass(frozen=True, slots=True)
class LogEvent:
    """A log line the driver writes: why something happened (or was refused)."""

    level: LogLevel
    event: str
    message: str


@dataclass(frozen=True, slots=True)
class Rejection:
    """An input refused without any change of state, and the status to answer with."""

    code: RejectCode
    message: str


@dataclass(frozen=True, slots=True)
class Ready:
    """Everything one input produced. The driver applies it in this order:

    1. ``persist``: when set, write it durably (fsync) **before** anything else. Messages
       below may promise it (a ``ReadyAck`` says "I persisted this epoch").
    2. ``messages``: send them, in order, best effort (the protocol tolerates loss).
    3. ``role_command``: apply it to the local replica. After a DEACTIVATE, read the
       replica's state once it has stopped and pass it to ``Election.replica_report`` with
       ``command_seq`` set to the command's ``seq``: the node will not answer an invitation
       or reorganize a group until it has that report.
    4. ``view_changed``: publish the new ``Election.status()`` to group-view watchers.
    5. ``events``: log them (they say why), and ``rejection``: answer the RPC that carried
       the input with ``rejection.code.status``; a rejected input changed nothing.
    6. ``hand_over_to``: a member that joined to catch up (``Invitation.catch_up``) is
       caught up: hand the group to it as an operator's transfer does (the replica's
       ``PrepareHandoff``, then ``Election.transfer_leadership``), in the background.

    When several role commands arise from one input only the last is returned; it
    supersedes the others (a replica told MASTER need not first be told DEACTIVATE).
    """

    persist: PersistedState | None = None
    messages: tuple[PeerMessage, ...] = ()
    role_command: RoleCommand | None = None
    view_changed: bool = False
    events: tuple[LogEvent, ...] = ()
    rejection: Rejection | None = None
    hand_over_to: str = ""
    step_aside: str = ""
    """7. Set (to the reason) when this node's coordinator dropped it from its group with
    ``StepAside``: the driver holds the node out of every group for a while."""
    transfer_dropped: str = ""
    """8. Set (to the target) when this coordinator gave up handing its group over because
    the target left it or went silent before taking over: the driver has the replica lift
    its write fence at once instead of at the fence's deadline."""


@dataclass(frozen=True, slots=True)
class ConfigMismatch:
    """A node refused because one of its agreed settings differs from this node's."""

    node_id: str
    key: str
    local_value: str
    peer_value: str


@dataclass(frozen=True, slots=True)
class ElectionStatus:
    """One node's view, as IceStorm's ``replica`` admin command shows it, plus epoch and role."""

    node_id: str
    coordinator_id: str
    group_name: str
    state: NodeState
    group: tuple[str, ...]
    max_seen: int
    epoch: int
    role: Role
    last_change_reason: str
    priority: int
    designated_primary: bool
    quorum_override: int
    quorum_required: int
    members: tuple[str, ...] = ()
    """Every member, coordinator included, once the group is normal (for the group view)."""
    quorum_override_record: OperatorRecord | None = None
    """Who set the quorum override in force, when and why."""
    quarantine: OperatorRecord | None = None
    """Set while the node is quarantined: who (or which fault) quarantined it, and why."""
    audit: tuple[OperatorRecord, ...] = ()
    """The newest operator actions and automatic reverts on this node, oldest first."""
    invited: tuple[str, ...] = ()
    """On a coordinator: the nodes its last merge invited into the current group."""
    sync_source_id: str = ""
    """The member whose log the group adopted when it formed (known once normal)."""
    transfer_target: str = ""
    """On a coordinator handing its group over: the node it hands it to."""
    replica_unreachable_since_ms: int | None = None
    """Set while the node is out of every group because its replica stopped answering:
    wall-clock time (ms since the Unix epoch) of the replica's last answer."""
    lead_held_off_until_ms: int | None = None
    """Set while the node is out of every group because its replica kept refusing the master
    role: wall-clock time (ms since the Unix epoch) the hold-off ends."""
    lead_held_off_reason: str = ""
    """The last refusal's reason, while held off."""
    config_mismatches: tuple[ConfigMismatch, ...] = ()
    """Nodes refused because their agreed settings differ from this node's, one row per
    differing setting (docs/operations.md, "Consistency at start")."""
    losses: tuple[LossRecord, ...] = ()
    """Loss reports of this node no operator acknowledged yet, oldest first."""
    membership: Membership | None = None
    """The node set this node uses (the config file's until a change)."""
    membership_change: str = ""
    """The membership change in progress on this coordinator, or the outcome of the last
    one (``add-node 4: done in epoch 7``)."""


def _cluster(cluster_id: str) -> str:
    """`` cluster=ID`` for a message that carries a cluster id, else nothing."""
    return f" cluster={cluster_id}" if cluster_id else ""


def _digest(digest: str, settings: tuple[tuple[str, str], ...] = ()) -> str:
    """`` settings=DIGEST`` (and the values, when carried), else nothing."""
    values = " values=" + ",".join(f"{k}={v}" for k, v in settings) if settings else ""
    return f" settings={digest}{values}" if digest else ""


def _membership(membership: Membership | None) -> str:
    """`` nodes=v1@3:1:3,2:2,4:1L`` for a message that carries a changed node set (``L``:
    a learner)."""
    if membership is None or membership.version == 0:
        return ""
    nodes = membership.describe().split("): ", 1)[1]
    return f" nodes=v{membership.version}@{membership.epoch}:{nodes}"


def _format_body(body: Body) -> str:
    """One message body as ``Name key=value ...`` for logs and transcripts."""
    if isinstance(body, AreYouCoordinator):
        extra = " designated" if body.designated_primary else ""
        extra += " serving" if body.serving else ""
        return (
            f"AreYouCoordinator group={body.group_name} priority={body.priority}{extra}"
            + _cluster(body.cluster_id)
            + _digest(body.settings_digest, body.settings)
        )
    if isinstance(body, AreYouCoordinatorReply):
        extra = " designated" if body.designated_primary else ""
        extra += " serving" if body.serving else ""
        return (
            f"AreYouCoordinatorReply coordinator={str(body.is_coordinator).lower()} "
            f"group={body.group_name} priority={body.priority}{extra}"
            + _cluster(body.cluster_id)
            + _digest(body.settings_digest, body.settings)
        )
    if isinstance(body, AreYouThere):
        return f"AreYouThere group={body.group_name}"
    if isinstance(body, AreYouThereReply):
        held = f" held={body.held_reason!r}" if body.held_reason else ""
        return f"AreYouThereReply group={body.group_name} yes={str(body.yes).lower()}{held}"
    if isinstance(body, Invitation):
        extra = f" transfer={body.transfer_group}" if body.transfer_group else ""
        extra += f" catch-up={','.join(body.catch_up)}" if body.catch_up else ""
        return (
            f"Invitation group={body.group_name} priority={body.priority} epoch={body.epoch}"
            + _cluster(body.cluster_id)
            + extra
            + _digest(body.settings_digest)
            + _membership(body.membership)
        )
    if isinstance(body, LeadershipTransfer):
        return (
            f"LeadershipTransfer group={body.group_name} epoch={body.epoch} "
            f"target={body.target} members={','.join(body.members)}"
        )
    if isinstance(body, Leave):
        return f"Leave group={body.group_name} reason={body.reason!r}"
    if isinstance(body, Accept):
        r = body.report
        forwarded = ",".join(body.forwarded_to) or "-"
        store = r.store_state.value
        if r.shutdown_id:
            store += f"/{r.shutdown_id}"
        joined = " joined" if r.joined else ""
        return (
            f"Accept group={body.group_name} epoch={r.epoch} log={r.last_epoch}/{r.last_lsn} "
            f"store={store}{joined} max={r.max_seen} forwarded={forwarded}"
            + _cluster(r.cluster_id)
            + _membership(r.membership)
        )
    if isinstance(body, GroupReady):
        return (
            f"Ready group={body.group_name} epoch={body.epoch} "
            f"members={','.join(body.members)} sync={body.sync_source_id} max={body.max_seen}"
            + _cluster(body.cluster_id)
            + _membership(body.membership)
        )
    return f"ReadyAck group={body.group_name} epoch={body.epoch}"


def format_message(msg: PeerMessage) -> str:
    """A message as ``1->2 AreYouCoordinator group=1:ab12 priority=1`` (logs, transcripts)."""
    return f"{msg.from_node}->{msg.to_node} {_format_body(msg.body)}"


def format_role_command(cmd: RoleCommand) -> str:
    """A role command as one line: ``master epoch=2 members=1,2,3 sync=2``."""
    if cmd.kind is RoleCommandKind.DEACTIVATE:
        return "deactivate"
    if cmd.kind is RoleCommandKind.MASTER:
        learners = f" learners={','.join(cmd.learners)}" if cmd.learners else ""
        return (
            f"master epoch={cmd.epoch} members={','.join(cmd.members)} "
            f"sync={cmd.sync_source_id}{learners}"
        )
    return f"follow master={cmd.master_id} epoch={cmd.epoch}"
