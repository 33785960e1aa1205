"""The replica's driver logic, synchronous: applies ``ReplicaCore``'s effects against the
store facade and the committed-reads gate, with no asyncio, gRPC or threads inside.

``ReplicaDriver`` owns the store (``Store``, LMDB or the in-memory twin) and the commit
gate (``CommitGate``) around the node's ``ReplicaCore``, and carries out, in the order
``core.Effects`` documents, what the core decides for the slave side of replication:
the Hello (position, cluster id adoption, the store marked in use), each batch (the
refusal, the acks on receipt, hiding what is not committed yet, the follower's written
report, compaction and the commit advance), heartbeats, snapshot chunks (the gate emptied
when an install begins, restored from the snapshot's uncommitted topics when it ends),
and the mapping of a store failure to the stream's status; and what a new master fetches
from its sync source (the request, cluster id adoption, the checks of fetched entries,
truncations and snapshots, the commit advance); and the master writer's planning of a
group-commit batch and the mapping of a failed append.

Its methods come in two kinds. ``store_*`` methods only touch the store, so a shell may
run them on a store thread (fsync must not block its event loop); every other method
reads or changes the core and the gate and runs where the shell feeds the core (its
loop). Between the two a shell may wait (``ReplicaNode`` holds its commit lock across a
batch and awaits the store thread); a simulator calls them one after the other. A
sequence that interleaves both is a generator of steps (``role_steps``,
``install_snapshot``, ``write_batch``, ``store_fetched``): it yields each store operation
or shell step in its place in the order, and the shell carries it out before asking for
the next (``run_store_steps`` runs store operations at once), so the asyncio shells
(``roles.py``, ``slave_side.py``, ``taking_master.py``) and the replication simulator
(``tests/sim/replication_sim.py``) run the same sequence. Waking readers is a hook
(``on_committed``), as waking loops is the coordinator driver's.

``services/replica/node.py`` (``ReplicaNode``) is the asyncio shell that feeds it; the
master's streams (``MasterDriver``) and the writer's queue are the shell's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, LimitsConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import commands
from squall_server.replica.commands import BatchBuilder, Command, Planned
from squall_server.replica.committed import track
from squall_server.replica.core import (
    EPOCH_KEY,
    Effects,
    Follow,
    PersistRole,
    ReplicaCore,
    RoleRefusal,
    TakeMaster,
)
from squall_server.replica.divergence import HistoryError, fork_lsn
from squall_server.replica.follower import (
    BatchAccepted,
    EntriesChecked,
    EntryProblem,
    Follower,
    FollowerConfig,
    FollowerError,
    RefusalCode,
    SnapshotAccepted,
    check_entries,
)
from squall_server.replica.replication import (
    Ack,
    AckPolicy,
    MasterConfig,
    ReplicationError,
    ReplicationMaster,
    SyncPolicy,
)
from squall_server.replica.store import (
    CorruptRecordError,
    SnapshotError,
    Store,
    StoreError,
    StoreFullError,
    StoreMeta,
)
from squall_server.replica.visibility import CommitGate

log = logging.getLogger("squall.replica")

# What a master's replication core waits on per write (the shell's futures).
W = TypeVar("W")
T = TypeVar("T")

StoreCall = Callable[[], object]
"""A store operation a driver step yields: the shell runs it where it runs store writes
(a store thread: fsync must not block its event loop) before resuming the step."""


def run_store_steps(steps: Generator[StoreCall, None, T]) -> T:
    """Runs a driver step's store operations at once, in order (a caller with no store
    thread: the simulator, a test); returns what the step returns."""
    try:
        call = next(steps)
        while True:
            try:
                call()
            except Exception as exc:
                # The step learns its store operation failed (it may undo what it did
                # before yielding it), then raises it again.
                call = steps.throw(exc)
            else:
                call = steps.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


@dataclass
class PlannedBatch:
    """One group-commit batch planned on the store's state: its entries, and for each
    command (by its index in the input) its plan and the LSN it waits for (its entry's,
    or for a command with no entry — a duplicate, an ack below the cursor — the last
    LSN of the state it read), or why it was refused. ``faults``: checksum errors met
    while planning, for the shell to report (the node is quarantined)."""

    entries: list[replica_pb2.LogEntry]
    planned: list[tuple[int, Planned, int]] = field(default_factory=list)
    refused: list[tuple[int, ServiceError]] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CancelTaking:
    """Role step: stop the task taking the master role and wait until it and its store
    work stopped (``why`` says why), before the next step."""

    why: str


@dataclass(frozen=True, slots=True)
class DropRole:
    """Role step: the role was dropped (``reason``): stop the master's replication or the
    slave's stream, fail queued writes as not stored, stop push delivery, and wait until
    no batch is being written (``was_active``: the role held was not INACTIVE)."""

    reason: str
    was_active: bool


@dataclass(frozen=True, slots=True)
class StartTaking:
    """Role step: start taking the master role in the background (``reorg``); the task
    writes ``persist`` first (``take_master_persist``)."""

    take: TakeMaster
    persist: PersistRole


@dataclass(frozen=True, slots=True)
class FollowMaster:
    """Role step: the epoch is persisted; with no batch half-applied (the shell's commit
    lock), make the follower (``ReplicaDriver.follow``)."""

    follow: Follow


@dataclass(frozen=True, slots=True)
class JoinTaking:
    """Role step: the command repeats the one being carried out: answer it when that
    task ends or within a heartbeat (``reorg``)."""


@dataclass(frozen=True, slots=True)
class RecordClusterId:
    """Role step, a store operation (``Effects.record_cluster_id``): record the group's
    cluster id in an empty store before it takes the role."""

    cluster_id: str


# The role's flushed store writes (``Effects.record_cluster_id``, ``Effects.persist_role``),
# each a role step of its own: the shell runs ``ReplicaDriver.write_role`` off the event
# loop, serialized with every other write. A flush also writes out every unsynced append
# before it, which on a busy disk outlasts ``replica_timeout_ms``; the shell's loop must
# keep answering its coordinator.
RoleWrite = RecordClusterId | PersistRole


@dataclass(frozen=True, slots=True)
class RenewMembers:
    """Role step: a master renewal naming another group: tell the replication core."""

    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TruncateLog:
    """Batch step: truncate the log after keep_lsn, the master's batch diverging from it
    (``truncation``); a failure is the stream's (``batch_failed``)."""

    keep_lsn: int


@dataclass(frozen=True, slots=True)
class AppendBatch:
    """Batch step: append the accepted entries, recording the commit LSN known with them
    (the store thread; ``sync``: flushed); a failure is the stream's (``batch_failed``)."""

    entries: Sequence[replica_pb2.LogEntry]
    sync: bool
    commit_lsn: int


@dataclass(frozen=True, slots=True)
class CompactLog:
    """Batch step: delete the log below keep_from_lsn (the store thread), then report
    ``compacted``; a failure only leaves more log than wanted."""

    keep_from_lsn: int


