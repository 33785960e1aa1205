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
  it leaves.

This node owns the commit lock (held while a batch, a truncation, an install or a role's
store write runs, so a deactivation can wait for it and report a log that no longer
grows) and the one store thread (so fsync never blocks the event loop), talks to the
other replicas through a ``ReplicaTransport`` (``transport.py``), and keeps the public
methods the servicers call (through the narrow protocols of ``endpoints.py``) and the
coordinator's reports read.

Roles: every role rule (role, epoch floor, lease, taking and dropping roles, the shutdown
freeze, the hand-off fence, which writes are refused) is decided by ``ReplicaCore``
(``core``); this node feeds it role commands, ticks and what it saw, and carries out the
``Effects`` it returns in their documented order (``apply_effects``).

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
import contextlib
import dataclasses
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
from squall_server.replica.core import (
    CoreConfig,
    Effects,
    Follow,
    LogPosition,
    ReplicaCore,
    Role,
    RoleOrder,
    StoreFacts,
    WriteFence,
)
from squall_server.replica.driver import (
    CancelTaking,
    DropRole,
    FollowMaster,
    JoinTaking,
    PersistRole,
    RenewMembers,
    ReplicaDriver,
    StartTaking,
)
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
from squall_server.replica.replication import ReplicationError, SyncPolicy
from squall_server.replica.slave_side import SlaveSide
from squall_server.replica.store import Store, StoreError, StoreFullError, TopicInfo
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
# How often the lease watch asks the core whether the role lease ran out: a small part of
# the shortest lease a coordinator gives (its member timeout).
_LEASE_CHECK_S = 0.05


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
        io: concurrent.futures.Executor | None = None,
        running_nodes: RunningNodes | None = None,
    ) -> None:
        """``transport`` makes the connections to the other replicas: one per master epoch
        and one per reorganization sync, each closed when done (gRPC unless given).
        ``io`` runs the store's writes one at a time (the store thread unless given; the
        simulator's runs them on its virtual loop, ``tests/sim/virtual_loop.py``).
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
        self.transient = TransientTopics(config.limits.subscribe_batch_max_events * 10)
        self.push = PushDelivery(self)  # runs while master, from the epoch start's commit
        self.links = LinkForwarding(self)  # likewise
        self._committed = asyncio.Event()
        # Set (and replaced) whenever a role command was applied or the role was lost.
        self._role_changed = asyncio.Event()
        self._io: concurrent.futures.Executor = io or concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"store-{node.id}"
        )
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
            lambda: self.config,
            self.core,
            self.driver,
            lambda: self._driver,
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
            lambda: self.config,
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
        # Taking the master role: the reorganization fetch, the epoch start (taking_master.py).
        self.taking = TakingMaster(
            node,
            lambda: self.config,
            lambda: self._nodes,
            self.core,
            self.driver,
            transport=lambda: self._new_transport(),
            clock=self.clock,
            io=self._io,
            commit_lock=self._commit_lock,
            observability=self.telemetry,
            truncate_by_snapshot=truncator is None,
            persist_role=self._persist_role,
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
        self.writer.start()
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
        await self.taking.cancel(f"replica {self.node.id} stopping")
        if self._instruments is not None:
            self._instruments.unwatch(self)
        if self._driver is not None:
            await self._driver.stop(f"replica {self.node.id} stopping")
            self._driver = None
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
        if taking.task.done() and self.taking.current is taking:
            self.taking.observe()
            self.taking.current = None
            self.driver.taking_answer(taking.epoch)

    async def _apply_role(self, command: replica_pb2.RoleCommand) -> Taking | None:
        """Applies a role command as the core decides; returns the task taking a master
        role, if any."""
        await self.taking.wait_stopped()
        self.taking.observe()
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
        taking = self.taking.current
        if self.core.taking is None and taking is not None and taking.task.done():
            self.taking.current = None  # its outcome answered this command
        return await self.apply_effects(effects)

    async def apply_effects(self, effects: Effects) -> Taking | None:
        """Carries out what the core decided (the driver's ``role_steps``, in the order
        ``Effects`` documents), doing each step it leaves to this shell; returns the task
        taking (or already taking) a master role, if any."""
        taking: Taking | None = None
        for step in self.driver.role_steps(effects):
            match step:
                case CancelTaking(why):
                    await self.taking.cancel(why)
                case DropRole(reason, was_active):
                    await self._drop_role(reason, was_active=was_active)
                case StartTaking(take):
                    taking = self.taking.start(take)
                case PersistRole(write):
                    try:
                        await self._persist_role(write)
                    except ServiceError as refusal:
                        if refusal.code == Code.RESOURCE_EXHAUSTED:
                            # No role on an epoch the store does not hold; the coordinator
                            # asks again, and the role is taken once the write fits.
                            await self.deactivate(refusal.message)
                        raise
                case FollowMaster(follow):
                    await self._become_slave(follow)
                case JoinTaking():
                    taking = self.taking.current
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

    async def _persist_role(self, persist: Callable[[], T]) -> T:
        """Runs a role's flushed store writes (its epoch, the DIRTY mark) on the store
        thread, serialized with every other write. A flush also writes out every unsynced
        append before it (a slave's WRITE_NO_SYNC batches): on a busy disk that outlasts
        the coordinator's replica_timeout_ms, and the event loop must keep answering its
        role renewals and health probes meanwhile (issue 14).

        A store that cannot persist the role's epoch must not hold it (nor acknowledge
        anything again): the replica fail-stops and the command is refused, UNAVAILABLE
        naming the store's error (found by tests/sim/shell_sim.py: it escaped SetRole as
        an unexpected exception and left the role held on an unpersisted epoch)."""
        async with self._commit_lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._io, persist)
            except StoreFullError as exc:
                # Nothing was written and space may come back (as a full store refuses a
                # batch): the role is refused, the replica keeps serving what it can.
                raise ServiceError(
                    Code.RESOURCE_EXHAUSTED,
                    f"replica {self.node.id} could not persist its new role: store full "
                    f"({exc}); its store still at epoch {self.epoch}",
                ) from exc
            except StoreError as exc:
                epoch = self.epoch  # the one its store holds (the new role's is not stored)
                self._fail_stop(f"store write failed persisting a new role: {exc}")
                raise ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self.node.id} could not persist its new role (store write "
                    f"failed: {exc}); it stopped serving, its store still at epoch {epoch}",
                ) from exc

    async def drain_writes(self) -> None:
        """Waits until every write queued now has finished (committed or failed) and no
        batch is being written."""
        await self.writer.drain()

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
        await self.taking.wait_stopped()
        self.writer.fail_queued(
            ServiceError(
                Code.UNAVAILABLE,
                f"replica {self.node.id} lost its role before the write began (not stored)",
            )
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

    def _set_master(self, driver: MasterDriver) -> None:
        """The master's replication of the epoch just taken (taking_master.py)."""
        self._driver = driver

    def _epoch_started(self, epoch: int) -> None:
        """The epoch start committed and this node is still its master: everything before
        it is committed, so push delivery and topic links start."""
        self.push.start(epoch)
        self.links.start(epoch)

    def _master_deposed(self, reason: str) -> None:
        """The replication core deposed this master: no more writes in this epoch."""
        self.push.stop()
        self.links.stop()
        self._driver = None
        self.writer.wake()
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

    async def _watch_lease(self) -> None:
        """Ticks the core, which drops the role when the coordinator stops renewing it
        (e.g. it died)."""
        while True:
            await asyncio.sleep(_LEASE_CHECK_S)
            effects = self.core.tick(self.clock.monotonic_ms())
            if effects.drop_role:
                await self.apply_effects(effects)

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
