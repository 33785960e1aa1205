"""The replica node: the adapter the servicers, the coordinator's reports and the master's
work (push delivery, topic links) talk to, over the replica's pure core, its synchronous
driver and the asyncio shells that do the waiting. ``assembly.build_replica_node`` makes
and wires them; this module only holds them and answers for them.

The synchronous ``ReplicaDriver`` (``driver.py``, ``driver``) owns the store and the
commit gate and applies the pure ``ReplicaCore``'s effects (``core``). The asyncio work
around it lives in small classes, each given what it uses (the driver, the commit lock,
the store thread, the clock, a fault callback), not the node:

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
  set, the lease watch). What a role command replaces while the node runs (the
  configuration in force, its nodes, the master's ``MasterDriver``) is the
  ``NodeState`` (``state``) this node shares with them.

The master's work (``MasterWork``: ``PushDelivery``, ``LinkForwarding``) is made here,
given this node through the narrow protocols of ``endpoints.py``; the servicers see the
node through those and ``control_endpoints.py``.

Roles: every role rule (role, epoch floor, lease, taking and dropping roles, the shutdown
freeze, the hand-off fence, which writes are refused) is decided by ``ReplicaCore``;
``RoleApplication`` feeds it role commands and ticks and carries out the ``Effects`` it
returns in their documented order; ``apply_role``, ``apply_effects`` and
``wait_for_role`` here delegate to it.

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
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.loss_record import LossRecord
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.telemetry import Telemetry
from squall_server.replica import commands
from squall_server.replica.commands import Command, Planned
from squall_server.replica.committed import reopen_gate
from squall_server.replica.core import Effects, ReplicaCore
from squall_server.replica.core_view import CoreView
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.faults import Fault, FaultReports
from squall_server.replica.links import LinkForwarding
from squall_server.replica.master_driver import SlaveStatus
from squall_server.replica.master_tasks import MasterWork
from squall_server.replica.push import PushDelivery
from squall_server.replica.reorg import Taking
from squall_server.replica.roles import NodeState, RoleApplication
from squall_server.replica.signals import CommitSignal
from squall_server.replica.slave_side import BatchAcks, SlaveSide
from squall_server.replica.store import CorruptRecordError, TopicInfo
from squall_server.replica.store.stall import StallMeter
from squall_server.replica.sync_source import SyncSource
from squall_server.replica.taking_master import TakingMaster
from squall_server.replica.telemetry import PublishedTraces, PublishWatch, ReplicaInstruments
from squall_server.replica.transient import TransientTopics
from squall_server.replica.truncation import Truncation
from squall_server.replica.writer import Writer, cancel_with, pass_receipt

log = logging.getLogger("squall.replica")

# Request metadata from a publisher proxy: the replica addresses it just failed to reach,
# comma-separated, so this replica does not redirect it back to a dead master.
UNREACHABLE_KEY = "squall-unreachable"
# A joined request's part with no outcome: a bug (every part is answered), told as one.
_UNANSWERED = AssertionError("a part of a joined request was not answered")


@dataclass(eq=False, repr=False)
class ReplicaNode(CoreView):
    """One node's replica: owns the store, takes roles, serializes and commits writes
    (made by ``assembly.build_replica_node``)."""

    node: NodeConfig
    clock: Clock
    # The configuration in force, its nodes and the master's replication (roles.py).
    state: NodeState
    # The node ids the server's call guards accept (the running node set moves them).
    running_nodes: RunningNodes
    core: ReplicaCore  # the role rules, the log's position and commit-LSN record
    driver: ReplicaDriver  # the store and the commit gate (CoreView reads through it)
    telemetry: Telemetry
    instruments: ReplicaInstruments | None  # the replica's metrics, if metering
    published_traces: PublishedTraces  # traced publishes, for delivery spans to link to
    transient: TransientTopics
    faults: FaultReports  # the fault that makes this node unfit to serve, if any
    committed: CommitSignal
    stall: StallMeter  # how long the store's oldest write in progress has run
    io: concurrent.futures.Executor  # the store thread
    # Held while a batch, a truncation, an install or a role's store write runs.
    commit_lock: asyncio.Lock
    writer: Writer
    truncation: Truncation
    sync_source: SyncSource
    slave: SlaveSide
    taking: TakingMaster
    roles: RoleApplication
    master_work: MasterWork  # push delivery and topic links, while master
    # How the process is stopped once a cluster shutdown finished (shutdown.py).
    on_shutdown: Callable[[], None] | None = None
    push: PushDelivery = field(init=False)
    links: LinkForwarding = field(init=False)
    _lease_task: asyncio.Task[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # The master's work reads and writes through this node (endpoints.py names what).
        self.push = PushDelivery(self)
        self.links = LinkForwarding(self)
        self.master_work.attach(self.push, self.links)

    # --- the store, the commit gate, the role, epoch and log bounds: CoreView's

    def store_stalled_ms(self) -> int:
        """How long the store's oldest write in progress has run (0: none is)."""
        return self.stall.stalled_ms()

    @property
    def master(self) -> NodeConfig | None:
        """The master of this replica's epoch while it holds a role, else None."""
        return self.state.nodes.get(self.core.master_id)

    @property
    def failed_reason(self) -> str:
        """Why this replica fail-stopped (empty: it did not)."""
        return self.core.failed_reason

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

    def freeze_remaining_ms(self) -> int:
        """While frozen and not finished: the ms until the freeze lapses (0 otherwise)."""
        core = self.core
        if not core.frozen_for or core.shutdown_finished:
            return 0
        return max(0, core.frozen_until_ms - self.clock.monotonic_ms())

    async def start(self) -> None:
        """Starts the writer and the lease watch; the role comes from the coordinator."""
        try:
            self.gate = await asyncio.get_running_loop().run_in_executor(
                self.io, reopen_gate, self.store, self.node.id, "start-up"
            )
        except CorruptRecordError as exc:
            self.driver.gate_unreadable(exc, "start-up")
        if self.instruments is not None:
            self.instruments.watch(self)
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

    async def stop(self) -> None:
        """Stops the writer and fails anything still queued as indeterminate."""
        await self.master_work.close()
        await self.taking.cancel(f"replica {self.node.id} stopping")
        if self.instruments is not None:
            self.instruments.unwatch(self)
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
        self.io.shutdown(wait=True)

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

    def send_riding_writes(self) -> None:
        """Writes waiting to ride with the next commit batch go now (a fenced master's
        log must stop growing)."""
        self.writer.release_riders()

    async def write_with_next(self, command: Command, within_s: float) -> Planned:
        """Commits one command on the master with the next commit batch, or alone once
        within_s passed (``Writer.submit_with_next``)."""
        self.check_writable()
        return await self.writer.submit_with_next(command, within_s)

    def start_publish(
        self,
        request: broker_pb2.PublishRequest,
        trace: PublishWatch | None = None,
    ) -> asyncio.Future[common_pb2.BatchReceipt]:
        """Queues a publish without waiting, so pipelined requests keep their order.

        The future resolves to the batch's receipt once the events are durable (replicated
        topics) or handed to live subscribers (transient topics). A traced publish's
        `trace` hears when its entry is appended.
        """
        planned = self.begin_publish(request, trace)
        # Chained by callbacks, not a task: one publish at a time pays no task per event.
        receipt: asyncio.Future[common_pb2.BatchReceipt] = (
            asyncio.get_running_loop().create_future()
        )
        planned.add_done_callback(functools.partial(pass_receipt, receipt))
        receipt.add_done_callback(functools.partial(cancel_with, planned))
        return receipt

    def begin_publish(
        self,
        request: broker_pb2.PublishRequest,
        trace: PublishWatch | None = None,
        *,
        alone: bool = False,
    ) -> asyncio.Future[Planned]:
        """``start_publish`` without the receipt's own future: the writer's future, which
        resolves to the plan (its ``receipt``; cancelling it gives the write up). The
        publish servicer's path: a future, two callbacks and a loop turn fewer per publish
        (issue 16). ``alone``: the caller has no other publish in flight (a lone
        publisher), so the write may begin at once (``Writer.submit``)."""
        self.check_writable()
        topic = self.topic(request.topic)
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            commands.check_publish_limits(request, self.config.limits)
            done: asyncio.Future[Planned] = asyncio.get_running_loop().create_future()
            done.set_result(
                Planned(
                    None,
                    receipt=self.transient.publish(
                        request,
                        topic_id=topic.topic_id,
                        epoch=self.epoch,
                        now_ms=self.clock.wall_ms(),
                        master_id=self.node.id,
                    ),
                )
            )
            self.committed.notify()
            return done
        return self.writer.submit(commands.Publish(request), trace=trace, alone=alone)

    def start_publish_parts(
        self, parts: Sequence[broker_pb2.PublishRequest]
    ) -> asyncio.Future[list[common_pb2.BatchReceipt | BaseException]]:
        """Queues a joined request's parts (``PublishRequest.parts``) without waiting, as
        one write: each part is published as ``start_publish`` would (its topic looked up,
        a transient topic's part handed to its subscribers at once) and fails alone.

        The future resolves, once every replicated part has committed or failed, to each
        part's receipt or error, in order. Untraced: a traced request's parts take
        ``start_publish`` one by one (a span each).
        """
        loop = asyncio.get_running_loop()
        outcomes: list[common_pb2.BatchReceipt | BaseException | None] = [None] * len(parts)
        replicated: list[int] = []
        try:
            self.check_writable()
        except ServiceError as exc:
            outcomes = [exc] * len(parts)
            parts = ()
        topics: dict[str, TopicInfo | BaseException] = {}
        transient = False
        for index, part in enumerate(parts):
            topic = topics.get(part.topic)
            if topic is None:
                topic = topics[part.topic] = self._part_topic(part.topic)
            if isinstance(topic, BaseException):
                outcomes[index] = topic
            elif topic.kind != common_pb2.TOPIC_KIND_TRANSIENT:
                replicated.append(index)
            else:
                transient = True
                try:
                    commands.check_publish_limits(part, self.config.limits)
                    outcomes[index] = self.transient.publish(
                        part,
                        topic_id=topic.topic_id,
                        epoch=self.epoch,
                        now_ms=self.clock.wall_ms(),
                        master_id=self.node.id,
                    )
                except ServiceError as exc:
                    outcomes[index] = exc
        if transient:
            self.committed.notify()
        done: asyncio.Future[list[common_pb2.BatchReceipt | BaseException]] = loop.create_future()
        if not replicated:
            done.set_result([o if o is not None else _UNANSWERED for o in outcomes])
            return done
        # A commit batch fits one replication message (``commit_batch_max_entries``): a
        # longer request is queued as consecutive writes of at most that many parts.
        size = self.config.limits.commit_batch_max_entries
        pieces = [replicated[i : i + size] for i in range(0, len(replicated), size)]
        planned = [
            self.writer.submit(commands.PublishParts(tuple(parts[i] for i in piece)))
            for piece in pieces
        ]
        left = [len(planned)]

        def settle(piece: list[int], ended: asyncio.Future[Planned]) -> None:
            if done.done():
                return  # the caller gave up
            if ended.cancelled():
                done.cancel()
                return
            error = ended.exception()
            part_plans = None if error is not None else ended.result().parts
            for position, index in enumerate(piece):
                if error is not None:
                    outcomes[index] = error
                    continue
                if part_plans is None:
                    outcomes[index] = AssertionError("a joined request's plan has its parts")
                    continue
                outcome = part_plans[position]
                receipt = None if outcome.plan is None else outcome.plan.receipt
                outcomes[index] = (
                    outcome.error
                    if outcome.error is not None
                    else receipt
                    if receipt is not None
                    else AssertionError("a planned publish always has a receipt")
                )
            left[0] -= 1
            if not left[0]:
                done.set_result([o if o is not None else _UNANSWERED for o in outcomes])

        for piece, future in zip(pieces, planned, strict=True):
            future.add_done_callback(functools.partial(settle, piece))

        def cancelled(ended: asyncio.Future[list[common_pb2.BatchReceipt | BaseException]]) -> None:
            if ended.cancelled():
                for future in planned:
                    future.cancel()

        done.add_done_callback(cancelled)
        return done

    def _part_topic(self, name: str) -> TopicInfo | BaseException:
        """A joined request's part's topic, or why it cannot be published to (the part
        fails alone: an unknown topic, or a checksum error, which is also a fault)."""
        try:
            return self.topic(name)
        except ServiceError as exc:
            return exc
        except CorruptRecordError as exc:
            self.report_fault(f"checksum error serving a read: {exc}")
            return ServiceError(Code.DATA_LOSS, f"corrupt record, not served: {exc}")

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

    async def wait_for_role(self, unreachable: frozenset[str], timeout_s: float) -> None:
        """Waits (up to timeout_s) while this replica can neither serve a write nor name a
        master the caller can reach (``RoleApplication.wait_for_role``)."""
        await self.roles.wait_for_role(unreachable, timeout_s)

    @property
    def config(self) -> ClusterConfig:
        """The configuration in force (a membership change's running node set replaces
        the config file's nodes)."""
        return self.state.config

    async def drain_writes(self) -> None:
        """Waits until every write queued now has finished (committed or failed) and no
        batch is being written."""
        await self.writer.drain()

    async def store_write(self, write: Callable[[], None]) -> None:
        """Runs one store write on the store thread, serialized with every other write."""
        async with self.commit_lock:
            await asyncio.get_running_loop().run_in_executor(self.io, write)

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

    async def replication_batch_acks(self, stream: int, batch: replica_pb2.EntryBatch) -> BatchAcks:
        """Checks and stores one batch from the master: the acks due on receipt, and those
        due once stored or the task storing it (``SlaveSide.batch_acks``)."""
        return await self.slave.batch_acks(stream, batch)

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

    def report_fault(self, reason: str) -> None:
        """Records a fault that makes this node unfit to serve (``FaultReports.report``):
        the coordinator reads it in the replica's state and quarantines the node."""
        self.faults.report(reason)

    @property
    def fault(self) -> Fault | None:
        """The fault this node reports, if any (faults.py)."""
        return self.faults.fault

    @property
    def losses(self) -> tuple[LossRecord, ...]:
        """Loss reports beside the store (acknowledged entries this node discarded),
        reported to the coordinator in every ReplicaState (truncation.py)."""
        return self.truncation.losses

    def writes_idle(self) -> bool:
        """No write queued or being committed (a fenced master's log has stopped growing)."""
        return self.writer.idle()

    def commit_signal(self) -> asyncio.Event:
        """An event set at the next commit (take it before reading, then wait on it)."""
        return self.committed.signal()

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Holds a following read open: while any is, a slave's acks say so and its
        master tells it each commit at once."""
        self.driver.follow_started()
        try:
            yield
        finally:
            self.driver.follow_ended()

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

    def quorum_silent_ms(self) -> int:
        """As master: how long it has not heard from enough slaves to commit; else 0."""
        driver = self.state.master
        if driver is None or self.role != common_pb2.ROLE_MASTER:
            return 0
        return driver.quorum_silent_ms()

    @property
    def commit_lsn(self) -> int:
        """The highest LSN committed reads serve here."""
        return self.gate.commit_lsn

    def visible_end(self, topic: str) -> int | None:
        """The first offset of topic that committed reads may not serve yet (None: none;
        0 hides the whole topic); UNAVAILABLE when this replica serves no reads."""
        if self.driver.reads_refused:
            raise ServiceError(
                Code.UNAVAILABLE,
                f"replica {self.node.id} serves no reads: {self.driver.reads_refused}",
            )
        return self.gate.hidden_from(topic)
