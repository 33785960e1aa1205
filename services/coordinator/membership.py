"""The running membership of a cluster and the rules for changing it one node at a time.

The config file lists the nodes a cluster starts with (version 0, the bootstrap). An
operator changes the set while the cluster runs (``squall cluster add-node``,
``remove-node``, ``replace-node``, ``set-priority``); each change is one
``MembershipChange`` that the coordinator of the serving group checks here and then
carries to the members in the ``Ready`` of a re-formed group (election.py, "Membership
changes"). Every change adds, removes or re-addresses at most one voting node, so any
majority of the old set and any majority of the new set share a node (the single-server
changes of Raft's thesis, section 4.1; docs/replication.md says why not joint consensus).

A node that arrives empty (``add-node``, ``replace-node``) comes in as a *learner* (Raft's
non-voting member, thesis section 4.2.1): it is a member of the group and receives the
log, but it neither counts for a group's majority nor for a commit, and never
coordinates. Once its replica is within the catch-up bound of the master's log the
coordinator makes it a voter with one more change (``PROMOTE``), again one voter at a time.
So a new node never stalls commits or weakens the majority while it copies the log, and a
node that never catches up simply stays a learner.

Pure: no I/O; the refusals are sentences an operator can act on.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

# The most nodes a cluster may hold (the election's NODES_MAX).
MEMBERS_MAX = 64
_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Longest address accepted (host:port, IPv6 in brackets included).
_ADDRESS_CHARS_MAX = 256


def _order(node_id: str) -> tuple[int, int, str]:
    """Numeric ids by value, then the others (the election's node_sort_key)."""
    return (0, int(node_id), node_id) if node_id.isdigit() else (1, 0, node_id)


@dataclass(frozen=True, slots=True)
class Member:
    """One node: its id, priority and the addresses its peers dial; a ``learner`` gets the
    log but neither votes, counts for a commit nor coordinates until it is promoted."""

    node_id: str
    priority: int
    coordinator_address: str = ""
    replica_address: str = ""
    learner: bool = False


@dataclass(frozen=True, slots=True)
class Membership:
    """The node set in force.

    ``version`` counts the changes since the config file's set (0); ``epoch`` is the
    epoch of the newest group whose ``Ready`` carried this set (persisted with it). When
    groups form, the set with the highest ``epoch`` among the members' reports wins, as
    Raft's newest log term does: a set that some group went normal with was persisted by
    a majority, so every later majority holds it or a newer one.
    """

    version: int = 0
    epoch: int = 0
    members: tuple[Member, ...] = ()

    @staticmethod
    def bootstrap(members: Collection[Member]) -> Membership:
        """The config file's set: version 0, sorted by node id."""
        return Membership(0, 0, tuple(sorted(members, key=lambda m: _order(m.node_id))))

    @property
    def ids(self) -> tuple[str, ...]:
        """Every node id, in node order."""
        return tuple(m.node_id for m in self.members)

    @property
    def priorities(self) -> dict[str, int]:
        """node id -> priority."""
        return {m.node_id: m.priority for m in self.members}

    @property
    def voters(self) -> tuple[str, ...]:
        """The ids of the nodes that vote (every member but the learners), in node order."""
        return tuple(m.node_id for m in self.members if not m.learner)

    @property
    def learners(self) -> tuple[str, ...]:
        """The ids of the learners, in node order."""
        return tuple(m.node_id for m in self.members if m.learner)

    @property
    def majority(self) -> int:
        """Voters a majority of this set needs."""
        return len(self.voters) // 2 + 1

    def member(self, node_id: str) -> Member | None:
        """The member with this id, or None."""
        return next((m for m in self.members if m.node_id == node_id), None)

    def settings(self) -> tuple[tuple[str, str], ...]:
        """The node entries of the agreed settings, as ClusterConfig.agreed_settings
        writes them, so a bootstrap set has the config file's digest."""
        return tuple(
            (
                f"nodes.{m.node_id}",
                f"priority={m.priority} coordinator={m.coordinator_address} "
                f"replica={m.replica_address}" + (" learner" if m.learner else ""),
            )
            for m in sorted(self.members, key=lambda m: m.node_id)
        )

    def describe(self) -> str:
        """``v2 (epoch 7): 1:3,2:2,4:1L`` for logs and status (``L``: a learner)."""
        nodes = ",".join(
            f"{m.node_id}:{m.priority}{'L' if m.learner else ''}" for m in self.members
        )
        return f"v{self.version} (epoch {self.epoch}): {nodes}"


class ChangeKind(enum.Enum):
    """The four runtime membership changes an operator asks for, and ``PROMOTE``, which
    the coordinator makes itself when a learner has caught up."""

    ADD = "add-node"
    REMOVE = "remove-node"
    REPLACE = "replace-node"
    SET_PRIORITY = "set-priority"
    PROMOTE = "promote-learner"


# What an operator may ask for (PROMOTE is the coordinator's own).
OPERATOR_CHANGES = (ChangeKind.ADD, ChangeKind.REMOVE, ChangeKind.REPLACE, ChangeKind.SET_PRIORITY)


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """One change: ADD and REPLACE carry the (new) addresses; ADD and SET_PRIORITY the
    priority (REPLACE keeps the node's priority)."""

    kind: ChangeKind
    node_id: str
    priority: int = 0
    coordinator_address: str = ""
    replica_address: str = ""

    def describe(self) -> str:
        """``add-node 4 (priority 1, coordinator h:1, replica h:2)``."""
        if self.kind in (ChangeKind.REMOVE, ChangeKind.PROMOTE):
            return f"{self.kind.value} {self.node_id}"
        if self.kind is ChangeKind.SET_PRIORITY:
            return f"{self.kind.value} {self.node_id} {self.priority}"
        extra = f"priority {self.priority}, " if self.kind is ChangeKind.ADD else ""
        return (
            f"{self.kind.value} {self.node_id} ({extra}coordinator "
            f"{self.coordinator_address}, replica {self.replica_address})"
        )


class ChangeRefused(Exception):
    """The change is unsafe or malformed; the message says why and what to do."""


def apply_change(
    current: Membership, change: MembershipChange, *, live: Collection[str], coordinator: str
) -> Membership:
    """The set after ``change`` (version one more), or ChangeRefused naming the reason.

    ``live``: the members of the serving group (coordinator included), the nodes known to
    be up; the change must leave them a majority of both the old and the new set, so the
    group can re-form at once and no acknowledged write depends on a node that leaves.
    ``coordinator``: the node applying it, which can neither be removed nor replaced
    while it leads (transfer the leadership first). ADD and REPLACE make the node a
    learner; PROMOTE makes a learner a voter (the coordinator asks for it once the
    learner has caught up).
    """
    node = change.node_id
    if not _ID_RE.fullmatch(node):
        raise ChangeRefused(
            f"node id {node[:80]!r} is not 1 to 64 characters from A-Z a-z 0-9 '_' '-'"
        )
    existing = current.member(node)
    if change.kind is ChangeKind.ADD:
        if existing is not None:
            raise ChangeRefused(
                f"node id {node} is already a member; use replace-node to give it new addresses"
            )
        if len(current.members) >= MEMBERS_MAX:
            raise ChangeRefused(f"the cluster already has {MEMBERS_MAX} nodes, the most it may")
        _check_priority(change.priority)
        _check_addresses(current, change, ignore=None)
        new = Member(
            node, change.priority, change.coordinator_address, change.replica_address, True
        )
        members = (*current.members, new)
    else:
        if existing is None:
            raise ChangeRefused(f"node {node} is not a member (members: {', '.join(current.ids)})")
        if change.kind is ChangeKind.REMOVE:
            if node == coordinator:
                raise ChangeRefused(
                    f"node {node} coordinates the serving group; hand the leadership to "
                    "another node first (squall cluster transfer), then remove it"
                )
            if len(current.members) == 1:
                raise ChangeRefused(f"node {node} is the only member; a cluster keeps one")
            members = tuple(m for m in current.members if m.node_id != node)
        elif change.kind is ChangeKind.REPLACE:
            if node == coordinator:
                raise ChangeRefused(
                    f"node {node} coordinates the serving group and is up; replace-node is "
                    "for a node that is gone"
                )
            if node in live:
                raise ChangeRefused(
                    f"node {node} is a live member of the serving group; stop it before "
                    "replacing it (replace-node gives a dead node's id to a new machine with "
                    "an empty store)"
                )
            _check_addresses(current, change, ignore=node)
            # The new machine's store is empty: it learns before it votes again.
            members = tuple(
                replace(
                    m,
                    coordinator_address=change.coordinator_address,
                    replica_address=change.replica_address,
                    learner=True,
                )
                if m.node_id == node
                else m
                for m in current.members
            )
        elif change.kind is ChangeKind.PROMOTE:
            if not existing.learner:
                raise ChangeRefused(f"node {node} already votes; only a learner is promoted")
            if node not in live:
                raise ChangeRefused(
                    f"node {node} is not in the serving group; a learner is promoted once "
                    "it has caught up there"
                )
            members = tuple(
                replace(m, learner=False) if m.node_id == node else m for m in current.members
            )
        else:
            _check_priority(change.priority)
            if node == coordinator and change.priority == 0:
                raise ChangeRefused(
                    f"node {node} coordinates the serving group and priority 0 never "
                    "coordinates; hand the leadership to another node first"
                )
            if change.priority == existing.priority:
                raise ChangeRefused(f"node {node} already has priority {change.priority}")
            members = tuple(
                replace(m, priority=change.priority) if m.node_id == node else m
                for m in current.members
            )
    if all(m.priority == 0 or m.learner for m in members):
        raise ChangeRefused("every voting node would have priority 0, so none could coordinate")
    new_set = Membership(current.version + 1, current.epoch, members)
    _check_quorum(current, new_set, live, change)
    return new_set


def _check_priority(priority: int) -> None:
    if priority < 0:
        raise ChangeRefused(
            f"priority {priority} is negative; use 0 for a node that never coordinates"
        )


def _check_addresses(current: Membership, change: MembershipChange, *, ignore: str | None) -> None:
    """Both addresses given, distinct, and used by no other member."""
    wanted = {
        "coordinator address": change.coordinator_address,
        "replica address": change.replica_address,
    }
    for what, address in wanted.items():
        if not address or len(address) > _ADDRESS_CHARS_MAX or ":" not in address:
            raise ChangeRefused(f"{what} {address[:80]!r} is not host:port")
    if change.coordinator_address == change.replica_address:
        raise ChangeRefused(
            f"the coordinator and replica addresses are both {change.coordinator_address}"
        )
    for member in current.members:
        if member.node_id == ignore:
            continue
        taken = {
            member.coordinator_address: "coordinator address",
            member.replica_address: "replica address",
        }
        for what, address in wanted.items():
            if address in taken:
                raise ChangeRefused(
                    f"{what} {address} is already node {member.node_id}'s {taken[address]}"
                )


def _check_quorum(
    old: Membership, new: Membership, live: Collection[str], change: MembershipChange
) -> None:
    """The live voters must make a majority of the old voters and of the new ones."""
    up = set(live)
    if change.kind in (ChangeKind.REMOVE, ChangeKind.REPLACE):
        up.discard(change.node_id)
    old_up = len(up & set(old.voters))
    new_up = len(up & set(new.voters))
    if old_up < old.majority or new_up < new.majority:
        up_names = ",".join(sorted(up & set(old.voters) | up & set(new.voters), key=_order))
        raise ChangeRefused(
            f"{change.describe()} would leave the cluster unable to form a majority: "
            f"{len(old.voters)} -> {len(new.voters)} voters needs {old.majority} of the old "
            f"and {new.majority} of the new set up, and the serving group has "
            f"{up_names or 'none'} "
            f"({old_up} of the old, {new_up} of the new); bring members back first"
        )


def in_force(persisted: Membership | None, bootstrap: Membership) -> Membership:
    """The set a node uses: what it persisted, else the config file's."""
    return persisted if persisted is not None else bootstrap


def newest(candidates: Mapping[str, Membership]) -> str:
    """The key of the set carried by the newest group (highest epoch, then version); ""
    for none. Ties (same epoch) are the same set: one group carries one set."""
    best = ""
    best_key = (-1, -1)
    for key in sorted(candidates):
        m = candidates[key]
        if (m.epoch, m.version) > best_key:
            best, best_key = key, (m.epoch, m.version)
    return best
