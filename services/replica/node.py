"""The replica node: the asyncio shell around the replica's cores and its synchronous
driver, the group-commit writer, and committed reads.

The synchronous ``ReplicaDriver`` (``driver.py``, ``self.driver``) owns the store and the
commit gate and applies the core's slave-side effects and checks a reorganization fetch;
this shell holds the commit lock, runs store writes on the store thread and talks to the
other replicas through a ``ReplicaTransport`` (``transport.py``) between its steps.

Roles: every role rule (role, epoch floor, lease, taking and dropping roles, the shutdown
freeze, the hand-off fence, which writes are refused) is decided by the pure
``ReplicaCore`` (``core``); this node feeds it role commands, ticks and what it saw, and
carries out the ``Effects`` it returns in their documented order (``apply_effects``).

All writes go through one writer task. It drains every command waiting (up to a bounded
batch), plans them with a `BatchBuilder`, appends the whole batch to the store in one
transaction on a dedicated thread (so fsync never blocks the event loop), and only then
registers each command with the replication core (``master_driver``): a write is
acknowledged only once its entry is committed (held by the replicas the ack policy
requires, each under its sync policy). As a slave the node applies the master's stream
(``replication_hello``/``replication_batch``, driven by the pure ``Follower``). Readers
on either side see only committed entries (``CommitGate``).

Reorganization: before a new master writes its epoch-start entry it fetches the log it
lacks from the group's sync source (``Replication.FetchLog``), truncating a divergent
suffix of its own first (by rebuilding the store from its log, ``rebuild``). When that
cannot work (its log is compacted or shares no entry with the source's, or the source's
no longer holds what it lacks) the source sends a snapshot and the log after it,
installed as a slave installs one. The master role is taken in a background task that
outlives the coordinator's SetRole call (``reorg``): a large snapshot may take long.

Committed reads across restarts: the store records the commit LSN this node knew (with
each appended batch, and a slave's idle heartbeats); ``start`` hides every publish above
it until a master's commit LSN passes it, and a snapshot carries the sender's commit LSN
and what it holds above it (``visibility``).

Log retention: after each batch the master and the slaves compact their logs to at
most ``limits.log_retention_entries`` entries (plus one compaction step), on the store
thread with the commit lock held; the master never compacts the log after a snapshot it
is sending (``MasterDriver.compaction_target``). A slave behind the retained log, or
one whose own log no longer starts at LSN 1 and holds a divergent suffix, gets a
snapshot (``replication_snapshot`` installs it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall.wire import stages as _stages
from squall_server.common.clock import Clock, SystemClock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.loss import load_losses, record_loss
from squall_server.common.loss_record import LossRecord
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.telemetry import Telemetry, current
from squall_server.replica import commands, telemetry
from squall_server.replica.commands import Command, Planned
from squall_server.replica.committed import gate_from_store
from squall_server.replica.core import (
    CoreConfig,
    Effects,
    Follow,
    LogPosition,
    ReplicaCore,
    Role,
    RoleOrder,
    StoreFacts,
    TakeMaster,
    WriteFence,
)
from squall_server.replica.driver import (
    CancelTaking,
    DropRole,
    FetchTail,
    FollowMaster,
    InstallFetched,
    JoinTaking,
    PersistRole,
    RenewMembers,
    ReplicaDriver,
    StartTaking,
    StoreFetched,
    TruncateFetched,
    master_config,
)
from squall_server.replica.faults import (
    REASON_CHARS_MAX,
    Fault,
    load_fault,
    new_fault,
    save_fault,
)
from squall_server.replica.follower import (
    FollowerConfig,
    FollowerError,
)
from squall_server.replica.links import LinkForwarding
from squall_server.replica.loss_scan import scan_discarded, truncation_loss
from squall_server.replica.master_driver import MasterDriver, SlaveStatus, Waiting
from squall_server.replica.push import PushDelivery
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.reorg import SyncProgress, Taking, answer_wait_s, outcome, read_within
from squall_server.replica.replication import (
    ReplicationError,
    ReplicationMaster,
    SyncPolicy,
    batch_size_bytes,
)
from squall_server.replica.snapshot_pump import pump_snapshot
from squall_server.replica.store import (
    Store,
    StoreError,
    TopicInfo,
)
from squall_server.replica.store.stall import StallMeter
from squall_server.replica.transient import TransientTopics
from squall_server.replica.transport import GrpcReplicaTransport, ReplicaCallError, ReplicaTransport
from squall_server.replica.visibility import CommitGate

T = TypeVar("T")
log = logging.getLogger("squall.replica")

# Request metadata from a publisher proxy: the replica addresses it just failed to reach,
# comma-separated, so this replica does not redirect it back to a dead master.
UNREACHABLE_KEY = "squall-unreachable"
# Unflushed appends up to this size run on the event loop: an LMDB commit of a few
# entries without fsync takes tens of microseconds, less than the hand-off to the store
# thread and back (~0.3 ms per append measured on a busy 2-core machine), which one-at-a-
# time publishing pays twice per event (master and slave). Flushes and large batches go to
# the store thread so the loop never waits on the disk or on a long copy.
_INLINE_APPEND_BYTES_MAX = 64 * 1024
# How often the lease watch asks the core whether the role lease ran out: a small part of
# the shortest lease a coordinator gives (its member timeout).
_LEASE_CHECK_S = 0.05


@dataclass
class _Pending:
    command: Command
    future: asyncio.Future[Planned]
    # Set once the command's entry is appended locally (before it commits).
    appended: asyncio.Future[None] | None = None
    # A traced publish: told when its entry is appended (squall_server.replica.telemetry).
    trace: telemetry.PublishWatch | None = None


class ReplicaNode:
    """One node's replica: owns the store, takes roles, serializes and commits writes."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeConfig,
        store: Store,
        clock: Clock | None = None,
        *,
        truncator: LmdbTruncator | None = None,
        observability: Telemetry | None = None,
        transport: Callable[[], ReplicaTransport] | None = None,
        running_nodes: RunningNodes | None = None,
    ) -> None:
        """``transport`` makes the connections to the other replicas: one per master epoch
        and one per reorganization sync, each closed when done (gRPC unless given).
        ``running_nodes``: the node ids the server's call guards accept; the role
        commands' running node set moves them (so an added node is taken at once)."""
        self.config = config
        self.running_nodes = running_nodes or RunningNodes(
            (n.id for n in config.nodes), (g.id for g in config.gateways)
        )
        self.node = node
        self.clock = clock or SystemClock()
        # (The running node set may move a node's address: a transport is made from the
        # configuration in force when it is needed.)
        self._new_transport: Callable[[], ReplicaTransport] = transport or (
            lambda: GrpcReplicaTransport(self.config, node.id)
        )
        # Times the store's writes so a stuck disk is reported to the coordinator; moves
        # with the store when a truncation installs a new one.
        self._stall = StallMeter(self.clock)
        store.stall_meter = self._stall
        # Truncates a divergent log suffix; None: refuse truncation (the memory twin).
        self.truncator = truncator
        # Spans and metrics (squall_server.replica.telemetry); off unless a service installed it.
        self.telemetry = observability or current()
        self._instruments = (
            telemetry.instruments(self.telemetry) if self.telemetry.metering else None
        )
        # The newest traced publishes, for delivery spans to link to (telemetry.py).
        self.published_traces = telemetry.PublishedTraces()
        # The role rules (role, epoch and its floor, lease, shutdown freeze, hand-off fence,
        # the write gate) live in the pure core; this driver carries out its effects.
        # The log's position and commit-LSN record too (``_last_lsn`` and its kin read it).
        self.core = ReplicaCore(
            CoreConfig(
                node.id,
                {n.id: n.replica_address for n in config.nodes},
                config.limits.log_retention_entries,
            ),
            stored_epoch=store.meta().epoch,
            log=LogPosition(store.meta().last_lsn, store.log_start_lsn()),
        )
        self._nodes = {n.id: n for n in config.nodes}
        self._counted_role = Role.INACTIVE  # the role the role-change metric last saw
        # A fault that makes this node unfit to serve; reported to the coordinator, which
        # quarantines the node (faults.py).
        self.fault: Fault | None = load_fault(node.data_dir)
        # Loss reports beside the store (acknowledged entries this node discarded); reported
        # to the coordinator in every ReplicaState (services/common/loss.py).
        # The offline store tools name the node after its directory: the file is this
        # node's, so its id is what the reports carry.
        self.losses: tuple[LossRecord, ...] = tuple(
            dataclasses.replace(r, node_id=node.id) for r in load_losses(node.data_dir)
        )
        self.transient = TransientTopics(config.limits.subscribe_batch_max_events * 10)
        self.push = PushDelivery(self)  # runs while master, from the epoch start's commit
        self.links = LinkForwarding(self)  # likewise
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._committed = asyncio.Event()
        # Set (and replaced) whenever a role command was applied or the role was lost.
        self._role_changed = asyncio.Event()
        self._io = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"store-{node.id}"
        )
        self._writer: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None
        # Held while a batch is being written, so a deactivation can wait for it and then
        # report a log that no longer grows.
        self._commit_lock = asyncio.Lock()
        # Role commands are applied one at a time (a become_master may wait on a fetch).
        self._role_lock = asyncio.Lock()
        # Committed reads: what a subscriber may see. The store records the commit LSN
        # this node knew; what it holds above it stays hidden (start() tracks it) until a
        # master's commit LSN passes it. A store that never recorded one (written before
        # the record existed) counts as committed throughout.
        recorded = store.meta().commit_lsn
        gate = CommitGate(self._last_lsn if recorded is None else recorded)
        self.core.log_reset(self._last_lsn, self._log_start_lsn, gate.commit_lsn)
        # Applies the core's slave-side effects to the store and the gate (both its own).
        self.driver = ReplicaDriver(
            node.id,
            self.core,
            store,
            gate,
            follower_config=FollowerConfig(
                node_id=node.id,
                sync_policy=SyncPolicy(int(config.durability.replica_sync)),
                inflight_entries_max=config.limits.replication_inflight_entries_max,
                inflight_bytes_max=config.limits.replication_inflight_bytes_max,
            ),
            on_committed=self._notify_committed,
            on_role_changed=self._role_changed_now,
            on_fault=self.report_fault,
        )
        self._commit_recording: asyncio.Task[None] | None = None  # the core's record_commit
        # The task taking a master role in the background (its reorganization sync).
        self._taking: Taking | None = None
        self._stopping: asyncio.Task[None] | None = None  # an abandoned taking winding down
        self._answer_wait_s = answer_wait_s(
            config.timeouts.heartbeat_interval_ms, config.timeouts.rpc_timeout_ms
        )
        # The master's replication for its epoch (a slave's follower and the number of its
        # current stream are the core's: ``core.follower``, ``core.stream_seq``).
        self._driver: MasterDriver | None = None
        # How the process is stopped once a cluster shutdown finished (shutdown.py).
        self.on_shutdown: Callable[[], None] | None = None

    # --- the store and the commit gate (the driver's)

    @property
    def store(self) -> Store:
        """The store (replaced whole when a truncation installs a rebuilt one)."""
        return self.driver.store

    @store.setter
    def store(self, store: Store) -> None:
        self.driver.store = store

    @property
    def gate(self) -> CommitGate:
        """Committed reads: what a subscriber may see."""
        return self.driver.gate

    @gate.setter
    def gate(self, gate: CommitGate) -> None:
        self.driver.gate = gate

    # --- the core's state, as the servicers and the coordinator's reports read it

    @property
    def _last_lsn(self) -> int:
        """The log's last LSN (the core keeps it)."""
        return self.core.log.last_lsn

    @property
    def _log_start_lsn(self) -> int:
        """The first LSN still in the log (the core keeps it)."""
        return self.core.log.log_start_lsn

    @property
    def role(self) -> common_pb2.Role.ValueType:
        """The role this replica holds."""
        return common_pb2.Role.ValueType(int(self.core.role))

    def store_stalled_ms(self) -> int:
        """How long the store's oldest write in progress has run (0: none is)."""
        return self._stall.stalled_ms()

    @property
    def epoch(self) -> int:
        """The epoch this replica is in (holds, or is taking, a role of)."""
        return self.core.epoch

    @property
    def master(self) -> NodeConfig | None:
        """The master of this replica's epoch while it holds a role, else None."""
        return self._nodes.get(self.core.master_id)

    @property
    def failed_reason(self) -> str:
        """Why this replica fail-stopped (empty: it did not)."""
        return self.core.failed_reason

    @property
    def fence(self) -> WriteFence:
        """A leadership transfer's write fence (handoff.py)."""
        return self.core.fence

    @property
    def command_seq(self) -> int:
        """The seq of the last role command applied."""
        return self.core.command_seq

    @property
    def joined(self) -> bool:
        """Whether this process has held a role (its store is part of the running
        cluster, docs/operations.md "Store lifecycle")."""
        return self.core.joined

    @property
    def frozen_for(self) -> str:
        """The cluster shutdown this replica is frozen for (no new role, no new write)."""
        return self.core.frozen_for

    @property
    def shutdown_finished(self) -> str:
        """The cluster shutdown this replica finished (it takes nothing any more)."""
        return self.core.shutdown_finished

    async def start(self) -> None:
        """Starts the writer and the lease watch; the role comes from the coordinator."""
        self.gate = await asyncio.get_running_loop().run_in_executor(
            self._io, self._gate_from_store, "start-up"
        )
        if self._instruments is not None:
            self._instruments.watch(self)
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.node.id}")
        self._lease_task = asyncio.create_task(self._watch_lease(), name=f"lease-{self.node.id}")
        meta = self.store.meta()
        log.info(
            "replica %s opened store: cluster_id=%s epoch=%d last_lsn=%d",
            self.node.id,
            meta.cluster_id or "-",
            meta.epoch,
            meta.last_lsn,
        )

    def _gate_from_store(self, why: str) -> CommitGate:
        """A committed-reads gate for the store as it is (store thread): at the recorded
        commit LSN, hiding every publish above it, from the installed snapshot's list
        and from the log. Used at start-up and after an interrupted reorganization."""
        gate = gate_from_store(self.store)
        meta = self.store.meta()
        if gate.commit_lsn < meta.last_lsn:
            log.info(
                "replica %s (%s): LSNs %d..%d are not known committed: %d publishes hidden "
                "from reads until a master commits them",
                self.node.id,
                why,
                gate.commit_lsn + 1,
                meta.last_lsn,
                gate.tracked,
            )
        return gate

    async def stop(self) -> None:
        """Stops the writer and fails anything still queued as indeterminate."""
        await self.push.close()
        await self.links.close()
        await self._cancel_taking(f"replica {self.node.id} stopping")
        if self._instruments is not None:
            self._instruments.unwatch(self)
        if self._driver is not None:
            await self._driver.stop(f"replica {self.node.id} stopping")
            self._driver = None
        for task in (self._lease_task, self._writer):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        while self._queue:
            pending = self._queue.popleft()
            if not pending.future.done():
                pending.future.set_exception(
                    ServiceError(Code.UNKNOWN, "replica stopped before the write committed")
                )
        self._io.shutdown(wait=True)

    async def become_master(
        self,
        epoch: int,
        *,
        reason: str,
        members: Sequence[str] = (),
        sync_source_id: str = "",
        progress: SyncProgress | None = None,
    ) -> None:
        """Takes the master role in `epoch` (the core's ``TakeMaster``, run by the task
        ``_start_taking`` made): persists the epoch, brings the log to the sync source's,
        starts replication to the members, then writes the epoch start.

        progress: where the reorganization sync reports how far it got (``reorg``)."""
        # Before the fetch below changes the store.
        member_ids = await self._persist_role(
            functools.partial(self.driver.take_master_persist, epoch, members)
        )
        self.transient.new_epoch(epoch)
        if sync_source_id and sync_source_id != self.node.id:
            await self._sync_from(
                sync_source_id,
                epoch,
                progress or SyncProgress(epoch, sync_source_id, self.clock.monotonic_ms()),
            )
        core: ReplicationMaster[Waiting] = self.driver.master_core(
            master_config(
                self.config,
                self.node.id,
                sum(1 for m in member_ids if not self._is_learner(m)),
                truncate_by_snapshot=self.truncator is None,
            ),
            epoch,
            member_ids,
        )
        # (This node's own config when the group names it without the configuration.)
        member_nodes = [self._nodes.get(member, self.node) for member in member_ids]
        driver = MasterDriver(
            self.config,
            self.node,
            core,
            lambda: self.store,
            cluster_id=self.store.meta().cluster_id,
            members=member_nodes,
            transport=self._new_transport(),
            clock=self.clock,
            on_commit=self._advance_commit,
            on_deposed=self._master_deposed,
            io=self._io,
            commit_lock=self._commit_lock,
            log_start_lsn=self._log_start_lsn,
            stamp_snapshot=self._stamp_snapshot,
            observability=self.telemetry,
        )
        # The role may be taken long after its SetRole call (a reorganization sync).
        self.driver.master_taken(epoch)  # refused if abandoned meanwhile
        self._driver = driver
        driver.start()
        loop = asyncio.get_running_loop()
        appended: asyncio.Future[None] = loop.create_future()
        started = self._submit(
            commands.StartEpoch(epoch=epoch, master_id=self.node.id), appended=appended
        )
        started.add_done_callback(functools.partial(self._epoch_start_done, epoch))
        # Wait for the local append only: the commit needs the slaves, which take their
        # role from their own coordinators meanwhile.
        await appended
        log.info(
            "replica %s is master: epoch=%d lsn=%d members=%s sync_source=%s reason=%s",
            self.node.id,
            epoch,
            self._last_lsn,
            ",".join(n.id for n in member_nodes),
            sync_source_id or self.node.id,
            reason,
        )

    def _epoch_start_done(self, epoch: int, future: asyncio.Future[Planned]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning(
                "replica %s: epoch %d start entry did not commit: %s",
                self.node.id,
                self.epoch,
                future.exception(),
            )
        elif not future.cancelled() and self.role == common_pb2.ROLE_MASTER and self.epoch == epoch:
            self.push.start(epoch)  # all before the epoch start is committed: deliver it
            self.links.start(epoch)

    async def _sync_from(self, source_id: str, epoch: int, progress: SyncProgress) -> None:
        """Reorganization: fetches the log after this node's from the sync source.

        Runs in the background of the SetRole call (``reorg``): no deadline on the whole
        fetch, but the source must send each message within ``timeouts.rpc_timeout_ms``.
        """
        source = next((n for n in self.config.nodes if n.id == source_id), None)
        if source is None:
            raise ServiceError(Code.INVALID_ARGUMENT, f"unknown sync source '{source_id}'")
        idle_timeout_s = self.config.timeouts.rpc_timeout_ms / 1000
        sync = self.config.durability.master_sync == common_pb2.SYNC_POLICY_SYNC
        tail: FetchTail | None = None
        driver = self.driver
        links = self._new_transport()
        try:
            # Twice at most: once more after truncating a divergent suffix.
            for _ in range(2):
                tail = driver.fetch_begin(tail)
                request = driver.fetch_request(epoch, self.config.limits.commit_batch_max_entries)
                progress.phase = "fetching log"
                call = links.fetch_log(source_id, request)
                try:
                    # One step per message: bounded by the source's log and snapshot.
                    while True:
                        response = await read_within(
                            call, idle_timeout_s, f"sync source {source_id}"
                        )
                        if response is None:
                            break
                        step = driver.fetch_step(tail, response, epoch, source_id)
                        if isinstance(step, InstallFetched):
                            progress.phase = "installing snapshot"
                            progress.snapshot_lsn = step.chunk.snapshot_lsn
                            snapshot_lsn = await self._fetched_snapshot_chunk(
                                step.chunk, epoch, source_id, after_entries=tail.entries > 0
                            )
                            progress.snapshot_chunks += 1
                            progress.snapshot_records += len(step.chunk.records)
                            driver.fetched_chunk_installed(tail, step.chunk, snapshot_lsn)
                        elif isinstance(step, TruncateFetched):
                            raise _Diverged(step.keep_lsn)
                        elif isinstance(step, StoreFetched):
                            progress.phase = "fetching log"
                            await self._store_fetched(step.entries, step.commit_lsn, sync=sync)
                            driver.fetched_entries_stored(tail, step)
                            progress.entries_fetched = tail.entries
                    break
                except _Diverged as diverged:
                    progress.phase = "truncating"
                    await self._truncate_after(diverged.fork_lsn, f"sync source {source_id}")
                except ReplicaCallError as exc:
                    code = (
                        Code.FAILED_PRECONDITION
                        if exc.status == "FAILED_PRECONDITION"
                        else Code.UNAVAILABLE
                    )
                    raise ServiceError(
                        code,
                        f"replica {self.node.id} cannot take the master role in epoch {epoch}: "
                        f"fetching the log from sync source {source_id} failed: "
                        f"{exc.status}: {exc.details}",
                    ) from exc
                except StoreError as exc:
                    raise ServiceError(
                        Code.FAILED_PRECONDITION,
                        f"replica {self.node.id} cannot take the master role in epoch {epoch}: "
                        f"storing the log fetched from {source_id} failed: {exc}",
                    ) from exc
                finally:
                    call.cancel()  # a no-op once the stream ended
        finally:
            await links.close()
        meta = self.store.meta()
        self.core.log_reset(meta.last_lsn, self._log_start_lsn)
        log.info(
            "replica %s synced from %s for epoch %d: %s%d entries fetched, log at epoch %d "
            "LSN %d (from LSN %d), commit LSN %d, %d publishes hidden until committed: %s",
            self.node.id,
            source_id,
            epoch,
            "a snapshot and " if tail is not None and tail.snapshots else "",
            0 if tail is None else tail.entries,
            meta.last_epoch,
            meta.last_lsn,
            self._log_start_lsn,
            self.gate.commit_lsn,
            self.gate.tracked,
            progress.describe(self.clock.monotonic_ms()),
        )

    async def _store_fetched(
        self, entries: list[replica_pb2.LogEntry], source_commit_lsn: int, *, sync: bool
    ) -> None:
        """Appends fetched entries; their publishes above the source's commit LSN stay
        hidden from committed reads until this node's own commit LSN passes them."""
        async with self._commit_lock:
            self.driver.hide_uncommitted(entries, source_commit_lsn)
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._io,
                    functools.partial(
                        self.driver.store_append, entries, sync=sync, commit_lsn=source_commit_lsn
                    ),
                )
            except Exception:
                # (Cancelled: the store thread may still append; _cancel_taking rebuilds.)
                self.driver.fetched_store_failed()
                raise
            self.driver.fetched_stored(entries[-1].lsn, source_commit_lsn)

    async def _fetched_snapshot_chunk(
        self, chunk: replica_pb2.SnapshotChunk, epoch: int, source_id: str, *, after_entries: bool
    ) -> int | None:
        """Installs one snapshot chunk of a reorganization fetch, as a slave does; returns
        the snapshot's LSN after the last chunk, else None. Store errors propagate."""
        self.driver.check_fetched_snapshot(chunk, epoch, source_id, after_entries=after_entries)
        async with self._commit_lock:
            return await self._install_snapshot_chunk(
                chunk,
                last=chunk.last,
                history=[(b.epoch, b.start_lsn) for b in chunk.history],
                source=f"sync source {source_id}",
            )

    async def _truncate_after(self, keep_lsn: int, why: str) -> None:
        """Removes the log after keep_lsn (a deposed master's uncommitted suffix)."""
        async with self._commit_lock:
            await self._truncate_locked(keep_lsn, why)

    async def _truncate_locked(self, keep_lsn: int, why: str) -> None:
        """_truncate_after with the commit lock held."""
        truncator = self.truncator
        meta = self.store.meta()
        log_start = self.store.log_start_lsn()
        if log_start > 1:
            # Replaying needs the log from LSN 1; only a snapshot can undo applied entries
            # now (a master sends one to a slave whose Position shows a compacted log).
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node.id} (epoch {self.epoch}, last LSN {meta.last_lsn}) must "
                f"truncate its log after LSN {keep_lsn} ({why}), but its log starts at LSN "
                f"{log_start} (compacted or installed from a snapshot): it needs a snapshot",
            )
        if truncator is None:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node.id} (epoch {self.epoch}, last LSN {meta.last_lsn}) must "
                f"truncate its log after LSN {keep_lsn} ({why}), and this store cannot",
            )
        log.warning(
            "replica %s truncating its log after LSN %d (it ends at %d; %s): epoch=%d",
            self.node.id,
            keep_lsn,
            meta.last_lsn,
            why,
            self.epoch,
        )
        loop = asyncio.get_running_loop()
        known_commit = self.gate.commit_lsn
        if keep_lsn < known_commit:
            # Entries this node knew committed (acknowledged to publishers) go: only a group
            # formed without a majority holding them can ask that. Reported before the
            # truncation, so a crash in between cannot lose the report.
            discarded = await loop.run_in_executor(
                self._io, lambda: scan_discarded(self.store, keep_lsn, known_commit)
            )
            self._record_loss(
                truncation_loss(
                    self.node.id, self.epoch, why, discarded, at_ms=self.clock.wall_ms()
                )
            )
        try:
            staging = await loop.run_in_executor(
                self._io, lambda: truncator.stage(self.store, keep_lsn)
            )
            self.store = truncator.swap(self.store, staging)
            self.store.stall_meter = self._stall
            # The rename's flush (a journal commit, long on a busy disk) off the loop; the
            # commit lock held until it is done, so nothing is appended after the
            # truncation before it is durable.
            await loop.run_in_executor(self._io, truncator.settle, staging)
        except (StoreError, OSError) as exc:
            self._fail_stop(f"truncating the log after LSN {keep_lsn} failed: {exc}")
            raise ServiceError(
                Code.UNAVAILABLE, f"replica {self.node.id}: truncation failed: {exc}"
            ) from exc
        self.published_traces.clear()  # their offsets may be reused by the new log
        self.driver.truncated(keep_lsn, self.store)

    # --- writes

    def check_writable(self) -> None:
        """Refuses a write this replica may not accept now (the core's write gate)."""
        refusal = self.core.write_refusal(self.clock.monotonic_ms(), self._taking_progress)
        if refusal is not None:
            raise refusal.error()

    def _taking_progress(self) -> str:
        """How far the master role being taken got, for a refusal."""
        taking = self._taking
        if taking is None:
            return f"about to take the master role of epoch {self.epoch}"
        return taking.progress.describe(self.clock.monotonic_ms())

    def _submit(
        self,
        command: Command,
        *,
        appended: asyncio.Future[None] | None = None,
        trace: telemetry.PublishWatch | None = None,
    ) -> asyncio.Future[Planned]:
        """Queues a command for the writer; the future resolves once it committed."""
        future: asyncio.Future[Planned] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(command, future, appended, trace))
        self._wakeup.set()
        return future

    async def write(self, command: Command) -> Planned:
        """Commits one command on the master and returns what it produced."""
        self.check_writable()
        return await self._submit(command)

    def start_publish(
        self,
        request: broker_pb2.PublishRequest,
        trace: telemetry.PublishWatch | None = None,
    ) -> asyncio.Future[common_pb2.BatchReceipt]:
        """Queues a publish without waiting, so pipelined requests keep their order.

        The future resolves to the batch's receipt once the events are durable (replicated
        topics) or handed to live subscribers (transient topics). A traced publish's
        `trace` hears when its entry is appended.
        """
        self.check_writable()
        topic = self.topic(request.topic)
        loop = asyncio.get_running_loop()
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            commands.check_publish_limits(request, self.config.limits)
            done: asyncio.Future[common_pb2.BatchReceipt] = loop.create_future()
            done.set_result(
                self.transient.publish(
                    request,
                    topic_id=topic.topic_id,
                    epoch=self.epoch,
                    now_ms=self.clock.wall_ms(),
                    master_id=self.node.id,
                )
            )
            self._notify_committed()
            return done
        planned = self._submit(commands.Publish(request), trace=trace)
        # Chained by callbacks, not a task: one publish at a time pays no task per event.
        receipt: asyncio.Future[common_pb2.BatchReceipt] = loop.create_future()
        planned.add_done_callback(functools.partial(_pass_receipt, receipt))
        receipt.add_done_callback(functools.partial(_cancel_with, planned))
        return receipt

    async def apply_role(self, command: replica_pb2.RoleCommand) -> None:
        """Takes (or renews) the role the coordinator commands, one command at a time.

        A master role is taken by a background task (its reorganization sync may take
        long, see ``reorg``): this waits for it at most a heartbeat interval; if it is
        still running, ``reorganization_progress`` says how far it got and the same
        command repeated joins it.
        """
        async with self._role_lock:
            try:
                taking = await self._apply_role(command)
            finally:
                self._notify_role_changed()
        if taking is None:
            return
        await asyncio.wait({taking.task}, timeout=self._answer_wait_s)
        if taking.task.done() and self._taking is taking:
            self._observe_taking()
            self._taking = None
            self.driver.taking_answer(taking.epoch)

    def reorganization_progress(self) -> replica_pb2.ReorganizationProgress | None:
        """How far the master role being taken got (None when none is being taken)."""
        taking = self._taking
        if taking is None or taking.task.done():
            return None
        return taking.progress.to_proto(self.clock.monotonic_ms())

    async def _apply_role(self, command: replica_pb2.RoleCommand) -> Taking | None:
        """Applies a role command as the core decides; returns the task taking a master
        role, if any."""
        await self._wait_stopped()
        self._observe_taking()
        self._adopt_running_set(command)
        meta = self.store.meta()
        order = RoleOrder(
            role=command.role,
            epoch=command.epoch,
            master_id=command.master.node_id,
            members=tuple(m.node_id for m in command.members),
            sync_source_id=command.sync_source_id,
            reason=command.reason,
            seq=command.seq,
            lease_ms=command.lease_ms,
            cluster_id=command.cluster_id,
        )
        effects = self.core.role_command(
            order, self.clock.monotonic_ms(), StoreFacts(meta.epoch, meta.cluster_id)
        )
        taking = self._taking
        if self.core.taking is None and taking is not None and taking.task.done():
            self._taking = None  # its outcome answered this command
        return await self.apply_effects(effects)

    async def apply_effects(self, effects: Effects) -> Taking | None:
        """Carries out what the core decided (the driver's ``role_steps``, in the order
        ``Effects`` documents), doing each step it leaves to this shell; returns the task
        taking (or already taking) a master role, if any."""
        taking: Taking | None = None
        for step in self.driver.role_steps(effects):
            match step:
                case CancelTaking(why):
                    await self._cancel_taking(why)
                case DropRole(reason, was_active):
                    await self._drop_role(reason, was_active=was_active)
                case StartTaking(take):
                    taking = self._start_taking(take)
                case PersistRole(write):
                    await self._persist_role(write)
                case FollowMaster(follow):
                    await self._become_slave(follow)
                case JoinTaking():
                    taking = self._taking
                case RenewMembers(members):
                    self._renew_members(list(members))
        return taking

    def _role_changed_now(self) -> None:
        """Counts a role change and wakes whoever waits for one."""
        role = self.core.role
        if role != self._counted_role and self._instruments is not None:
            name = telemetry.ROLE_NAMES.get(self.role, role.name)
            self._instruments.role_changes.add(1, {"node": self.node.id, "role": name})
        self._counted_role = role
        self._notify_role_changed()

    def _start_taking(self, take: TakeMaster) -> Taking:
        """Starts taking the master role in the background (``reorg``)."""
        progress = SyncProgress(
            take.epoch,
            take.sync_source_id or self.node.id,
            self.clock.monotonic_ms(),
            attempt=take.attempt,
        )
        task = asyncio.get_running_loop().create_task(
            self._take_master(take, progress), name=f"take-master-{self.node.id}"
        )
        taking = Taking(
            epoch=take.epoch, source_id=take.sync_source_id, task=task, progress=progress
        )
        self._taking = taking
        task.add_done_callback(functools.partial(self._taking_done, taking))
        return taking

    def _adopt_running_set(self, command: replica_pb2.RoleCommand) -> None:
        """A membership change made a running node set: take its nodes and addresses in
        place of the config file's, so the commit majority is counted from it and the
        master streams to the nodes it added (docs/operations.md, "Changing the
        membership")."""
        if not command.voting_nodes:
            return
        added, removed = self.running_nodes.follow(
            [e.node_id for e in (*command.voting_nodes, *command.learner_nodes)]
        )
        if added or removed:
            log.info(
                "replica %s: call guards follow the running node set: %s added, %s removed",
                self.node.id,
                ",".join(sorted(added)) or "none",
                ",".join(sorted(removed)) or "none",
            )
        nodes = tuple(
            NodeConfig(
                e.node_id,
                e.priority,
                e.coordinator_address,
                e.replica_address,
                self._nodes[e.node_id].data_dir if e.node_id in self._nodes else self.node.data_dir,
                learner,
            )
            for entries, learner in ((command.voting_nodes, False), (command.learner_nodes, True))
            for e in entries
        )
        if nodes == self.config.nodes:
            return
        log.warning(
            "replica %s: running node set %s (was %s): commits count a majority of its voters",
            self.node.id,
            ",".join(n.id + (" (learner)" if n.learner else "") for n in nodes),
            ",".join(n.id + (" (learner)" if n.learner else "") for n in self.config.nodes),
        )
        self.config = dataclasses.replace(self.config, nodes=nodes)
        self._nodes = {n.id: n for n in nodes}
        self.core.config = dataclasses.replace(
            self.core.config, replica_addresses={n.id: n.replica_address for n in nodes}
        )

    def _is_learner(self, node_id: str) -> bool:
        """Is ``node_id`` a learner of the running set (its acks count for no commit)?"""
        node = self._nodes.get(node_id)
        return node is not None and node.learner

    async def _take_master(self, take: TakeMaster, progress: SyncProgress) -> None:
        await self.become_master(
            take.epoch,
            reason=take.reason,
            members=take.members,
            sync_source_id=take.sync_source_id,
            progress=progress,
        )

    def _taking_done(self, taking: Taking, task: asyncio.Task[None]) -> None:
        """Tells the core the attempt ended (its lease starts, or the next SetRole hears of
        the failure) and logs a failure."""
        if self._taking is taking:
            self._observe_taking()
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.warning(
                "replica %s did not take the master role: %s",
                self.node.id,
                error.message if isinstance(error, ServiceError) else repr(error),
            )

    def _observe_taking(self) -> None:
        """Reports a finished attempt to take the master role to the core (once: the core
        ignores repeats)."""
        taking = self._taking
        if taking is None or not taking.task.done():
            return
        self.driver.taking_finished(taking.epoch, outcome(taking.task), self.clock.monotonic_ms())

    async def _cancel_taking(self, why: str) -> None:
        """Stops taking a master role (a newer command, deactivation, shutdown) and waits
        until the task has stopped, so no two role changes run at once."""
        taking, self._taking = self._taking, None
        if taking is None or taking.task.done() or taking.task is asyncio.current_task():
            await self._wait_stopped()
            return
        log.info(
            "replica %s abandons taking the master role: %s; %s",
            self.node.id,
            taking.progress.describe(self.clock.monotonic_ms()),
            why,
        )
        taking.task.cancel()
        # Its own task: a caller cancelled meanwhile (a SetRole past its deadline) must not
        # cut it short; the next role command waits for it (_wait_stopped).
        self._stopping = asyncio.get_running_loop().create_task(self._stopped(taking))
        await self._wait_stopped()

    async def _wait_stopped(self) -> None:
        """Waits until an abandoned master role's task and its store work have stopped."""
        stopping = self._stopping
        if stopping is not None:
            await asyncio.shield(stopping)

    async def _stopped(self, taking: Taking) -> None:
        await asyncio.wait({taking.task})
        # A cancelled await does not stop the store thread: what it was doing finishes
        # before this job runs, so the log no longer grows once this returns (a
        # deactivation's report says so), and the gate is rebuilt from what was stored.
        self.gate = await asyncio.get_running_loop().run_in_executor(
            self._io, self._gate_from_store, "reorganization interrupted"
        )
        meta = self.store.meta()
        self.core.log_reset(meta.last_lsn, self.store.log_start_lsn(), self.gate.commit_lsn)
        self._notify_committed()

    def _mark_dirty(self) -> None:
        """A store in use is DIRTY: a restart must not take it for a clean or empty one."""
        self.driver.mark_dirty()

    async def _persist_role(self, persist: Callable[[], T]) -> T:
        """Runs a role's flushed store writes (its epoch, the DIRTY mark) on the store
        thread, serialized with every other write. A flush also writes out every unsynced
        append before it (a slave's WRITE_NO_SYNC batches): on a busy disk that outlasts
        the coordinator's replica_timeout_ms, and the event loop must keep answering its
        role renewals and health probes meanwhile (issue 14)."""
        async with self._commit_lock:
            return await asyncio.get_running_loop().run_in_executor(self._io, persist)

    async def drain_writes(self) -> None:
        """Waits until every write queued now has finished (committed or failed) and no
        batch is being written."""
        queued = [pending.future for pending in self._queue]
        if queued:
            await asyncio.wait(queued)
        async with self._commit_lock:
            pass

    async def store_write(self, write: Callable[[], None]) -> None:
        """Runs one store write on the store thread, serialized with every other write."""
        async with self._commit_lock:
            await asyncio.get_running_loop().run_in_executor(self._io, write)

    def _renew_members(self, member_ids: list[str]) -> None:
        """A master renewal naming fewer members: the group shrank within the epoch."""
        driver = self._driver
        if driver is None or set(member_ids) == set(driver.core.members):
            return
        try:
            driver.set_members(member_ids)
        except ReplicationError as exc:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node.id} (master, epoch {self.epoch}) cannot take members "
                f"{','.join(member_ids)}: {exc}",
            ) from exc
        log.info(
            "replica %s (master, epoch %d): group now %s",
            self.node.id,
            self.epoch,
            ",".join(member_ids),
        )

    async def _become_slave(self, follow: Follow) -> None:
        """Follows the master in its epoch (the core's ``Follow``, its epoch persisted by
        the driver): the master's replication stream is accepted from now."""
        async with self._commit_lock:  # no batch half-applied while the follower is made
            self.driver.follow(follow, self.clock.monotonic_ms())
        log.info(
            "replica %s follows %s: epoch=%d lsn=%d reason=%s",
            self.node.id,
            follow.master_id,
            follow.epoch,
            self._last_lsn,
            follow.reason,
        )

    async def deactivate(self, reason: str) -> None:
        """Drops the role: stops serving writes and replication; returns once no write is
        in progress."""
        await self.apply_effects(self.core.drop_role(reason))

    async def _drop_role(self, reason: str, *, was_active: bool) -> None:
        """The core dropped the role (``Effects.drop_role``): stops the follower, fails the
        writes not begun, stops push delivery and the master's replication, and waits for
        the batch being written."""
        await self._wait_stopped()
        while self._queue:  # never started: definitely not stored
            pending = self._queue.popleft()
            _fail_pending(
                pending,
                ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self.node.id} lost its role before the write began (not stored)",
                ),
            )
        self.push.stop()
        self.links.stop()
        async with self._commit_lock:
            pass
        driver, self._driver = self._driver, None
        if driver is not None:
            await driver.stop(f"replica {self.node.id} deactivated: {reason}")
        if was_active:
            log.info(
                "replica %s inactive: epoch=%d lsn=%d commit_lsn=%d reason=%s",
                self.node.id,
                self.epoch,
                self._last_lsn,
                self.gate.commit_lsn,
                reason,
            )

    def _master_deposed(self, reason: str) -> None:
        """The replication core deposed this master: no more writes in this epoch."""
        self.push.stop()
        self.links.stop()
        self._driver = None
        self._wakeup.set()
        self.driver.deposed(reason)

    def _notify_role_changed(self) -> None:
        changed, self._role_changed = self._role_changed, asyncio.Event()
        changed.set()

    async def wait_for_role(self, unreachable: frozenset[str], timeout_s: float) -> None:
        """Waits (up to timeout_s) while this replica can neither serve a write nor name a
        master the caller can reach: no role, or a slave of a master in `unreachable`.

        A publisher proxy whose master just died otherwise bounces between this replica's
        redirect to the dead master and its own backoff; held here, its call goes on (served
        or redirected to the new master) the moment the coordinator's next role command
        lands, so the publisher's gap is the election's. A master named in an epoch newer
        than the one the wait began in was elected after the caller found it unreachable
        (its replica restarted, or the node took the lead back): the call goes to it.
        """
        held_in_epoch = self.epoch
        # Bounded by the timeout: each pass waits for a role change (the event loop keeps
        # the deadline, so no clock is read here).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self.failed_reason and self.role != common_pb2.ROLE_MASTER:
                    master = self.master
                    if (
                        self.role == common_pb2.ROLE_SLAVE
                        and master is not None
                        and (
                            master.replica_address not in unreachable or self.epoch > held_in_epoch
                        )
                    ):
                        return
                    await self._role_changed.wait()

    def _advance_commit(self, commit_lsn: int) -> None:
        """The commit LSN moved: committed reads may serve more; wake subscribers."""
        self.driver.advance_commit(commit_lsn)

    # --- the slave side of replication (driven by the Replication servicer; the driver
    # applies the core's effects, this shell holds the commit lock and awaits the store)

    def _refused(self, code: Code, message: str) -> ServiceError:
        """A replication refusal carrying this replica's epoch for a stale master."""
        return self.driver.refused(code, message)

    async def replication_hello(
        self, hello: replica_pb2.ReplicationHello
    ) -> tuple[int, replica_pb2.ReplicationPosition]:
        """Accepts a stream from this epoch's master; returns its number and our position."""
        async with self._commit_lock:
            return self.driver.hello(hello)

    async def replication_batch(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> AsyncGenerator[replica_pb2.ReplicationAck, None]:
        """Checks and stores one batch from the master, yielding each ack as it is due.

        A NO_SYNC replica's ack on receipt is yielded before the write, so the master can
        count it without waiting for this store.
        """
        driver = self.driver
        if _stages.ENABLED:
            for entry in batch.entries:
                _stages.mark("s.in", f"lsn/{entry.lsn}")
        async with self._commit_lock:
            accepted, follower, acks_now = driver.batch(stream, batch)
            for ack_now in acks_now:
                yield ack_now
            result = accepted.batch
            if result is not None:
                try:
                    if result.truncate_after_lsn is not None:
                        await self._truncate_locked(
                            result.truncate_after_lsn, f"master {follower.state().master_id}"
                        )
                    driver.hide_uncommitted(result.entries, batch.commit_lsn)
                    await self._append(
                        result.entries, sync=result.sync, commit_lsn=batch.commit_lsn
                    )
                except (StoreError, ServiceError) as exc:
                    error, fail_stop = driver.batch_failed(follower, exc)
                    if fail_stop:
                        self._fail_stop(fail_stop)
                    raise error from exc
                if _stages.ENABLED:
                    for entry in result.entries:
                        _stages.mark("s.stored", f"lsn/{entry.lsn}")
                effects = driver.batch_written(follower, result, batch.commit_lsn)
                for written in await self._apply_log_effects(effects):
                    yield written
            else:
                await self._apply_log_effects(accepted)

    async def replication_snapshot(
        self, stream: int, chunk: replica_pb2.SnapshotChunk
    ) -> list[replica_pb2.ReplicationAck]:
        """Installs one snapshot chunk from the master; after the last, returns the ack."""
        async with self._commit_lock:
            result, follower = self.driver.snapshot_chunk(stream, chunk)
            try:
                installed = await self._install_snapshot_chunk(
                    chunk,
                    last=result.install,
                    history=result.history,
                    source=f"master {follower.state().master_id}",
                )
            except (StoreError, FollowerError) as exc:
                error, fail_stop = self.driver.snapshot_failed(follower, chunk.index, exc)
                if fail_stop:
                    self._fail_stop(fail_stop)
                raise error from exc
            if installed is None:
                return []
            return [self.driver.snapshot_installed_ack(follower, installed)]

    async def _install_snapshot_chunk(
        self,
        chunk: replica_pb2.SnapshotChunk,
        *,
        last: bool,
        history: Iterable[tuple[int, int]],
        source: str,
    ) -> int | None:
        """Installs one snapshot chunk on the store thread (commit lock held): chunk 0
        begins the install, the last (`last`) finishes it with `history`. Returns the
        snapshot's LSN once installed, else None. A slave's stream and a new master's
        reorganization fetch share it; store errors are the caller's to map."""
        loop = asyncio.get_running_loop()
        store = self.store
        if chunk.index == 0:
            log.warning(
                "replica %s installing a snapshot at LSN %d (epoch %d) from %s: its state "
                "and log (last LSN %d) are replaced",
                self.node.id,
                chunk.snapshot_lsn,
                chunk.snapshot_epoch,
                source,
                self._last_lsn,
            )
            await loop.run_in_executor(
                self._io,
                functools.partial(store.begin_snapshot, chunk.snapshot_lsn, chunk.snapshot_epoch),
            )
            # The store reports itself empty until the install finishes.
            self.driver.snapshot_begun()
        await loop.run_in_executor(self._io, store.install_chunk, chunk)
        if not last:
            return None
        lsn = chunk.snapshot_lsn
        commit_lsn = min(chunk.commit_lsn, lsn)
        uncommitted = [(u.topic, u.first_offset, u.last_lsn) for u in chunk.uncommitted]
        await loop.run_in_executor(
            self._io,
            functools.partial(
                store.finish_snapshot,
                list(history),
                commit_lsn=commit_lsn,
                uncommitted=uncommitted,
            ),
        )
        hidden = self.driver.snapshot_finished(lsn, commit_lsn, uncommitted)
        log.info(
            "replica %s installed the snapshot at LSN %d (epoch %d) from %s; the log "
            "continues from LSN %d; commit LSN %d, %d topics hold uncommitted events",
            self.node.id,
            lsn,
            chunk.snapshot_epoch,
            source,
            lsn + 1,
            commit_lsn,
            hidden,
        )
        return lsn

    def replication_heartbeat(
        self, stream: int, heartbeat: replica_pb2.ReplicationHeartbeat
    ) -> replica_pb2.ReplicationAck:
        """A heartbeat from the master: learns its commit LSN; returns the ack."""
        record_commit, ack = self.driver.heartbeat(stream, heartbeat)
        # No store operation but the background record: applied without the commit lock.
        if record_commit:
            self._commit_recording = asyncio.get_running_loop().create_task(
                self._record_commit(record_commit), name=f"record-commit-{self.node.id}"
            )
        return ack

    async def _apply_log_effects(self, effects: Effects) -> list[replica_pb2.ReplicationAck]:
        """Carries out the log effects of a batch (commit lock held), in the order of
        ``Effects``: compaction, then commit advance; returns the acks to send."""
        compact_from, acks = self.driver.log_effects(effects)
        if compact_from:
            await self._compact(compact_from)
        self.driver.advance(effects)
        return acks

    async def _record_commit(self, commit_lsn: int) -> None:
        """Records a commit LSN learnt without a batch (a heartbeat: the stream is idle),
        so a restart does not hide the last batch (the core allows one at a time)."""
        recorded = 0
        try:
            async with self._commit_lock:  # ordered with appends, truncations and installs
                recorded = await asyncio.get_running_loop().run_in_executor(
                    self._io, self.driver.store_record_commit, commit_lsn
                )
        except StoreError as exc:
            # Only a hint for the next start-up: a failure hides more after a restart.
            log.warning(
                "replica %s: recording commit LSN %d failed: %s", self.node.id, commit_lsn, exc
            )
        finally:
            # Cancelled or failed: the next heartbeat records it.
            self.driver.commit_recorded(recorded)

    def _track(self, entry: replica_pb2.LogEntry) -> None:
        """Hides an uncommitted publish from committed reads until it commits."""
        self.driver.track(entry)

    async def fetch_log(
        self, request: replica_pb2.FetchLogRequest
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]:
        """Serves a new master's reorganization fetch: the log after where ours part, or a
        snapshot and the log after it when the requester cannot take the log alone."""
        answer = self.driver.fetch_answer(
            request,
            is_master=self.role == common_pb2.ROLE_MASTER,
            step_max=self.config.limits.commit_batch_max_entries,
        )
        meta, fork, diverged, why_snapshot, step = (
            answer.meta,
            answer.fork,
            answer.diverged,
            answer.why_snapshot,
            answer.step,
        )
        if why_snapshot:
            snapshot_lsn = 0
            async for chunk in self._export_snapshot(request.node_id[:64]):
                snapshot_lsn = chunk.snapshot_lsn
                yield replica_pb2.FetchLogResponse(snapshot=chunk, cluster_id=meta.cluster_id)
            # The log after the snapshot, as far as it reached when the fetch began (our
            # log may have grown while the snapshot was read: the rest is its tail).
            last_lsn = max(meta.last_lsn, self.store.meta().last_lsn)
            async for batch in self._log_batches(snapshot_lsn + 1, last_lsn, step, meta.epoch):
                yield replica_pb2.FetchLogResponse(entries=batch, cluster_id=meta.cluster_id)
            return
        yield replica_pb2.FetchLogResponse(
            entries=replica_pb2.EntryBatch(
                epoch=meta.epoch,
                truncate_after_lsn=fork if diverged else 0,
                commit_lsn=self.gate.commit_lsn,
            ),
            cluster_id=meta.cluster_id,
        )
        async for batch in self._log_batches(fork + 1, meta.last_lsn, step, meta.epoch):
            yield replica_pb2.FetchLogResponse(entries=batch, cluster_id=meta.cluster_id)

    def _stamp_snapshot(self, chunk: replica_pb2.SnapshotChunk) -> None:
        """On a snapshot's last chunk: what the receiver must hide (the driver's)."""
        self.driver.stamp_snapshot(chunk)

    async def _log_batches(
        self, from_lsn: int, to_lsn: int, step: int, epoch: int
    ) -> AsyncIterator[replica_pb2.EntryBatch]:
        """The log from from_lsn to to_lsn in batches of at most step entries."""
        store = self.store
        next_lsn = from_lsn
        # One batch per step: bounded by to_lsn.
        while next_lsn <= to_lsn:
            count = min(step, to_lsn - next_lsn + 1)
            entries = await asyncio.to_thread(store.read_log, next_lsn, count)
            if not entries:
                break
            # Our commit LSN as of now: what the requester may show its subscribers.
            yield replica_pb2.EntryBatch(
                entries=entries, epoch=epoch, commit_lsn=self.gate.commit_lsn
            )
            next_lsn = entries[-1].lsn + 1

    async def _export_snapshot(self, requester: str) -> AsyncIterator[replica_pb2.SnapshotChunk]:
        """This store's snapshot for a fetch (``snapshot_pump``: one read transaction on
        the store thread, the next chunk read only once the caller took the last one)."""
        pump = pump_snapshot(
            lambda: self.store,
            io=self._io,
            commit_lock=self._commit_lock,  # no batch half-applied under the snapshot's LSN
            clock=self.clock,
            max_message_bytes=self.config.limits.max_message_bytes,
            sender=f"replica {self.node.id}",
            recipient=requester,
            purpose=" for its reorganization",
            stamp=self._stamp_snapshot,
            chunk_delay_s=self.config.timeouts.snapshot_chunk_delay_ms / 1000,  # test-only
        )
        async with contextlib.aclosing(pump) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _watch_lease(self) -> None:
        """Ticks the core, which drops the role when the coordinator stops renewing it
        (e.g. it died)."""
        while True:
            await asyncio.sleep(_LEASE_CHECK_S)
            effects = self.core.tick(self.clock.monotonic_ms())
            if effects.drop_role:
                await self.apply_effects(effects)

    async def _write_loop(self) -> None:
        max_commands = self.config.limits.commit_batch_max_entries
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                room = max_commands
                driver = self._driver
                if driver is not None and self.role == common_pb2.ROLE_MASTER:
                    # Publishers wait here while the replicas hold back commits (a full
                    # pending-write table), instead of the master growing memory.
                    room = min(room, await driver.wait_room()) or max_commands
                count = min(room, len(self._queue))
                batch = [self._queue.popleft() for _ in range(count)]
                async with self._commit_lock:
                    try:
                        await self._commit(batch)
                    finally:
                        _finish_appended(batch)

    async def _commit(self, batch: list[_Pending]) -> None:
        driver = self._driver
        if self.role != common_pb2.ROLE_MASTER or driver is None or driver.deposed:
            _fail_all(
                [(p, Planned(None)) for p in batch],
                ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self.node.id} lost its role before the write began (not stored)",
                ),
            )
            return
        if _stages.ENABLED:
            _mark_publishes("m.plan", batch)
        # The caller may have given up (cancelled) before the write began.
        live = [pending for pending in batch if not pending.future.done()]
        planning = self.driver.plan_batch(
            [pending.command for pending in live],
            limits=self.config.limits,
            epoch=self.epoch,
            now_ms=self.clock.wall_ms(),
        )
        for fault in planning.faults:
            self.report_fault(fault)
        for index, refusal in planning.refused:
            live[index].future.set_exception(refusal)
        planned = [(live[index], plan) for index, plan, _ in planning.planned]
        lsns = [lsn for _, _, lsn in planning.planned]
        entries = planning.entries
        sync = self.config.durability.master_sync == common_pb2.SYNC_POLICY_SYNC
        if entries:
            commit_lsn = self.gate.commit_lsn
            try:
                await self._append(entries, sync=sync, commit_lsn=commit_lsn)
            except StoreError as exc:
                error, fail_stop = self.driver.append_failed(
                    exc,
                    len(entries),
                    epoch=self.epoch,
                    map_size_bytes=self.config.limits.map_size_bytes,
                )
                if fail_stop:
                    self._fail_stop(fail_stop)
                _fail_all(planned, error)
                return
            self.driver.batch_appended(entries[-1].lsn, commit_lsn)
        if driver is not self._driver or driver.deposed:
            _fail_all(
                planned,
                ServiceError(
                    Code.UNKNOWN,
                    f"indeterminate: replica {self.node.id} lost the master role of epoch "
                    f"{self.epoch} after storing the write locally; it may or may not survive",
                ),
            )
            return
        if _stages.ENABLED:
            _mark_stored(planned, lsns)
        if self.telemetry.tracing:
            # Before the append reaches the driver: its sends may leave at once.
            driver.traced(
                [
                    (lsn, pending.trace.appended(lsn, self.epoch, plan.receipt))
                    for (pending, plan), lsn in zip(planned, lsns, strict=True)
                    if pending.trace is not None
                ]
            )
        driver.appended(entries, synced=sync)
        floor = driver.core.epoch_start_lsn
        driver.register(
            [
                Waiting(pending.future, plan, max(lsn, floor))
                for (pending, plan), lsn in zip(planned, lsns, strict=True)
            ]
        )
        retention = self.config.limits.log_retention_entries
        # Never above the commit LSN: a restart hides what is above it by reading the log.
        keep = min(driver.compaction_target(retention), self.gate.commit_lsn + 1)
        if self.core.compaction(keep) and not driver.deposed:
            driver.set_log_start(keep)  # the core first: no batch is built below keep
            await self._compact(keep)

    async def _append(
        self, entries: Sequence[replica_pb2.LogEntry], *, sync: bool, commit_lsn: int
    ) -> None:
        """Appends entries to the store (commit lock held), on the loop when small and
        unflushed, recording the commit LSN known with them."""
        append = functools.partial(
            self.driver.store_append, entries, sync=sync, commit_lsn=commit_lsn
        )
        if not sync and batch_size_bytes(entries) <= _INLINE_APPEND_BYTES_MAX:
            append()
            return
        await asyncio.get_running_loop().run_in_executor(self._io, append)

    async def _compact(self, keep_from_lsn: int) -> None:
        """Deletes the log below keep_from_lsn on the store thread (commit lock held)."""
        try:
            deleted = await asyncio.get_running_loop().run_in_executor(
                self._io, self.driver.store_compact, keep_from_lsn
            )
        except StoreError as exc:
            # Compaction only deletes: a failure leaves more log than wanted, not less.
            log.warning(
                "replica %s: compacting the log below LSN %d failed: epoch=%d: %s",
                self.node.id,
                keep_from_lsn,
                self.epoch,
                exc,
            )
            return
        self.driver.compacted()
        log.debug(
            "replica %s compacted its log: %d entries deleted, now LSNs %d..%d",
            self.node.id,
            deleted,
            self._log_start_lsn,
            self._last_lsn,
        )

    def _fail_stop(self, reason: str) -> None:
        """A store that cannot write must not acknowledge anything again (the driver's)."""
        self.driver.fail_stop(reason)

    def report_fault(self, reason: str) -> None:
        """Records a fault that makes this node unfit to serve; the coordinator reads it in
        the replica's state and quarantines the node. The same fault hit again (the same
        bad record read by every subscriber) is one fault: an operator who cleared it is
        not overruled; a different one is new and quarantines the node again."""
        if self.fault is not None and self.fault.reason == reason[:REASON_CHARS_MAX]:
            return
        self.fault = new_fault(reason, self.clock.wall_ms())
        log.error(
            "replica %s FAULT: %s (epoch=%d lsn=%d); reporting it to the coordinator, which "
            "quarantines this node",
            self.node.id,
            reason,
            self.epoch,
            self._last_lsn,
        )
        save_fault(self.node.data_dir, self.fault)

    def _record_loss(self, record: LossRecord) -> None:
        """Keeps a loss report beside the store, logs it (SQUALL-LOSS-001) and counts it;
        the coordinator hears of it in the next ReplicaState."""
        self.losses = tuple(
            dataclasses.replace(r, node_id=self.node.id)
            for r in record_loss(self.node.data_dir, record, log)
        )
        if self._instruments is not None:
            self._instruments.loss_reports.add(1, {"node": self.node.id, "cause": record.cause})
            self._instruments.loss_events.add(record.events(), {"node": self.node.id})

    def writes_idle(self) -> bool:
        """No write queued or being committed (a fenced master's log has stopped growing)."""
        return not self._queue and not self._commit_lock.locked()

    def _notify_committed(self) -> None:
        committed, self._committed = self._committed, asyncio.Event()
        committed.set()

    def commit_signal(self) -> asyncio.Event:
        """An event set at the next commit (take it before reading, then wait on it)."""
        return self._committed

    # --- reads (committed state only)

    def topic(self, name: str) -> TopicInfo:
        """A topic, or NOT_FOUND."""
        topic = self.store.get_topic(name)
        if topic is None:
            raise ServiceError(Code.NOT_FOUND, f"topic '{name}' does not exist")
        return topic

    @property
    def last_lsn(self) -> int:
        """The LSN of the last entry in the local log."""
        return self._last_lsn

    @property
    def log_start_lsn(self) -> int:
        """The first LSN still in the local log."""
        return self._log_start_lsn

    def slave_status(self) -> list[SlaveStatus]:
        """As master: each member slave's progress, lag, catch-up rate and ETA; else []."""
        driver = self._driver
        if driver is None or self.role != common_pb2.ROLE_MASTER:
            return []
        return driver.slave_status()

    @property
    def commit_lsn(self) -> int:
        """The highest LSN committed reads serve here."""
        return self.gate.commit_lsn

    def visible_end(self, topic: str) -> int:
        """The first offset of topic that committed reads may not serve yet (0: none)."""
        return self.gate.hidden_from(topic) or 0


