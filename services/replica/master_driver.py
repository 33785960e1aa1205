"""The master's replication driver: real streams, clock and store around ReplicationMaster.

One ``MasterDriver`` lives for one master epoch (as its core does). It opens one
bidirectional ``Replication.Replicate`` stream per member slave (through the injected
``ReplicaTransport``: gRPC in the service, in process in the tests), reconnecting with
bounded backoff while this node is master, feeds the core every
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

Snapshots (a slave behind the retained log, or one whose divergent suffix cannot be
truncated): one task per slave streams it through ``snapshot_pump.pump_snapshot`` (its
read transaction opens with the commit lock held, so the snapshot's LSN is one the core
knows the log reached), tells the core ``on_snapshot_started`` with the first chunk's
LSN, and streams the chunks one at a time: the next chunk is read only once the stream
took the last, so memory holds one chunk whatever the slave does. The slave's ack of the
snapshot LSN puts it back to streaming the log from there.

Progress for status: every half second the driver samples each slave's acknowledged LSN
(at the replica sync policy); the catch-up rate is over the last few seconds of samples
and the ETA is lag / rate (the pure core stays clock-free).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace

from squall.v1 import common_pb2, replica_pb2
from squall.wire import stages as _stages
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.telemetry import Telemetry, current
from squall_server.replica.commands import Planned
from squall_server.replica.core import EPOCH_KEY
from squall_server.replica.replication import (
    Actions,
    RejectCode,
    ReplicationError,
    ReplicationMaster,
    SendGrant,
    SlaveProgress,
    SlaveState,
    SyncPolicy,
    batch_size_bytes,
    fit_batch,
)
from squall_server.replica.snapshot_pump import pump_snapshot
from squall_server.replica.store import Store, StoreError
from squall_server.replica.telemetry import ReplicationTracer
from squall_server.replica.transport import ReplicaCallError, ReplicateCall, ReplicaTransport

log = logging.getLogger("squall.replica")

# Reconnect backoff to a slave: fast at first (failover time depends on it), bounded.
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
# Recently appended entries kept in memory, so streaming to an up-to-date slave does not
# read the store; older entries (catch-up) are read from the store. Bounded by count and
# by bytes (twice a slave's in-flight byte window): entries can be large.
_TAIL_CACHE_ENTRIES_MAX = 4096
# Entries per store read when a catching-up slave's batch is built.
_STORE_READ_ENTRIES = 64
# Progress samples for the catch-up rate: one every _RATE_SAMPLE_S, the last
# _RATE_SAMPLES kept (a window of about 5 s).
_RATE_SAMPLE_S = 0.5
_RATE_SAMPLES = 11


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
    stream_id: int = 0
    outbox: asyncio.Queue[replica_pb2.ReplicateRequest] = field(default_factory=asyncio.Queue)
    close_reason: str = ""
    call: ReplicateCall | None = None
    task: asyncio.Task[None] | None = None
    snapshot_task: asyncio.Task[None] | None = None
    # (monotonic seconds, acknowledged LSN at the replica sync policy), newest last.
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_RATE_SAMPLES))


@dataclass(frozen=True)
class SlaveStatus:
    """One slave's progress with the driver's timing: lag, catch-up rate, ETA."""

    progress: SlaveProgress
    lag_entries: int
    catch_up_entries_per_s: float
    eta_s: float
    """Seconds until the lag closes at the recent rate; -1 while the slave is not gaining."""


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
        transport: ReplicaTransport,
        clock: Clock,
        on_commit: Callable[[int], None],
        on_deposed: Callable[[str], None],
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        log_start_lsn: int = 1,
        stamp_snapshot: Callable[[replica_pb2.SnapshotChunk], None] | None = None,
        observability: Telemetry | None = None,
    ) -> None:
        """``transport``: this epoch's own (closed with the driver); ``io``: the store
        thread; ``commit_lock``: held by the writer while it appends;
        ``stamp_snapshot``: adds the commit LSN and what the snapshot holds above it to a
        snapshot's last chunk (the node's committed-reads gate knows)."""
        self.config = config
        self.node = node
        self.core = core
        self._store = store
        self._cluster_id = cluster_id
        self._transport = transport
        self._clock = clock
        self._on_commit = on_commit
        self._on_deposed = on_deposed
        self._io = io
        self._commit_lock = commit_lock
        self.log_start_lsn = log_start_lsn
        self._stamp_snapshot = stamp_snapshot
        self._room = asyncio.Event()
        self._room.set()
        self._tail: deque[replica_pb2.LogEntry] = deque(maxlen=_TAIL_CACHE_ENTRIES_MAX)
        self._tail_bytes = 0
        self._tail_bytes_max = 2 * config.limits.replication_inflight_bytes_max
        self._ticker: asyncio.Task[None] | None = None
        self._stopped = False
        observed = observability or current()
        # Replication spans, per traced batch (None while tracing is off).
        self._spans = (
            ReplicationTracer(observed.tracer, node.id, core.epoch) if observed.tracing else None
        )
        self._links: dict[str, _Link] = {
            member.id: _Link(node=member) for member in members if member.id != node.id
        }

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
        if self._spans is not None:
            self._spans.close(self.core.deposed or "master stopped")
        tasks = [
            t
            for t in (
                self._ticker,
                *(lk.task for lk in self._links.values()),
                *(lk.snapshot_task for lk in self._links.values()),
            )
            if t
        ]
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        for task in tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._transport.close()

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
        tail = self._tail
        for entry in entries:
            if len(tail) == tail.maxlen:
                self._tail_bytes -= len(tail[0].operation)
            tail.append(entry)
            self._tail_bytes += len(entry.operation)
        # Bounded by the tail's length: each pass drops one entry.
        while len(tail) > 1 and self._tail_bytes > self._tail_bytes_max:
            self._tail_bytes -= len(tail.popleft().operation)
        self.apply(self.core.on_appended(entries[-1].lsn, synced=synced))

    def traced(self, writes: Iterable[tuple[int, trace.SpanContext | None]]) -> None:
        """Traced writes about to be appended, by LSN: their batches get replication spans."""
        if self._spans is not None:
            self._spans.note(writes)

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
                self._start_snapshot(node_id)
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

    def _read(self, from_lsn: int, count: int, bytes_max: int) -> list[replica_pb2.LogEntry]:
        """Up to count entries from from_lsn, reading little beyond bytes_max."""
        tail = self._tail
        if tail and tail[0].lsn <= from_lsn:
            start = from_lsn - tail[0].lsn
            return [tail[i] for i in range(start, min(len(tail), start + count))]
        # From the store in small steps, so large entries are not read only to be cut
        # by fit_batch; one step per _STORE_READ_ENTRIES entries, bounded by count.
        store = self._store()
        out: list[replica_pb2.LogEntry] = []
        size = 0
        while len(out) < count and size <= bytes_max:
            step = store.read_log(from_lsn + len(out), min(_STORE_READ_ENTRIES, count - len(out)))
            if not step:
                break
            out.extend(step)
            size += batch_size_bytes(step)
        return out

    def _send(self, grant: SendGrant) -> Actions[Waiting]:
        link = self._links[grant.node_id]
        kept: Sequence[replica_pb2.LogEntry] = []
        if grant.entries_max:
            kept = fit_batch(
                self._read(grant.from_lsn, grant.entries_max, grant.bytes_max), grant.bytes_max
            )
        last = kept[-1].lsn if kept else grant.from_lsn - 1
        actions = self.core.on_sent(grant.node_id, grant.stream_id, last, batch_size_bytes(kept))
        truncate = grant.truncate_after_lsn
        if truncate == 0:
            # The wire cannot say "truncate everything" (0 means no truncation); the core
            # sends a log that shares no entry with ours a snapshot instead.
            raise ReplicationError(
                f"a grant to truncate node {grant.node_id}'s whole log (the core sends a "
                "snapshot for a fork at LSN 0)"
            )
        if self._spans is not None and kept:
            self._spans.sent(grant.node_id, kept[0].lsn, last, batch_size_bytes(kept))
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

    def _start_snapshot(self, node_id: str) -> None:
        """The core wants a snapshot sent to node_id: one task streams it."""
        link = self._links.get(node_id)
        if link is None or not link.stream_id or self._stopped:
            return
        if link.snapshot_task is not None and not link.snapshot_task.done():
            link.snapshot_task.cancel()
        link.snapshot_task = asyncio.get_running_loop().create_task(
            self._send_snapshot(link, link.stream_id),
            name=f"snapshot-{self.node.id}-{node_id}",
        )

    async def _send_snapshot(self, link: _Link, stream_id: int) -> None:
        """Streams one snapshot to a slave, a chunk at a time (see the module docstring)."""
        node_id = link.node.id

        def started(chunk: replica_pb2.SnapshotChunk) -> bool:
            # With the writer held, the store's last LSN is the core's: the snapshot
            # LSN is one on_snapshot_started accepts, and the log after it is kept.
            if link.stream_id != stream_id or self.core.deposed:
                return False
            self.apply(self.core.on_snapshot_started(node_id, stream_id, chunk.snapshot_lsn))
            return True

        pump = pump_snapshot(
            self._store,
            io=self._io,
            commit_lock=self._commit_lock,
            clock=self._clock,
            max_message_bytes=self.config.limits.max_message_bytes,
            sender=f"replica {self.node.id} (master, epoch {self.core.epoch})",
            recipient=f"node {node_id}",
            started=started,
            stamp=self._stamp_snapshot,
        )
        try:
            async with contextlib.aclosing(pump) as chunks:
                async for chunk in chunks:
                    link.outbox.put_nowait(replica_pb2.ReplicateRequest(snapshot=chunk))
                    await link.outbox.join()  # the stream took it: the pump reads the next
                    if link.stream_id != stream_id:
                        return
        except StoreError as exc:
            message = (
                f"master {self.node.id} epoch {self.core.epoch}: the snapshot for node "
                f"{node_id} failed: {exc}"
            )
            log.error("replica %s: %s", self.node.id, message)
            self._close_stream(node_id, stream_id, message)

    def _complete(self, done: Sequence[Waiting]) -> None:
        stamps: dict[int, bytes] = {}
        for waiting in done:
            if waiting.future.done():
                continue
            if _stages.ENABLED:
                _stages.mark("m.commit", f"lsn/{waiting.lsn}")
            stamp = stamps.get(waiting.lsn)
            if stamp is None:
                holders = self.core.holders(waiting.lsn) if waiting.lsn else ()
                stamp = common_pb2.BatchReceipt(
                    master_id=self.node.id,
                    holders=[
                        common_pb2.ReplicaDurability(
                            node_id=node_id, durability=_SYNC_POLICIES[policy]
                        )
                        for node_id, policy in holders
                    ],
                ).SerializeToString()
                stamps[waiting.lsn] = stamp
            receipt = waiting.plan.receipt
            if receipt is not None:
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
        next_sample_s = 0.0
        while not self.core.deposed:
            self.apply(self.core.tick(self._clock.monotonic_ms()))
            now_s = self._clock.monotonic_ms() / 1000
            if now_s >= next_sample_s:
                next_sample_s = now_s + _RATE_SAMPLE_S
                self._sample_progress(now_s)
            await asyncio.sleep(interval_s)

    # --- log retention and status

    def compaction_target(self, retention_entries: int) -> int:
        """The LSN to compact the master's log below: at most retention_entries kept.

        Bounded whatever the slaves do: a slave further behind gets a snapshot. The one
        exception is a slave receiving a snapshot at S: the log from S+1 is kept until
        it has the snapshot, so it continues with the log (no endless chase).
        """
        keep = self.core.last_lsn - retention_entries + 1
        for progress in self.core.status():
            if progress.state == SlaveState.SNAPSHOTTING and progress.snapshot_lsn:
                keep = min(keep, progress.snapshot_lsn + 1)
        return max(keep, self.log_start_lsn)

    def set_log_start(self, log_start_lsn: int) -> None:
        """The log is about to be compacted below log_start_lsn: grant nothing below it.

        Called before the store compacts, so no batch is ever built from deleted entries.
        """
        self.apply(self.core.set_log_start(log_start_lsn))
        self.log_start_lsn = log_start_lsn

    def _durable(self, progress: SlaveProgress) -> int:
        policy = self.core.config.replica_sync
        if policy == SyncPolicy.SYNC:
            return progress.synced_lsn
        if policy == SyncPolicy.WRITE_NO_SYNC:
            return progress.written_lsn
        return progress.received_lsn

    def _sample_progress(self, now_s: float) -> None:
        for progress in self.core.status():
            link = self._links.get(progress.node_id)
            if link is not None:
                link.samples.append((now_s, self._durable(progress)))

    def slave_status(self) -> list[SlaveStatus]:
        """Every member slave's progress, lag, recent catch-up rate and ETA, by node id."""
        out: list[SlaveStatus] = []
        last_lsn = self.core.last_lsn
        for progress in self.core.status():
            held = self._durable(progress)
            lag = max(0, last_lsn - held)
            rate = 0.0
            link = self._links.get(progress.node_id)
            if link is not None and len(link.samples) >= 2:
                (t0, lsn0), (t1, lsn1) = link.samples[0], link.samples[-1]
                if t1 > t0:
                    rate = max(0.0, (lsn1 - lsn0) / (t1 - t0))
            eta_s = 0.0 if lag == 0 else (lag / rate if rate > 0 else -1.0)
            out.append(
                SlaveStatus(
                    progress=progress,
                    lag_entries=lag,
                    catch_up_entries_per_s=round(rate, 1),
                    eta_s=round(eta_s, 2),
                )
            )
        return out

    async def _run_link(self, link: _Link) -> None:
        """Keeps one stream open to a slave while this master is not deposed."""
        backoff_s = _BACKOFF_MIN_S
        while not self.core.deposed:
            opened = False
            try:
                opened = await self._stream(link)
            except ReplicaCallError as exc:
                self._refused(link, exc)
            except asyncio.CancelledError:
                if not link.close_reason:
                    raise
                link.close_reason = ""
            if opened:
                backoff_s = _BACKOFF_MIN_S
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)

    def _refused(self, link: _Link, exc: ReplicaCallError) -> None:
        for key, value in exc.metadata:
            if key == EPOCH_KEY and value.isdigit():
                self.apply(self.core.observe_epoch(int(value)))
        if self.core.deposed:
            return
        level = logging.DEBUG if exc.status in ("UNAVAILABLE", "CANCELLED") else logging.WARNING
        log.log(
            level,
            "replica %s (master, epoch %d): stream to %s ended: %s: %s",
            self.node.id,
            self.core.epoch,
            link.node.id,
            exc.status,
            exc.details,
        )

    async def _stream(self, link: _Link) -> bool:
        """One stream's life; True once the slave answered the Hello."""
        stream_id = self.core.connect(link.node.id)
        link.stream_id = stream_id
        link.outbox = asyncio.Queue()
        call = self._transport.replicate(link.node.id)
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
            if first is None:
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
                    log_start_lsn=position.log_start_lsn or 1,
                )
            )
            while not self.core.deposed:
                message = await call.read()
                if message is None:
                    break  # the slave closed the stream
                if message.WhichOneof("body") == "ack":
                    ack = message.ack
                    if self._spans is not None:
                        self._spans.acked(
                            link.node.id,
                            ack.received_lsn,
                            _durable_lsn(self.core.config.replica_sync, ack),
                        )
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
            snapshot = link.snapshot_task
            if snapshot is not None and not snapshot.done():
                snapshot.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await snapshot
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, ReplicaCallError):
                    await writer
            call.cancel()
            link.call = None
            if self._spans is not None:
                self._spans.closed(link.node.id, link.close_reason or "stream ended")
            if link.stream_id == stream_id:
                link.stream_id = 0
                if not self.core.deposed:
                    self.apply(self.core.disconnected(link.node.id, stream_id))

    async def _pump(
        self,
        link: _Link,
        call: ReplicateCall,
    ) -> None:
        """Writes a stream's queued messages in order."""
        outbox = link.outbox
        while True:
            message = await outbox.get()
            if _stages.ENABLED and message.HasField("entries"):
                for entry in message.entries.entries:
                    _stages.mark("m.sent", f"lsn/{entry.lsn}")
            await call.write(message)
            outbox.task_done()  # a snapshot sender waits for its chunk to be taken


_SYNC_POLICIES = {
    SyncPolicy.SYNC: common_pb2.SYNC_POLICY_SYNC,
    SyncPolicy.WRITE_NO_SYNC: common_pb2.SYNC_POLICY_WRITE_NO_SYNC,
    SyncPolicy.NO_SYNC: common_pb2.SYNC_POLICY_NO_SYNC,
}


def _durable_lsn(policy: SyncPolicy, ack: replica_pb2.ReplicationAck) -> int:
    """The LSN an ack says the slave holds under the replica sync policy."""
    if policy == SyncPolicy.SYNC:
        return ack.synced_lsn
    if policy == SyncPolicy.WRITE_NO_SYNC:
        return ack.written_lsn
    return ack.received_lsn
