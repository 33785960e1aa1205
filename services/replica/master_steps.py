"""The master's replication steps, synchronous: one master epoch's ``ReplicationMaster``
``Actions`` applied in the order ``replication.Actions`` documents, each granted batch
built as the message to send, and the log-retention arithmetic; no asyncio, gRPC or
threads inside.

``MasterSteps`` keeps a tail cache of the entries recently appended (streaming to an
up-to-date slave reads no store; a catching-up slave's batch is read from the store in
small steps and cut to the grant by ``fit_batch``). What needs streams, tasks or futures
it leaves to its shell through ``MasterOutputs``: queue a message on a slave's stream,
start a snapshot, close a stream, settle completed and failed writes, the commit LSN
moved, the core was deposed, a record it read fails its checksum. Actions returned by
``on_sent`` are applied after the record that produced them, in order, so no recursion
grows with the window.

The steps also read what a slave's stream says (its answer to the Hello, its acks, a
refusal naming its epoch, the stream's end) and answer the writer's hand-off (whether a
flush follows the send, which LSN a write waits for), so every shell asks them rather
than deciding. ``MasterDriver`` (``master_driver.py``) is the asyncio shell (streams,
reconnection after ``master_streams.ReconnectBackoff``, snapshot pumps, ticks, progress
sampling); a simulator gives its own outputs.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from squall.v1 import common_pb2, replica_pb2
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
from squall_server.replica.store import CorruptRecordError, Store

log = logging.getLogger("squall.replica")

# What the core waits on per write (the shell's futures).
W = TypeVar("W")

# Recently appended entries kept in memory, so streaming to an up-to-date slave does not
# read the store; older entries (catch-up) are read from the store. Bounded by count and
# by bytes (twice a slave's in-flight byte window): entries can be large.
TAIL_CACHE_ENTRIES_MAX = 4096
# Entries per store read when a catching-up slave's batch is built.
STORE_READ_ENTRIES = 64
# Serialized receipt stamps kept (one per combination of holders and their policies).
_STAMPS_MAX = 64

_SYNC_POLICIES = {
    SyncPolicy.SYNC: common_pb2.SYNC_POLICY_SYNC,
    SyncPolicy.WRITE_NO_SYNC: common_pb2.SYNC_POLICY_WRITE_NO_SYNC,
    SyncPolicy.NO_SYNC: common_pb2.SYNC_POLICY_NO_SYNC,
}


@dataclass(frozen=True)
class MasterOutputs(Generic[W]):
    """What the steps leave to the shell, each called in its place in the order.

    ``send``: queue a batch on node_id's stream; ``heartbeat``: queue a heartbeat on it
    if a stream is open; ``snapshot``: start sending node_id a snapshot; ``close_stream``:
    close node_id's stream stream_id (a protocol violation, the text says which);
    ``completed``/``failed``: writes committed, or failed as indeterminate (the master was
    deposed); ``committed``: the commit LSN (each record's, moved or not); ``room``: the
    core may admit more writes; ``deposed``: the core was deposed (the text says why);
    ``sent``: a batch of LSNs first..last, of so many bytes, went to node_id (tracing);
    ``fault``: the log a slave lacks cannot be read (a record fails its checksum): the
    node reports it as its fault (``FaultReports.report``), so that its coordinator
    quarantines it and a node with a sound copy leads."""

    send: Callable[[str, replica_pb2.ReplicateRequest], None]
    heartbeat: Callable[[str, replica_pb2.ReplicateRequest], None]
    snapshot: Callable[[str], None]
    close_stream: Callable[[str, int, str], None]
    completed: Callable[[Sequence[W]], None]
    failed: Callable[[Sequence[W]], None]
    committed: Callable[[int], None]
    room: Callable[[], None]
    deposed: Callable[[str], None]
    fault: Callable[[str], None]
    sent: Callable[[str, int, int, int], None] | None = None


class MasterSteps(Generic[W]):
    """Applies one master epoch's ``Actions`` and builds the batches it grants."""

    def __init__(
        self,
        node_id: str,
        core: ReplicationMaster[W],
        store: Callable[[], Store],
        outputs: MasterOutputs[W],
        *,
        tail_bytes_max: int,
        log_start_lsn: int = 1,
    ) -> None:
        """``store``: the node's current store (a truncation replaces it);
        ``tail_bytes_max``: the tail cache's byte bound."""
        self.node_id = node_id
        self.core = core
        self._store = store
        self._out = outputs
        self.log_start_lsn = log_start_lsn
        self._tail: deque[replica_pb2.LogEntry] = deque(maxlen=TAIL_CACHE_ENTRIES_MAX)
        self._tail_bytes = 0
        self._tail_bytes_max = tail_bytes_max
        # Receipt stamps by holders: the same few combinations commit write after write.
        self._stamps: dict[tuple[tuple[str, SyncPolicy], ...], bytes] = {}
        # Nodes whose Position on their latest stream in this epoch said they apply
        # PublishPartsOp entries: until every node of the node set has, a node of an older
        # release may be among them.
        self._joined_readers: set[str] = set()

    # --- inputs from the writer

    def appended(
        self,
        entries: Sequence[replica_pb2.LogEntry],
        *,
        synced: bool,
        writes: Sequence[tuple[int, W]] = (),
    ) -> None:
        """The store appended entries (flushed when synced); ``writes``, the client writes
        of this commit batch, wait for their entries (``ReplicationMaster.on_appended``)."""
        if not entries:
            if writes:
                self.apply(self.core.register_writes(writes))
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
        self.apply(self.core.on_appended(entries[-1].lsn, synced=synced, writes=writes))

    def synced(self, lsn: int) -> None:
        """The store flushed everything up to lsn (the fsync that runs while the batch
        appended unflushed is already on its way to the slaves)."""
        self.apply(self.core.on_local_synced(lsn))

    def sync_failed(self, reason: str) -> None:
        """The store's flush failed after the batch went to the slaves: the master is
        deposed at once (its waiting writes fail as indeterminate, it commits and sends
        nothing more). The slaves may hold entries this master never made durable; they
        are uncommitted (the commit needs the master's own flush under ``SYNC``), so the
        next master keeps or truncates them by the epoch rules."""
        self.apply(self.core.depose(f"local store flush failed after sending: {reason}"))

    def flush_after_send(self) -> bool:
        """Whether the writer flushes each appended batch once it went to the slaves (and
        then reports ``synced`` or ``sync_failed``): under the ``SYNC`` master policy
        only; otherwise the master counts its entries as appended."""
        return self.core.config.master_sync == SyncPolicy.SYNC

    def joins_publishes(self) -> bool:
        """Whether a joined request's parts may be stored as one entry
        (``PublishPartsOp``): every other node of the node set, voter or learner, said on
        its latest stream in this epoch that it applies them. Not only the group's members:
        a node the group dropped in this epoch, or one that is down, reads this log when it
        catches up, and an older release refuses the first joined entry (a rolling upgrade,
        a member that has not connected yet). Until then each part is an entry of its own."""
        readers, config = self._joined_readers, self.core.config
        return all(
            node == self.node_id or node in readers for node in (*config.nodes, *config.learners)
        )

    def wait_lsn(self, lsn: int) -> int:
        """The LSN a client write planned at lsn waits for: its entry's, or this epoch's
        start for a duplicate answered from an earlier epoch's entry (an earlier epoch's
        entry counts as committed only once this epoch's start commits)."""
        return max(lsn, self.core.epoch_start_lsn)

    # --- inputs from a slave's stream

    def hello_answered(
        self, node_id: str, stream_id: int, answer: replica_pb2.ReplicateResponse
    ) -> bool:
        """The slave's first message on stream_id: a Position opens the stream (the core
        hears where the slave's log ends and grants what it lacks; True); anything else
        leaves it unopened (False: the shell ends it)."""
        if answer.WhichOneof("body") != "position":
            log.warning(
                "replica %s: node %s answered the Hello without a Position", self.node_id, node_id
            )
            return False
        position = answer.position
        if position.reads_joined_publishes:
            self._joined_readers.add(node_id)
        else:
            self._joined_readers.discard(node_id)
        log.info(
            "replica %s (master, epoch %d): stream to %s open; it holds epoch %d LSN %d",
            self.node_id,
            self.core.epoch,
            node_id,
            position.last_epoch,
            position.last_lsn,
        )
        self.apply(
            self.core.on_position(
                node_id,
                stream_id,
                last_epoch=position.last_epoch,
                last_lsn=position.last_lsn,
                history=position.history,
                log_start_lsn=position.log_start_lsn or 1,
            )
        )
        return True

    def received(
        self, node_id: str, stream_id: int, message: replica_pb2.ReplicateResponse
    ) -> None:
        """A later message on an open stream: an ack moves the slave's progress (and says
        whether it serves following readers, who then hear each commit at once); nothing
        else is an input once the stream is open."""
        if message.WhichOneof("body") == "ack":
            ack = message.ack
            self.apply(
                self.core.on_ack(
                    node_id,
                    stream_id,
                    received_lsn=ack.received_lsn,
                    written_lsn=ack.written_lsn,
                    synced_lsn=ack.synced_lsn,
                    readers_following=ack.readers_following,
                )
            )

    def refused(
        self, node_id: str, status: str, details: str, metadata: Iterable[tuple[str, str]]
    ) -> bool:
        """The slave ended the stream with a refusal (its status, message and trailing
        metadata): every epoch it names (``core.EPOCH_KEY``) is observed, so a newer one
        deposes this master. True while this master still serves (the shell reconnects
        after its backoff); the end itself is ``stream_ended``."""
        for key, value in metadata:
            if key == EPOCH_KEY and value.isdigit():
                self.apply(self.core.observe_epoch(int(value)))
        if self.core.deposed:
            return False
        if status == "RESOURCE_EXHAUSTED":  # its store is full: it cannot hold the log
            self.apply(self.core.cannot_store(node_id, f"{status}: {details}"))
        # An unavailable or cancelled slave is routine (it restarts, its role moves).
        level = logging.DEBUG if status in ("UNAVAILABLE", "CANCELLED") else logging.WARNING
        log.log(
            level,
            "replica %s (master, epoch %d): stream to %s ended: %s: %s",
            self.node_id,
            self.core.epoch,
            node_id,
            status,
            details,
        )
        return True

    def stream_ended(self, node_id: str, stream_id: int) -> bool:
        """Stream stream_id to node_id is gone (closed by either side, refused or broken);
        what the slave acknowledged keeps counting. True when it was the slave's current
        stream and this master still serves: a new stream is due after the backoff."""
        if self.core.deposed:
            return False
        actions = self.core.disconnected(node_id, stream_id)
        self.apply(actions)
        return actions.rejection is None and not self.core.deposed

    # --- applying Actions, in the documented order

    def apply(self, first: Actions[W]) -> None:
        """Applies an Actions record (and those its sends produce), in order."""
        out = self._out
        # Made only when a send produces a record (most records grant nothing).
        queue: deque[Actions[W]] | None = None
        actions: Actions[W] | None = first
        while actions is not None:
            rejection = actions.rejection
            if rejection is not None and rejection.code not in (
                RejectCode.STALE_STREAM,
                RejectCode.DEPOSED,
            ):
                log.warning("replica %s: %s", self.node_id, rejection.message)
                out.close_stream(rejection.node_id, rejection.stream_id, rejection.message)
            for grant in actions.sends:
                if queue is None:
                    queue = deque()
                queue.append(self._send(grant))
            for node_id in actions.snapshots:
                out.snapshot(node_id)
            # Idle slaves' heartbeats and commit notices alike: the commit LSN, now.
            for node_id in actions.heartbeats:
                out.heartbeat(
                    node_id,
                    replica_pb2.ReplicateRequest(
                        heartbeat=replica_pb2.ReplicationHeartbeat(
                            commit_lsn=actions.commit_lsn, epoch=self.core.epoch
                        )
                    ),
                )
            # Readers first: the commit wakes following subscribers and push deliveries
            # before the writers' own tasks, which then answer behind them in the same
            # loop turn (answered first, they put their response's work ahead of every
            # delivery: ~0.1 ms more from commit to a follower, bench/README.md).
            out.committed(actions.commit_lsn)
            if actions.completed:
                out.completed(actions.completed)
            if actions.failed:
                out.failed(actions.failed)
            if actions.completed or actions.failed or actions.deposed:
                out.room()
            if actions.deposed:
                log.warning(
                    "replica %s deposed as master: epoch=%d commit_lsn=%d: %s",
                    self.node_id,
                    self.core.epoch,
                    actions.commit_lsn,
                    actions.deposed,
                )
                out.deposed(actions.deposed)
            for event in actions.events:
                log.info("replica %s: %s", self.node_id, event)
            actions = queue.popleft() if queue else None

    def _read(self, from_lsn: int, count: int, bytes_max: int) -> list[replica_pb2.LogEntry]:
        """Up to count entries from from_lsn, reading little beyond bytes_max."""
        tail = self._tail
        if tail and tail[0].lsn <= from_lsn:
            start = from_lsn - tail[0].lsn
            return [tail[i] for i in range(start, min(len(tail), start + count))]
        # From the store in small steps, so large entries are not read only to be cut
        # by fit_batch; one step per STORE_READ_ENTRIES entries, bounded by count.
        store = self._store()
        out: list[replica_pb2.LogEntry] = []
        size = 0
        while len(out) < count and size <= bytes_max:
            step = store.read_log(from_lsn + len(out), min(STORE_READ_ENTRIES, count - len(out)))
            if not step:
                break
            out.extend(step)
            size += batch_size_bytes(step)
        return out

    def _send(self, grant: SendGrant) -> Actions[W]:
        """Builds a granted batch, reports it sent to the core and queues it."""
        kept: Sequence[replica_pb2.LogEntry] = []
        if grant.entries_max:
            try:
                read = self._read(grant.from_lsn, grant.entries_max, grant.bytes_max)
            except CorruptRecordError as exc:
                return self._unreadable(grant, exc)
            kept = fit_batch(read, grant.bytes_max)
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
        if self._out.sent is not None and kept:
            self._out.sent(grant.node_id, kept[0].lsn, last, batch_size_bytes(kept))
        self._out.send(
            grant.node_id,
            replica_pb2.ReplicateRequest(
                entries=replica_pb2.EntryBatch(
                    entries=kept,
                    commit_lsn=grant.commit_lsn,
                    truncate_after_lsn=truncate or 0,
                    epoch=self.core.epoch,
                )
            ),
        )
        return actions

    def _unreadable(self, grant: SendGrant, exc: CorruptRecordError) -> Actions[W]:
        """A granted batch whose log fails its checksum: nothing of it is sent, the node
        reports the fault and the stream closes (every retry meets the same record, so the
        slave can only be brought up to date by a master with a sound copy)."""
        reason = f"checksum error reading the log for node {grant.node_id}: {exc}"
        # The stream ends here for the core too: told only that nothing went, it would
        # grant the same batch again at once.
        actions = self.core.disconnected(grant.node_id, grant.stream_id)
        self._out.fault(reason)
        self._out.close_stream(grant.node_id, grant.stream_id, reason)
        return actions

    def receipt_stamp(self, lsn: int) -> bytes:
        """What a committed write's receipt gains: this master and the replicas holding
        the entry, each with its sync policy (serialized, to merge into each receipt)."""
        holders = self.core.holders(lsn) if lsn else ()
        stamp = self._stamps.get(holders)
        if stamp is None:
            if len(self._stamps) >= _STAMPS_MAX:
                self._stamps.clear()
            stamp = self._stamps[holders] = common_pb2.BatchReceipt(
                master_id=self.node_id,
                holders=[
                    common_pb2.ReplicaDurability(node_id=node_id, durability=_SYNC_POLICIES[policy])
                    for node_id, policy in holders
                ],
            ).SerializeToString()
        return stamp

    # --- log retention and progress

    def compaction_target(self, retention_entries: int) -> int:
        """The LSN to compact the master's log below: at most retention_entries kept.

        Bounded whatever the slaves do: a slave further behind gets a snapshot. The one
        exception is a slave receiving a snapshot at S: the log from S+1 is kept until
        it has the snapshot, so it continues with the log (no endless chase).
        """
        keep = self.core.last_lsn - retention_entries + 1
        if keep <= self.log_start_lsn:
            # The usual case, checked per commit batch: a snapshotting slave only lowers
            # keep, so the answer is the log start without building every slave's status.
            return self.log_start_lsn
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

    def durable(self, progress: SlaveProgress) -> int:
        """The LSN a slave holds under the replica sync policy."""
        policy = self.core.config.replica_sync
        if policy == SyncPolicy.SYNC:
            return progress.synced_lsn
        if policy == SyncPolicy.WRITE_NO_SYNC:
            return progress.written_lsn
        return progress.received_lsn


def durable_lsn(policy: SyncPolicy, ack: replica_pb2.ReplicationAck) -> int:
    """The LSN an ack says the slave holds under the replica sync policy."""
    if policy == SyncPolicy.SYNC:
        return ack.synced_lsn
    if policy == SyncPolicy.WRITE_NO_SYNC:
        return ack.written_lsn
    return ack.received_lsn
