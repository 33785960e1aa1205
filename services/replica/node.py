"""The replica node: the composition root and adapter around the replica's cores, its
synchronous driver and the asyncio shells that do the waiting.

The synchronous ``ReplicaDriver`` (``driver.py``, ``self.driver``) owns the store and the
commit gate and applies the pure ``ReplicaCore``'s effects. The asyncio work around it
lives in small classes, each given what it uses (the driver, the commit lock, the store
thread, the clock, a fault callback), not the node:

* ``Writer`` (``writer.py``): the write queue, group commit (a batch appended in one
  transaction, registered with the master's ``MasterDriver`` and acknowledged once
  committed) and log compaction;
* ``SlaveSide`` (``slave_side.py``): a slave's hello, batches, snapshot chunks and
  heartbeats from its master;
* ``SyncSource`` (``sync_source.py``): answering a new master's reorganization fetch;
* ``TakingMaster`` (``taking_master.py``): taking the master role in a background task
  (``reorg``): the reorganization fetch from the sync source, then the epoch start;
* ``Truncation`` (``truncation.py``): removing a divergent suffix, and the loss reports
  it leaves;
* ``RoleApplication`` (``roles.py``): the coordinator's role commands and the core's role
  effects (taking, following and dropping a role, a membership change's running node
  set, the lease watch), with ``RolePersistence`` (a role's store write) and
  ``RoleChanges`` (the role-changed signal). What a role command replaces while the
  node runs (the configuration in force, its nodes, the master's ``MasterDriver``) is
  the ``NodeState`` (``self.state``) this node shares with them.

This node owns the commit lock (held while a batch, a truncation, an install or a role's
store write runs, so a deactivation can wait for it and report a log that no longer
grows) and the one store thread (so fsync never blocks the event loop), talks to the
other replicas through a ``ReplicaTransport`` (``transport.py``), and keeps the public
methods the servicers call (through the narrow protocols of ``endpoints.py``) and the
coordinator's reports read.

Roles: every role rule (role, epoch floor, lease, taking and dropping roles, the shutdown
freeze, the hand-off fence, which writes are refused) is decided by ``ReplicaCore``
(``core``); ``RoleApplication`` feeds it role commands and ticks and carries out the
``Effects`` it returns in their documented order (``apply_effects``); this node's
``apply_role``, ``apply_effects``, ``deactivate`` and ``wait_for_role`` delegate to it.

Committed reads across restarts: the store records the commit LSN this node knew (with
each appended batch, and a slave's idle heartbeats); ``start`` hides every publish above
it until a master's commit LSN passes it, and a snapshot carries the sender's commit LSN
and what it holds above it (``visibility``).

Log retention: after each batch the master and the slaves compact their logs to at
most ``limits.log_retention_entries`` entries (plus one compaction step), on the store
thread with the commit lock held; the master never compacts the log after a snapshot it
is sending (``MasterDriver.compaction_target``). A slave behind the retained log, or
one whose own log no longer starts at LSN 1 and holds a divergent suffix, gets a
snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TypeVar

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.clock import Clock, SystemClock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.loss_record import LossRecord
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.telemetry import Telemetry, current
from squall_server.replica import commands, telemetry
from squall_server.replica.commands import Command, Planned
from squall_server.replica.committed import gate_from_store
from squall_server.replica.core import CoreConfig, Effects, LogPosition, ReplicaCore, WriteFence
from squall_server.replica.core_view import CoreView
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.faults import (
    REASON_CHARS_MAX,
    Fault,
    load_fault,
    new_fault,
    save_fault,
)
from squall_server.replica.follower import FollowerConfig
from squall_server.replica.links import LinkForwarding
from squall_server.replica.master_driver import MasterDriver, SlaveStatus
from squall_server.replica.push import PushDelivery
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.reorg import SyncProgress, Taking, answer_wait_s
from squall_server.replica.replication import SyncPolicy
from squall_server.replica.roles import NodeState, RoleApplication, RoleChanges, RolePersistence
from squall_server.replica.slave_side import SlaveSide
from squall_server.replica.store import Store, TopicInfo
from squall_server.replica.store.stall import StallMeter
from squall_server.replica.sync_source import SyncSource
from squall_server.replica.taking_master import TakingMaster
from squall_server.replica.transient import TransientTopics
from squall_server.replica.transport import GrpcReplicaTransport, ReplicaTransport
from squall_server.replica.truncation import Truncation
from squall_server.replica.visibility import CommitGate
from squall_server.replica.writer import Writer, cancel_with, pass_receipt

T = TypeVar("T")
log = logging.getLogger("squall.replica")

# Request metadata from a publisher proxy: the replica addresses it just failed to reach,
# comma-separated, so this replica does not redirect it back to a dead master.
UNREACHABLE_KEY = "squall-unreachable"


class ReplicaNode(CoreView):
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
        io: concurrent.futures.Executor | None = None,
        running_nodes: RunningNodes | None = None,
    ) -> None:
        """``transport`` makes the connections to the other replicas: one per master epoch
        and one per reorganization sync, each closed when done (gRPC unless given).
        ``io`` runs the store's writes one at a time (the store thread unless given; the
        simulator's runs them on its virtual loop, ``tests/sim/virtual_loop.py``).
        ``running_nodes``: the node ids the server's call guards accept; the role
        commands' running node set moves them (so an added node is taken at once)."""
        # The configuration in force and the master's replication (roles.py replaces them).
        self.state = NodeState.of(config)
        self.running_nodes = running_nodes or RunningNodes(
            (n.id for n in config.nodes), (g.id for g in config.gateways)
        )
        self.node = node
        self.clock = clock or SystemClock()
        # (The running node set may move a node's address: a transport is made from the
        # configuration in force when it is needed.)
        self._new_transport: Callable[[], ReplicaTransport] = transport or (
            lambda: GrpcReplicaTransport(self.state.config, node.id)
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
        # Set (and replaced) whenever a role command was applied or the role was lost.
        self._role_changes = RoleChanges(node.id, self.core, self._instruments)
        # A fault that makes this node unfit to serve; reported to the coordinator, which
        # quarantines the node (faults.py).
        self.fault: Fault | None = load_fault(node.data_dir)
        self.transient = TransientTopics(config.limits.subscribe_batch_max_events * 10)
        self.push = PushDelivery(self)  # runs while master, from the epoch start's commit
        self.links = LinkForwarding(self)  # likewise
        self._committed = asyncio.Event()
        self._io: concurrent.futures.Executor = io or concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"store-{node.id}"
        )
        self._lease_task: asyncio.Task[None] | None = None
        # Held while a batch is being written, so a deactivation can wait for it and then
        # report a log that no longer grows.
        self._commit_lock = asyncio.Lock()
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
            on_role_changed=self._role_changes.changed_now,
            on_fault=self.report_fault,
            local_commits=config.durability.acks == common_pb2.ACK_POLICY_NONE,
        )
        # Truncation of a divergent suffix and the loss reports it leaves (truncation.py).
        self.truncation = Truncation(
            node.id,
            node.data_dir,
            self.core,
            self.driver,
            truncator,
            stall=self._stall,
            io=self._io,
            commit_lock=self._commit_lock,
            clock=self.clock,
            published_traces=self.published_traces,
            instruments=self._instruments,
            fail_stop=self._fail_stop,
        )
        # The write queue, group commit and compaction (writer.py).
        self.writer = Writer(
            node,
            lambda: self.state.config,
            self.core,
            self.driver,
            lambda: self.state.master,
            clock=self.clock,
            io=self._io,
            commit_lock=self._commit_lock,
            observability=self.telemetry,
            report_fault=self.report_fault,
            fail_stop=self._fail_stop,
        )
        # Answers a new master's reorganization fetch (sync_source.py).
        self.sync_source = SyncSource(
            node.id,
            self.driver,
            lambda: self.state.config,
            is_master=lambda: self.role == common_pb2.ROLE_MASTER,
            io=self._io,
            commit_lock=self._commit_lock,
            clock=self.clock,
        )
        # What a slave does with its master's stream (slave_side.py).
        self.slave = SlaveSide(
            node.id,
            self.core,
            self.driver,
            io=self._io,
            commit_lock=self._commit_lock,
            append=self.writer.append_entries,
            compact=self.writer.compact,
            truncate_locked=self.truncation.truncate_locked,
            fail_stop=self._fail_stop,
        )
        # A role's flushed store writes (its epoch, the DIRTY mark), on the store thread.
        persistence = RolePersistence(
            node.id,
            self.core,
            io=self._io,
            commit_lock=self._commit_lock,
            fail_stop=self._fail_stop,
        )
        # Taking the master role: the reorganization fetch, the epoch start (taking_master.py).
        self.taking = TakingMaster(
            node,
            lambda: self.state.config,
            lambda: self.state.nodes,
            self.core,
            self.driver,
            transport=lambda: self._new_transport(),
            clock=self.clock,
            io=self._io,
            commit_lock=self._commit_lock,
            observability=self.telemetry,
            truncate_by_snapshot=truncator is None,
            persist_role=persistence.persist,
            submit=self.writer.submit,
            install_snapshot_chunk=self.slave.install_snapshot_chunk,
            truncate_after=self.truncation.truncate_after,
            gate_from_store=self._gate_from_store,
            new_epoch=self.transient.new_epoch,
            set_master=self._set_master,
            on_deposed=self._master_deposed,
            on_epoch_started=self._epoch_started,
            on_committed=self._notify_committed,
        )
        # Role commands and the core's role effects (roles.py). (The master's replication
        # for its epoch is ``state.master``; a slave's follower and the number of its
        # current stream are the core's: ``core.follower``, ``core.stream_seq``.)
        self.roles = RoleApplication(
            node,
            self.core,
            self.driver,
            self.state,
            clock=self.clock,
            commit_lock=self._commit_lock,
            writer=self.writer,
            taking=self.taking,
            persistence=persistence,
            changes=self._role_changes,
            running_nodes=self.running_nodes,
            stop_delivery=self._stop_delivery,
            answer_wait_s=answer_wait_s(
                config.timeouts.heartbeat_interval_ms, config.timeouts.rpc_timeout_ms
            ),
        )
        # How the process is stopped once a cluster shutdown finished (shutdown.py).
        self.on_shutdown: Callable[[], None] | None = None

    # --- the store, the commit gate, the role, epoch and log bounds: CoreView's

    def store_stalled_ms(self) -> int:
        """How long the store's oldest write in progress has run (0: none is)."""
        return self._stall.stalled_ms()

    @property
    def master(self) -> NodeConfig | None:
        """The master of this replica's epoch while it holds a role, else None."""
        return self.state.nodes.get(self.core.master_id)

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
        self.writer.start()
        self._lease_task = asyncio.create_task(
            self.roles.watch_lease(), name=f"lease-{self.node.id}"
        )
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
        await self.taking.cancel(f"replica {self.node.id} stopping")
        if self._instruments is not None:
            self._instruments.unwatch(self)
        if self.state.master is not None:
            await self.state.master.stop(f"replica {self.node.id} stopping")
            self.state.master = None
        if self._lease_task is not None:
            self._lease_task.cancel()
            try:
                await self._lease_task
            except asyncio.CancelledError:
                pass
        await self.writer.stop()
        self._io.shutdown(wait=True)

    # --- writes

    def check_writable(self) -> None:
        """Refuses a write this replica may not accept now (the core's write gate)."""
        refusal = self.core.write_refusal(self.clock.monotonic_ms(), self.taking.describe_progress)
        if refusal is not None:
            raise refusal.error()

    async def write(self, command: Command) -> Planned:
        """Commits one command on the master and returns what it produced."""
        self.check_writable()
        return await self.writer.submit(command)

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
        planned = self.writer.submit(commands.Publish(request), trace=trace)
        # Chained by callbacks, not a task: one publish at a time pays no task per event.
        receipt: asyncio.Future[common_pb2.BatchReceipt] = loop.create_future()
        planned.add_done_callback(functools.partial(pass_receipt, receipt))
        receipt.add_done_callback(functools.partial(cancel_with, planned))
        return receipt

    async def become_master(
        self,
        epoch: int,
        *,
        reason: str,
        members: Sequence[str] = (),
        sync_source_id: str = "",
        progress: SyncProgress | None = None,
    ) -> None:
        """Takes the master role in `epoch` (taking_master.py): persists the epoch, brings
        the log to the sync source's, starts replication to the members, then writes the
        epoch start."""
        await self.taking.become_master(
            epoch,
            reason=reason,
            members=members,
            sync_source_id=sync_source_id,
            progress=progress,
        )

    def reorganization_progress(self) -> replica_pb2.ReorganizationProgress | None:
        """How far the master role being taken got (None when none is being taken)."""
        return self.taking.reorganization_progress()

    # --- roles (roles.py)

    async def apply_role(self, command: replica_pb2.RoleCommand) -> None:
        """Takes (or renews) the role the coordinator commands, one command at a time
        (``RoleApplication.apply_role``)."""
        await self.roles.apply_role(command)

    async def apply_effects(self, effects: Effects) -> Taking | None:
        """Carries out what the core decided, in the order ``Effects`` documents; returns
        the task taking (or already taking) a master role, if any."""
        return await self.roles.apply_effects(effects)

    async def deactivate(self, reason: str) -> None:
        """Drops the role: stops serving writes and replication; returns once no write is
        in progress."""
        await self.roles.deactivate(reason)

    async def wait_for_role(self, unreachable: frozenset[str], timeout_s: float) -> None:
        """Waits (up to timeout_s) while this replica can neither serve a write nor name a
        master the caller can reach (``RoleApplication.wait_for_role``)."""
        await self.roles.wait_for_role(unreachable, timeout_s)

    @property
    def config(self) -> ClusterConfig:
        """The configuration in force (a membership change's running node set replaces
        the config file's nodes)."""
        return self.state.config

    @property
    def _nodes(self) -> dict[str, NodeConfig]:
        """The nodes of the configuration in force, by id."""
        return self.state.nodes

    @property
    def _driver(self) -> MasterDriver | None:
        """The master's replication for its epoch (None unless master)."""
        return self.state.master

    async def drain_writes(self) -> None:
        """Waits until every write queued now has finished (committed or failed) and no
        batch is being written."""
        await self.writer.drain()

    async def store_write(self, write: Callable[[], None]) -> None:
        """Runs one store write on the store thread, serialized with every other write."""
        async with self._commit_lock:
            await asyncio.get_running_loop().run_in_executor(self._io, write)

    def _set_master(self, driver: MasterDriver) -> None:
        """The master's replication of the epoch just taken (taking_master.py)."""
        self.state.master = driver

    def _epoch_started(self, epoch: int) -> None:
        """The epoch start committed and this node is still its master: everything before
        it is committed, so push delivery and topic links start."""
        self.push.start(epoch)
        self.links.start(epoch)

    def _stop_delivery(self) -> None:
        """Stops push delivery and topic links (they run while master)."""
        self.push.stop()
        self.links.stop()

    def _master_deposed(self, reason: str) -> None:
        """The replication core deposed this master: no more writes in this epoch."""
        self._stop_delivery()
        self.state.master = None
        self.writer.wake()
        self.driver.deposed(reason)

    # --- the slave side of replication (slave_side.py; driven by the Replication servicer)

    async def replication_hello(
        self, hello: replica_pb2.ReplicationHello
    ) -> tuple[int, replica_pb2.ReplicationPosition]:
        """Accepts a stream from this epoch's master; returns its number and our position."""
        return await self.slave.hello(hello)

    def replication_batch(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> AsyncGenerator[replica_pb2.ReplicationAck, None]:
        """Checks and stores one batch from the master, yielding each ack as it is due."""
        return self.slave.batch(stream, batch)

    async def replication_snapshot(
        self, stream: int, chunk: replica_pb2.SnapshotChunk
    ) -> list[replica_pb2.ReplicationAck]:
        """Installs one snapshot chunk from the master; after the last, returns the ack."""
        return await self.slave.snapshot(stream, chunk)

    def replication_heartbeat(
        self, stream: int, heartbeat: replica_pb2.ReplicationHeartbeat
    ) -> replica_pb2.ReplicationAck:
        """A heartbeat from the master: learns its commit LSN; returns the ack."""
        return self.slave.heartbeat(stream, heartbeat)

    def fetch_log(
        self, request: replica_pb2.FetchLogRequest
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]:
        """Serves a new master's reorganization fetch (sync_source.py)."""
        return self.sync_source.fetch_log(request)

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

    @property
    def losses(self) -> tuple[LossRecord, ...]:
        """Loss reports beside the store (acknowledged entries this node discarded),
        reported to the coordinator in every ReplicaState (truncation.py)."""
        return self.truncation.losses

    def writes_idle(self) -> bool:
        """No write queued or being committed (a fenced master's log has stopped growing)."""
        return self.writer.idle()

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
        driver = self.state.master
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