# What writing a slave's batch leaves to the shell, in the order ``core.Effects`` documents.
BatchStep = TruncateLog | AppendBatch | CompactLog


# What a role change leaves to the shell, in the order ``core.Effects`` documents.
RoleStep = (
    CancelTaking
    | DropRole
    | RecordClusterId
    | PersistRole
    | StartTaking
    | FollowMaster
    | JoinTaking
    | RenewMembers
)


@dataclass
class FetchTail:
    """A reorganization fetch as it goes: where the log ends (each fetched batch must
    continue it), where the store's log ended when this pass began (a truncation is
    only below it), and what the fetch brought so far."""

    last_lsn: int
    last_epoch: int
    store_last_lsn: int
    entries: int = 0
    snapshots: int = 0


@dataclass(frozen=True, slots=True)
class InstallFetched:
    """Fetch step: install this snapshot chunk as a slave does (``check_fetched_snapshot``
    first), then report ``fetched_chunk_installed``."""

    chunk: replica_pb2.SnapshotChunk


@dataclass(frozen=True, slots=True)
class StoreFetched:
    """Fetch step: append these checked entries (``ReplicaDriver.store_fetched``, or
    ``fetched_store_failed`` when the append fails)."""

    entries: list[replica_pb2.LogEntry]
    commit_lsn: int
    checked: EntriesChecked


@dataclass(frozen=True, slots=True)
class TruncateFetched:
    """Fetch step: this log diverges from the source's after keep_lsn: truncate it there
    and fetch again."""

    keep_lsn: int


FetchStep = InstallFetched | StoreFetched | TruncateFetched


@dataclass(frozen=True, slots=True)
class FetchAnswer:
    """How a sync source answers a new master's fetch: the log after ``fork`` (a
    ``diverged`` requester truncates after it first), or, when ``why_snapshot`` says why,
    a snapshot of this store and the log after it; ``meta``: this store as the answer
    began, ``step``: entries per batch."""

    meta: StoreMeta
    fork: int
    diverged: bool
    why_snapshot: str
    step: int


def _persist_of(effects: Effects) -> PersistRole:
    """The role's epoch write the core sets with every ``take_master`` and ``follow``."""
    if effects.persist_role is None:
        raise ValueError("the core took a role without naming the epoch to persist")
    return effects.persist_role


def master_config(
    config: ClusterConfig, node_id: str, member_count: int, *, truncate_by_snapshot: bool
) -> MasterConfig:
    """The replication core's configuration for one master epoch of a group of
    member_count voting nodes (learners not counted); ``truncate_by_snapshot``: this
    store cannot truncate its log (a divergent slave gets a snapshot instead)."""
    durability = config.durability
    limits = config.limits
    nodes = tuple(n.id for n in config.nodes if not n.learner)
    learners = tuple(n.id for n in config.nodes if n.learner)
    majority = len(nodes) // 2 + 1
    # The coordinator only forms a group smaller than a majority under an operator's
    # quorum override or a designated primary; the commit count follows its decision.
    override = member_count if member_count < majority else 0
    return MasterConfig(
        node_id=node_id,
        nodes=nodes,
        acks=AckPolicy(int(durability.acks)),
        master_sync=SyncPolicy(int(durability.master_sync)),
        replica_sync=SyncPolicy(int(durability.replica_sync)),
        inflight_entries_max=limits.replication_inflight_entries_max,
        inflight_bytes_max=limits.replication_inflight_bytes_max,
        pending_writes_max=limits.replication_pending_writes_max,
        heartbeat_interval_ms=config.timeouts.heartbeat_interval_ms,
        quorum_override=override,
        truncate_by_snapshot=truncate_by_snapshot,
        learners=learners,
    )


def ack_message(ack: Ack, *, readers_following: bool = False) -> replica_pb2.ReplicationAck:
    """A core's ack as the wire message."""
    return replica_pb2.ReplicationAck(
        received_lsn=ack.received_lsn,
        written_lsn=ack.written_lsn,
        synced_lsn=ack.synced_lsn,
        readers_following=readers_following,
    )