def _pass_receipt(
    receipt: asyncio.Future[common_pb2.BatchReceipt], planned: asyncio.Future[Planned]
) -> None:
    """Settles a publish's receipt future as its planned write ended."""
    if receipt.done():
        return  # the caller gave up
    if planned.cancelled():
        receipt.cancel()
        return
    error = planned.exception()
    if error is not None:
        receipt.set_exception(error)
        return
    got = planned.result().receipt
    if got is None:
        receipt.set_exception(AssertionError("a planned publish always has a receipt"))
        return
    receipt.set_result(got)


def _cancel_with(
    planned: asyncio.Future[Planned], receipt: asyncio.Future[common_pb2.BatchReceipt]
) -> None:
    """A caller that gives up on its receipt cancels the write's wait (as awaiting did)."""
    if receipt.cancelled():
        planned.cancel()


def _fail_all(planned: list[tuple[_Pending, Planned]], error: ServiceError) -> None:
    for pending, _ in planned:
        _fail_pending(pending, error)


def _fail_pending(pending: _Pending, error: ServiceError) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)
    if pending.appended is not None and not pending.appended.done():
        pending.appended.set_exception(error)


def _finish_appended(batch: list[_Pending]) -> None:
    """Answers become_master's wait for the epoch start: appended, or why not."""
    for pending in batch:
        appended = pending.appended
        if appended is None or appended.done():
            continue
        future = pending.future
        if future.done() and not future.cancelled() and future.exception() is not None:
            error = future.exception()
            appended.set_exception(error if error is not None else RuntimeError("write failed"))
        else:
            appended.set_result(None)


