"""Invariant checker for the election simulator: runs after every simulated step.

Safety invariants (docs/architecture.md, "Election and membership"):

* at most one coordinator is ever NORMAL in a given epoch, and at most one node is ever told
  MASTER in a given epoch;
* a NORMAL group holds the quorum: a majority of all configured nodes (less only when an
  operator override or designated primary is in force), and a majority of nodes has
  persisted the group's epoch (the votes that make the first point true);
* a node's persisted epoch never decreases, across restarts included;
* a priority-0 node never coordinates a group and never sends Invitation or Ready;
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
                f"node {node} is quarantined but {status.state.value} with role "
                f"{status.role.value}"
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
        if self.priorities[node] == 0 and status.state is not NodeState.INACTIVE:
            raise InvariantViolation(
                f"node {node} has priority 0 but coordinates in state {status.state.value}"
            )
        if status.state is not NodeState.NORMAL:
            return
        epoch = status.epoch
        first = self.normal_by_epoch.setdefault(epoch, node)
        if first != node:
            raise InvariantViolation(
                f"two coordinators normal in epoch {epoch}: {first} and {node}"
            )
        required = self.majority
        if stored.quorum_override or stored.designated_primary:
            required = 1
        if len(status.members) < required:
            raise InvariantViolation(
                f"node {node} is normal in epoch {epoch} with {len(status.members)} members "
                f"({','.join(status.members)}); a majority is {self.majority}"
            )
        voters = sum(1 for p in durable.values() if p.epoch >= epoch)
        if voters < required:
            raise InvariantViolation(
                f"node {node} is normal in epoch {epoch} but only {voters} nodes have "
                f"persisted an epoch >= {epoch}"
            )

    def check_send(self, msg: PeerMessage) -> None:
        """Priority-0 nodes never invite or form groups."""
        if self.priorities[msg.from_node] == 0 and isinstance(msg.body, Invitation | GroupReady):
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
            raise InvariantViolation(
                f"two masters in epoch {command.epoch}: {first} and {node}"
            )
        if reissue:
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
