"""The replica node: its role and epoch, the group-commit writer, and committed reads.

All writes go through one writer task. It drains every command waiting (up to a bounded
batch), plans them with a `BatchBuilder`, appends the whole batch to the store in one
transaction on a dedicated thread (so fsync never blocks the event loop), and only then
answers the callers: a publish is acknowledged once it is durable under the master's
sync policy. Readers see only what the writer has committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections import deque
from dataclasses import dataclass

import grpc

from services.common.clock import Clock, SystemClock
from services.common.config import ClusterConfig, NodeConfig
from services.common.errors import Code, ServiceError
from services.common.grpc_server import channel_options
from services.replica import commands
from services.replica.commands import BatchBuilder, Command, Planned
from services.replica.store import (
    CorruptRecordError,
    Store,
    StoreError,
    StoreFullError,
    TopicInfo,
)
from services.replica.transient import TransientTopics
from squall.v1 import broker_pb2, common_pb2, replica_pb2, replica_pb2_grpc

log = logging.getLogger("squall.replica")

# The master answers with this metadata key when a write reaches a non-master.
MASTER_ADDRESS_KEY = "squall-master-address"


@dataclass
class _Pending:
    command: Command
    future: asyncio.Future[Planned]


class ReplicaNode:
    """One node's replica: owns the store, takes roles, serializes and commits writes."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeConfig,
        store: Store,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self.store = store
        self.clock = clock or SystemClock()
        self.role = common_pb2.ROLE_INACTIVE
        self.epoch = store.meta().epoch
        self.master: NodeConfig | None = None
        self.failed_reason = ""
        self.transient = TransientTopics(config.limits.subscribe_batch_max_events * 10)
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._committed = asyncio.Event()
        self._io = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"store-{node.id}"
        )
        self._writer: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._last_lsn = store.meta().last_lsn
        # Held while a batch is being written, so a deactivation can wait for it and then
        # report a log that no longer grows.
        self._commit_lock = asyncio.Lock()
        # The seq of the last role command applied, and when the role lapses unless renewed.
        self.command_seq = 0
        self._lease_until_ms = 0
        self._learner: asyncio.Task[None] | None = None
        # A role is taken afresh only in an epoch above every epoch this store has held a
        # role in: a replica that restarted or dropped its role must not resume an epoch
        # whose group may have moved on without it.
        self._role_epoch_floor = store.meta().epoch

    # --- lifecycle and roles

    async def start(self) -> None:
        """Starts the writer and the lease watch; the role comes from the coordinator."""
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

    async def stop(self) -> None:
        """Stops the writer and fails anything still queued as indeterminate."""
        for task in (self._lease_task, self._writer, self._learner):
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

    async def become_master(self, epoch: int, *, reason: str) -> None:
        """Takes the master role in `epoch`: persists the epoch, then writes its start."""
        meta = self.store.meta()
        if self.role == common_pb2.ROLE_MASTER and epoch == self.epoch:
            return  # a renewal of the role it holds
        if epoch < meta.epoch:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"epoch {epoch} is older than this replica's epoch {meta.epoch}",
            )
        if not meta.cluster_id:
            cluster_id = uuid.uuid4().hex
            self.store.set_cluster_id(cluster_id)
            log.info("replica %s: new cluster id %s", self.node.id, cluster_id)
        self.store.set_state(common_pb2.STORE_STATE_DIRTY)
        self.store.set_epoch(epoch)
        self.epoch = epoch
        self.role = common_pb2.ROLE_MASTER
        self.master = self.node
        await self._submit(commands.StartEpoch(epoch=epoch, master_id=self.node.id))
        log.info(
            "replica %s is master: epoch=%d lsn=%d reason=%s",
            self.node.id,
            epoch,
            self._last_lsn,
            reason,
        )

    # --- writes

    def check_writable(self) -> None:
        if self.failed_reason:
            raise ServiceError(
                Code.UNAVAILABLE,
                f"replica {self.node.id} stopped serving writes: {self.failed_reason}",
            )
        if self.role == common_pb2.ROLE_MASTER:
            return
        if self.role == common_pb2.ROLE_SLAVE and self.master is not None:
            raise ServiceError(
                Code.UNAVAILABLE,
                f"replica {self.node.id} is a slave; the master is {self.master.id} "
                f"at {self.master.replica_address}",
                metadata=((MASTER_ADDRESS_KEY, self.master.replica_address),),
            )
        raise ServiceError(
            Code.UNAVAILABLE, f"replica {self.node.id} has no role yet (no master elected)"
        )

    def _submit(self, command: Command) -> asyncio.Future[Planned]:
        """Queues a command for the writer; the future resolves once it committed."""
        future: asyncio.Future[Planned] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(command, future))
        self._wakeup.set()
        return future

    async def write(self, command: Command) -> Planned:
        """Commits one command on the master and returns what it produced."""
        self.check_writable()
        return await self._submit(command)

    def start_publish(
        self, request: broker_pb2.PublishRequest
    ) -> asyncio.Future[list[common_pb2.AckReceipt]]:
        """Queues a publish without waiting, so pipelined requests keep their order.

        The future resolves to the receipts once the events are durable (replicated
        topics) or handed to live subscribers (transient topics).
        """
        self.check_writable()
        topic = self.topic(request.topic)
        loop = asyncio.get_running_loop()
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            commands.check_publish_limits(request, self.config.limits)
            done: asyncio.Future[list[common_pb2.AckReceipt]] = loop.create_future()
            done.set_result(
                self.transient.publish(
                    request, epoch=self.epoch, now_ms=self.clock.wall_ms(), master_id=self.node.id
                )
            )
            self._notify_committed()
            return done
        planned = self._submit(commands.Publish(request))
        return asyncio.ensure_future(_receipts(planned))

    async def apply_role(self, command: replica_pb2.RoleCommand) -> None:
        """Takes (or renews) the role the coordinator commands.

        Replication itself comes with the replication issue; until then a slave refuses
        writes with a redirect to its master and serves committed reads.
        """
        role = command.role
        if role not in (common_pb2.ROLE_MASTER, common_pb2.ROLE_SLAVE, common_pb2.ROLE_INACTIVE):
            raise ServiceError(Code.INVALID_ARGUMENT, f"unknown role {role}")
        stored_epoch = self.store.meta().epoch
        if role != common_pb2.ROLE_INACTIVE and command.epoch < stored_epoch:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"role command for epoch {command.epoch} is older than replica "
                f"{self.node.id}'s epoch {stored_epoch}",
            )
        master: NodeConfig | None = None
        if role == common_pb2.ROLE_SLAVE:
            master = next((n for n in self.config.nodes if n.id == command.master.node_id), None)
            if master is None:
                raise ServiceError(
                    Code.INVALID_ARGUMENT, f"unknown master node id '{command.master.node_id}'"
                )
        renewal = role == self.role and (
            role == common_pb2.ROLE_INACTIVE or command.epoch == self.epoch
        )
        if (
            not renewal
            and role != common_pb2.ROLE_INACTIVE
            and command.epoch <= self._role_epoch_floor
        ):
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node.id} does not hold a role in epoch {command.epoch} (it "
                f"restarted or dropped it); it takes a new role only in an epoch above "
                f"{self._role_epoch_floor}",
            )
        self.command_seq = command.seq
        self._lease_until_ms = (
            self.clock.monotonic_ms() + command.lease_ms if command.lease_ms else 0
        )
        if renewal:
            return
        if role == common_pb2.ROLE_MASTER:
            await self.become_master(command.epoch, reason=command.reason or "elected")
            return
        if role == common_pb2.ROLE_INACTIVE:
            await self.deactivate(command.reason or "coordinator")
            return
        self.store.set_epoch(command.epoch)
        self.epoch = command.epoch
        self.role = common_pb2.ROLE_SLAVE
        self.master = master
        if not self.store.meta().cluster_id and master is not None:
            self._learner = asyncio.create_task(self._learn_cluster_id(master, command.epoch))
        log.info(
            "replica %s follows %s: epoch=%d lsn=%d reason=%s",
            self.node.id,
            command.master.node_id,
            self.epoch,
            self._last_lsn,
            command.reason,
        )

    async def deactivate(self, reason: str) -> None:
        """Stops serving writes; returns once no write is in progress, so the log is final."""
        was = self.role
        self._role_epoch_floor = max(self._role_epoch_floor, self.epoch)
        self.role = common_pb2.ROLE_INACTIVE
        self.master = None
        self._lease_until_ms = 0
        while self._queue:  # never started: definitely not stored
            pending = self._queue.popleft()
            if not pending.future.done():
                pending.future.set_exception(
                    ServiceError(
                        Code.UNAVAILABLE,
                        f"replica {self.node.id} lost its role before the write began (not stored)",
                    )
                )
        async with self._commit_lock:
            pass
        if was != common_pb2.ROLE_INACTIVE:
            log.info(
                "replica %s inactive: epoch=%d lsn=%d reason=%s",
                self.node.id,
                self.epoch,
                self._last_lsn,
                reason,
            )

    async def _learn_cluster_id(self, master: NodeConfig, epoch: int) -> None:
        """Adopts the master's cluster id: an empty store joins the cluster it follows.

        The replication stream's hello will carry the id once replication lands; until then
        a slave asks its master, so a later failover keeps one cluster id.
        """
        options = channel_options(self.config.limits.max_message_bytes)
        async with grpc.aio.insecure_channel(master.replica_address, options=options) as channel:
            stub = replica_pb2_grpc.ReplicaControlStub(channel)
            for _ in range(600):  # ~1 minute, then the next role command tries again
                if self.role != common_pb2.ROLE_SLAVE or self.epoch != epoch:
                    return
                try:
                    state = await stub.GetReplicaState(
                        replica_pb2.GetReplicaStateRequest(), timeout=1.0
                    )
                except grpc.aio.AioRpcError:
                    state = None
                if state is not None and state.cluster_id:
                    if not self.store.meta().cluster_id:
                        self.store.set_cluster_id(state.cluster_id)
                        log.info(
                            "replica %s joined cluster %s (from master %s, epoch=%d)",
                            self.node.id,
                            state.cluster_id,
                            master.id,
                            epoch,
                        )
                    return
                await asyncio.sleep(0.1)

    async def _watch_lease(self) -> None:
        """Drops the role when the coordinator stops renewing it (e.g. it died)."""
        while True:
            await asyncio.sleep(0.05)
            if self._lease_until_ms and self.clock.monotonic_ms() > self._lease_until_ms:
                await self.deactivate("role lease expired: no word from the coordinator")

    async def _write_loop(self) -> None:
        max_commands = self.config.limits.commit_batch_max_entries
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(max_commands, len(self._queue)))]
                async with self._commit_lock:
                    await self._commit(batch)

    async def _commit(self, batch: list[_Pending]) -> None:
        if self.role != common_pb2.ROLE_MASTER:
            _fail_all(
                [(p, Planned(None)) for p in batch],
                ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self.node.id} lost its role before the write began (not stored)",
                ),
            )
            return
        builder = BatchBuilder(
            self.store,
            limits=self.config.limits,
            node_id=self.node.id,
            epoch=self.epoch,
            next_lsn=self._last_lsn + 1,
            now_ms=self.clock.wall_ms(),
        )
        planned: list[tuple[_Pending, Planned]] = []
        for pending in batch:
            if pending.future.done():
                continue  # the caller gave up (cancelled) before the write began
            try:
                planned.append((pending, builder.add(pending.command)))
            except ServiceError as exc:
                pending.future.set_exception(exc)
            except CorruptRecordError as exc:
                pending.future.set_exception(ServiceError(Code.DATA_LOSS, str(exc)))
        if builder.entries:
            sync = self.config.durability.master_sync == common_pb2.SYNC_POLICY_SYNC
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._io, lambda: self.store.append(builder.entries, sync=sync)
                )
            except StoreFullError as exc:
                log.warning(
                    "replica %s: store full, %d entries refused: epoch=%d lsn=%d: %s",
                    self.node.id,
                    len(builder.entries),
                    self.epoch,
                    self._last_lsn,
                    exc,
                )
                error = ServiceError(
                    Code.RESOURCE_EXHAUSTED,
                    f"store of replica {self.node.id} is full (map_size_bytes="
                    f"{self.config.limits.map_size_bytes}); the write was not stored",
                )
                _fail_all(planned, error)
                return
            except StoreError as exc:
                self._fail_stop(f"store write failed: {exc}")
                _fail_all(planned, ServiceError(Code.UNKNOWN, f"write outcome unknown: {exc}"))
                return
            self._last_lsn = builder.entries[-1].lsn
        # Every receipt gets the same master and holders; merging their serialized form is
        # one protobuf call per receipt instead of two (a publish has a receipt per event).
        stamp = common_pb2.AckReceipt(
            master_id=self.node.id,
            holders=[
                common_pb2.ReplicaDurability(
                    node_id=self.node.id, durability=self.config.durability.master_sync
                )
            ],
        ).SerializeToString()
        for pending, plan in planned:
            for receipt in plan.receipts:
                receipt.MergeFromString(stamp)
            if not pending.future.done():
                pending.future.set_result(plan)
        self._notify_committed()

    def _fail_stop(self, reason: str) -> None:
        """A store that cannot write must not acknowledge anything again."""
        log.error(
            "replica %s FAIL-STOP: %s (epoch=%d lsn=%d)",
            self.node.id,
            reason,
            self.epoch,
            self._last_lsn,
        )
        self.failed_reason = reason
        self.role = common_pb2.ROLE_INACTIVE

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
        """The LSN of the last committed entry."""
        return self._last_lsn


async def _receipts(planned: asyncio.Future[Planned]) -> list[common_pb2.AckReceipt]:
    return (await planned).receipts


def _fail_all(planned: list[tuple[_Pending, Planned]], error: ServiceError) -> None:
    for pending, _ in planned:
        if not pending.future.done():
            pending.future.set_exception(error)