class _Diverged(Exception):
    """The sync source's log parts from ours at fork_lsn: ours must be truncated."""

    def __init__(self, fork_lsn: int) -> None:
        super().__init__(f"diverges after LSN {fork_lsn}")
        self.fork_lsn = fork_lsn


def _mark_publishes(stage: str, batch: Sequence[_Pending]) -> None:
    """Marks each publish of a commit batch for the latency budget (squall.wire.stages)."""
    for pending in batch:
        command = pending.command
        if isinstance(command, commands.Publish) and command.request.events:
            first = command.request.events[0].sequence
            _stages.mark(stage, _stages.request_key(command.request.publisher_id, first))


def _mark_stored(planned: Sequence[tuple[_Pending, Planned]], lsns: Sequence[int]) -> None:
    """Marks the publishes just stored, linking each to its LSN and first offset."""
    for (pending, plan), lsn in zip(planned, lsns, strict=True):
        command = pending.command
        if not isinstance(command, commands.Publish) or not command.request.events:
            continue
        request = command.request
        key = _stages.request_key(request.publisher_id, request.events[0].sequence)
        _stages.mark("m.stored", key)
        _stages.link(key, f"lsn/{lsn}")
        if plan.receipt is not None:
            _stages.link(key, f"off/{request.topic}/{plan.receipt.first_offset}")
