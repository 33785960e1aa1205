"""Taking the master role: the reorganization fetch and the start of a master's epoch.

A master role is taken in a background task that outlives the coordinator's SetRole call
(``reorg``): a large snapshot may take long. Before a new master writes its epoch-start
entry it fetches the log it lacks from the group's sync source (``Replication.FetchLog``,
answered by ``sync_source``), truncating a divergent suffix of its own first (by
rebuilding the store from its log, ``truncation``). When that cannot work (its log is
compacted or shares no entry with the source's, or the source's no longer holds what it
lacks) the source sends a snapshot and the log after it, installed as a slave installs
one (``slave_side``). Then it starts its replication (``MasterDriver``) and queues the
epoch start with the writer.

``TakingMaster`` holds the task taking the role (``current``) and the task winding down
an abandoned one; the synchronous ``ReplicaDriver`` checks each fetched message and
tells the core how an attempt ended. Everything else it uses is handed to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.telemetry import Telemetry
from squall_server.replica import commands
from squall_server.replica.commands import Command, Planned
from squall_server.replica.core import PersistRole, ReplicaCore, TakeMaster
from squall_server.replica.core_view import CoreView
from squall_server.replica.driver import (
    FetchTail,
    InstallFetched,
    ReplicaDriver,
    StoreFetched,
    TruncateFetched,
    master_config,
)
from squall_server.replica.master_driver import MasterDriver, Waiting
from squall_server.replica.reorg import SyncProgress, Taking, outcome, read_within
from squall_server.replica.replication import ReplicationMaster
from squall_server.replica.store import CorruptRecordError, StoreError
from squall_server.replica.transport import ReplicaCallError, ReplicaTransport
from squall_server.replica.visibility import CommitGate

T = TypeVar("T")
log = logging.getLogger("squall.replica")


class SubmitCommand(Protocol):
    """Queues a command with the writer (``Writer.submit``)."""

    def __call__(
        self, command: Command, *, appended: asyncio.Future[None] | None = None
    ) -> asyncio.Future[Planned]: ...


class InstallSnapshotChunk(Protocol):
    """Installs one snapshot chunk, commit lock held (``SlaveSide.install_snapshot_chunk``)."""

    def __call__(
        self,
        chunk: replica_pb2.SnapshotChunk,
        *,
        last: bool,
        history: Iterable[tuple[int, int]],
        source: str,
    ) -> Awaitable[int | None]: ...


class PersistOnStoreThread(Protocol):
    """Runs a role's flushed store write on the store thread, serialized with every other
    write (``RolePersistence.persist``, ``roles.py``)."""

    def __call__(self, persist: Callable[[], T]) -> Awaitable[T]: ...


class TakingMaster(CoreView):
    """Takes the master role in the background and winds down an abandoned attempt."""

    def __init__(
        self,
        node: NodeConfig,
        config: Callable[[], ClusterConfig],
        nodes: Callable[[], dict[str, NodeConfig]],
        core: ReplicaCore,
        driver: ReplicaDriver,
        *,
        transport: Callable[[], ReplicaTransport],
        clock: Clock,
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        observability: Telemetry,
        truncate_by_snapshot: bool,
        persist_role: PersistOnStoreThread,
        submit: SubmitCommand,
        install_snapshot_chunk: InstallSnapshotChunk,
        truncate_after: Callable[[int, str], Awaitable[None]],
        gate_from_store: Callable[[str], CommitGate],
        new_epoch: Callable[[int], None],
        set_master: Callable[[MasterDriver], None],
        on_deposed: Callable[[str], None],
        on_epoch_started: Callable[[int], None],
        report_fault: Callable[[str], None],
    ) -> None:
        """``config`` and ``nodes`` give the configuration in force and its nodes by id (a
        membership change replaces them); ``transport`` makes a connection to the other
        replicas; ``truncate_by_snapshot``: this store cannot truncate (the memory twin),
        a slave's divergent suffix is replaced by a snapshot. ``set_master`` hands the
        epoch's replication to the node; ``on_deposed`` is its deposition;
        ``on_epoch_started(epoch)`` runs once the epoch start committed and this node
        still is its master (readers are woken through the driver's hook);
        ``report_fault``: the node's fault report, for a master that cannot read its own
        log or snapshot for a slave (``FaultReports.report``)."""
        self.node = node
        self._config = config
        self._nodes = nodes
        self.core = core
        self.driver = driver
        self._new_transport = transport
        self.clock = clock
        self._io = io
        self._commit_lock = commit_lock
        self.telemetry = observability
        self._truncate_by_snapshot = truncate_by_snapshot
        self._persist_role = persist_role
        self._submit = submit
        self._install_snapshot_chunk = install_snapshot_chunk
        self._truncate_after = truncate_after
        self._gate_from_store = gate_from_store
        self._new_epoch = new_epoch
        self._set_master = set_master
        self._on_deposed = on_deposed
        self._on_epoch_started = on_epoch_started
        self._report_fault = report_fault
        # The task taking a master role in the background (its reorganization sync).
        self.current: Taking | None = None
        self._stopping: asyncio.Task[None] | None = None  # an abandoned taking winding down

    @property
    def config(self) -> ClusterConfig:
        return self._config()

    def _is_learner(self, node_id: str) -> bool:
        """Is ``node_id`` a learner of the running set (its acks count for no commit)?"""
        node = self._nodes().get(node_id)
        return node is not None and node.learner

    async def become_master(
        self,
        epoch: int,
        *,
        reason: str,
        members: Sequence[str] = (),
        sync_source_id: str = "",
        progress: SyncProgress | None = None,
        persist: PersistRole,
    ) -> None:
        """Takes the master role in `epoch` (the core's ``TakeMaster``, run by the task
        ``start`` made): persists the epoch (the core's ``persist``), brings the log to
        the sync source's, starts replication to the members, then writes the epoch
        start.

        progress: where the reorganization sync reports how far it got (``reorg``)."""
        # Before the fetch below changes the store.
        member_ids = await self._persist_role(
            functools.partial(self.driver.take_master_persist, persist, members)
        )
        self._new_epoch(epoch)
        if sync_source_id and sync_source_id != self.node.id:
            await self._sync_from(
                sync_source_id,
                epoch,
                progress or SyncProgress(epoch, sync_source_id, self.clock.monotonic_ms()),
            )
        # The role may be taken long after its SetRole call (a reorganization sync):
        # refused if abandoned meanwhile.
        core: ReplicationMaster[Waiting] = self.driver.hold_master(
            master_config(
                self.config,
                self.node.id,
                # Learners get the log but their acks count for no commit.
                sum(1 for m in member_ids if not self._is_learner(m)),
                truncate_by_snapshot=self._truncate_by_snapshot,
            ),
            epoch,
            member_ids,
        )
        # (This node's own config when the group names it without the configuration.)
        member_nodes = [self._nodes().get(member, self.node) for member in member_ids]
        driver = MasterDriver(
            self.config,
            self.node,
            core,
            lambda: self.store,
            cluster_id=self.store.meta().cluster_id,
            members=member_nodes,
            transport=self._new_transport(),
            clock=self.clock,
            on_commit=self.driver.advance_commit,
            on_deposed=self._on_deposed,
            on_fault=self._report_fault,
            io=self._io,
            commit_lock=self._commit_lock,
            log_start_lsn=self._log_start_lsn,
            stamp_snapshot=self.driver.stamp_snapshot,
            observability=self.telemetry,
        )
        self._set_master(driver)
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
            self._on_epoch_started(epoch)  # all before it is committed: push delivers it

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
                            await self._store_fetched(tail, step, sync=sync)
                            progress.entries_fetched = tail.entries
                    break
                except _Diverged as diverged:
                    progress.phase = "truncating"
                    await self._truncate_after(diverged.fork_lsn, f"sync source {source_id}")
                except ReplicaCallError as exc:
                    # A source whose log fails its checksum fails every retry alike: a
                    # refusal, so that after a few the coordinator steps this node aside
                    # and a new epoch picks its source among the members left.
                    code = (
                        Code.FAILED_PRECONDITION
                        if exc.status in ("FAILED_PRECONDITION", "DATA_LOSS")
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
        meta = self.driver.fetch_finished()
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

    async def _store_fetched(self, tail: FetchTail, step: StoreFetched, *, sync: bool) -> None:
        """Appends fetched entries as ``ReplicaDriver.store_fetched`` says (commit lock
        held, the append on the store thread)."""
        steps = self.driver.store_fetched(tail, step, sync=sync)
        loop = asyncio.get_running_loop()
        async with self._commit_lock:
            try:
                call = next(steps)
                # One store operation: the append.
                while True:
                    try:
                        await loop.run_in_executor(self._io, call)
                    except Exception:
                        # (Cancelled: the store thread may still append; cancel rebuilds.)
                        self.driver.fetched_store_failed()
                        raise
                    call = steps.send(None)
            except StopIteration:
                return

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

    def describe_progress(self) -> str:
        """How far the master role being taken got, for a refusal."""
        taking = self.current
        if taking is None:
            return f"about to take the master role of epoch {self.epoch}"
        return taking.progress.describe(self.clock.monotonic_ms())

    def reorganization_progress(self) -> replica_pb2.ReorganizationProgress | None:
        """How far the master role being taken got (None when none is being taken)."""
        taking = self.current
        if taking is None or taking.task.done():
            return None
        return taking.progress.to_proto(self.clock.monotonic_ms())

    def start(self, take: TakeMaster, persist: PersistRole) -> Taking:
        """Starts taking the master role in the background (``reorg``); the task writes
        the core's ``persist`` first."""
        progress = SyncProgress(
            take.epoch,
            take.sync_source_id or self.node.id,
            self.clock.monotonic_ms(),
            attempt=take.attempt,
        )
        task = asyncio.get_running_loop().create_task(
            self._take_master(take, persist, progress), name=f"take-master-{self.node.id}"
        )
        taking = Taking(
            epoch=take.epoch, source_id=take.sync_source_id, task=task, progress=progress
        )
        self.current = taking
        task.add_done_callback(functools.partial(self._taking_done, taking))
        return taking

    async def _take_master(
        self, take: TakeMaster, persist: PersistRole, progress: SyncProgress
    ) -> None:
        await self.become_master(
            take.epoch,
            reason=take.reason,
            members=take.members,
            sync_source_id=take.sync_source_id,
            progress=progress,
            persist=persist,
        )

    def _taking_done(self, taking: Taking, task: asyncio.Task[None]) -> None:
        """Tells the core the attempt ended (its lease starts, or the next SetRole hears of
        the failure) and logs a failure."""
        if self.current is taking:
            self.observe()
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.warning(
                "replica %s did not take the master role: %s",
                self.node.id,
                error.message if isinstance(error, ServiceError) else repr(error),
            )

    def observe(self) -> None:
        """Reports a finished attempt to take the master role to the core (once: the core
        ignores repeats)."""
        taking = self.current
        if taking is None or not taking.task.done():
            return
        self.driver.taking_finished(taking.epoch, outcome(taking.task), self.clock.monotonic_ms())

    async def cancel(self, why: str) -> None:
        """Stops taking a master role (a newer command, deactivation, shutdown) and waits
        until the task has stopped, so no two role changes run at once."""
        taking, self.current = self.current, None
        if taking is None or taking.task.done() or taking.task is asyncio.current_task():
            await self.wait_stopped()
            return
        log.info(
            "replica %s abandons taking the master role: %s; %s",
            self.node.id,
            taking.progress.describe(self.clock.monotonic_ms()),
            why,
        )
        taking.task.cancel()
        # Its own task: a caller cancelled meanwhile (a SetRole past its deadline) must not
        # cut it short; the next role command waits for it (wait_stopped).
        self._stopping = asyncio.get_running_loop().create_task(self._stopped(taking))
        await self.wait_stopped()

    async def wait_stopped(self) -> None:
        """Waits until an abandoned master role's task and its store work have stopped."""
        stopping = self._stopping
        if stopping is not None:
            await asyncio.shield(stopping)

    async def _stopped(self, taking: Taking) -> None:
        await asyncio.wait({taking.task})
        # A cancelled await does not stop the store thread: what it was doing finishes
        # before this job runs, so the log no longer grows once this returns (a
        # deactivation's report says so), and the gate is rebuilt from what was stored.
        why = "reorganization interrupted"
        try:
            gate = await asyncio.get_running_loop().run_in_executor(
                self._io, self._gate_from_store, why
            )
        except CorruptRecordError as exc:
            self.driver.gate_unreadable(exc, why)
            return
        self.driver.taking_stopped(gate)


class _Diverged(Exception):
    """The sync source's log parts from ours at fork_lsn: ours must be truncated."""

    def __init__(self, fork_lsn: int) -> None:
        super().__init__(f"diverges after LSN {fork_lsn}")
        self.fork_lsn = fork_lsn
