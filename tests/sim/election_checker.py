"""Invariant checker for the election simulator: runs after every simulated step.

Safety invariants (docs/architecture.md, "Election and membership"):

* at most one coordinator is ever NORMAL in a given epoch, and at most one node is ever told
  MASTER in a given epoch;
* a NORMAL group holds the quorum: a majority of its node set (the configured nodes, or the
  set a membership change made; less only when an operator override or designated primary
  is in force), and a majority of that set has persisted the group's epoch (the votes that
  make the first point true);
* membership changes: the node sets NORMAL groups use move one node at a time (two sets
  in force one after the other differ by at most one node, so their majorities overlap),
  and a later epoch never goes back to an older set (a change a group went normal with is
  never lost);
* a node's persisted epoch never decreases, across restarts included;
* a priority-0 node, and a learner, never coordinates a group and never sends Invitation
  or Ready; a learner counts for no group's majority and no epoch vote;
* a quarantined node is in no group: never normal, its replica never serving a role;
* a node whose replica is unreachable (one fate per node) is in no group either: it
  coordinates only itself, inactive, its replica told to take no role;
* a new master's sync source holds the newest log of the members still in its epoch.

Only the node an event touched can have changed, so each step checks that node; the
result is the same as checking every node, at a fraction of the cost.
"""

from __future__ import annotations

from collections.abc import Mapping

from squall_server.coordinator.election import Election
from squall_server.coordinator.membership import Membership
from squall_server.coordinator.messages import (
    GroupReady,
    Invitation,
    NodeState,
    PeerMessage,
    PersistedState,
    RoleCommand,
)


class InvariantViolation(AssertionError):
    """A safety invariant failed; the message names it, the node and the epoch."""


