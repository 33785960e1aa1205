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

from services.common.clock import Clock, SystemClock
from services.common.config import ClusterConfig, NodeConfig
from services.common.errors import Code, ServiceError
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
from squall.v1 import broker_pb2, common_pb2, replica_pb2

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
        self._last_lsn = store.meta().last_lsn

    # --- lifecycle and roles

    async def start(self) -> None:
        """Starts the writer; a one-node cluster's replica makes itself master."""
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.node.id}")
        meta = self.store.meta()
        log.info(
            "replica %s opened store: cluster_id=%s epoch=%d last_lsn=%d",
            self.node.id,
            meta.cluster_id or "-",
            meta.epoch,
            meta.last_lsn,
        )
        if len(self.config.nodes) == 1:
            await self.become_master(meta.epoch + 1, reason="single-node cluster")

    async def stop(self) -> None:
        """Stops the writer and fails anything still queued as indeterminate."""
        if self._writer is not None:
            self._writer.cancel()
            try:
                await self._writer
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
        if epoch <= meta.epoch and self.role == common_pb2.ROLE_MASTER and epoch == self.epoch:
            return
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
        """Takes the role the coordinator commands (replication itself comes later)."""
        if command.epoch < self.store.meta().epoch:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"role command for epoch {command.epoch} is older than this replica's "
                f"epoch {self.store.meta().epoch}",
            )
        if command.role == common_pb2.ROLE_MASTER:
            await self.become_master(command.epoch, reason=command.reason or "elected")
            return
        if command.role == common_pb2.ROLE_SLAVE:
            master = next((n for n in self.config.nodes if n.id == command.master.node_id), None)
            if master is None:
                raise ServiceError(
                    Code.INVALID_ARGUMENT, f"unknown master node id '{command.master.node_id}'"
                )
            self.store.set_epoch(command.epoch)
            self.epoch = command.epoch
            self.role = common_pb2.ROLE_SLAVE
            self.master = master
        elif command.role == common_pb2.ROLE_INACTIVE:
            self.role = common_pb2.ROLE_INACTIVE
            self.master = None
        else:
            raise ServiceError(Code.INVALID_ARGUMENT, f"unknown role {command.role}")
        log.info(
            "replica %s role=%s epoch=%d lsn=%d reason=%s",
            self.node.id,
            common_pb2.Role.Name(self.role),
            self.epoch,
            self._last_lsn,
            command.reason,
        )

    async def _write_loop(self) -> None:
        max_commands = self.config.limits.commit_batch_max_entries
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(max_commands, len(self._queue)))]
                await self._commit(batch)

    async def _commit(self, batch: list[_Pending]) -> None:
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
        holders = [
            common_pb2.ReplicaDurability(
                node_id=self.node.id, durability=self.config.durability.master_sync
            )
        ]
        for pending, plan in planned:
            for receipt in plan.receipts:
                receipt.master_id = self.node.id
                receipt.holders.extend(holders)
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
