"""The master's replication driver: real streams, clock and store around ReplicationMaster.

One ``MasterDriver`` lives for one master epoch (as its core does). It opens one
bidirectional ``Replication.Replicate`` stream per member slave (through the injected
``ReplicaTransport``: gRPC in the service, in process in the tests), reconnecting with
bounded backoff (``master_streams.ReconnectBackoff``) while this node is master, feeds
the core every input (local appends, client writes, Positions, acks, broken streams,
ticks) and has the synchronous ``MasterSteps`` (``master_steps.py``) apply each
``Actions`` record in the order ``replication.Actions`` documents: rejection, sends
(build the batch, ``on_sent``, queue it on the stream), snapshots, heartbeats, completed
writes, failed writes, deposition, log lines; the steps also read each slave's messages
(``hello_answered``, ``received``, ``refused``, ``stream_ended``). This shell carries out
the steps' outputs: the streams' queues, snapshot tasks, the writes' futures.

Everything runs on the node's event loop: inputs are applied one at a time. A stream's
outgoing messages go through its own ``_Sender``, so applying an Actions record never
waits on the network: a message is handed to the stream at once when nothing is being
written on it (a lone publish's batch reaches gRPC in the turn it was granted, with no
queue or task hop: issue 16), else it waits behind the write in progress; the backlog is
bounded by the core's in-flight window (plus one heartbeat per tick).

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

from squall.v1 import replica_pb2
from squall.wire import stages as _stages
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.eager import start_now
from squall_server.common.errors import Code, ServiceError
from squall_server.common.telemetry import Telemetry, current
from squall_server.replica.commands import PartOutcome, Planned, fail_parts
from squall_server.replica.master_steps import MasterOutputs, MasterSteps, durable_lsn
from squall_server.replica.master_streams import ReconnectBackoff
from squall_server.replica.replication import ReplicationMaster, SlaveProgress
from squall_server.replica.snapshot_pump import pump_snapshot
from squall_server.replica.store import CorruptRecordError, Store, StoreError
from squall_server.replica.telemetry import ReplicationTracer
from squall_server.replica.transport import ReplicaCallError, ReplicateCall, ReplicaTransport

log = logging.getLogger("squall.replica")

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


class _Sender:
    """One stream's outgoing messages, written in order, one write at a time: a message
    goes to the stream at once, in the caller's turn (``eager.start_now``), when nothing
    is being written on it, else behind the write in progress, by the task carrying that
    write on. Held until the slave answered the Hello (what the Position grants waits).
    A failed write drops what is queued and whatever follows: the stream's read side
    sees the failure and ends it."""

    def __init__(self, call: ReplicateCall, name: str) -> None:
        self._call = call
        self._name = name
        self._backlog: deque[replica_pb2.ReplicateRequest] = deque()
        self._held = True
        self._writing = False
        self._failed = False
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def send(self, message: replica_pb2.ReplicateRequest) -> None:
        if self._failed:
            return
        self._backlog.append(message)
        self._idle.clear()
        if not self._held and not self._writing:
            self._start()

    def open(self) -> None:
        """The slave answered the Hello: what is queued goes out now."""
        self._held = False
        if self._backlog and not self._writing and not self._failed:
            self._start()

    async def drained(self) -> None:
        """Waits until everything sent so far was written (or dropped)."""
        await self._idle.wait()

    async def close(self) -> None:
        """The stream ended: the write in progress is cancelled, nothing more is sent."""
        self._failed = True
        self._backlog.clear()
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ReplicaCallError):
                await task
        self._idle.set()

    def _start(self) -> None:
        self._writing = True
        task = start_now(self._write_all(), name=self._name)
        if self._writing:  # still writing: the task carries on
            self._task = task

    async def _write_all(self) -> None:
        call = self._call
        backlog = self._backlog
        try:
            # Bounded by what is queued: the core's in-flight window and the heartbeats.
            while backlog:
                message = backlog.popleft()
                if _stages.ENABLED and message.HasField("entries"):
                    for entry in message.entries.entries:
                        _stages.mark("m.sent", f"lsn/{entry.lsn}")
                await call.write(message)
        except (ReplicaCallError, asyncio.InvalidStateError) as exc:
            # The stream failed or ended (gRPC refuses writes on a finished call).
            log.debug("%s: the stream took no more: %r", self._name, exc)
            self._drop()
        except Exception:
            log.warning("%s: writing to the stream failed", self._name, exc_info=True)
            self._drop()
        finally:
            self._writing = False
            self._task = None
            if not backlog:
                self._idle.set()

    def _drop(self) -> None:
        self._failed = True
        self._backlog.clear()


@dataclass(eq=False)
class _Link:
    """One member slave's stream."""

    node: NodeConfig
    stream_id: int = 0
    sender: _Sender | None = None
    close_reason: str = ""
    # The current stream's slave answered its Hello: the next reconnect is quick.
    opened: bool = False
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
        on_fault: Callable[[str], None],
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        log_start_lsn: int = 1,
        stamp_snapshot: Callable[[replica_pb2.SnapshotChunk], None] | None = None,
        observability: Telemetry | None = None,
    ) -> None:
        """``transport``: this epoch's own (closed with the driver); ``io``: the store
        thread; ``commit_lock``: held by the writer while it appends;
        ``stamp_snapshot``: adds the commit LSN and what the snapshot holds above it to a
        snapshot's last chunk (the node's committed-reads gate knows); ``on_fault``: the
        node's fault report (a record of the log or of a snapshot fails its checksum)."""
        self.config = config
        self.node = node
        self.core = core
        self._store = store
        self._cluster_id = cluster_id
        self._transport = transport
        self._clock = clock
        self._on_deposed = on_deposed
        self._on_fault = on_fault
        self._io = io
        self._commit_lock = commit_lock
        self._stamp_snapshot = stamp_snapshot
        self._room = asyncio.Event()
        self._room.set()
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
        spans = self._spans
        # Applies the core's Actions and builds its batches; this shell does the rest.
        self.steps = MasterSteps(
            node.id,
            core,
            store,
            MasterOutputs(
                send=self._queue_batch,
                heartbeat=self._queue_heartbeat,
                snapshot=self._start_snapshot,
                close_stream=self._close_stream,
                completed=self._complete,
                failed=self._fail,
                committed=on_commit,
                room=self._room.set,
                deposed=self._deposed,
                fault=on_fault,
                sent=None if spans is None else spans.sent,
            ),
            tail_bytes_max=2 * config.limits.replication_inflight_bytes_max,
            log_start_lsn=log_start_lsn,
        )

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
        self.steps.apply(self.core.depose(reason))
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

    def appended(
        self,
        entries: Sequence[replica_pb2.LogEntry],
        *,
        synced: bool,
        writes: Sequence[Waiting] = (),
    ) -> None:
        """The store appended entries (flushed when synced); ``writes``, the client writes
        they hold, resolve once committed (as ``register`` right after would, in the same
        record: one per commit batch)."""
        self.steps.appended(entries, synced=synced, writes=[(w.lsn, w) for w in writes])

    def synced(self, lsn: int) -> None:
        """The store flushed everything up to lsn."""
        self.steps.synced(lsn)

    def sync_failed(self, reason: str) -> None:
        """The store's flush failed after the batch was sent: deposes the master."""
        self.steps.sync_failed(reason)

    def traced(self, writes: Iterable[tuple[int, trace.SpanContext | None]]) -> None:
        """Traced writes about to be appended, by LSN: their batches get replication spans."""
        if self._spans is not None:
            self._spans.note(writes)

    def set_members(self, member_ids: Sequence[str]) -> None:
        """The group shrank within the epoch (a renewal naming fewer members)."""
        gone = [n for n in self._links if n not in member_ids]
        self.steps.apply(self.core.set_members(member_ids))
        for node_id in gone:
            link = self._links[node_id]
            if link.task is not None:
                link.task.cancel()

    # --- the steps' outputs, in the order ``replication.Actions`` documents

    def _queue_batch(self, node_id: str, message: replica_pb2.ReplicateRequest) -> None:
        """A granted batch: sent on the slave's stream (at once when it is idle)."""
        sender = self._links[node_id].sender
        if sender is not None:
            sender.send(message)

    def _queue_heartbeat(self, node_id: str, message: replica_pb2.ReplicateRequest) -> None:
        """A heartbeat: sent on the slave's stream if one is open."""
        link = self._links.get(node_id)
        if link is not None and link.stream_id and link.sender is not None:
            link.sender.send(message)

    def _fail(self, failed: Sequence[Waiting]) -> None:
        """Writes the core failed: the master was deposed before they committed. A joined
        request's parts committed before (at or below the commit LSN) keep their receipts;
        the others fail as a write of their own would."""
        for waiting in failed:
            if waiting.future.done():
                continue
            parts = waiting.plan.parts
            if parts is None:
                waiting.future.set_exception(self._deposed_error(waiting.lsn))
                continue
            commit_lsn = self.core.commit_lsn
            self._stamp_parts([p for p in parts if p.error is None and p.lsn <= commit_lsn])
            fail_parts([p for p in parts if p.lsn > commit_lsn], self._deposed_error)
            waiting.future.set_result(waiting.plan)

    def _deposed_error(self, lsn: int) -> ServiceError:
        return ServiceError(
            Code.UNKNOWN,
            f"indeterminate: master {self.node.id} (epoch {self.core.epoch}) was "
            f"deposed before LSN {lsn} committed; it may or may not "
            f"survive, retry with the same publisher id and sequence",
        )

    def _stamp_parts(self, parts: Sequence[PartOutcome]) -> None:
        """Committed parts' receipts gain their master and holders (as ``_complete``)."""
        stamped = [(part.lsn, part.plan.receipt) for part in parts if part.plan is not None]
        if not stamped:
            return
        # Whoever holds an LSN holds every LSN below it as durably: when the lowest and
        # the highest of the parts have the same holders, so has every part between.
        low = self.steps.receipt_stamp(min(lsn for lsn, _ in stamped))
        same = low == self.steps.receipt_stamp(max(lsn for lsn, _ in stamped))
        stamps: dict[int, bytes] = {}
        for lsn, receipt in stamped:
            if _stages.ENABLED:
                _stages.mark("m.commit", f"lsn/{lsn}")
            if receipt is None:
                continue
            stamp = low if same else stamps.get(lsn)
            if stamp is None:
                stamp = stamps[lsn] = self.steps.receipt_stamp(lsn)
            receipt.MergeFromString(stamp)

    def _deposed(self, reason: str) -> None:
        """The core was deposed: the node hears it, and the streams close."""
        self._on_deposed(reason)
        asyncio.get_running_loop().create_task(self._close())

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
            self.steps.apply(self.core.on_snapshot_started(node_id, stream_id, chunk.snapshot_lsn))
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
        sender = link.sender
        if sender is None:
            return
        try:
            async with contextlib.aclosing(pump) as chunks:
                async for chunk in chunks:
                    sender.send(replica_pb2.ReplicateRequest(snapshot=chunk))
                    await sender.drained()  # the stream took it: the pump reads the next
                    if link.stream_id != stream_id:
                        return
        except StoreError as exc:
            message = (
                f"master {self.node.id} epoch {self.core.epoch}: the snapshot for node "
                f"{node_id} failed: {exc}"
            )
            log.error("replica %s: %s", self.node.id, message)
            if isinstance(exc, CorruptRecordError):
                # As for the log: a node with a sound copy must send this slave its state.
                self._on_fault(f"checksum error taking a snapshot for node {node_id}: {exc}")
            self._close_stream(node_id, stream_id, message)

    def _complete(self, done: Sequence[Waiting]) -> None:
        stamps: dict[int, bytes] = {}
        for waiting in done:
            if waiting.future.done():
                continue
            if waiting.plan.parts is not None:
                self._stamp_parts(waiting.plan.parts)
                waiting.future.set_result(waiting.plan)
                continue
            if _stages.ENABLED:
                _stages.mark("m.commit", f"lsn/{waiting.lsn}")
            stamp = stamps.get(waiting.lsn)
            if stamp is None:
                stamp = stamps[waiting.lsn] = self.steps.receipt_stamp(waiting.lsn)
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
            self.steps.apply(self.core.tick(self._clock.monotonic_ms()))
            now_s = self._clock.monotonic_ms() / 1000
            if now_s >= next_sample_s:
                next_sample_s = now_s + _RATE_SAMPLE_S
                self._sample_progress(now_s)
            await asyncio.sleep(interval_s)

    # --- log retention and status

    def compaction_target(self, retention_entries: int) -> int:
        """The LSN to compact the master's log below (``MasterSteps.compaction_target``)."""
        return self.steps.compaction_target(retention_entries)

    def set_log_start(self, log_start_lsn: int) -> None:
        """The log is about to be compacted below log_start_lsn: grant nothing below it."""
        self.steps.set_log_start(log_start_lsn)

    def _sample_progress(self, now_s: float) -> None:
        for progress in self.core.status():
            link = self._links.get(progress.node_id)
            if link is not None:
                link.samples.append((now_s, self.steps.durable(progress)))

    def quorum_silent_ms(self) -> int:
        """How long this master has not heard from enough slaves to commit (the core's)."""
        return self.core.quorum_silent_ms()

    def slave_status(self) -> list[SlaveStatus]:
        """Every member slave's progress, lag, recent catch-up rate and ETA, by node id."""
        out: list[SlaveStatus] = []
        last_lsn = self.core.last_lsn
        for progress in self.core.status():
            held = self.steps.durable(progress)
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
        backoff = ReconnectBackoff()
        while not self.core.deposed:
            link.opened = False
            try:
                await self._stream(link)
            except ReplicaCallError as exc:
                self.steps.refused(link.node.id, exc.status, exc.details, exc.metadata)
            except asyncio.CancelledError:
                if not link.close_reason:
                    raise
                link.close_reason = ""
            await asyncio.sleep(backoff.after(opened=link.opened) / 1000)

    async def _stream(self, link: _Link) -> None:
        """One stream's life; ``link.opened`` once the slave answered the Hello, however
        the stream then ends (a slave's stream ends in an error, not cleanly)."""
        stream_id = self.core.connect(link.node.id)
        link.stream_id = stream_id
        call = self._transport.replicate(link.node.id)
        sender = link.sender = _Sender(call, f"replicate-{self.node.id}-{link.node.id}")
        link.call = call
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
                return  # the slave closed the stream
            if not self.steps.hello_answered(link.node.id, stream_id, first):
                return
            link.opened = True
            sender.open()  # the grants for the Position go out now
            spans = self._spans
            while not self.core.deposed:
                message = await call.read()
                if message is None:
                    break  # the slave closed the stream
                if spans is not None and message.WhichOneof("body") == "ack":
                    ack = message.ack
                    spans.acked(
                        link.node.id,
                        ack.received_lsn,
                        durable_lsn(self.core.config.replica_sync, ack),
                    )
                self.steps.received(link.node.id, stream_id, message)
        finally:
            snapshot = link.snapshot_task
            if snapshot is not None and not snapshot.done():
                snapshot.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await snapshot
            await sender.close()
            call.cancel()
            link.call = None
            if self._spans is not None:
                self._spans.closed(link.node.id, link.close_reason or "stream ended")
            if link.stream_id == stream_id:
                link.stream_id = 0
                self.steps.stream_ended(link.node.id, stream_id)
