"""The coordinator's driver logic, synchronous: applies the Election's ``Ready`` records and
decides what its loops do next, with no asyncio, gRPC or disk inside.

``CoordinatorDriver`` owns the pure ``Election`` and everything the driver decides around
it: it persists, sends and hands role commands on in the order ``Ready`` documents; it
turns the replica's answers to role commands into reports, recoveries and the one fate per
node watch (``replica_silent`` / ``replica_answered``); it recovers with a fresh Election
when the replica refuses a role, held off from leading for a while after
``MASTER_REFUSALS_MAX`` refusals of the master role in a row. What it needs from the world
is injected: a ``Clock``, a ``PeerTransport`` (send one peer message, fire and forget), a
``StateStore`` (the persisted state: a file, or memory in the simulator) and a few hooks
that wake its loops.

Two shells run it. ``services/coordinator/node.py`` (``CoordinatorNode``) runs three
asyncio loops over gRPC: the tick loop sleeps ``tick()``'s answer, the role loop sends
``role_wanted()`` to the replica and waits as ``role_outcome()`` says, the watch loop calls
``watch()`` every ``watch_interval_ms`` and probes the replica's health when told to. The
simulator (``tests/sim/election_sim.py``) runs the same calls as events on its virtual
clock, with a simulated network, replica and in-memory state store. The loops hold no
decisions of their own, so what the simulator runs is what ships. (A deterministic
asyncio event loop with a virtual clock would run the shell itself too, but would cost a
task switch per message over thousands of seeds, and its ordering would depend on
asyncio's scheduler rather than on the seed.)
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from squall_server.common.clock import Clock
from squall_server.common.loss_record import LossRecord
from squall_server.coordinator.answer_times import RecentAnswerTimes
from squall_server.coordinator.election import Election, ElectionConfig, LeadHoldOff
from squall_server.coordinator.membership import MembershipChange
from squall_server.coordinator.messages import (
    LogLevel,
    PeerMessage,
    PersistedState,
    Ready,
    ReplicaReport,
    RoleCommand,
    RoleCommandKind,
)
from squall_server.coordinator.persist import load_state, save_state

log = logging.getLogger("squall.coordinator")

_LEVELS = {
    LogLevel.DEBUG: logging.DEBUG,
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
}
# A replica's reorganization progress is logged at most this often.
SYNC_LOG_INTERVAL_MS = 1000
# One fate per node: the replica counts as quiet once this many heartbeat intervals pass
# without an answer (a role renewal is answered about once per interval); the driver then
# probes its health and tells the election since when it has been silent. The election
# decides (after timeouts.replica_timeout_ms) that the node leaves its group.
QUIET_HEARTBEATS = 1.5
# How often the watch looks at the replica's last answer, in heartbeat intervals.
WATCH_HEARTBEATS = 0.5
# Master refusals: once the replica has refused the master role (FAILED_PRECONDITION) this
# many times in a row, the node steps aside from leading for MASTER_REFUSAL_HOLDOFF_MS: out
# of every group, so the other nodes elect a master among themselves instead of this
# (highest-ranked) node leading and naming its refusing replica again, for ever. A master role
# the replica takes resets the count; a call it does not answer (UNAVAILABLE: its sync source
# is unreachable, say) neither counts nor resets: such failures step the node aside once
# they have lasted master_failing_ms_max in one epoch. After the hold-off one more refusal steps
# aside again (docs/operations.md, "A replica that refuses the master role").
MASTER_REFUSALS_MAX = 3
# About 25 election timeouts (member_timeout_ms 400) with the defaults: a disk that is full
# or failing is not fixed in a second, and each attempt costs the cluster a re-formation.
MASTER_REFUSAL_HOLDOFF_MS = 10_000
# Slave refusals: a member whose replica refuses the slave role recovers into a group of
# its own, and the group's coordinator merges it back at once, a new epoch each time: the
# master is deposed and re-formed about twenty times a second (every write in flight
# indeterminate) for as long as the replica refuses, e.g. the 90 s a replica stays frozen
# after an interrupted `squall cluster shutdown`. So after this many refusals of the slave
# role in a row the node steps aside from its group for SLAVE_REFUSAL_HOLDOFF_MS, as for
# master refusals; a role taken resets the count.
SLAVE_REFUSALS_MAX = 3
SLAVE_REFUSAL_HOLDOFF_MS = 10_000


@dataclass(frozen=True)
class RefusalStepAside:
    """What refusals of one role in a row make the node do (``_note_refusal``)."""

    role: Literal["master", "slave"]
    most: int
    hold_ms: int
    aside: str  # what the node steps aside from
    then: str  # what the other nodes do meanwhile


REFUSAL_STEP_ASIDE = {
    RoleCommandKind.MASTER: RefusalStepAside(
        "master",
        MASTER_REFUSALS_MAX,
        MASTER_REFUSAL_HOLDOFF_MS,
        "leading",
        "the other nodes elect a master; then it rejoins and may lead again",
    ),
    RoleCommandKind.FOLLOW: RefusalStepAside(
        "slave",
        SLAVE_REFUSALS_MAX,
        SLAVE_REFUSAL_HOLDOFF_MS,
        "its group",
        "the others stop re-forming the group for it; then it rejoins",
    ),
}
# A node that steps aside because replica links are cut (a master whose replica hears no
# majority, a leader whose replica cannot reach its sync source, a member dropped under
# acks "group") stays out this long first: enough for the others to re-form without it.
# Back while the cut lasts, it rejoins as a member catching up (the others wrote a new
# epoch it lacks), which neither leads nor holds a commit back, so it neither takes the
# lead nor is dropped again until its links are back and it has caught up; a longer
# hold-off would only keep a healthy node out of the group after a short cut.
STEP_ASIDE_HOLDOFF_MIN_MS = 1_000
# Stepping aside again within this long after its hold-off ended (a link that comes and
# goes: it caught up, then was cut again), it stays out twice as long as the last time, up
# to the maximum: each time, the group's writes stalled for quorum_lost_ms.
STEP_ASIDE_AGAIN_WITHIN_MS = 30_000
STEP_ASIDE_HOLDOFF_MAX_MS = 80_000
# A master whose replica hears from no majority of the group's replicas while the
# coordinators reach each other (the replicas' links alone are cut) stalls every write,
# and only its own replica knows. Past store_stall_timeout_ms + member_timeout_ms of that
# (longer than a healthy slave's slowest ack: a busy disk's write, then a lost heartbeat)
# the node steps aside: the others elect a master that can commit. Back after the
# hold-off, it joins behind their newer log and leads again only once caught up, which
# needs its replica links.


class PeerTransport(Protocol):
    """Sends peer messages: fire and forget (the protocol tolerates loss)."""

    def send(self, message: PeerMessage) -> None:
        """Hand one message to the network; it may be dropped."""
        ...


class StateSaveError(Exception):
    """The coordinator's state could not be saved: it must not act on what it did not save
    (its node stops the process: a fail-stop)."""


class StateStore(Protocol):
    """Where the coordinator's persisted state lives."""

    def load(self) -> PersistedState:
        """The state last saved (all zero for a node that never ran)."""
        ...

    def save(self, state: PersistedState) -> None:
        """Save durably before anything that depends on it is sent."""
        ...