class Checker:
    """Remembers what has happened and raises InvariantViolation when an invariant breaks."""

    def __init__(self, priorities: Mapping[str, int]) -> None:
        """Start with no history."""
        self.priorities = dict(priorities)
        self.n = len(priorities)
        self.majority = self.n // 2 + 1
        self.normal_by_epoch: dict[int, str] = {}
        self.master_by_epoch: dict[int, str] = {}
        self.epoch_seen: dict[str, int] = {node: 0 for node in priorities}
        # The node set each NORMAL epoch used (membership changes).
        self.set_by_epoch: dict[int, Membership] = {}

    def check_node(
        self, node: str, election: Election | None, durable: Mapping[str, PersistedState]
    ) -> None:
        """Check one node after it handled an input (or crashed, or restarted)."""
        stored = durable[node]
        if stored.epoch < self.epoch_seen[node]:
            raise InvariantViolation(
                f"node {node}: persisted epoch went back from {self.epoch_seen[node]} to "
                f"{stored.epoch}"
            )
        self.epoch_seen[node] = stored.epoch
        if election is None:
            return
        if election.persisted != stored:
            raise InvariantViolation(
                f"node {node}: in-memory persisted state {election.persisted} differs from "
                f"what the driver wrote {stored}"
            )
        status = election.status()
        if stored.quarantine is not None and (
            status.state is not NodeState.INACTIVE or status.role.value != "inactive"
        ):
            raise InvariantViolation(
                f"node {node} is quarantined but {status.state.value} with role {status.role.value}"
            )
        if status.replica_unreachable_since_ms is not None and (
            status.state is not NodeState.INACTIVE
            or status.role.value != "inactive"
            or status.coordinator_id != node
            or status.group
        ):
            raise InvariantViolation(
                f"node {node}'s replica is unreachable but it is {status.state.value} with "
                f"role {status.role.value}, coordinator {status.coordinator_id}, group "
                f"{','.join(status.group) or '-'}"
            )
        if status.coordinator_id != node:
            return
        membership = status.membership
        priority = (
            membership.priorities.get(node, 0) if membership is not None else self.priorities[node]
        )
        learner = membership is not None and node in membership.learners
        if (priority == 0 or learner) and status.state is not NodeState.INACTIVE:
            raise InvariantViolation(
                f"node {node} has priority 0 or is a learner but coordinates in state "
                f"{status.state.value}"
            )
        if status.state is not NodeState.NORMAL:
            return
        epoch = status.epoch
        first = self.normal_by_epoch.setdefault(epoch, node)
        if first != node:
            raise InvariantViolation(
                f"two coordinators normal in epoch {epoch}: {first} and {node}"
            )
        ids = set(membership.ids) if membership is not None else set(self.priorities)
        # Learners count for no majority: only the voters do.
        voting = set(membership.voters) if membership is not None else ids
        majority = len(voting) // 2 + 1
        required = majority
        if stored.quorum_override or stored.designated_primary:
            required = 1
        if len(set(status.members) & voting) < required or not set(status.members) <= ids:
            raise InvariantViolation(
                f"node {node} is normal in epoch {epoch} with {len(status.members)} members "
                f"({','.join(status.members)}); a majority of its node set's voters "
                f"{','.join(sorted(voting))} is {majority}"
            )
        if membership is not None:
            self.check_set(node, epoch, membership)
        voters = sum(1 for x, p in durable.items() if x in voting and p.epoch >= epoch)
        if voters < required:
            raise InvariantViolation(
                f"node {node} is normal in epoch {epoch} but only {voters} nodes have "
                f"persisted an epoch >= {epoch}"
            )

    def check_set(self, node: str, epoch: int, membership: Membership) -> None:
        """The set of a NORMAL epoch: one node from its neighbours' sets, never older."""
        known = self.set_by_epoch.setdefault(epoch, membership)
        if known.ids != membership.ids or known.version != membership.version:
            raise InvariantViolation(
                f"epoch {epoch} is normal under two node sets: {known.describe()} and "
                f"{membership.describe()} (seen at {node})"
            )
        before = [e for e in self.set_by_epoch if e < epoch]
        after = [e for e in self.set_by_epoch if e > epoch]
        for other in ([max(before)] if before else []) + ([min(after)] if after else []):
            earlier, later = sorted((epoch, other))
            a, b = self.set_by_epoch[earlier], self.set_by_epoch[later]
            if len(set(a.ids) ^ set(b.ids)) > 1 or len(set(a.voters) ^ set(b.voters)) > 1:
                raise InvariantViolation(
                    f"normal epochs {earlier} and {later} use node sets {a.describe()} and "
                    f"{b.describe()}, which differ by more than one node or voter"
                )
            if b.version < a.version:
                raise InvariantViolation(
                    f"normal epoch {later} went back to node set {b.describe()} after epoch "
                    f"{earlier} used {a.describe()}: a membership change was lost"
                )

    def check_send(self, msg: PeerMessage) -> None:
        """Priority-0 nodes and learners never invite or form groups (a coordinator that
        accepted forwards its inviter's invitation to its members: that names the
        inviter's group, not the sender's)."""
        body = msg.body
        if isinstance(body, Invitation) and body.group_name.split(":")[0] != msg.from_node:
            return
        carried = body.membership if isinstance(body, Invitation | GroupReady) else None
        priority = (
            carried.priorities.get(msg.from_node, 0)
            if carried is not None and msg.from_node not in carried.learners
            else 0
            if carried is not None
            else self.priorities[msg.from_node]
        )
        if priority == 0 and isinstance(msg.body, Invitation | GroupReady):
            raise InvariantViolation(
                f"node {msg.from_node} has priority 0 but sent {type(msg.body).__name__}"
            )

    def check_master(
        self,
        node: str,
        command: RoleCommand,
        logs: Mapping[str, tuple[int, int]],
        durable: Mapping[str, PersistedState],
        reissue: bool,
    ) -> None:
        """One master per epoch; the sync source is at least as new as every member."""
        first = self.master_by_epoch.setdefault(command.epoch, node)
        if first != node:
            raise InvariantViolation(f"two masters in epoch {command.epoch}: {first} and {node}")
        if reissue or logs[node][0] == command.epoch:
            # Renewed, or sent again after the replica lost the role it had taken: its
            # log already holds this epoch's entries, which only it could have written.
            return
        source = command.sync_source_id
        if durable[source].epoch > command.epoch:
            return  # the source has moved on to a newer group; its log may have grown
        for member in command.members:
            if durable[member].epoch != command.epoch:
                continue
            if logs[member] > logs[source]:
                raise InvariantViolation(
                    f"master {node} of epoch {command.epoch} syncs from {source} "
                    f"(log {logs[source]}) but member {member} holds newer log {logs[member]}"
                )