class ReplicaDriver:
    """Applies the replica core's slave-side effects to the store and the commit gate."""

    def __init__(
        self,
        node_id: str,
        core: ReplicaCore,
        store: Store,
        gate: CommitGate,
        *,
        follower_config: FollowerConfig,
        on_committed: Callable[[], None],
        on_role_changed: Callable[[], None] = lambda: None,
        on_fault: Callable[[str], None] | None = None,
        local_commits: bool = False,
    ) -> None:
        """``follower_config``: the slave side's sync policy and in-flight limits;
        ``local_commits``: a commit here needs no other replica (``acks = "none"``), so
        a sync source may lack entries this node knew committed;
        ``on_committed``: committed reads may serve more (wake subscribers);
        ``on_role_changed``: the core's role changed (count it, wake who waits for one);
        ``on_fault``: a fault the node must record and report (its coordinator
        quarantines it; unset: logged only)."""
        self.node_id = node_id
        self.core = core
        self.follower_config = follower_config
        # Both replaced whole by the shell: a truncation installs a rebuilt store, a start
        # re-reads the gate from the store.
        self.store = store
        self.gate = gate
        self._on_committed = on_committed
        self._on_role_changed = on_role_changed
        self._on_fault = on_fault or self._log_fault
        self.local_commits = local_commits
        # Following reads open here: while any is, every ack says so, and the master
        # tells this slave each commit at once rather than at its next batch or heartbeat.
        self.following_readers = 0
        # What this replica's Position tells a master: it applies PublishPartsOp entries.
        # The shell simulator sets it False on a member to play an older release.
        self.reads_joined_publishes = True
        # Why committed reads are refused ("": served): the commit gate could not be
        # rebuilt from the store (``gate_unreadable``).
        self.reads_refused = ""

    # --- small steps shared by both sides

    def follow_started(self) -> None:
        """A following read opened here (the next ack tells a master)."""
        self.following_readers += 1

    def follow_ended(self) -> None:
        """A following read ended."""
        self.following_readers -= 1

    def ack(self, ack: Ack) -> replica_pb2.ReplicationAck:
        """An ack as the wire message, saying whether following reads are open here."""
        return ack_message(ack, readers_following=self.following_readers > 0)

    def refused(self, code: Code, message: str) -> ServiceError:
        """A replication refusal carrying this replica's epoch for a stale master."""
        return ServiceError(code, message, metadata=((EPOCH_KEY, str(self.core.epoch)),))

    def advance_commit(self, commit_lsn: int) -> None:
        """The commit LSN moved: committed reads may serve more; wake subscribers."""
        if self.gate.advance(commit_lsn):
            self._on_committed()

    def mark_dirty(self) -> None:
        """A store in use is DIRTY: a restart must not take it for a clean or empty one."""
        if self.store.meta().state != common_pb2.STORE_STATE_DIRTY:
            self.store.set_state(common_pb2.STORE_STATE_DIRTY)

    def track(self, entry: replica_pb2.LogEntry) -> None:
        """Hides an uncommitted publish from committed reads until it commits."""
        track(self.gate, entry)

    def hide_uncommitted(self, entries: Iterable[replica_pb2.LogEntry], source_commit: int) -> None:
        """Hides the publishes of entries about to be stored that lie above both this
        node's and their source's commit LSN."""
        visible = max(self.gate.commit_lsn, source_commit)
        for entry in entries:
            if entry.lsn > visible:
                self.track(entry)

    def compacted(self) -> None:
        """The store compacted its log: the core learns where it starts now."""
        self.core.log_compacted(self.store.log_start_lsn())

    def _log_fault(self, reason: str) -> None:
        log.error("replica %s FAULT: %s (no fault hook set)", self.node_id, reason)

    # --- role changes: the core's role effects, in the order ``core.Effects`` documents

    def role_steps(self, effects: Effects) -> Iterator[RoleStep]:
        """Carries out a role change's effects, yielding each step that needs the shell
        (a task to stop or start, a lock to wait for) in its place in the order; the
        shell carries out each before asking for the next. A refusal raises it, after the
        cancelled taking stopped and before anything else."""
        if effects.role_changed:
            self._on_role_changed()
        if effects.cancel_taking:
            yield CancelTaking(effects.cancel_taking)
        if effects.refusal is not None:
            raise effects.refusal.error()
        if effects.drop_role:
            yield DropRole(effects.drop_role, was_active=effects.role_changed)
        if effects.record_cluster_id:
            yield RecordClusterId(effects.record_cluster_id)
        if effects.take_master is not None:
            yield StartTaking(effects.take_master, _persist_of(effects))
        elif effects.follow is not None:
            yield _persist_of(effects)
            yield FollowMaster(effects.follow)
        elif effects.join_taking:
            yield JoinTaking()
        if effects.members is not None:
            yield RenewMembers(effects.members)
        for fault in effects.faults:
            self._on_fault(fault)

    def role_answer(self, effects: Effects) -> None:
        """Carries out an answer of the core that needs no shell step (a role taken, lost
        or fail-stopped); raises its refusal."""
        if effects.role_changed:
            self._on_role_changed()
        if effects.refusal is not None:
            raise effects.refusal.error()
        for fault in effects.faults:
            self._on_fault(fault)

    def write_role(self, write: RoleWrite) -> None:
        """Carries out one of the role's store operations (on the store thread)."""
        match write:
            case RecordClusterId(cluster_id):
                self.record_cluster_id(cluster_id)
            case PersistRole():
                self.persist_role(write)

    def persist_role(self, persist: PersistRole) -> None:
        """Persists the epoch of the role about to be taken and marks the store in use."""
        self.store.set_epoch(persist.epoch)
        self.mark_dirty()

    def record_cluster_id(self, cluster_id: str) -> None:
        """The group's coordinator chose the cluster id (at the first formation): recorded
        before the role, so this store can never be taken for another cluster's."""
        self.store.set_cluster_id(cluster_id)
        log.info(
            "replica %s joined cluster %s (epoch=%d)",
            self.node_id,
            cluster_id,
            self.core.epoch,
        )

    def fail_stop(self, reason: str) -> None:
        """A store that cannot write must not acknowledge anything again."""
        log.error(
            "replica %s FAIL-STOP: %s (epoch=%d lsn=%d)",
            self.node_id,
            reason,
            self.core.epoch,
            self.core.log.last_lsn,
        )
        self.role_answer(self.core.fail_stop(reason))

    def deposed(self, reason: str) -> None:
        """The replication core deposed this master: no more writes in this epoch."""
        self.role_answer(self.core.deposed_by(reason))

    def taking_finished(self, epoch: int, error: ServiceError | None, now_ms: int) -> None:
        """An attempt to take the master role of epoch ended (error: why it failed); the
        core ignores repeats."""
        refusal = None if error is None else RoleRefusal(error.code, error.message, error.metadata)
        self.role_answer(self.core.taking_finished(epoch, refusal, now_ms))

    def taking_answer(self, epoch: int) -> None:
        """A role command waiting for the master role's attempt heard its outcome."""
        self.role_answer(self.core.taking_answer(epoch))

    def master_taken(self, epoch: int) -> None:
        """The master role of epoch is held (refused if abandoned meanwhile)."""
        self.role_answer(self.core.master_taken(epoch))

    def gate_unreadable(self, exc: CorruptRecordError, why: str) -> None:
        """Rebuilding the commit gate (``why``: at start-up, after an interrupted
        reorganization) met a log record that fails its checksum: this replica cannot
        tell which of its stored publishes are committed. It serves no read and takes no
        role until its store is repaired; the fault quarantines the node (a replica that
        exited instead would be seen down, not told why)."""
        self.reads_refused = (
            f"its log fails its checksum rebuilding the commit gate ({why}): {exc}; "
            "repair its store (docs/operations.md, Quarantine)"
        )
        meta = self.store.meta()
        commit_lsn = min(self.gate.commit_lsn, meta.last_lsn)
        self.core.log_reset(meta.last_lsn, self.store.log_start_lsn(), commit_lsn)
        self.fail_stop(self.reads_refused)

    def taking_stopped(self, gate: CommitGate) -> None:
        """An abandoned attempt to take the master role and its store work stopped:
        committed reads and the core's log follow what was stored (``gate``: read from
        the store on the store thread)."""
        self.gate = gate
        meta = self.store.meta()
        self.core.log_reset(meta.last_lsn, self.store.log_start_lsn(), gate.commit_lsn)
        self._on_committed()

    # --- taking the master role (the core's ``TakeMaster``, run by the shell's task)

    def take_master_persist(self, persist: PersistRole, members: Sequence[str]) -> list[str]:
        """Checks a master role's epoch and members, then writes the core's ``persist``
        (the epoch, the store marked in use; before a reorganization fetch changes it);
        returns the group's member ids (this node alone if none are named; this node
        always among them)."""
        epoch = persist.epoch
        meta = self.store.meta()
        if epoch < meta.epoch:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"epoch {epoch} is older than this replica's epoch {meta.epoch}",
            )
        known = self.core.config.replica_addresses
        member_ids: list[str] = []
        for member in members or (self.node_id,):
            if member not in known:
                raise ServiceError(Code.INVALID_ARGUMENT, f"unknown member node id '{member}'")
            member_ids.append(member)
        if self.node_id not in member_ids:
            member_ids.append(self.node_id)
        self.persist_role(persist)
        return member_ids

    def master_core(
        self, config: MasterConfig, epoch: int, member_ids: Sequence[str]
    ) -> ReplicationMaster[W]:
        """The replication core of a master epoch over the store's log as it is now (after
        any reorganization fetch), which the replica's core takes as its log too. A store
        with no cluster id, or a log the core refuses, is FAILED_PRECONDITION."""
        meta = self.store.meta()
        if not meta.cluster_id:
            # The first group's coordinator mints the cluster id (services/common/ids.py)
            # and every MASTER command carries it; a master without one is never heard.
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node_id}: the master role of epoch {epoch} names no cluster "
                "id and this store holds none (the coordinator mints it)",
            )
        self.core.log_reset(meta.last_lsn, self.core.log.log_start_lsn)
        try:
            return ReplicationMaster(
                config,
                epoch=epoch,
                members=list(member_ids),
                last_lsn=meta.last_lsn,
                history=meta.history,
                log_start_lsn=self.core.log.log_start_lsn,
            )
        except ReplicationError as exc:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node_id} cannot be master of epoch {epoch}: {exc}",
            ) from exc

    def hold_master(
        self, config: MasterConfig, epoch: int, member_ids: Sequence[str]
    ) -> ReplicationMaster[W]:
        """The last step of taking the master role of epoch, after any reorganization
        fetch: the epoch's replication core over the store's log (``master_core``), and
        the role held (``master_taken``: refused if the attempt was abandoned meanwhile).
        The shell then starts replicating with it and appends the epoch start."""
        core: ReplicationMaster[W] = self.master_core(config, epoch, member_ids)
        self.master_taken(epoch)
        return core

    # --- the slave side: taking the role (the core's ``Follow``)

    def follow(self, follow: Follow, now_ms: int) -> None:
        """Makes the follower from the store (no batch half-applied: the shell holds its
        commit lock) and reports it to the core, carrying out its answer. A store the
        follower cannot continue is FAILED_PRECONDITION."""
        meta = self.store.meta()
        try:
            follower = Follower(
                self.follower_config,
                cluster_id=meta.cluster_id,
                epoch=follow.epoch,
                master_id=follow.master_id,
                last_lsn=meta.last_lsn,
                history=meta.history,
            )
        except FollowerError as exc:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node_id} cannot follow {follow.master_id} in epoch "
                f"{follow.epoch}: {exc}",
            ) from exc
        effects = self.core.followed(
            follow.epoch, follow.master_id, follow.lease_ms, now_ms, follower
        )
        self.core.log_reset(meta.last_lsn, self.store.log_start_lsn())
        self.role_answer(effects)

    # --- the slave side, one stream message at a time (the shell holds its commit lock)

    def hello(
        self, hello: replica_pb2.ReplicationHello
    ) -> tuple[int, replica_pb2.ReplicationPosition]:
        """Accepts a stream from this epoch's master; returns its number and our position.
        A refusal raises it (ServiceError)."""
        meta = self.store.meta()
        effects = self.core.slave_hello(
            master_id=hello.master_id,
            epoch=hello.epoch,
            cluster_id=hello.cluster_id,
            store_last_lsn=meta.last_lsn,
            store_history=tuple((b.epoch, b.start_lsn) for b in meta.history),
            store_log_start_lsn=self.store.log_start_lsn(),
        )
        if effects.log_reread:
            self.gate.truncated(meta.last_lsn)
        result = effects.hello
        if effects.refusal is not None or result is None:
            raise self.stream_refused(effects)
        if result.adopt_cluster_id:
            self.store.set_cluster_id(result.adopt_cluster_id)
            log.info(
                "replica %s joined cluster %s (from master %s, epoch=%d)",
                self.node_id,
                result.adopt_cluster_id,
                hello.master_id,
                hello.epoch,
            )
        self.mark_dirty()
        position = result.position
        log.info(
            "replica %s accepted the stream of %s: epoch=%d last_epoch=%d lsn=%d",
            self.node_id,
            hello.master_id,
            hello.epoch,
            position.last_epoch,
            position.last_lsn,
        )
        return effects.stream, replica_pb2.ReplicationPosition(
            node_id=position.node_id,
            last_epoch=position.last_epoch,
            last_lsn=position.last_lsn,
            history=[replica_pb2.EpochBoundary(epoch=e, start_lsn=s) for e, s in position.history],
            log_start_lsn=self.store.log_start_lsn(),
            reads_joined_publishes=self.reads_joined_publishes,
        )

    def stream_follower(self, stream: int) -> Follower:
        """The follower of the current stream (the core's); a superseded one is refused."""
        follower = self.core.slave_stream(stream)
        if isinstance(follower, RoleRefusal):
            raise follower.error()
        return follower

    def stream_refused(self, effects: Effects) -> ServiceError:
        """A refused stream message as the stream's status (logged when the core says so)."""
        refusal = effects.refusal or RoleRefusal(
            Code.INTERNAL, "a Hello neither accepted nor refused"
        )
        if effects.warn:
            log.warning("replica %s: %s", self.node_id, refusal.message)
        return refusal.error()

    def batch(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> tuple[Effects, Follower, list[replica_pb2.ReplicationAck]]:
        """A batch from the master: the core's effects (written by ``write_batch``; a
        failed step is ``batch_failed``), the stream's follower and the acks due on
        receipt, before the write. A refusal raises it."""
        accepted = self.core.slave_batch(
            stream,
            epoch=batch.epoch,
            entries=list(batch.entries),
            commit_lsn=batch.commit_lsn,
            truncate_after_lsn=batch.truncate_after_lsn or None,
        )
        if accepted.refusal is not None:
            raise self.stream_refused(accepted)
        follower = self.stream_follower(stream)
        return accepted, follower, [self.ack(ack) for ack in accepted.acks]

    def write_batch(
        self, accepted: Effects, follower: Follower, commit_lsn: int
    ) -> Generator[BatchStep, None, list[replica_pb2.ReplicationAck]]:
        """Writes a batch the core accepted (``batch``'s effects; no other batch
        half-applied: the shell's commit lock), in the order ``core.Effects`` documents:
        yields the truncation a diverged log needs, then the append (its publishes above
        the commit LSN hidden from committed reads first), then, once the follower heard
        it written, the log effects (``apply_log_effects``); returns the acks to send.
        A batch with nothing to write has only its log effects (its acks went out on
        receipt). The shell carries out each step before asking for the next."""
        result = accepted.batch
        if result is None:
            yield from self.apply_log_effects(accepted)
            return []
        if result.truncate_after_lsn is not None:
            yield TruncateLog(result.truncate_after_lsn)
        self.hide_uncommitted(result.entries, commit_lsn)
        yield AppendBatch(result.entries, result.sync, commit_lsn)
        effects = self.batch_written(follower, result, commit_lsn)
        return (yield from self.apply_log_effects(effects))

    def apply_log_effects(
        self, effects: Effects
    ) -> Generator[BatchStep, None, list[replica_pb2.ReplicationAck]]:
        """The log effects of a batch (commit lock held), in the order of ``Effects``:
        yields the compaction the core asks for, then moves the commit LSN; returns the
        acks to send."""
        compact_from, acks = self.log_effects(effects)
        if compact_from:
            yield CompactLog(compact_from)
        self.advance(effects)
        return acks

    def batch_written(
        self, follower: Follower, result: BatchAccepted[replica_pb2.LogEntry], batch_commit: int
    ) -> Effects:
        """The batch is stored: the follower's ack and the core's log effects (compaction,
        commit advance, acks) for ``log_effects``."""
        ack = follower.on_written(result.last_lsn, synced=result.sync)
        return self.core.slave_written(
            last_lsn=result.last_lsn,
            batch_commit_lsn=batch_commit,
            commit_lsn=follower.commit_lsn,
            ack=ack,
        )

    def store_failed(self, follower: Follower) -> None:
        """A slave's write or install failed: the core and the gate re-read the store."""
        meta = self.store.meta()
        self.core.slave_store_failed(
            follower,
            store_last_lsn=meta.last_lsn,
            store_history=tuple((b.epoch, b.start_lsn) for b in meta.history),
            store_log_start_lsn=self.store.log_start_lsn(),
            store_commit_lsn=meta.commit_lsn or 0,
        )
        self.gate.truncated(meta.last_lsn)

    def batch_failed(self, follower: Follower, exc: Exception) -> tuple[ServiceError, str]:
        """Storing a batch failed: the stream's status, and the reason to fail-stop this
        replica with ("" when it may go on: a full store, a refused truncation)."""
        self.store_failed(follower)
        if isinstance(exc, ServiceError):
            return self.refused(exc.code, exc.message), ""
        if isinstance(exc, StoreFullError):
            return self.refused(
                Code.RESOURCE_EXHAUSTED,
                f"replica {self.node_id}: store full, batch not stored: {exc}",
            ), ""
        return self.refused(
            Code.UNAVAILABLE, f"replica {self.node_id}: store write failed: {exc}"
        ), f"store write failed: {exc}"

    def log_effects(self, effects: Effects) -> tuple[int, list[replica_pb2.ReplicationAck]]:
        """A batch's log effects in the order of ``Effects``: returns the LSN to compact
        below (0: none; the shell runs ``store_compact`` then ``compacted`` first), and
        the acks to send once it did; the commit advance is applied by ``advance``."""
        return effects.compact_from, [self.ack(ack) for ack in effects.acks]

    def advance(self, effects: Effects) -> None:
        """Applies an ``advance_commit`` effect (after any compaction)."""
        if effects.advance_commit is not None:
            self.advance_commit(effects.advance_commit)

    def heartbeat(
        self, stream: int, heartbeat: replica_pb2.ReplicationHeartbeat
    ) -> tuple[int, replica_pb2.ReplicationAck]:
        """A heartbeat from the master: learns its commit LSN. Returns the commit LSN to
        record in the background (0: none; ``store_record_commit`` ordered with appends,
        then ``commit_recorded``) and the ack to send. A refusal raises it."""
        effects = self.core.slave_heartbeat_message(
            stream, epoch=heartbeat.epoch, commit_lsn=heartbeat.commit_lsn
        )
        if effects.refusal is not None:
            raise self.stream_refused(effects)
        self.advance(effects)
        return effects.record_commit, self.ack(effects.acks[0])

    def commit_recorded(self, recorded_lsn: int) -> None:
        """A background commit record finished (0: it failed or was cancelled; the next
        heartbeat records it)."""
        if recorded_lsn:
            self.core.commit_record_done(recorded_lsn)
        else:
            self.core.commit_record_failed()

    def snapshot_chunk(
        self, stream: int, chunk: replica_pb2.SnapshotChunk
    ) -> tuple[SnapshotAccepted, Follower]:
        """A snapshot chunk from the master: how to install it and the stream's follower
        (then ``install`` as the chunk says, and ``snapshot_failed`` on a store error).
        A refusal raises it."""
        accepted = self.core.slave_snapshot_chunk(
            stream,
            index=chunk.index,
            snapshot_lsn=chunk.snapshot_lsn,
            snapshot_epoch=chunk.snapshot_epoch,
            last=chunk.last,
            history=[(b.epoch, b.start_lsn) for b in chunk.history],
        )
        result = accepted.snapshot
        if accepted.refusal is not None or result is None:
            raise self.stream_refused(accepted)
        return result, self.stream_follower(stream)

    def snapshot_failed(
        self, follower: Follower, index: int, exc: StoreError | FollowerError
    ) -> tuple[ServiceError, str]:
        """Installing a snapshot chunk failed: the stream's status and the reason to
        fail-stop with ("" when the chunk was refused or the store is full)."""
        self.store_failed(follower)
        if isinstance(exc, StoreFullError):
            return self.refused(
                Code.RESOURCE_EXHAUSTED,
                f"replica {self.node_id}: store full, snapshot not installed: {exc}",
            ), ""
        if isinstance(exc, (SnapshotError, CorruptRecordError)):
            return self.refused(
                Code.INVALID_ARGUMENT,
                f"replica {self.node_id}: snapshot chunk {index} refused: {exc}",
            ), ""
        return self.refused(
            Code.UNAVAILABLE, f"replica {self.node_id}: snapshot install failed: {exc}"
        ), f"snapshot install failed: {exc}"

    def snapshot_installed_ack(self, follower: Follower, lsn: int) -> replica_pb2.ReplicationAck:
        """The ack of an installed snapshot (``store_finish_snapshot`` flushed it all)."""
        return self.ack(follower.on_written(lsn, synced=True))

    # --- snapshot installs (a slave's stream and a new master's fetch share them)

    def install_snapshot(
        self,
        chunk: replica_pb2.SnapshotChunk,
        *,
        last: bool,
        history: Iterable[tuple[int, int]],
        source: str,
    ) -> Generator[StoreCall, None, int | None]:
        """Installs one snapshot chunk (no batch half-applied: the shell's commit lock):
        chunk 0 begins the install, the last (``last``) finishes it with ``history``.
        Yields each store operation for the shell to run where it runs store writes (its
        store thread; ``run_store_steps`` at once) before asking for the next; returns
        the snapshot's LSN once installed, else None. A slave's stream and a new
        master's reorganization fetch share it; store errors are the caller's to map."""
        store = self.store
        if chunk.index == 0:
            log.warning(
                "replica %s installing a snapshot at LSN %d (epoch %d) from %s: staged, its "
                "state and log (last LSN %d) are kept and served until the last chunk is in",
                self.node_id,
                chunk.snapshot_lsn,
                chunk.snapshot_epoch,
                source,
                self.core.log.last_lsn,
            )
            # The chunks are staged: the store keeps, serves and reports its state and log
            # (committed reads, the position a Hello and the coordinator see) until
            # finish_snapshot swaps the snapshot in, in one transaction.
            yield functools.partial(store.begin_snapshot, chunk.snapshot_lsn, chunk.snapshot_epoch)
        yield functools.partial(store.install_chunk, chunk)
        if not last:
            return None
        lsn = chunk.snapshot_lsn
        commit_lsn = min(chunk.commit_lsn, lsn)
        uncommitted = [(u.topic, u.first_offset, u.last_lsn) for u in chunk.uncommitted]
        # The swap commits on the store thread while the event loop serves reads, through
        # this gate, of whichever state is live then: hide what either may hold uncommitted.
        self.gate.swapping(commit_lsn, uncommitted)
        try:
            yield functools.partial(
                store.finish_snapshot, list(history), commit_lsn=commit_lsn, uncommitted=uncommitted
            )
        except StoreError:
            # finish_snapshot's contract: a failure leaves the old state live, so its exact
            # gate serves again. Any other way out (cancelled: the store thread may still
            # swap) keeps the conservative gate until commits or a truncation lift it.
            if self.gate.swap_failed():
                self._on_committed()
            raise
        hidden = self.snapshot_finished(lsn, commit_lsn, uncommitted)
        log.info(
            "replica %s installed the snapshot at LSN %d (epoch %d) from %s; the log "
            "continues from LSN %d; commit LSN %d, %d topics hold uncommitted events",
            self.node_id,
            lsn,
            chunk.snapshot_epoch,
            source,
            lsn + 1,
            commit_lsn,
            hidden,
        )
        return lsn

    def snapshot_finished(
        self, lsn: int, commit_lsn: int, uncommitted: Sequence[tuple[str, int, int]]
    ) -> int:
        """The install finished at lsn; returns how many topics hold uncommitted events.

        The snapshot's state cannot be hidden entry by entry: what it holds above the
        sender's commit LSN is hidden per topic until this node's commit LSN passes it
        (the gate moves first, then hides). What the gate tracked of the state the
        snapshot replaced is forgotten first: that state is gone."""
        self.gate.truncated(0)
        installed = self.core.snapshot_installed(lsn, commit_lsn)
        if installed.advance_commit is not None:
            self.gate.advance(installed.advance_commit)
        hidden = self.gate.restore(uncommitted)
        self._on_committed()
        return hidden

    # --- the master's writer: one group-commit batch at a time (commit lock held)

    def plan_batch(
        self,
        batch: Sequence[Command],
        *,
        limits: LimitsConfig,
        epoch: int,
        now_ms: int,
        join_parts: bool = False,
    ) -> PlannedBatch:
        """Plans the commands on top of the store's state (``BatchBuilder``); publishes
        are hidden from committed reads until their entries commit. ``join_parts``: a
        joined request's parts are stored as one entry (every node reads
        ``PublishPartsOp``), else as one entry each."""
        first_lsn = self.core.log.last_lsn + 1
        builder = BatchBuilder(
            self.store,
            limits=limits,
            node_id=self.node_id,
            epoch=epoch,
            next_lsn=first_lsn,
            now_ms=now_ms,
        )
        out = PlannedBatch(builder.entries)
        for index, command in enumerate(batch):
            if isinstance(command, commands.PublishParts):
                plan = self._plan_parts(
                    builder,
                    command,
                    out.faults,
                    first_lsn,
                    limits.max_batch_bytes if join_parts else 0,
                )
            else:
                planned = self._plan_one(builder, command, out.faults, first_lsn)
                if isinstance(planned, ServiceError):
                    out.refused.append((index, planned))
                    continue
                plan = planned
            out.planned.append((index, plan, first_lsn - 1 + len(builder.entries)))
        return out

    def _plan_one(
        self, builder: BatchBuilder, command: Command, faults: list[str], first_lsn: int
    ) -> Planned | ServiceError:
        """Plans one command (``BatchBuilder.add``), or the error refusing it (a checksum
        error also noted in faults); a planned publish is hidden until its entry commits."""
        try:
            plan = builder.add(command)
        except ServiceError as exc:
            return exc
        except CorruptRecordError as exc:
            faults.append(f"checksum error planning a write: {exc}")
            return ServiceError(Code.DATA_LOSS, str(exc))
        if (
            plan.entry_index is not None
            and plan.receipt is not None
            and isinstance(command, commands.Publish)
        ):
            self.gate.appended(
                first_lsn + plan.entry_index, command.request.topic, plan.receipt.first_offset
            )
        return plan

    def _plan_parts(
        self,
        builder: BatchBuilder,
        command: commands.PublishParts,
        faults: list[str],
        first_lsn: int,
        joined_bytes_max: int,
    ) -> Planned:
        """Plans a joined request's parts in order, each as a ``Publish`` of its own (a
        refused part fails alone and leaves no trace); one plan holds every outcome.

        ``joined_bytes_max`` > 0: the parts' events go into joined entries
        (``PublishPartsOp``) of at most that many bytes (``limits.max_batch_bytes``, which
        fits one gRPC message as a plain publish's entry does): one entry unless the parts
        are larger; each part waits for its entry. 0: an entry per part."""
        outcomes: list[commands.PartOutcome] = []
        if not joined_bytes_max:
            for part in command.parts:
                plan = self._plan_one(builder, commands.Publish(part), faults, first_lsn)
                if isinstance(plan, ServiceError):
                    outcomes.append(commands.PartOutcome(error=plan))
                else:
                    lsn = first_lsn - 1 + len(builder.entries)
                    outcomes.append(commands.PartOutcome(plan, lsn=lsn))
            return Planned(None, parts=outcomes)
        entry: list[commands.PartOutcome] = []  # the parts of the joined entry being planned
        size = 0
        builder.begin_joined()
        for part in command.parts:
            part_bytes = commands.op_bytes_bound(part)
            if size and size + part_bytes > joined_bytes_max:
                self._end_joined(builder, entry, first_lsn)
                entry, size = [], 0
                builder.begin_joined()
            plan = self._plan_one(builder, commands.Publish(part), faults, first_lsn)
            if isinstance(plan, ServiceError):
                outcome = commands.PartOutcome(error=plan)
            else:
                outcome = commands.PartOutcome(plan)
                size += part_bytes
            outcomes.append(outcome)
            entry.append(outcome)
        self._end_joined(builder, entry, first_lsn)
        return Planned(None, parts=outcomes)

    @staticmethod
    def _end_joined(
        builder: BatchBuilder, entry: list[commands.PartOutcome], first_lsn: int
    ) -> None:
        """Emits the joined entry; its parts wait for its LSN (a part made only of
        duplicates may name an earlier part of it)."""
        builder.end_joined()
        lsn = first_lsn - 1 + len(builder.entries)
        for outcome in entry:
            outcome.lsn = lsn

    def batch_appended(self, last_lsn: int, commit_lsn: int) -> None:
        """The master's batch is stored (with the commit LSN known then)."""
        self.core.log_appended(last_lsn, commit_lsn)

    def append_failed(
        self, exc: StoreError, entries: int, *, epoch: int, map_size_bytes: int
    ) -> tuple[ServiceError, str]:
        """The master's append failed: what its writers are told, and the reason to
        fail-stop with ("" for a full store: nothing was stored, later writes may fit)."""
        if isinstance(exc, StoreFullError):
            self.gate.truncated(self.core.log.last_lsn)
            log.warning(
                "replica %s: store full, %d entries refused: epoch=%d lsn=%d: %s",
                self.node_id,
                entries,
                epoch,
                self.core.log.last_lsn,
                exc,
            )
            return ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"store of replica {self.node_id} is full (map_size_bytes="
                f"{map_size_bytes}); the write was not stored",
            ), ""
        return ServiceError(
            Code.UNKNOWN, f"write outcome unknown: {exc}"
        ), f"store write failed: {exc}"

    # --- the reorganization fetch: a new master syncing from its group's sync source

    def fetch_begin(self, previous: FetchTail | None = None) -> FetchTail:
        """A fetch pass begins where this store's log ends (keeping the counts of the
        previous pass, when one was cut short by a truncation)."""
        meta = self.store.meta()
        tail = FetchTail(meta.last_lsn, meta.last_epoch, meta.last_lsn)
        if previous is not None:
            tail.entries, tail.snapshots = previous.entries, previous.snapshots
        return tail

    def fetch_step(
        self, tail: FetchTail, response: replica_pb2.FetchLogResponse, epoch: int, source_id: str
    ) -> FetchStep | None:
        """One message of the sync source's answer: what the shell must do with it (None:
        nothing, an empty batch only moved the commit LSN). The source answers with a
        snapshot when this log cannot be truncated by replay, shares no entry with the
        source's, or lacks entries the source compacted. A log the follower's rules
        refuse raises FAILED_PRECONDITION with nothing of that batch stored."""
        self.adopt_cluster_id(response.cluster_id, source_id)
        if response.WhichOneof("body") == "snapshot":
            return InstallFetched(response.snapshot)
        batch = response.entries
        if batch.truncate_after_lsn and batch.truncate_after_lsn < tail.store_last_lsn:
            self.check_fetched_truncation(batch.truncate_after_lsn, epoch, source_id)
            return TruncateFetched(batch.truncate_after_lsn)
        entries = list(batch.entries)
        if not entries:
            self.fetched_commit(batch.commit_lsn)
            return None
        checked = self.check_fetched_entries(
            entries,
            prev_lsn=tail.last_lsn,
            prev_epoch=tail.last_epoch,
            epoch=epoch,
            source_id=source_id,
        )
        return StoreFetched(entries, batch.commit_lsn, checked)

    def fetched_chunk_installed(
        self, tail: FetchTail, chunk: replica_pb2.SnapshotChunk, snapshot_lsn: int | None
    ) -> None:
        """A fetched snapshot chunk is installed (snapshot_lsn: after its last chunk):
        the log continues from the snapshot."""
        if snapshot_lsn is not None:
            tail.snapshots += 1
            tail.last_lsn = snapshot_lsn
            tail.last_epoch = chunk.snapshot_epoch

    def fetched_entries_stored(self, tail: FetchTail, step: StoreFetched) -> None:
        """Fetched entries are stored: the log continues after them."""
        tail.last_lsn, tail.last_epoch = step.checked.last_lsn, step.checked.last_epoch
        tail.entries += len(step.entries)

    def store_fetched(
        self, tail: FetchTail, step: StoreFetched, *, sync: bool
    ) -> Generator[StoreCall, None, None]:
        """Stores fetched entries (no batch half-applied: the shell's commit lock): their
        publishes above the source's commit LSN stay hidden from committed reads until
        this node's own commit LSN passes them; yields the append for the shell to run
        on its store thread (``run_store_steps``: at once), whose failure the shell
        reports with ``fetched_store_failed``; then the log continues after them."""
        self.hide_uncommitted(step.entries, step.commit_lsn)
        yield functools.partial(
            self.store_append, step.entries, sync=sync, commit_lsn=step.commit_lsn
        )
        self.fetched_stored(step.entries[-1].lsn, step.commit_lsn)
        self.fetched_entries_stored(tail, step)

    def fetch_finished(self) -> StoreMeta:
        """The fetch is done: the core's log is where the store's ends now; returns the
        store as it is."""
        meta = self.store.meta()
        self.core.log_reset(meta.last_lsn, self.core.log.log_start_lsn)
        return meta

    def fetch_request(self, epoch: int, max_entries: int) -> replica_pb2.FetchLogRequest:
        """What to ask the sync source for: the log after where this store's ends."""
        meta = self.store.meta()
        return replica_pb2.FetchLogRequest(
            node_id=self.node_id,
            epoch=epoch,
            cluster_id=meta.cluster_id,
            last_lsn=meta.last_lsn,
            history=[
                replica_pb2.EpochBoundary(epoch=b.epoch, start_lsn=b.start_lsn)
                for b in meta.history
            ],
            max_entries=max_entries,
            log_start_lsn=self.store.log_start_lsn(),
        )

    def adopt_cluster_id(self, cluster_id: str, source_id: str) -> None:
        """An empty store joins its sync source's cluster (as a slave does its master's)."""
        if not cluster_id or self.store.meta().cluster_id:
            return
        self.store.set_cluster_id(cluster_id)
        log.info(
            "replica %s joined cluster %s (from sync source %s)",
            self.node_id,
            cluster_id,
            source_id,
        )

    def fetch_answer(
        self, request: replica_pb2.FetchLogRequest, *, is_master: bool, step_max: int
    ) -> FetchAnswer:
        """The sync source's side of a fetch: whether this store may serve it (a master's
        log still grows; another cluster's or an older epoch's fetch is refused), where
        the two logs part, and whether only a snapshot brings the requester to this
        store's state (truncation by rebuild replays its log from LSN 1, and what it
        lacks must still be in this log). Raises the refusal."""
        meta = self.store.meta()
        who = f"replica {self.node_id} (epoch {meta.epoch}, last LSN {meta.last_lsn})"
        if is_master:
            raise self.refused(Code.FAILED_PRECONDITION, f"{who} is a master: its log still grows")
        if request.cluster_id and meta.cluster_id and request.cluster_id != meta.cluster_id:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"{who} belongs to cluster {meta.cluster_id}, not {request.cluster_id[:64]!r}",
            )
        if request.epoch < meta.epoch:
            raise self.refused(
                Code.FAILED_PRECONDITION, f"{who}: a fetch for epoch {request.epoch} is stale"
            )
        try:
            fork = fork_lsn(meta.history, meta.last_lsn, request.history, request.last_lsn)
        except HistoryError as exc:
            raise ServiceError(Code.INVALID_ARGUMENT, f"{who}: bad position: {exc}") from exc
        diverged = request.last_lsn > fork
        if diverged and meta.last_lsn == 0:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"{who}: node {request.node_id[:64]!r} holds a log and this one is empty: "
                "this replica cannot be its sync source",
            )
        log_start = self.store.log_start_lsn()
        why_snapshot = ""
        if diverged and fork == 0:
            # truncate_after_lsn 0 means "no truncation" on the wire: a log that shares
            # no entry with ours is replaced whole.
            why_snapshot = "its log shares no entry with this one"
        elif diverged and max(request.log_start_lsn, 1) > 1:
            why_snapshot = (
                f"it must truncate after LSN {fork} and its log starts at LSN "
                f"{request.log_start_lsn}"
            )
        elif fork + 1 < log_start:
            why_snapshot = f"it lacks LSNs from {fork + 1} and this log starts at {log_start}"
        log.info(
            "replica %s serves a fetch to %s for epoch %d: %s%s",
            self.node_id,
            request.node_id[:64],
            request.epoch,
            f"a snapshot ({why_snapshot})" if why_snapshot else f"LSNs {fork + 1}..{meta.last_lsn}",
            f" (it truncates after {fork})" if diverged and not why_snapshot else "",
        )
        step = min(request.max_entries or step_max, self.follower_config.inflight_entries_max)
        return FetchAnswer(meta, fork, diverged, why_snapshot, step)

    def fetch_refused(self, epoch: int, source_id: str, problem: EntryProblem) -> ServiceError:
        """A fetched log refused by the follower's rules (nothing of that batch stored)."""
        log.warning(
            "replica %s refused the log fetched from sync source %s for epoch %d at LSN %d: "
            "%s (%s)",
            self.node_id,
            source_id,
            epoch,
            problem.lsn,
            problem.detail,
            problem.code.value,
        )
        return ServiceError(
            Code.FAILED_PRECONDITION,
            f"replica {self.node_id} cannot take the master role in epoch {epoch}: sync "
            f"source {source_id} sent a log it refuses at LSN {problem.lsn} "
            f"({problem.code.value}): {problem.detail}; nothing of that batch was stored",
        )

    def check_fetched_truncation(self, keep_lsn: int, epoch: int, source_id: str) -> None:
        """A sync source may not have this node truncate entries it knows committed,
        unless commits here were this node's alone (``acks = "none"``): then the sync
        source, the group's most up-to-date log, rightly lacks them, and refusing would
        have this node refuse the master role its coordinator gives it again and again.
        The truncation records them as lost (``truncation.py``)."""
        if keep_lsn < self.gate.commit_lsn and not self.local_commits:
            raise self.fetch_refused(
                epoch,
                source_id,
                EntryProblem(
                    RefusalCode.TRUNCATE_BELOW_COMMIT,
                    keep_lsn,
                    f"truncate after LSN {keep_lsn} would remove committed entries "
                    f"(commit LSN {self.gate.commit_lsn})",
                ),
            )

    def check_fetched_entries(
        self,
        entries: Sequence[replica_pb2.LogEntry],
        *,
        prev_lsn: int,
        prev_epoch: int,
        epoch: int,
        source_id: str,
    ) -> EntriesChecked:
        """Holds fetched entries to a streamed batch's rules before anything is stored."""
        checked = check_entries(entries, prev_lsn=prev_lsn, prev_epoch=prev_epoch, max_epoch=epoch)
        if isinstance(checked, EntryProblem):
            raise self.fetch_refused(epoch, source_id, checked)
        return checked

    def check_fetched_snapshot(
        self, chunk: replica_pb2.SnapshotChunk, epoch: int, source_id: str, *, after_entries: bool
    ) -> None:
        """A fetch's snapshot comes first and never from a newer epoch."""
        if after_entries or chunk.snapshot_epoch > epoch:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node_id} cannot take the master role in epoch {epoch}: sync "
                f"source {source_id} sent snapshot chunk {chunk.index} (LSN "
                f"{chunk.snapshot_lsn}, epoch {chunk.snapshot_epoch}) "
                + ("after log entries" if after_entries else "of a newer epoch"),
            )

    def fetched_stored(self, last_lsn: int, source_commit_lsn: int) -> None:
        """Fetched entries are stored up to last_lsn: the core's log grows and committed
        reads follow the source's commit LSN as far as this log reaches."""
        self.core.log_appended(last_lsn)
        self.advance_commit(min(source_commit_lsn, self.core.log.last_lsn))

    def fetched_commit(self, source_commit_lsn: int) -> None:
        """An empty fetched batch: committed reads follow the source's commit LSN."""
        self.advance_commit(min(source_commit_lsn, self.core.log.last_lsn))

    def stamp_snapshot(self, chunk: replica_pb2.SnapshotChunk) -> None:
        """On a snapshot's last chunk: this node's commit LSN, and per topic the publishes
        the snapshot holds above it, so the receiver hides them until they commit."""
        chunk.commit_lsn = min(self.gate.commit_lsn, chunk.snapshot_lsn)
        chunk.uncommitted.extend(
            replica_pb2.UncommittedPublish(topic=topic, first_offset=offset, last_lsn=lsn)
            for topic, offset, lsn in self.gate.uncommitted(chunk.snapshot_lsn)
        )

    def check_truncation(self, keep_lsn: int, why: str, *, can_truncate: bool) -> None:
        """Whether this log may be truncated after keep_lsn (``why``: who asks): replaying
        needs the log from LSN 1, so a compacted or snapshot-installed log needs a
        snapshot instead, and a store with no truncator (``can_truncate`` False: the
        memory twin) cannot. Raises FAILED_PRECONDITION naming the reason."""
        log_start = self.store.log_start_lsn()
        if log_start <= 1 and can_truncate:
            return
        meta = self.store.meta()
        who = (
            f"replica {self.node_id} (epoch {self.core.epoch}, last LSN {meta.last_lsn}) must "
            f"truncate its log after LSN {keep_lsn} ({why})"
        )
        if log_start > 1:
            # Only a snapshot can undo applied entries now (a master sends one to a slave
            # whose Position shows a compacted log).
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"{who}, but its log starts at LSN {log_start} (compacted or installed from "
                "a snapshot): it needs a snapshot",
            )
        raise ServiceError(Code.FAILED_PRECONDITION, f"{who}, and this store cannot")

    def truncated(self, keep_lsn: int, store: Store) -> None:
        """The log was truncated after keep_lsn (``store``: the rebuilt store, which
        replaces this one): the core's log position and committed reads follow."""
        self.store = store
        self.core.log_truncated(keep_lsn, store.log_start_lsn())
        self.gate.truncated(keep_lsn)
        self._on_committed()

    def fetched_store_failed(self) -> None:
        """Storing fetched entries failed (or was cancelled): the gate re-reads the log."""
        self.gate.truncated(self.store.meta().last_lsn)

    # --- store operations: the store alone, so a shell may run them on a store thread

    def store_append(
        self, entries: Sequence[replica_pb2.LogEntry], *, sync: bool, commit_lsn: int
    ) -> None:
        """Appends entries, recording the commit LSN known with them."""
        self.store.append(entries, sync=sync, commit_lsn=commit_lsn)

    def store_sync(self) -> None:
        """Flushes every appended entry to disk."""
        self.store.sync()

    def store_compact(self, keep_from_lsn: int) -> int:
        """Deletes the log below keep_from_lsn; returns how many entries went."""
        return self.store.compact_log(keep_from_lsn)

    def store_record_commit(self, commit_lsn: int) -> int:
        """Records a commit LSN learnt without a batch; returns the LSN recorded."""
        return self.store.record_commit(commit_lsn)