class FileStateStore:
    """The state file in the node's data directory (``persist.py``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> PersistedState:
        """Reads the file (StateFileError if it is malformed)."""
        return load_state(self.path)

    def save(self, state: PersistedState) -> None:
        """Writes the file atomically and durably (OSError naming the file)."""
        try:
            save_state(self.path, state)
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: {exc.strerror or exc}") from exc


class MemoryStateStore:
    """An in-memory twin of the state file (the simulator's; survives a simulated crash)."""

    def __init__(self, state: PersistedState | None = None) -> None:
        self.state = state or PersistedState()

    def load(self) -> PersistedState:
        """The state last saved."""
        return self.state

    def save(self, state: PersistedState) -> None:
        """Keeps the state."""
        self.state = state


class Failure(enum.Enum):
    """How a call to the replica failed."""

    NO_ANSWER = "no-answer"  # unreachable, dead or hung: maybe no answer at all
    REFUSED = "refused"  # the replica refused the role (FAILED_PRECONDITION)
    ERROR = "error"  # any other answer from a live replica


@dataclass(frozen=True, slots=True)
class ReplicaFailure:
    """A failed role call; ``code`` names the status (for the log)."""

    kind: Failure
    code: str
    details: str


def _master_without_room(command: RoleCommand, outcome: ReplicaFailure) -> bool:
    """The replica could not take the master role for want of room (its store is full:
    it cannot even persist the role): a refusal, which no retry in the next seconds
    changes, so the node steps aside after MASTER_REFUSALS_MAX of them (~0.3 s) rather
    than keep its group from writing for quorum_lost_ms (chaos seed 57: a slave with a
    full store led once the master's coordinator died, and nobody took a write for 3 s).
    Only for the master role: a slave that cannot persist its role holds nothing back,
    and leaving its group at every refusal would cost the others re-formations."""
    return command.kind is RoleCommandKind.MASTER and outcome.code == "RESOURCE_EXHAUSTED"


@dataclass(frozen=True, slots=True)
class ReplicaAnswer:
    """The replica's state, as it answers a role command."""

    report: ReplicaReport  # command_seq is filled in by the driver
    fault_id: str = ""
    fault_reason: str = ""
    # A reorganization sync still running (the replica answered a master role before
    # taking it), in one phrase for the log; empty when none.
    syncing: str = ""
    syncing_epoch: int = 0
    # How long the replica's oldest store write has run (0: none in progress).
    store_stalled_ms: int = 0
    # A master's streaming slaves and the entries each lacks (node id, lag).
    slave_lags: tuple[tuple[str, int], ...] = ()
    # The loss reports beside the replica's store (docs/operations.md, "Loss reports").
    losses: tuple[LossRecord, ...] = ()
    # A master's: how long it has not heard from a majority of slaves (0: it has).
    quorum_silent_ms: int = 0
    # A master's: how long it has not heard from each member slave (node id, ms).
    slave_silences: tuple[tuple[str, int], ...] = ()


class RoleNext(enum.Enum):
    """What the role loop does after a call."""

    AGAIN = "again"  # call the replica again at once (with the newest command)
    WAIT = "wait"  # wait for a new command or the renewal interval


@dataclass(frozen=True, slots=True)
class DriverTimings:
    """The driver's intervals (from ``timeouts`` in the cluster configuration)."""

    heartbeat_interval_ms: int
    # The replica drops its role if the coordinator stops renewing it for this long.
    lease_ms: int
    rpc_timeout_ms: int
    replica_timeout_ms: int
    # A replica whose oldest store write has run longer counts as silent (a stuck disk).
    store_stall_timeout_ms: int


def _nothing() -> None:
    return None


class CoordinatorDriver:
    """Drives one Election: see the module docstring."""

    def __init__(
        self,
        config: ElectionConfig,
        timings: DriverTimings,
        clock: Clock,
        transport: PeerTransport,
        store: StateStore,
        new_group_id: Callable[[], str],
        new_cluster_id: Callable[[], str],
        *,
        wake: Callable[[], None] = _nothing,
        role_changed: Callable[[], None] = _nothing,
        view_changed: Callable[[], None] = _nothing,
        applied: Callable[[Ready], None] | None = None,
        hand_over: Callable[[str], None] | None = None,
        transfer_dropped: Callable[[str], None] | None = None,
        save_failed: Callable[[str], None] | None = None,
        every_member_acks: bool = False,
    ) -> None:
        self.config = config
        # acks "group": a commit waits for every member that has caught up, so such a
        # member whose replica the master's cannot hear holds every write back; the
        # coordinator drops it.
        self.every_member_acks = every_member_acks
        self.timings = timings
        self.clock = clock
        self.transport = transport
        self.store = store
        self._new_group_id = new_group_id
        self._new_cluster_id = new_cluster_id
        # Hooks: the tick loop's next deadline may have moved earlier; a new role command
        # is wanted; the group view changed; a Ready was applied (observers, the simulator).
        self._wake = wake
        self._role_changed = role_changed
        self._view_changed = view_changed
        self._applied = applied
        # Starts a hand-over of the group to that member in the background (node.py: the
        # replica's PrepareHandoff, then transfer_leadership); None: nobody can.
        self._hand_over = hand_over
        # Lifts the replica's write fence of a transfer the election gave up (node.py: the
        # replica's PrepareHandoff with cancel); None: nobody can.
        self._transfer_dropped = transfer_dropped
        # Told once the state could not be saved (the node fail-stops); "" until then.
        self._save_failed = save_failed
        self.failed = ""
        # Refusals in a row by the replica, per role, and the hold-off they caused (kept
        # across recoveries: each makes a fresh Election).
        self._refusals = dict.fromkeys(REFUSAL_STEP_ASIDE, 0)
        self._lead_hold_off: LeadHoldOff | None = None
        # The epoch of a master role the replica has failed to take (not refused: its sync
        # source unreachable, say), and when it first failed; None once one is taken.
        self._master_failing: tuple[int, int] | None = None
        # The last step-aside's hold-off: when it ends, and how long it was (doubled when
        # the node steps aside again soon after rejoining).
        self._stepped_aside_until_ms: int | None = None
        self._step_aside_hold_ms = STEP_ASIDE_HOLDOFF_MIN_MS
        self.election = self._new_election(store.load())
        self.shutting_down = ""
        # The last report handed to the election, to notice a replica that restarted (or
        # whose store an operator changed) while it was inactive.
        self._last_report: ReplicaReport | None = None
        self._role_wanted: RoleCommand | None = None
        # The role loop's memory: the command the replica last took, and the one whose
        # failure was last logged (a replica that is down fails every renewal, and once per
        # command says it; the election logs how long it is down).
        self._role_applied: RoleCommand | None = None
        self._role_warned: RoleCommand | None = None
        # One fate per node: when the replica last answered any call (the start counts, so
        # a replica starting after its coordinator has its grace), and whether the election
        # has been told it is silent.
        self._replica_seen_ms = clock.monotonic_ms()
        # How long its recent answers to role calls took (a busy replica's are slow).
        self._answer_times = RecentAnswerTimes()
        self._silence_reported = False
        # Since when the replica's store has not completed a write, as its last answer to a
        # role call said, once that passed store_stall_timeout_ms (None: it writes). A
        # stalled replica still answers, but counts as silent until it writes again.
        self._store_stalled_since_ms: int | None = None
        self._sync_noted_ms = 0

    def _new_election(self, state: PersistedState) -> Election:
        hold_off = self._lead_hold_off
        if hold_off is not None and hold_off.until_ms <= self.clock.monotonic_ms():
            hold_off = self._lead_hold_off = None
        return Election(
            self.config,
            state,
            self._new_group_id,
            self._new_cluster_id,
            wall_offset_ms=self.clock.wall_ms() - self.clock.monotonic_ms(),
            lead_hold_off=hold_off,
        )

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self.config.node_id

    def now(self) -> int:
        """Monotonic milliseconds from the injected clock."""
        return self.clock.monotonic_ms()

    @property
    def watch_interval_ms(self) -> float:
        """How often the watch loop calls ``watch()``."""
        return self.timings.heartbeat_interval_ms * WATCH_HEARTBEATS

    # --- applying a Ready, in the documented order

    def apply(self, ready: Ready) -> None:
        """Persist, send, command the replica, publish the view, log. Nothing of a Ready
        whose state could not be saved is carried out, nor of any after it
        (StateSaveError): the election has moved past what the file holds."""
        if self.failed:
            raise StateSaveError(self.failed)
        if ready.persist is not None:
            try:
                self.store.save(ready.persist)
            except OSError as exc:
                self.failed = f"saving its state failed: {exc}"
                if self._save_failed is not None:
                    self._save_failed(self.failed)
                raise StateSaveError(self.failed) from exc
        for message in ready.messages:
            self.transport.send(message)
        if ready.role_command is not None:
            self._role_wanted = ready.role_command
            self._role_changed()
        if ready.view_changed:
            self._view_changed()
        for event in ready.events:
            log.log(_LEVELS[event.level], "%s [%s]", event.message, event.event)
        if self._applied is not None:
            self._applied(ready)
        if ready.hand_over_to and self._hand_over is not None:
            self._hand_over(ready.hand_over_to)
        if ready.transfer_dropped and self._transfer_dropped is not None:
            self._transfer_dropped(ready.transfer_dropped)
        if ready.messages or ready.role_command:
            self._wake()  # the next deadline may have moved earlier
        if ready.step_aside:
            self._step_aside(ready.step_aside, leading=False)

    # --- inputs

    def tick(self) -> int:
        """Ticks the election; returns how long the tick loop may sleep (ms)."""
        self.apply(self.election.tick(self.now()))
        deadline = self.election.next_deadline_ms()
        wait_ms = self.timings.heartbeat_interval_ms
        if deadline is not None:
            wait_ms = max(1, min(wait_ms, deadline - self.now()))
        return wait_ms

    def deliver(self, message: PeerMessage) -> Ready | None:
        """Steps one decoded peer message (None while shutting down: as if it were lost)."""
        if self.shutting_down:
            return None
        ready = self.election.step(message, self.now())
        self.apply(ready)
        return ready

    def set_designated_primary(self, enabled: bool, operator: str) -> Ready:
        """Operator control: see Election.set_designated_primary."""
        ready = self.election.set_designated_primary(enabled, operator, self.now())
        self.apply(ready)
        return ready

    def set_quorum_override(self, required: int, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.set_quorum_override."""
        ready = self.election.set_quorum_override(required, operator, self.now(), reason)
        self.apply(ready)
        return ready

    def stopping(self, reason: str) -> Ready:
        """The process is stopping: see Election.stopping."""
        ready = self.election.stopping(reason, self.now())
        self.apply(ready)
        return ready

    def set_quarantine(self, enabled: bool, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.set_quarantine."""
        ready = self.election.set_quarantine(enabled, operator, self.now(), reason)
        self.apply(ready)
        return ready

    def ack_loss(self, loss_id: str, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.ack_loss."""
        ready = self.election.ack_loss(loss_id, operator, self.now(), reason)
        self.apply(ready)
        return ready

    def transfer_leadership(self, target: str, operator: str, reason: str = "") -> Ready:
        """Operator control, once the replica is ready: see Election.transfer_leadership."""
        ready = self.election.transfer_leadership(target, operator, self.now(), reason)
        self.apply(ready)
        return ready

    def change_membership(self, change: MembershipChange, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.change_membership."""
        ready = self.election.change_membership(change, operator, self.now(), reason)
        self.apply(ready)
        return ready

    # --- the role loop's decisions

    def role_wanted(self) -> RoleCommand | None:
        """The newest role command for the replica (None: wait for one)."""
        return self._role_wanted

    def role_outcome(
        self,
        command: RoleCommand,
        outcome: ReplicaAnswer | ReplicaFailure,
        took_ms: int | None = None,
    ) -> RoleNext:
        """The replica answered (or not) ``command``: apply what that means. took_ms: how
        long the call took, if timed (a silence after slow answers is allowed more)."""
        # Only a renewal times the replica: a new role may wait on purpose (a deactivation
        # for a write in progress, a master role for its reorganization sync).
        renewal = command is self._role_applied
        answered = not isinstance(outcome, ReplicaFailure) or outcome.kind is not Failure.NO_ANSWER
        if took_ms is not None and renewal and answered:
            self._answer_times.record(took_ms, self.now())
        if isinstance(outcome, ReplicaFailure):
            if outcome.kind is not Failure.NO_ANSWER:
                self.replica_answered()
            if (
                outcome.kind is Failure.REFUSED or _master_without_room(command, outcome)
            ) and command.kind is not RoleCommandKind.DEACTIVATE:
                self._note_refusal(command.kind, outcome.details)
                self.recover(f"replica refused {command.kind.value}: {outcome.details}")
                self._role_applied = None
                return RoleNext.AGAIN
            if command.kind is RoleCommandKind.MASTER and self._master_not_taken(
                command.epoch, outcome
            ):
                self._role_applied = None
                return RoleNext.AGAIN
            if command is not self._role_applied and command is not self._role_warned:
                self._role_warned = command
                log.warning(
                    "coordinator %s: replica did not take %s (epoch=%d): %s: %s",
                    self.node_id,
                    command.kind.value,
                    command.epoch,
                    outcome.code,
                    outcome.details,
                )
            return RoleNext.WAIT
        self.replica_answered(outcome.store_stalled_ms)
        if command.kind is RoleCommandKind.MASTER and outcome.report.active and not outcome.syncing:
            self._refusals[RoleCommandKind.MASTER] = 0  # it took the master role
            self._master_failing = None
        if command.kind is not RoleCommandKind.DEACTIVATE and outcome.report.active:
            # It took a role: its slave refusals are no longer in a row.
            self._refusals[RoleCommandKind.FOLLOW] = 0
        if outcome.fault_id:
            # A fault the replica reports quarantines this node (once per fault).
            self.apply(
                self.election.replica_fault(outcome.fault_id, outcome.fault_reason, self.now())
            )
        if outcome.losses:
            persisted = self.election.persisted
            known = {r.loss_id for r in persisted.losses} | set(persisted.acked_loss_ids)
            if any(r.loss_id not in known for r in outcome.losses):
                self.apply(self.election.replica_losses(outcome.losses, self.now()))
        if outcome.syncing:
            self._note_sync(outcome.syncing_epoch, outcome.syncing)
        if command.kind is RoleCommandKind.MASTER and outcome.slave_lags:
            self.apply(self.election.slave_lags(dict(outcome.slave_lags), self.now()))
        if command.kind is RoleCommandKind.MASTER and outcome.quorum_silent_ms >= (
            self.quorum_lost_ms
        ):
            self._step_aside_cut_off(outcome.quorum_silent_ms)
            self._role_applied = None
            return RoleNext.AGAIN
        if command.kind is RoleCommandKind.MASTER and self.every_member_acks:
            self._cut_off_silent_members(outcome.slave_silences)
        if command.kind is RoleCommandKind.DEACTIVATE:
            report = ReplicaReport(
                cluster_id=outcome.report.cluster_id,
                last_epoch=outcome.report.last_epoch,
                last_lsn=outcome.report.last_lsn,
                store_state=outcome.report.store_state,
                active=outcome.report.active,
                command_seq=command.seq,
                shutdown_id=outcome.report.shutdown_id,
                joined=outcome.report.joined,
            )
            if command is not self._role_applied:
                # The replica has stopped: its log no longer grows, so this report may
                # name a sync source or answer an invitation.
                self._last_report = report
                self.apply(self.election.replica_report(report, self.now()))
            elif self._last_report is not None and changed(self._last_report, report):
                # Only a restart (or an operator's offline change, e.g. `squall store
                # mark-clean`) changes an inactive replica: what this node told its
                # group is stale, so it recovers and is merged again with a new report.
                self.recover(
                    f"replica state changed while inactive: {summary(self._last_report)}"
                    f" -> {summary(report)}"
                )
                self._role_applied = None
                return RoleNext.AGAIN
        self._role_applied = command
        return RoleNext.WAIT

    def _note_refusal(self, kind: RoleCommandKind, reason: str) -> None:
        """The replica refused a role: count the refusals of that role in a row; at its
        maximum the node steps aside (the recovery that follows starts held off): from
        leading after MASTER_REFUSALS_MAX master refusals, so the others elect a master;
        from its group after SLAVE_REFUSALS_MAX slave refusals, so that the group is not
        re-formed for it again and again."""
        rule = REFUSAL_STEP_ASIDE[kind]
        refusals = self._refusals[kind] = self._refusals[kind] + 1
        if refusals < rule.most:
            return
        self._lead_hold_off = LeadHoldOff(
            self.now() + rule.hold_ms, refusals, reason, role=rule.role
        )
        log.warning(
            "coordinator %s: its replica refused the %s role %d times in a row (epoch=%d, "
            "last: %s); the node steps aside from %s for %d ms: out of every group, so %s",
            self.node_id,
            rule.role,
            refusals,
            self.election.persisted.epoch,
            reason,
            rule.aside,
            rule.hold_ms,
            rule.then,
        )

    @property
    def master_refusals(self) -> int:
        """Refusals of the master role in a row."""
        return self._refusals[RoleCommandKind.MASTER]

    @property
    def slave_refusals(self) -> int:
        """Refusals of the slave role in a row."""
        return self._refusals[RoleCommandKind.FOLLOW]

    @property
    def quorum_lost_ms(self) -> int:
        """How long a master's replica may go without hearing from enough slaves to
        commit before this node steps aside (see the constant's comment above)."""
        return self.timings.store_stall_timeout_ms + self.config.member_timeout_ms

    def _step_aside_cut_off(self, silent_ms: int) -> None:
        """The master's replica has not heard from enough slaves to commit for silent_ms."""
        self._step_aside(
            f"its replica, master of epoch {self.election.persisted.epoch}, has heard from "
            f"no majority of the group's replicas for {silent_ms} ms (at most "
            f"{self.quorum_lost_ms}), so nothing it writes can commit: its links to them may "
            "be cut while the coordinators still reach each other"
        )

    def master_failing_ms_max(self, now_ms: int) -> int:
        """How long the replica may fail to take the master role of one epoch before this
        node steps aside (``_master_not_taken``). A failure of the sync source that fails
        the fetch is a new epoch by then: its replica dead or paused is taken out by its own
        coordinator (replica_timeout_ms, plus the allowance for slow answers, which this
        node's own recent answers stand in for), its node gone by the group
        (member_timeout_ms). A source whose disk hangs keeps the fetch waiting rather than
        failing (up to rpc_timeout_ms a message), by when its own stall report is due
        (store_stall_timeout_ms), so waiting quorum_lost_ms, as before, only kept a leader
        cut off from its source leading a group without a master longer (chaos seed 94:
        2.2 s with no master, until the old master's node came back)."""
        return (
            self.timings.replica_timeout_ms
            + self._answer_times.longest_ms(now_ms)
            + self.config.member_timeout_ms
        )

    def _master_not_taken(self, epoch: int, failure: ReplicaFailure) -> bool:
        """The replica failed to take the master role of ``epoch`` without refusing it
        (its sync source unreachable, say: a reorganization fetch that cannot connect fails
        every renewal alike, for as long as the replica's links are cut, while this node
        keeps leading its group). Past master_failing_ms_max of failures in one epoch the
        node steps aside (True), so another member leads. A replica that does not answer
        at all is taken out sooner, by its silence (replica_timeout_ms)."""
        now = self.now()
        if self._master_failing is None or self._master_failing[0] != epoch:
            self._master_failing = (epoch, now)
            return False
        failing_ms = now - self._master_failing[1]
        bound_ms = self.master_failing_ms_max(now)
        if failing_ms < bound_ms:
            return False
        self._master_failing = None
        self._step_aside(
            f"its replica has failed to take the master role of epoch {epoch} for "
            f"{failing_ms} ms (at most {bound_ms}), last: {failure.code}: "
            f"{failure.details}"
        )
        return True

    def _cut_off_silent_members(self, silences: tuple[tuple[str, int], ...]) -> None:
        """Under acks "group", drop each member whose replica the master's has not heard
        from for quorum_lost_ms (it hears a majority, or it would have stepped aside): every
        commit waits for that member, and only this master's replica knows it is silent.
        The member steps aside when told (``StepAside``), so it is not merged back at once.
        Back after the hold-off and not reached, it is catching up, which holds no commit
        back, so the master reports no silence for it (``node.replica_answer``) and it
        stays; dropped again within STEP_ASIDE_AGAIN_WITHIN_MS only if it had caught up."""
        for node, silent_ms in silences:
            if silent_ms >= self.quorum_lost_ms:
                self.apply(
                    self.election.cut_off_member(node, silent_ms, self.quorum_lost_ms, self.now())
                )

    def _step_aside(self, reason: str, *, leading: bool = True) -> None:
        """Out of every group for STEP_ASIDE_HOLDOFF_MIN_MS, so the others form a group
        that can commit; then the node rejoins. Twice as long each time it steps aside
        again soon after it rejoined (up to STEP_ASIDE_HOLDOFF_MAX_MS). ``leading``: it
        led (or was to lead) the group; else its coordinator dropped it."""
        now = self.now()
        again = self._stepped_aside_until_ms is not None and (
            now - self._stepped_aside_until_ms <= STEP_ASIDE_AGAIN_WITHIN_MS
        )
        self._step_aside_hold_ms = (
            min(2 * self._step_aside_hold_ms, STEP_ASIDE_HOLDOFF_MAX_MS)
            if again
            else STEP_ASIDE_HOLDOFF_MIN_MS
        )
        hold_ms = self._step_aside_hold_ms
        self._stepped_aside_until_ms = now + hold_ms
        self._lead_hold_off = LeadHoldOff(now + hold_ms, 0, reason)
        log.warning(
            "coordinator %s: %s; the node steps aside from %s for %d ms: out of every "
            "group, so the other nodes %s; then it rejoins",
            self.node_id,
            reason,
            "leading" if leading else "its group",
            hold_ms,
            "elect a master that can commit" if leading else "commit without it",
        )
        self.recover(f"stepping aside: {reason}")

    def _note_sync(self, epoch: int, progress: str) -> None:
        """The replica answered a master role before taking it: its reorganization sync
        outlives the call and goes on; each renewal asks again. Logged every few seconds."""
        now = self.now()
        if now < self._sync_noted_ms:
            return
        self._sync_noted_ms = now + SYNC_LOG_INTERVAL_MS
        log.info(
            "coordinator %s: replica still syncing for epoch %d: %s",
            self.node_id,
            epoch,
            progress,
        )

    # --- one fate per node: is the replica answering?

    def replica_answered(self, store_stalled_ms: int | None = None) -> None:
        """The replica answered a call: note it; a silence the election knows of is over,
        unless the replica's store is stalled (a stuck disk).

        store_stalled_ms: how long its store's oldest write has run, from an answer that
        says (a role call's); None from one that does not (a health probe, an error),
        which leaves a known stall as it is."""
        now = self.now()
        self._replica_seen_ms = now
        if store_stalled_ms is not None:
            self._note_store_stall(store_stalled_ms, now)
        if self._store_stalled_since_ms is not None:
            return
        if self._silence_reported:
            self._silence_reported = False
            self.apply(self.election.replica_answered(now))

    def _note_store_stall(self, stalled_ms: int, now: int) -> None:
        """A store stalled past store_stall_timeout_ms is reported as a silent replica
        (since the stall began); a store that writes again ends it."""
        if stalled_ms <= self.timings.store_stall_timeout_ms:
            if self._store_stalled_since_ms is not None:
                log.warning(
                    "coordinator %s: replica store writes again after a %d ms stall",
                    self.node_id,
                    now - self._store_stalled_since_ms,
                )
            self._store_stalled_since_ms = None
            return
        if self._store_stalled_since_ms is not None:
            return
        self._store_stalled_since_ms = max(0, now - stalled_ms)
        log.warning(
            "coordinator %s: replica store stalled: its oldest write has run %d ms "
            "(store_stall_timeout_ms %d); the node leaves its group until writes complete",
            self.node_id,
            stalled_ms,
            self.timings.store_stall_timeout_ms,
        )
        self._report_stall(now)

    def _report_stall(self, now: int) -> None:
        """Tells the election the replica is silent since its store stalled, if it has."""
        since = self._store_stalled_since_ms
        if since is None:
            return
        self._silence_reported = True
        self.apply(self.election.replica_silent(since, now, store_stalled=True))

    def watch(self) -> bool:
        """Tells the election when the replica has gone quiet (it decides what that
        means); True when the replica's health should be probed meanwhile (a role call can
        be slow for a live replica, as a deactivation waits for a write in progress; a
        health check is not)."""
        if self.shutting_down:
            return False
        now = self.now()
        if now - self._replica_seen_ms <= self.timings.heartbeat_interval_ms * QUIET_HEARTBEATS:
            return False
        if not self._silence_reported:
            self._silence_reported = True
            self.apply(
                self.election.replica_silent(
                    self._replica_seen_ms, now, answer_ms=self._answer_times.longest_ms(now)
                )
            )
        return True

    def recover(self, reason: str) -> None:
        """Any error sends the node back to a group of its own (IceStorm's recovery)."""
        log.warning(
            "coordinator %s: %s; recovering as a group of its own (epoch=%d)",
            self.node_id,
            reason,
            self.election.persisted.epoch,
        )
        self.election = self._new_election(self.election.persisted)
        self._role_wanted = None
        # The new machine has not heard of a silence yet: the watch tells it again, and a
        # stalled store (whose replica still answers, so the watch is quiet) is told here.
        self._silence_reported = False
        self.apply(self.election.tick(self.now()))
        self._report_stall(self.now())


def changed(before: ReplicaReport, after: ReplicaReport) -> bool:
    """Did the replica's data or lifecycle change (not merely its command sequence)?"""
    return summary(before) != summary(after)


def summary(report: ReplicaReport) -> str:
    """A report's data in one phrase, for the log."""
    shutdown = f" {report.shutdown_id}" if report.shutdown_id else ""
    return (
        f"cluster {report.cluster_id or '-'}, store {report.store_state.value}{shutdown}, "
        f"log {report.last_epoch}/{report.last_lsn}, joined={str(report.joined).lower()}"
    )
