"""The replica's role rules as a pure state machine: its role, epoch and epoch floor, the
role lease, taking and dropping roles, the shutdown freeze, the hand-off fence and which
writes it may accept.

``ReplicaCore`` is what ``ReplicaNode`` (the driver) asks before it changes roles. Every
input is a plain value (a ``RoleOrder`` for the coordinator's ``SetRole``, ``now_ms`` read
from the injected clock, or a report of what the driver did or saw) and every answer is
one ``Effects`` record, applied by the driver in the order its docstring gives, as etcd
raft's ``Ready`` and the coordinator's election ``Ready`` (``services/coordinator/
messages.py``) are. Nothing here imports grpc, lmdb, asyncio, threading, time or random
(``tests/unit/test_purity.py``): the transcripts in ``tests/unit/scenarios/replica/`` run it
alone.

The rules it holds:

* **Epoch floor.** A replica takes a role afresh only in an epoch above every epoch its
  store held a role in (``epoch_floor``): one that restarted, dropped its role, was
  deposed or abandoned taking the master role must not resume an epoch whose group may
  have moved on without it. A command for the role it holds renews it.
* **Lease.** A role command carries ``lease_ms``; the role lapses (the replica drops it) if
  no command renews it within that time (``tick``). A master role being taken has no
  lease until it is taken: its reorganization sync may take long.
* **Taking the master role** runs in the background (``reorg``): the core keeps which
  epoch and sync source it is for; a repetition of the same command joins it, any other
  command abandons it (raising the floor to its epoch).
* **Fail-stop, deposition, shutdown freeze and the hand-off fence** each close the write
  gate (``write_refusal``) with their own status and message.
* **The log's position** (``log``): its last LSN, first LSN and the commit LSN the store
  recorded. The driver reports every append, truncation, compaction and snapshot install;
  for the slave side it decides compaction, the commit advance, the acks and when an idle
  stream's commit LSN is recorded (``slave_written``, ``slave_heartbeat``).

It wraps neither store nor network: the master's replication (``replication.py``) and the
slave's ``Follower`` (``follower.py``) stay the pure cores of the replication protocol; the
driver makes them when this core says the role is taken (``take_master``, ``follow``). A
slave's ``Follower`` is then held here: the core numbers the streams and puts each Hello,
batch, snapshot chunk and heartbeat to it (``slave_*``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from squall_server.common.errors import Code, ServiceError
from squall_server.replica.follower import (
    BatchAccepted,
    Follower,
    HelloAccepted,
    Refusal,
    SnapshotAccepted,
)
from squall_server.replica.replication import Ack, EntryLike

# The master answers with this metadata key when a write reaches a non-master.
MASTER_ADDRESS_KEY = "squall-master-address"
# Compaction runs once the log holds this many entries beyond the retention (at most
# COMPACT_STEP_MAX, at least 1): one bounded store transaction per step, not per batch.
COMPACT_STEP_MAX = 10_000
# Trailing metadata key on a slave's refusal: the slave's epoch, so a stale master steps down
# (``master_driver``) and a stale role command names the epoch that superseded it.
EPOCH_KEY = "squall-epoch"


class Role(enum.IntEnum):
    """The role a replica holds; numbered as ``squall.v1.Role`` so values pass through."""

    INACTIVE = 1
    MASTER = 2
    SLAVE = 3


@dataclass(frozen=True, slots=True)
class RoleOrder:
    """The coordinator's role command (``replica_pb2.RoleCommand``) as plain values.

    ``role`` is the wire value, checked here (an unknown one is refused)."""

    role: int
    epoch: int = 0
    master_id: str = ""
    members: tuple[str, ...] = ()
    sync_source_id: str = ""
    reason: str = ""
    seq: int = 0
    lease_ms: int = 0
    cluster_id: str = ""


@dataclass(frozen=True, slots=True)
class StoreFacts:
    """What the store holds that the role rules read: its epoch and cluster id."""

    epoch: int
    cluster_id: str


@dataclass(frozen=True, slots=True)
class RoleRefusal:
    """An input refused: the status, the sentence naming why, and trailing metadata."""

    code: Code
    message: str
    metadata: tuple[tuple[str, str], ...] = ()

    def error(self) -> ServiceError:
        """The refusal as the error a servicer answers with."""
        return ServiceError(self.code, self.message, metadata=self.metadata)


@dataclass(frozen=True, slots=True)
class PersistRole:
    """Store operation, flushed: record ``epoch``, the epoch of the ``role`` about to be
    taken, and mark the store in use (DIRTY: a restart must not take it for a clean or
    empty one). The role is used only once this is written: a store that cannot write it
    must not hold the role."""

    role: Role
    epoch: int


@dataclass(frozen=True, slots=True)
class TakeMaster:
    """Start taking the master role of ``epoch`` in the background: persist the epoch
    (``Effects.persist_role``), sync from ``sync_source_id`` (another node), make the
    replication core for ``members`` and append the epoch-start entry; report
    ``master_taken`` once the role is held and ``taking_finished`` when the attempt ends."""

    epoch: int
    members: tuple[str, ...]
    sync_source_id: str
    reason: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Follow:
    """Follow ``master_id`` in ``epoch``: persist the epoch (``Effects.persist_role``),
    make the ``Follower`` from
    the store; report ``followed`` on success (a failure is the command's refusal)."""

    epoch: int
    master_id: str
    reason: str
    lease_ms: int


@dataclass(frozen=True, slots=True)
class Effects:
    """Everything one input produced. The core's own state has changed already; the
    driver applies the rest in this order:

    1. ``role_changed``: the role is not what it was (``ReplicaCore.role``): count the
       change and wake whoever waits for a role (they read the core).
    2. ``cancel_taking``: stop the task taking the master role and wait until it and its
       store work have stopped (a store left mid-sync is re-read), before anything else.
       The core abandoned the attempt (its epoch is now below the floor), even when the
       command is then refused.
    3. ``refusal``: answer the input with it; nothing below is set. A refusal changed
       nothing else, except that a command repeating a finished master attempt records
       its seq and consumes the attempt's outcome (the coordinator then knows the answer
       is to its latest command).
    4. ``drop_role``: the role was dropped (the text says why): stop the master's
       replication or the slave's stream, fail queued writes as not stored, stop push
       delivery, and wait until no batch is being written.
    5. ``record_cluster_id``: store operation, flushed: an empty store records the
       group's cluster id before it takes the role, so it can never be taken for another
       cluster's.
    6. ``persist_role`` (set with ``take_master`` and with ``follow``): store operation,
       flushed: the new role's epoch and the DIRTY mark (``PersistRole``). For ``follow``
       it is written now, before the follower is made; for ``take_master`` it is the
       background task's first step (once the task checked the members, and before a
       reorganization fetch changes the store). A store error fails what wrote it (the
       command for 5 and a follow's 6, the attempt for a master's 6): a full store
       (nothing written) with RESOURCE_EXHAUSTED (a refused command also drops the
       role), any other by fail-stopping the replica, UNAVAILABLE.
    7. At most one of ``take_master`` (start the background task), ``follow`` (make the
       follower now, then report ``followed``; a failure is the command's refusal) or
       ``join_taking`` (the command repeats the one being carried out: answer it when
       that task ends or within a heartbeat, as ``reorg`` says).
    8. ``members``: a master renewal naming another group: tell the replication core.
    9. ``faults``: record each and report it to the coordinator (it quarantines the node).

    The log inputs (``log_*``, ``slave_*``, ``snapshot_*``, ``commit_record_*``) set only
    ``refusal`` (answer the stream with it, logged as a warning when ``warn``; nothing else
    is set) and the fields below, which the driver applies in this order, with the commit
    lock held (the batch, snapshot or heartbeat that produced them is the stream's current
    one):

    ``slave_hello`` alone: ``log_reread`` first, even with a refusal (the follower was
    reset to the store's log, which is not the one it knew; committed reads forget what
    was above it), then ``hello``: persist ``adopt_cluster_id`` when
    set, mark the store in use and answer with the position; ``stream`` numbers the
    accepted stream (its later messages name it).

    ``slave_batch``: ``acks`` (the ack on receipt: send it before the write), then
    ``batch``, written as ``BatchAccepted`` says (report ``slave_written``, or
    ``slave_store_failed`` and close the stream), or ``advance_commit`` when it has
    nothing to write. ``slave_snapshot_chunk``: ``snapshot``, installed as
    ``SnapshotAccepted`` says (a failure: ``slave_store_failed``).

    10. ``compact_from``: store operation: delete the log below this LSN (a failure
        leaves more log than wanted; report the store's log start with ``log_compacted``).
    11. ``record_commit``: store operation, in the background and ordered with appends:
        record this commit LSN so a restart does not hide it; report
        ``commit_record_done`` (or ``commit_record_failed``).
    12. ``advance_commit``: committed reads may serve up to this LSN; wake subscribers.
    13. ``acks``: send each to the master, in order.
    """

    refusal: RoleRefusal | None = None
    cancel_taking: str = ""
    drop_role: str = ""
    record_cluster_id: str = ""
    persist_role: PersistRole | None = None
    take_master: TakeMaster | None = None
    follow: Follow | None = None
    join_taking: bool = False
    members: tuple[str, ...] | None = None
    faults: tuple[str, ...] = ()
    role_changed: bool = False
    # A cluster shutdown's freeze lapsed (the text says which and why): log it.
    thawed: str = ""
    hello: HelloAccepted | None = None
    batch: BatchAccepted[Any] | None = None
    snapshot: SnapshotAccepted | None = None
    stream: int = 0
    log_reread: bool = False
    warn: bool = False
    compact_from: int = 0
    record_commit: int = 0
    advance_commit: int | None = None
    acks: tuple[Ack, ...] = ()


@dataclass
class WriteFence:
    """New writes refused until ``until_ms`` (monotonic) while the role stays as it was
    (a leadership transfer, ``handoff.py``)."""

    until_ms: int = 0
    target: str = ""
    epoch: int = 0

    def holds(self, now_ms: int, epoch: int) -> bool:
        """Is the fence up for this epoch's writes now?"""
        return self.until_ms > now_ms and self.epoch == epoch

    def clear(self) -> None:
        """Lift the fence."""
        self.until_ms, self.target, self.epoch = 0, "", 0


@dataclass
class Taking:
    """A master role being taken: the command's epoch and sync source, the lease the
    latest repetition asked for, and (once the attempt ended) its outcome."""

    epoch: int
    source_id: str
    lease_ms: int
    finished: bool = False
    error: RoleRefusal | None = None

    def matches(self, order: RoleOrder) -> bool:
        """Whether a role command repeats the one being carried out."""
        return (
            order.role == Role.MASTER
            and order.epoch == self.epoch
            and order.sync_source_id == self.source_id
        )


@dataclass
class LogPosition:
    """Where this replica's log stands, as the role rules and the slave side read it:
    its last LSN, the first LSN still in it, the commit LSN the store last recorded, and
    the one being recorded in the background (0: none)."""

    last_lsn: int = 0
    log_start_lsn: int = 1
    commit_recorded: int = 0
    commit_recording: int = 0


def compact_step(retention_entries: int) -> int:
    """Entries beyond the retention that make compaction worth a store transaction."""
    return max(1, min(retention_entries // 8, COMPACT_STEP_MAX))


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """This node's id, every configured node's replica address by node id, and how many
    log entries it keeps (``limits.log_retention_entries``)."""

    node_id: str
    replica_addresses: Mapping[str, str] = field(default_factory=dict)
    log_retention_entries: int = 0


class ReplicaCore:
    """The replica's role state machine (see the module docstring)."""

    def __init__(
        self, config: CoreConfig, *, stored_epoch: int, log: LogPosition | None = None
    ) -> None:
        """A replica that just started: no role, in the epoch its store holds, which is
        also its floor (it held no role in this process yet); ``log``: where its store's
        log stands."""
        self.config = config
        self.log = log if log is not None else LogPosition()
        self.role = Role.INACTIVE
        self.epoch = stored_epoch
        self.master_id = ""
        self.epoch_floor = stored_epoch
        self.command_seq = 0
        self.lease_until_ms = 0
        self.taking: Taking | None = None
        self.deposed = ""
        self.failed_reason = ""
        # Store lifecycle (docs/operations.md): whether this process has held a role, the
        # cluster shutdown it is frozen for (no new role, no new write) until when
        # (monotonic: a shutdown that neither finishes nor aborts lapses, as when the
        # operator's command was killed), and the one it finished (it takes nothing any
        # more).
        self.joined = False
        self.frozen_for = ""
        self.frozen_until_ms = 0
        self.shutdown_finished = ""
        self.fence = WriteFence()
        # The attempt count of the latest master role taken, per epoch (for progress).
        self._attempts: tuple[int, int] = (0, 0)
        # A slave's follower (made by the driver, ``followed``) and the number of the
        # stream it accepts: a newer Hello or role supersedes every older stream.
        self.follower: Follower | None = None
        self.stream_seq = 0

    # --- the coordinator's role commands

    def role_command(self, order: RoleOrder, now_ms: int, store: StoreFacts) -> Effects:
        """Decides what a role command does (see ``Effects`` for how it is applied)."""
        me = self.config.node_id
        malformed = self._malformed(order, store)
        if malformed is not None:
            return Effects(refusal=malformed)
        role = Role(order.role)
        cancel = ""
        taking = self.taking
        if taking is not None:
            if taking.matches(order):
                self.command_seq = order.seq
                taking.lease_ms = order.lease_ms
                if not taking.finished:
                    return Effects(join_taking=True)
                self.taking = None
                if taking.error is not None:
                    return Effects(refusal=taking.error)
                # Taken: renewed below like any role held.
            else:
                cancel = f"role command {role.name} for epoch {order.epoch}"
                self._abandon_taking()
        renewal = role == self.role and (role == Role.INACTIVE or order.epoch == self.epoch)
        if not renewal and role != Role.INACTIVE and order.epoch <= self.epoch_floor:
            deposed = f": {self.deposed}" if self.deposed else ""
            return self._after_cancel(
                cancel,
                RoleRefusal(
                    Code.FAILED_PRECONDITION,
                    f"replica {me} does not hold a role in epoch {order.epoch} (it restarted, "
                    f"dropped it or was deposed{deposed}); it takes a new role only in an "
                    f"epoch above {self.epoch_floor}",
                ),
            )
        if self.failed_reason and role != Role.INACTIVE:
            return self._after_cancel(
                cancel,
                RoleRefusal(
                    Code.FAILED_PRECONDITION,
                    f"replica {me} fail-stopped ({self.failed_reason}); it takes no role "
                    "until it is restarted",
                ),
            )
        if not renewal and role != Role.INACTIVE:
            refusal = self._new_role_refusal(order, store)
            if refusal is not None:
                return self._after_cancel(cancel, refusal)
        self.command_seq = order.seq
        if renewal:
            self._renew_lease(order.lease_ms, now_ms)
            members = order.members if role == Role.MASTER and order.members else None
            return Effects(cancel_taking=cancel, members=members)
        if role == Role.INACTIVE:
            return self._drop(order.reason or "coordinator", cancel=cancel)
        record = order.cluster_id if order.cluster_id and not store.cluster_id else ""
        if role == Role.MASTER:
            drop = f"taking the master role in epoch {order.epoch}"
            dropped = self._drop(drop, cancel=cancel) if self.role != Role.INACTIVE else None
            epoch, attempts = self._attempts
            attempt = attempts + 1 if epoch == order.epoch else 1
            self._attempts = (order.epoch, attempt)
            # The replica is in the new epoch from now (its store records it first thing).
            self.epoch = order.epoch
            self.taking = Taking(order.epoch, order.sync_source_id, order.lease_ms)
            # The lease runs from when the role is taken (a renewal may only come then).
            self.lease_until_ms = 0
            return Effects(
                cancel_taking=cancel,
                drop_role=drop if dropped is not None else "",
                record_cluster_id=record,
                persist_role=PersistRole(Role.MASTER, order.epoch),
                take_master=TakeMaster(
                    epoch=order.epoch,
                    members=order.members or (me,),
                    sync_source_id=order.sync_source_id,
                    reason=order.reason or "elected",
                    attempt=attempt,
                ),
                role_changed=dropped is not None,
            )
        drop = f"following {order.master_id} in epoch {order.epoch}"
        dropped = self._drop(drop, cancel=cancel) if self.role == Role.MASTER else None
        return Effects(
            cancel_taking=cancel,
            drop_role=drop if dropped is not None else "",
            record_cluster_id=record,
            persist_role=PersistRole(Role.SLAVE, order.epoch),
            follow=Follow(order.epoch, order.master_id, order.reason, order.lease_ms),
            role_changed=dropped is not None,
        )

    def _malformed(self, order: RoleOrder, store: StoreFacts) -> RoleRefusal | None:
        """A command no replica could apply: an unknown role or node, a stale epoch."""
        me = self.config.node_id
        if order.role not in (Role.MASTER, Role.SLAVE, Role.INACTIVE):
            return RoleRefusal(Code.INVALID_ARGUMENT, f"unknown role {order.role}")
        if order.role != Role.INACTIVE and order.epoch < store.epoch:
            return RoleRefusal(
                Code.FAILED_PRECONDITION,
                f"role command for epoch {order.epoch} is older than replica {me}'s epoch "
                f"{store.epoch}",
                ((EPOCH_KEY, str(store.epoch)),),
            )
        if order.role == Role.SLAVE and (
            order.master_id not in self.config.replica_addresses or order.master_id == me
        ):
            return RoleRefusal(Code.INVALID_ARGUMENT, f"unknown master node id '{order.master_id}'")
        if order.role == Role.MASTER:
            for member in order.members:
                if member not in self.config.replica_addresses:
                    return RoleRefusal(Code.INVALID_ARGUMENT, f"unknown member node id '{member}'")
        return None

    def _after_cancel(self, cancel: str, refusal: RoleRefusal) -> Effects:
        """A refusal after a running master attempt was abandoned: the driver still stops
        it (the abandonment stands, as the floor raised for it does)."""
        if not cancel:
            return Effects(refusal=refusal)
        return Effects(cancel_taking=cancel, refusal=refusal)

    def _new_role_refusal(self, order: RoleOrder, store: StoreFacts) -> RoleRefusal | None:
        """Refuses a new role during a cluster shutdown, or for another cluster's group."""
        me = self.config.node_id
        if self.shutdown_finished or self.frozen_for:
            return RoleRefusal(
                Code.FAILED_PRECONDITION,
                f"replica {me} takes no new role: it is stopping for cluster shutdown "
                f"{self.shutdown_finished or self.frozen_for}",
            )
        if order.cluster_id and store.cluster_id and order.cluster_id != store.cluster_id:
            return RoleRefusal(
                Code.FAILED_PRECONDITION,
                f"replica {me}'s store belongs to cluster {store.cluster_id}, but the group "
                f"of epoch {order.epoch} is cluster {order.cluster_id[:64]!r}: refused",
            )
        return None

    # --- what the driver did or saw

    def master_taken(self, epoch: int) -> Effects:
        """The background task made the replication core of ``epoch``: the role is held
        (the epoch start is being appended). Refused if that attempt was abandoned."""
        taking = self.taking
        if taking is None or taking.epoch != epoch or taking.finished:
            return _refused(
                Code.UNAVAILABLE,
                f"replica {self.config.node_id} abandoned taking the master role in epoch {epoch}",
            )
        self.role = Role.MASTER
        self.epoch = epoch
        self.master_id = self.config.node_id
        self.deposed = ""
        self.joined = True
        return Effects(role_changed=True)

    def taking_finished(self, epoch: int, error: RoleRefusal | None, now_ms: int) -> Effects:
        """The background attempt to take ``epoch``'s master role ended (``error`` None:
        the role is held and the epoch start appended). Its lease starts now; the outcome
        answers the next repetition of the command. Reported once; repeats are ignored."""
        taking = self.taking
        if taking is None or taking.epoch != epoch or taking.finished:
            return Effects()
        taking.finished, taking.error = True, error
        if error is None and self.role == Role.MASTER and self.epoch == epoch:
            self._renew_lease(taking.lease_ms, now_ms)
        return Effects()

    def taking_answer(self, epoch: int) -> Effects:
        """The SetRole call that waited for the attempt saw it end: the outcome is its
        answer (it is then forgotten)."""
        taking = self.taking
        if taking is None or taking.epoch != epoch or not taking.finished:
            return Effects()
        self.taking = None
        return Effects(refusal=taking.error)

    def followed(
        self,
        epoch: int,
        master_id: str,
        lease_ms: int,
        now_ms: int,
        follower: Follower | None = None,
    ) -> Effects:
        """The driver made the follower: this replica is ``master_id``'s slave."""
        self.follower = follower
        self.stream_seq += 1
        self.role = Role.SLAVE
        self.epoch = epoch
        self.master_id = master_id
        self.joined = True
        self._renew_lease(lease_ms, now_ms)
        return Effects(role_changed=True)

    def tick(self, now_ms: int) -> Effects:
        """Time passed: a role whose lease ran out is dropped (the coordinator died or
        cannot reach this replica, and the group may elect without it); a shutdown's
        freeze whose hold ran out lapses (nobody finished or aborted it)."""
        thawed = ""
        if self.frozen_for and not self.shutdown_finished and now_ms > self.frozen_until_ms:
            thawed = (
                f"the freeze for cluster shutdown {self.frozen_for} lapsed: neither its finish "
                "nor its abort came in time (the operator's command was stopped or lost "
                "this replica); writes and roles are accepted again"
            )
            self.frozen_for, self.frozen_until_ms = "", 0
        if self.lease_until_ms and now_ms > self.lease_until_ms:
            dropped = self._drop("role lease expired: no word from the coordinator")
            return replace(dropped, thawed=thawed)
        return Effects(thawed=thawed)

    def drop_role(self, reason: str) -> Effects:
        """The driver drops the role for its own reason (a cluster shutdown finishing)."""
        return self._drop(reason)

    def deposed_by(self, reason: str) -> Effects:
        """The replication core deposed this master: no more writes in this epoch."""
        self.deposed = reason
        self.fence.clear()
        self.epoch_floor = max(self.epoch_floor, self.epoch)
        changed = self.role == Role.MASTER
        if changed:
            self.role = Role.INACTIVE
            self.master_id = ""
        return Effects(role_changed=True)

    def fail_stop(self, reason: str) -> Effects:
        """A store that cannot write must not acknowledge anything again."""
        self.failed_reason = reason
        self.role = Role.INACTIVE
        return Effects(faults=(f"fail-stop: {reason}",), role_changed=True)

    # --- cluster shutdown (shutdown.py drives the store and the process)

    def freeze(self, shutdown_id: str, now_ms: int, hold_ms: int) -> Effects:
        """No new role, no new write, for hold_ms from now_ms unless the shutdown finishes
        or aborts first (idempotent for the same shutdown, which holds it anew)."""
        me = self.config.node_id
        if self.shutdown_finished:
            return _refused(
                Code.FAILED_PRECONDITION,
                f"replica {me} already finished cluster shutdown {self.shutdown_finished}",
            )
        if self.frozen_for and self.frozen_for != shutdown_id:
            return _refused(
                Code.FAILED_PRECONDITION,
                f"replica {me} is frozen for cluster shutdown {self.frozen_for}, not "
                f"{shutdown_id}; abort that one first",
            )
        self.frozen_for = shutdown_id
        self.frozen_until_ms = now_ms + hold_ms
        return Effects()

    def finish(self, shutdown_id: str) -> Effects:
        """The shutdown this replica is frozen for finishes: it drops its role for good."""
        if self.frozen_for != shutdown_id:
            held = self.frozen_for or "none"
            return _refused(
                Code.FAILED_PRECONDITION,
                f"replica {self.config.node_id} is not frozen for cluster shutdown "
                f"{shutdown_id} (frozen for: {held}); nothing was changed",
            )
        self.shutdown_finished = shutdown_id
        return self._drop(f"cluster shutdown {shutdown_id}")

    def abort(self, shutdown_id: str) -> Effects:
        """Undoes a freeze: writes and roles are accepted again."""
        me = self.config.node_id
        if self.shutdown_finished:
            return _refused(
                Code.FAILED_PRECONDITION,
                f"replica {me} already finished cluster shutdown {self.shutdown_finished}",
            )
        if self.frozen_for not in (shutdown_id, ""):
            return _refused(
                Code.FAILED_PRECONDITION,
                f"replica {me} is frozen for cluster shutdown {self.frozen_for}, not {shutdown_id}",
            )
        self.frozen_for, self.frozen_until_ms = "", 0
        return Effects()

    # --- leadership transfer (handoff.py waits for the target)

    def fence_writes(self, target: str, epoch: int, until_ms: int) -> RoleRefusal | None:
        """Refuse new writes until ``until_ms`` while ``target`` catches up; only the
        master of ``epoch`` can."""
        if self.role != Role.MASTER or self.epoch != epoch:
            return RoleRefusal(
                Code.FAILED_PRECONDITION,
                f"replica {self.config.node_id} is not the master of epoch {epoch} (epoch "
                f"{self.epoch}, role ROLE_{self.role.name})",
            )
        self.fence.until_ms, self.fence.target, self.fence.epoch = until_ms, target, epoch
        return None

    def lift_fence(self, epoch: int) -> None:
        """A cancelled transfer lifts the fence it set in ``epoch``."""
        if self.fence.epoch == epoch:
            self.fence.clear()

    # --- the write gate

    def write_refusal(self, now_ms: int, taking_progress: Callable[[], str]) -> RoleRefusal | None:
        """Why a write may not be accepted now (None: it may, this is the master).

        ``taking_progress`` describes a master role being taken (``reorg.SyncProgress``);
        called only when one is."""
        me = self.config.node_id
        if self.frozen_for:
            return RoleRefusal(
                Code.UNAVAILABLE,
                f"replica {me} is stopping for cluster shutdown {self.frozen_for}: writes "
                "are refused",
            )
        if self.failed_reason:
            return RoleRefusal(
                Code.UNAVAILABLE, f"replica {me} stopped serving writes: {self.failed_reason}"
            )
        if self.role == Role.MASTER:
            if self.fence.holds(now_ms, self.epoch):
                return RoleRefusal(
                    Code.UNAVAILABLE,
                    f"replica {me} (master, epoch {self.epoch}) is handing the leadership "
                    f"to {self.fence.target}; the write was not stored, retry",
                )
            return None
        if self.role == Role.SLAVE and self.master_id:
            address = self.config.replica_addresses.get(self.master_id, "")
            return RoleRefusal(
                Code.UNAVAILABLE,
                f"replica {me} is a slave; the master is {self.master_id} at {address}",
                ((MASTER_ADDRESS_KEY, address),),
            )
        if self.deposed:
            return RoleRefusal(
                Code.UNAVAILABLE,
                f"replica {me} was deposed as master of epoch {self.epoch}: {self.deposed}",
            )
        if self.taking is not None and not self.taking.finished:
            return RoleRefusal(
                Code.UNAVAILABLE, f"replica {me} is not master yet: {taking_progress()}"
            )
        return RoleRefusal(Code.UNAVAILABLE, f"replica {me} has no role yet (no master elected)")

    # --- the log's position and commit-LSN record (the slave side and every append)

    def slave_hello(
        self,
        *,
        master_id: str,
        epoch: int,
        cluster_id: str,
        store_last_lsn: int,
        store_history: tuple[tuple[int, int], ...],
        store_log_start_lsn: int,
    ) -> Effects:
        """A master opens a replication stream (``ReplicationHello``); ``store_*`` is what
        the store holds now. Accepted only by a slave, from its epoch's master."""
        follower = self.follower
        if self.role != Role.SLAVE or follower is None:
            stale = epoch < self.epoch
            return Effects(
                refusal=RoleRefusal(
                    Code.FAILED_PRECONDITION if stale else Code.UNAVAILABLE,
                    f"replica {self.config.node_id} (epoch {self.epoch}, last LSN "
                    f"{self.log.last_lsn}) refused the stream of {master_id[:64]!r} (epoch "
                    f"{epoch}): "
                    + ("that epoch is stale" if stale else "it is not a slave of that epoch yet"),
                    ((EPOCH_KEY, str(self.epoch)),),
                ),
                warn=stale,
            )
        reread = follower.state().last_lsn != store_last_lsn
        if reread:
            # The store's log is not the one the follower last knew: report what it holds.
            follower.reset(last_lsn=store_last_lsn, history=store_history)
            self.log_reset(store_last_lsn, store_log_start_lsn)
        result = follower.on_hello(master_id=master_id, epoch=epoch, cluster_id=cluster_id)
        if isinstance(result, Refusal):
            return Effects(refusal=self._stream_refusal(result), log_reread=reread, warn=True)
        self.stream_seq += 1
        return Effects(hello=result, stream=self.stream_seq, log_reread=reread)

    def slave_stream(self, stream: int) -> Follower | RoleRefusal:
        """The follower of replication stream ``stream``, or why that stream is over."""
        follower = self.follower
        if self.role != Role.SLAVE or follower is None or stream != self.stream_seq:
            return RoleRefusal(
                Code.FAILED_PRECONDITION,
                f"replica {self.config.node_id} (epoch {self.epoch}, last LSN "
                f"{self.log.last_lsn}): this replication stream was superseded (a newer "
                "stream or role)",
                ((EPOCH_KEY, str(self.epoch)),),
            )
        return follower

    def slave_batch(
        self,
        stream: int,
        *,
        epoch: int,
        entries: Sequence[EntryLike],
        commit_lsn: int,
        truncate_after_lsn: int | None,
    ) -> Effects:
        """A batch on replication stream ``stream``: checked whole by the follower (a
        refusal changes nothing and closes the stream)."""
        follower = self.slave_stream(stream)
        if isinstance(follower, RoleRefusal):
            return Effects(refusal=follower)
        result = follower.on_batch(
            epoch=epoch,
            entries=entries,
            commit_lsn=commit_lsn,
            truncate_after_lsn=truncate_after_lsn,
        )
        if isinstance(result, Refusal):
            return Effects(refusal=self._stream_refusal(result), warn=True)
        acks = () if result.ack_now is None else (result.ack_now,)
        if not result.write_needed:
            return Effects(acks=acks, advance_commit=follower.commit_lsn)
        return Effects(acks=acks, batch=result)

    def slave_snapshot_chunk(
        self,
        stream: int,
        *,
        index: int,
        snapshot_lsn: int,
        snapshot_epoch: int,
        last: bool,
        history: Sequence[tuple[int, int]],
    ) -> Effects:
        """A snapshot chunk on replication stream ``stream``, checked by the follower."""
        follower = self.slave_stream(stream)
        if isinstance(follower, RoleRefusal):
            return Effects(refusal=follower)
        result = follower.on_snapshot_chunk(
            index=index,
            snapshot_lsn=snapshot_lsn,
            snapshot_epoch=snapshot_epoch,
            last=last,
            history=history,
        )
        if isinstance(result, Refusal):
            return Effects(refusal=self._stream_refusal(result), warn=True)
        return Effects(snapshot=result)

    def slave_store_failed(
        self,
        follower: Follower,
        *,
        store_last_lsn: int,
        store_history: tuple[tuple[int, int], ...],
        store_log_start_lsn: int,
        store_commit_lsn: int,
    ) -> Effects:
        """Writing what ``follower`` accepted failed (nothing of it stored): it, the log
        position and the commit LSN it knows are re-read from the store (the commit LSN
        it recorded); the driver closes the stream."""
        follower.reset(last_lsn=store_last_lsn, history=store_history, commit_lsn=store_commit_lsn)
        self.log_reset(store_last_lsn, store_log_start_lsn)
        return Effects(log_reread=True)

    def _stream_refusal(self, refusal: Refusal) -> RoleRefusal:
        """The follower's refusal, carrying this replica's epoch for a stale master."""
        return RoleRefusal(refusal.status, refusal.message, ((EPOCH_KEY, str(self.epoch)),))

    def log_reset(
        self, last_lsn: int, log_start_lsn: int, commit_recorded: int | None = None
    ) -> Effects:
        """The driver re-read the store (a role taken, a write failed, a sync stopped):
        its log ends at ``last_lsn`` and starts at ``log_start_lsn``; ``commit_recorded``
        when the record is known anew."""
        self.log.last_lsn, self.log.log_start_lsn = last_lsn, log_start_lsn
        if commit_recorded is not None:
            self.log.commit_recorded = commit_recorded
        return Effects()

    def log_appended(self, last_lsn: int, recorded_commit_lsn: int = 0) -> Effects:
        """Entries up to ``last_lsn`` were appended (by the writer or a reorganization
        fetch); the same transaction recorded ``recorded_commit_lsn`` (0: none)."""
        self.log.last_lsn = last_lsn
        self.log.commit_recorded = max(self.log.commit_recorded, recorded_commit_lsn)
        return Effects()

    def log_truncated(self, keep_lsn: int, log_start_lsn: int) -> Effects:
        """The log after ``keep_lsn`` was removed: nothing above it is recorded committed."""
        self.log.last_lsn, self.log.log_start_lsn = keep_lsn, log_start_lsn
        self.log.commit_recorded = min(self.log.commit_recorded, keep_lsn)
        return Effects()

    def log_compacted(self, log_start_lsn: int) -> Effects:
        """The log below ``log_start_lsn`` was deleted."""
        self.log.log_start_lsn = log_start_lsn
        return Effects()

    def compaction(self, keep_lsn: int) -> int:
        """The LSN to compact the log below now (0: not worth a store transaction yet);
        ``keep_lsn`` is what the caller may delete below (never above a commit LSN)."""
        step = compact_step(self.config.log_retention_entries)
        return keep_lsn if keep_lsn - self.log.log_start_lsn >= step else 0

    def slave_written(
        self, *, last_lsn: int, batch_commit_lsn: int, commit_lsn: int, ack: Ack
    ) -> Effects:
        """A slave stored a batch up to ``last_lsn`` in one transaction recording the
        master's ``batch_commit_lsn``; ``commit_lsn`` is the follower's (known committed
        and written) and ``ack`` the follower's ack for it. Compacts the log beyond the
        retention (never above the commit LSN: a restart hides what is above it by
        reading the log), serves reads up to the commit LSN, then acknowledges."""
        self.log.last_lsn = last_lsn
        self.log.commit_recorded = max(self.log.commit_recorded, min(batch_commit_lsn, last_lsn))
        keep = min(last_lsn - self.config.log_retention_entries + 1, commit_lsn + 1)
        return Effects(compact_from=self.compaction(keep), advance_commit=commit_lsn, acks=(ack,))

    def slave_heartbeat_message(self, stream: int, *, epoch: int, commit_lsn: int) -> Effects:
        """A heartbeat on replication stream ``stream``: the follower learns the master's
        ``commit_lsn`` (a refusal closes the stream), then as ``slave_heartbeat``."""
        follower = self.slave_stream(stream)
        if isinstance(follower, RoleRefusal):
            return Effects(refusal=follower)
        result = follower.on_heartbeat(epoch=epoch, commit_lsn=commit_lsn)
        if isinstance(result, Refusal):
            return Effects(refusal=self._stream_refusal(result), warn=True)
        return self.slave_heartbeat(commit_lsn=follower.commit_lsn, ack=result)

    def slave_heartbeat(self, *, commit_lsn: int, ack: Ack) -> Effects:
        """An idle stream's heartbeat taught the follower ``commit_lsn``: serve reads up to
        it, record it (no batch will, one record at a time: the next heartbeat records the
        rest) and answer with ``ack``."""
        record = 0
        if commit_lsn > self.log.commit_recorded and not self.log.commit_recording:
            record = self.log.commit_recording = commit_lsn
        return Effects(record_commit=record, advance_commit=commit_lsn, acks=(ack,))

    def commit_record_done(self, recorded_lsn: int) -> Effects:
        """The store recorded commit LSN ``recorded_lsn`` (``record_commit``)."""
        self.log.commit_recording = 0
        self.log.commit_recorded = max(self.log.commit_recorded, recorded_lsn)
        return Effects()

    def commit_record_failed(self) -> Effects:
        """Recording the commit LSN failed (only a hint for the next start): the next
        heartbeat tries again."""
        self.log.commit_recording = 0
        return Effects()

    def snapshot_installed(self, snapshot_lsn: int, commit_lsn: int) -> Effects:
        """The install finished: the log continues from ``snapshot_lsn`` and the store
        recorded ``commit_lsn``; reads may serve up to it."""
        self.log.last_lsn, self.log.log_start_lsn = snapshot_lsn, snapshot_lsn + 1
        self.log.commit_recorded = commit_lsn
        return Effects(advance_commit=commit_lsn)

    # --- internals

    def _renew_lease(self, lease_ms: int, now_ms: int) -> None:
        self.lease_until_ms = now_ms + lease_ms if lease_ms else 0

    def _abandon_taking(self) -> None:
        """As with a role dropped: an abandoned attempt's epoch is not taken up again."""
        taking, self.taking = self.taking, None
        if taking is not None:
            self.epoch_floor = max(self.epoch_floor, taking.epoch)

    def _drop(self, reason: str, *, cancel: str = "") -> Effects:
        """Drops the role (and abandons a master role being taken)."""
        if self.taking is not None:
            cancel = cancel or f"deactivated: {reason}"
            self._abandon_taking()
        changed = self.role != Role.INACTIVE
        self.epoch_floor = max(self.epoch_floor, self.epoch)
        self.role = Role.INACTIVE
        self.fence.clear()
        self.master_id = ""
        self.lease_until_ms = 0
        self.follower = None
        self.stream_seq += 1
        return Effects(cancel_taking=cancel, drop_role=reason, role_changed=changed)


def _refused(code: Code, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> Effects:
    return Effects(refusal=RoleRefusal(code, message, metadata))
