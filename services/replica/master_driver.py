"""The master's replication driver: real streams, clock and store around ReplicationMaster.

One ``MasterDriver`` lives for one master epoch (as its core does). It opens one
bidirectional ``Replication.Replicate`` stream per member slave (grpc.aio client,
reconnecting with bounded backoff while this node is master), feeds the core every
input (local appends, client writes, Positions, acks, broken streams, ticks) and applies
each ``Actions`` record in the order ``replication.Actions`` documents: rejection,
sends (build the batch, ``on_sent``, queue it on the stream), snapshots, heartbeats,
completed writes, failed writes, deposition, log lines. Actions returned by ``on_sent``
are applied after the record that produced them, in order, so no recursion grows with
the window.

Everything runs on the node's event loop: inputs are applied one at a time. A stream's
outgoing messages go through its own queue and writer task, so applying an Actions
record never waits on the network; the queue is bounded by the core's in-flight window
(plus one heartbeat per tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from services.common.clock import Clock
from services.common.config import ClusterConfig, NodeConfig
from services.common.errors import Code, ServiceError
from services.common.grpc_server import channel_options
from services.replica.commands import Planned
from services.replica.replication import (
    Actions,
    RejectCode,
    ReplicationMaster,
    SendGrant,
    SyncPolicy,
    batch_size_bytes,
    fit_batch,
)
from services.replica.store import Store
from squall.v1 import common_pb2, replica_pb2, replica_pb2_grpc

log = logging.getLogger("squall.replica")

_Call = grpc.aio.StreamStreamCall[replica_pb2.ReplicateRequest, replica_pb2.ReplicateResponse]

# Trailing metadata key on a slave's refusal: the slave's epoch, so a stale master steps down.
EPOCH_KEY = "squall-epoch"
# Reconnect backoff to a slave: fast at first (failover time depends on it), bounded.
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
# Recently appended entries kept in memory, so streaming to an up-to-date slave does not
# read the store; older entries (catch-up) are read from the store.
_TAIL_CACHE_ENTRIES_MAX = 4096


@dataclass(eq=False)
class Waiting:
    """A client write waiting for its entry to commit (the core's token)."""

    future: asyncio.Future[Planned]
    plan: Planned
    lsn: int


@dataclass(eq=False)
class _Link:
    """One member slave's stream."""

    node: NodeConfig
    channel: grpc.aio.Channel
    stream_id: int = 0
    outbox: asyncio.Queue[replica_pb2.ReplicateRequest] = field(default_factory=asyncio.Queue)
    close_reason: str = ""
    call: _Call | None = None
    task: asyncio.Task[None] | None = None
    snapshot_logged: bool = False


class MasterDriver:
    """Drives one master epoch's ReplicationMaster with real streams and time."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeConfig,
        core: ReplicationMaster[Waiting],
        store: Callable[[], Store],
        *,
        cluster_id: str,
        members: Sequence[NodeConfig],
        clock: Clock,
        on_commit: Callable[[int], None],
        on_deposed: Callable[[str], None],
    ) -> None:
        self.config = config
        self.node = node
        self.core = core
        self._store = store
        self._cluster_id = cluster_id
        self._clock = clock
        self._on_commit = on_commit
        self._on_deposed = on_deposed
        self._room = asyncio.Event()
        self._room.set()
        self._tail: deque[replica_pb2.LogEntry] = deque(maxlen=_TAIL_CACHE_ENTRIES_MAX)
        self._ticker: asyncio.Task[None] | None = None
        self._stopped = False
        options = channel_options(config.limits.max_message_bytes)
        self._links: dict[str, _Link] = {}
        for member in members:
            if member.id == node.id:
                continue
            channel = grpc.aio.insecure_channel(member.replica_address, options=options)
            self._links[member.id] = _Link(node=member, channel=channel)

    # --- lifecycle

    def start(self) -> None:
        """Opens a stream to every member slave and starts the heartbeat ticker."""
        for link in self._links.values():
            link.task = asyncio.create_task(
                self._run_link(link), name=f"replicate-{self.node.id}-{link.node.id}"
            )
        self._ticker = asyncio.create_task(self._tick_loop(), name=f"repl-tick-{self.node.id}")

    async def stop(self, reason: str) -> None:
        """Deposes the core (pending writes fail as indeterminate) and closes every stream."""
        self.apply(self.core.depose(reason))
        await self._close()

    async def _close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._room.set()
        tasks = [t for t in (self._ticker, *(lk.task for lk in self._links.values())) if t]
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        for task in tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for link in self._links.values():
            await link.channel.close(None)

    # --- inputs from the writer

    @property
    def deposed(self) -> str:
        """Why the core was deposed ("" while it is not)."""
        return self.core.deposed

    async def wait_room(self) -> int:
        """Waits until the core admits at least one more write; returns the room (0: deposed)."""
        while not self.core.deposed and self.core.write_room <= 0:
            self._room.clear()
            await self._room.wait()
        return self.core.write_room

    def appended(self, entries: Sequence[replica_pb2.LogEntry], *, synced: bool) -> None:
        """The store appended entries (flushed when synced)."""
        if not entries:
            return
        self._tail.extend(entries)
        self.apply(self.core.on_appended(entries[-1].lsn, synced=synced))

    def register(self, writes: Sequence[Waiting]) -> None:
        """Client writes whose entries are appended: they resolve once committed."""
        if writes:
            self.apply(self.core.register_writes((w.lsn, w) for w in writes))

    def set_members(self, member_ids: Sequence[str]) -> None:
        """The group shrank within the epoch (a renewal naming fewer members)."""
        gone = [n for n in self._links if n not in member_ids]
        self.apply(self.core.set_members(member_ids))
        for node_id in gone:
            link = self._links[node_id]
            if link.task is not None:
                link.task.cancel()

    # --- applying Actions, in the documented order

    def apply(self, first: Actions[Waiting]) -> None:
        """Applies an Actions record (and those its sends produce), in order."""
        queue: deque[Actions[Waiting]] = deque([first])
        while queue:
            actions = queue.popleft()
            rejection = actions.rejection
            if rejection is not None and rejection.code not in (
                RejectCode.STALE_STREAM,
                RejectCode.DEPOSED,
            ):
                log.warning("replica %s: %s", self.node.id, rejection.message)
                self._close_stream(rejection.node_id, rejection.stream_id, rejection.message)
            for grant in actions.sends:
                queue.append(self._send(grant))
            for node_id in actions.snapshots:
                self._snapshot_unavailable(node_id)
            for node_id in actions.heartbeats:
                link = self._links.get(node_id)
                if link is not None and link.stream_id:
                    link.outbox.put_nowait(
                        replica_pb2.ReplicateRequest(
                            heartbeat=replica_pb2.ReplicationHeartbeat(
                                commit_lsn=actions.commit_lsn, epoch=self.core.epoch
                            )
                        )
                    )
            if actions.completed:
                self._complete(actions.completed)
            for waiting in actions.failed:
                if not waiting.future.done():
                    waiting.future.set_exception(
                        ServiceError(
                            Code.UNKNOWN,
                            f"indeterminate: master {self.node.id} (epoch {self.core.epoch}) was "
                            f"deposed before LSN {waiting.lsn} committed; it may or may not "
                            f"survive, retry with the same publisher id and sequence",
                        )
                    )
            self._on_commit(actions.commit_lsn)
            if actions.completed or actions.failed or actions.deposed:
                self._room.set()
            if actions.deposed:
                log.warning(
                    "replica %s deposed as master: epoch=%d commit_lsn=%d: %s",
                    self.node.id,
                    self.core.epoch,
                    actions.commit_lsn,
                    actions.deposed,
                )
                self._on_deposed(actions.deposed)
                asyncio.get_running_loop().create_task(self._close())
            for event in actions.events:
                log.info("replica %s: %s", self.node.id, event)

    def _read(self, from_lsn: int, count: int) -> list[replica_pb2.LogEntry]:
        tail = self._tail
        if tail and tail[0].lsn <= from_lsn:
            start = from_lsn - tail[0].lsn
            return [tail[i] for i in range(start, min(len(tail), start + count))]
        return self._store().read_log(from_lsn, count)

    def _send(self, grant: SendGrant) -> Actions[Waiting]:
        link = self._links[grant.node_id]
        kept: Sequence[replica_pb2.LogEntry] = []
        if grant.entries_max:
            kept = fit_batch(self._read(grant.from_lsn, grant.entries_max), grant.bytes_max)
        last = kept[-1].lsn if kept else grant.from_lsn - 1
        actions = self.core.on_sent(grant.node_id, grant.stream_id, last, batch_size_bytes(kept))
        truncate = grant.truncate_after_lsn
        if truncate == 0:
            # The wire cannot say "truncate everything" (0 means no truncation): the two
            # logs share no entry at all. That slave's store needs manual recovery.
            message = (
                f"master {self.node.id} epoch {self.core.epoch}: node {grant.node_id}'s log "
                f"shares no entry with this master's; empty its store to let it rejoin"
            )
            log.error("replica %s: %s", self.node.id, message)
            self._close_stream(grant.node_id, grant.stream_id, message)
            return actions
        link.outbox.put_nowait(
            replica_pb2.ReplicateRequest(
                entries=replica_pb2.EntryBatch(
                    entries=kept,
                    commit_lsn=grant.commit_lsn,
                    truncate_after_lsn=truncate or 0,
                    epoch=self.core.epoch,
                )
            )
        )
        return actions

    def _snapshot_unavailable(self, node_id: str) -> None:
        link = self._links.get(node_id)
        if link is None or link.snapshot_logged:
            return
        link.snapshot_logged = True
        log.warning(
            "replica %s (master, epoch %d): node %s needs a snapshot, which this store "
            "cannot take yet; it stays behind until snapshots land",
            self.node.id,
            self.core.epoch,
            node_id,
        )

    def _complete(self, done: Sequence[Waiting]) -> None:
        stamps: dict[int, bytes] = {}
        for waiting in done:
            if waiting.future.done():
                continue
            stamp = stamps.get(waiting.lsn)
            if stamp is None:
                holders = self.core.holders(waiting.lsn) if waiting.lsn else ()
                stamp = common_pb2.AckReceipt(
                    master_id=self.node.id,
                    holders=[
                        common_pb2.ReplicaDurability(
                            node_id=node_id, durability=_SYNC_POLICIES[policy]
                        )
                        for node_id, policy in holders
                    ],
                ).SerializeToString()
                stamps[waiting.lsn] = stamp
            for receipt in waiting.plan.receipts:
                receipt.MergeFromString(stamp)
            waiting.future.set_result(waiting.plan)

    def _close_stream(self, node_id: str, stream_id: int, reason: str) -> None:
        link = self._links.get(node_id)
        if link is None or link.stream_id != stream_id or link.call is None:
            return
        link.close_reason = reason
        link.call.cancel()

    # --- streams

    async def _tick_loop(self) -> None:
        interval_s = self.config.timeouts.heartbeat_interval_ms / 1000
        while not self.core.deposed:
            self.apply(self.core.tick(self._clock.monotonic_ms()))
            await asyncio.sleep(interval_s)

    async def _run_link(self, link: _Link) -> None:
        """Keeps one stream open to a slave while this master is not deposed."""
        backoff_s = _BACKOFF_MIN_S
        while not self.core.deposed:
            opened = False
            try:
                opened = await self._stream(link)
            except grpc.aio.AioRpcError as exc:
                self._refused(link, exc)
            except asyncio.CancelledError:
                if not link.close_reason:
                    raise
                link.close_reason = ""
            if opened:
                backoff_s = _BACKOFF_MIN_S
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)

    def _refused(self, link: _Link, exc: grpc.aio.AioRpcError) -> None:
        code = exc.code()
        for key, value in _pairs(exc.trailing_metadata()):
            if key == EPOCH_KEY and isinstance(value, str) and value.isdigit():
                self.apply(self.core.observe_epoch(int(value)))
        if self.core.deposed:
            return
        level = (
            logging.DEBUG
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            else logging.WARNING
        )
        log.log(
            level,
            "replica %s (master, epoch %d): stream to %s ended: %s: %s",
            self.node.id,
            self.core.epoch,
            link.node.id,
            code.name,
            exc.details(),
        )

    async def _stream(self, link: _Link) -> bool:
        """One stream's life; True once the slave answered the Hello."""
        stream_id = self.core.connect(link.node.id)
        link.stream_id = stream_id
        link.outbox = asyncio.Queue()
        call = replica_pb2_grpc.ReplicationStub(link.channel).Replicate(None)
        link.call = call
        writer: asyncio.Task[None] | None = None
        opened = False
        try:
            await call.write(
                replica_pb2.ReplicateRequest(
                    hello=replica_pb2.ReplicationHello(
                        master_id=self.node.id,
                        epoch=self.core.epoch,
                        cluster_id=self._cluster_id,
                    )
                )
            )
            first = await call.read()
            if not isinstance(first, replica_pb2.ReplicateResponse):
                return False  # the slave closed the stream
            if first.WhichOneof("body") != "position":
                log.warning(
                    "replica %s: node %s answered the Hello without a Position",
                    self.node.id,
                    link.node.id,
                )
                return False
            position = first.position
            opened = True
            log.info(
                "replica %s (master, epoch %d): stream to %s open; it holds epoch %d LSN %d",
                self.node.id,
                self.core.epoch,
                link.node.id,
                position.last_epoch,
                position.last_lsn,
            )
            writer = asyncio.create_task(self._pump(link, call))
            self.apply(
                self.core.on_position(
                    link.node.id,
                    stream_id,
                    last_epoch=position.last_epoch,
                    last_lsn=position.last_lsn,
                    history=position.history,
                )
            )
            while not self.core.deposed:
                message = await call.read()
                if not isinstance(message, replica_pb2.ReplicateResponse):
                    break  # the slave closed the stream
                if message.WhichOneof("body") == "ack":
                    ack = message.ack
                    self.apply(
                        self.core.on_ack(
                            link.node.id,
                            stream_id,
                            received_lsn=ack.received_lsn,
                            written_lsn=ack.written_lsn,
                            synced_lsn=ack.synced_lsn,
                        )
                    )
            return opened
        finally:
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await writer
            call.cancel()
            link.call = None
            if link.stream_id == stream_id:
                link.stream_id = 0
                if not self.core.deposed:
                    self.apply(self.core.disconnected(link.node.id, stream_id))

    async def _pump(
        self,
        link: _Link,
        call: _Call,
    ) -> None:
        """Writes a stream's queued messages in order."""
        outbox = link.outbox
        while True:
            message = await outbox.get()
            await call.write(message)


_SYNC_POLICIES = {
    SyncPolicy.SYNC: common_pb2.SYNC_POLICY_SYNC,
    SyncPolicy.WRITE_NO_SYNC: common_pb2.SYNC_POLICY_WRITE_NO_SYNC,
    SyncPolicy.NO_SYNC: common_pb2.SYNC_POLICY_NO_SYNC,
}


def _pairs(metadata: object) -> list[tuple[str, str | bytes]]:
    """Metadata as (key, value) pairs (grpc-stubs types its items too narrowly)."""
    return [(str(k), v) for k, v in metadata or ()]  # type: ignore[attr-defined]
