"""The slave side of replication as a pure state machine: what to accept from the stream,
what to write or truncate, and which ack to send (no network, disk, clock or thread).

A replica obeys only the master of its current epoch (the epoch its coordinator told it,
``set_role``): a Hello, batch or heartbeat from an older epoch or another node is
refused, as is one from a newer epoch the replica has not been told of yet (the master
retries). Before a batch's entries are handed to the store every one is checked: LSNs
consecutive from the log's end (or from the truncation point), epochs never decreasing
and never newer than the master's, and each entry's CRC-32 over its operation. Any
failure refuses the whole batch with a ``Refusal`` naming the node, its epoch and the
offending LSN, and changes nothing: the driver closes the stream with
``Refusal.status`` and the master reconnects (and re-sends from the slave's position).

Truncation (``truncate_after_lsn``, only on the first batch of a stream) removes a suffix
a deposed master wrote and never committed. It is refused below what this replica knows
is committed, or below its snapshot base: those entries cannot be uncommitted.

Acks follow the replica sync policy: ``NO_SYNC`` acknowledges on receipt, before the
write (``BatchAccepted.ack_now``); ``WRITE_NO_SYNC`` after the store wrote the batch;
``SYNC`` after it wrote and flushed it (the driver passes ``sync=True`` to the store).
The follower tracks received (accepted), written and synced LSNs; ``commit_lsn`` is the
highest LSN a committed read may serve here (known committed *and* written locally).

A snapshot (for a replica behind the master's retained log) arrives as chunks on an open
stream; the last chunk carries the epoch history, and its acceptance means: replace the
store's state with the staged snapshot, the log ending at ``snapshot_lsn``.

Errors: a driver bug raises ``FollowerError``; bad or stale peer input returns a
``Refusal``.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from squall_server.common.errors import Code
from squall_server.replica.divergence import (
    HISTORY_BOUNDARIES_MAX,
    UINT64_MAX,
    BoundaryLike,
    History,
    HistoryError,
    as_history,
    check_history,
    epoch_at,
    history_problem,
    truncate_history,
)
from squall_server.replica.replication import (
    INFLIGHT_BYTES_MAX_LIMIT,
    INFLIGHT_ENTRIES_MAX_LIMIT,
    Ack,
    EntryLike,
    SyncPolicy,
    entry_size_bytes,
)

E = TypeVar("E", bound=EntryLike)

# Longest peer-supplied text quoted in a refusal.
_SHOWN_CHARS_MAX = 80


class FollowerError(RuntimeError):
    """A driver bug: an input no correct driver makes. The message says which."""


class FollowerConfigError(ValueError):
    """A follower setting is unusable; the message names it."""


class RefusalCode(enum.Enum):
    """Why the follower refused a message (the refusal changed nothing)."""

    WRONG_CLUSTER = "WRONG_CLUSTER"
    STALE_EPOCH = "STALE_EPOCH"
    """Older than this replica's epoch: the sender is a deposed master."""
    FUTURE_EPOCH = "FUTURE_EPOCH"
    """Newer than the epoch this replica was told of: retry once its coordinator says so."""
    WRONG_MASTER = "WRONG_MASTER"
    NO_STREAM = "NO_STREAM"
    """No accepted Hello on this stream (or the role changed since)."""
    LSN_GAP = "LSN_GAP"
    OLD_EPOCH = "OLD_EPOCH"
    """An entry older than the entry before it."""
    BAD_ENTRY_EPOCH = "BAD_ENTRY_EPOCH"
    """An entry of epoch 0, or newer than the master's epoch."""
    BAD_CHECKSUM = "BAD_CHECKSUM"
    TOO_LARGE = "TOO_LARGE"
    TRUNCATE_BELOW_COMMIT = "TRUNCATE_BELOW_COMMIT"
    TRUNCATE_BELOW_SNAPSHOT = "TRUNCATE_BELOW_SNAPSHOT"
    """The entries are only in a snapshot here: the master must send a new snapshot."""
    BAD_SNAPSHOT = "BAD_SNAPSHOT"
    OUT_OF_ORDER = "OUT_OF_ORDER"
    """A message the stream's protocol does not allow now (a batch inside a snapshot)."""


_REFUSAL_STATUS = {
    RefusalCode.WRONG_CLUSTER: Code.FAILED_PRECONDITION,
    RefusalCode.STALE_EPOCH: Code.FAILED_PRECONDITION,
    RefusalCode.FUTURE_EPOCH: Code.UNAVAILABLE,
    RefusalCode.WRONG_MASTER: Code.FAILED_PRECONDITION,
    RefusalCode.NO_STREAM: Code.FAILED_PRECONDITION,
    RefusalCode.LSN_GAP: Code.INVALID_ARGUMENT,
    RefusalCode.OLD_EPOCH: Code.INVALID_ARGUMENT,
    RefusalCode.BAD_ENTRY_EPOCH: Code.INVALID_ARGUMENT,
    RefusalCode.BAD_CHECKSUM: Code.DATA_LOSS,
    RefusalCode.TOO_LARGE: Code.RESOURCE_EXHAUSTED,
    RefusalCode.TRUNCATE_BELOW_COMMIT: Code.FAILED_PRECONDITION,
    RefusalCode.TRUNCATE_BELOW_SNAPSHOT: Code.FAILED_PRECONDITION,
    RefusalCode.BAD_SNAPSHOT: Code.INVALID_ARGUMENT,
    RefusalCode.OUT_OF_ORDER: Code.INVALID_ARGUMENT,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refused message: who refused it, in which epoch, at which LSN, and why."""

    code: RefusalCode
    node_id: str
    epoch: int
    """This replica's current epoch (a master seeing a newer one is deposed)."""
    lsn: int
    """The offending LSN, or this replica's last LSN when no single entry is at fault."""
    last_lsn: int
    detail: str

    @property
    def status(self) -> Code:
        """The gRPC status to close the stream with."""
        return _REFUSAL_STATUS[self.code]

    @property
    def message(self) -> str:
        """One sentence for the status and the log."""
        return (
            f"replica {self.node_id} (epoch {self.epoch}, last LSN {self.last_lsn}) refused "
            f"at LSN {self.lsn}: {self.detail}"
        )


@dataclass(frozen=True, slots=True)
class FollowerConfig:
    """The slave's replication settings."""

    node_id: str
    sync_policy: SyncPolicy = SyncPolicy.WRITE_NO_SYNC
    inflight_entries_max: int = 1024
    """The most entries one batch may carry (the master's window is the same setting)."""
    inflight_bytes_max: int = 8 << 20
    """The most bytes one batch of two or more entries may carry."""

    def validate(self) -> None:
        """Raises FollowerConfigError naming the first bad setting."""
        if not self.node_id:
            raise FollowerConfigError("node_id: must not be empty")
        if self.sync_policy not in set(SyncPolicy):
            raise FollowerConfigError(f"sync_policy: unknown policy {self.sync_policy!r}")
        if not 1 <= self.inflight_entries_max <= INFLIGHT_ENTRIES_MAX_LIMIT:
            raise FollowerConfigError(
                f"inflight_entries_max: must be 1..{INFLIGHT_ENTRIES_MAX_LIMIT}, "
                f"got {self.inflight_entries_max}"
            )
        if not 1 <= self.inflight_bytes_max <= INFLIGHT_BYTES_MAX_LIMIT:
            raise FollowerConfigError(
                f"inflight_bytes_max: must be 1..{INFLIGHT_BYTES_MAX_LIMIT}, "
                f"got {self.inflight_bytes_max}"
            )


@dataclass(frozen=True, slots=True)
class Position:
    """The answer to a Hello (``replica_pb2.ReplicationPosition``)."""

    node_id: str
    last_epoch: int
    last_lsn: int
    history: History


@dataclass(frozen=True, slots=True)
class HelloAccepted:
    """A Hello from the epoch's master was accepted; answer with ``position``.

    Before answering: when ``adopt_cluster_id`` is set (an empty store meets its
    cluster), persist it as the store's cluster id. ``discard_snapshot``: an unfinished
    snapshot of an earlier stream is abandoned; the store drops what it staged with the
    next install's begin or the next append (``Store.begin_snapshot``, ``Store.append``).
    """

    position: Position
    adopt_cluster_id: str
    discard_snapshot: bool


@dataclass(frozen=True)
class BatchAccepted(Generic[E]):
    """An accepted batch. The driver applies it in this order:

    1. ``ack_now``: when set, send it at once (NO_SYNC acknowledges on receipt; an empty
       batch with nothing to write is acknowledged the same way).
    2. When ``write_needed``: in ONE store transaction truncate the log after
       ``truncate_after_lsn`` (when set, trimming the epoch history the same way) and
       append ``entries``, flushed when ``sync``. Then call ``on_written(last_lsn,
       synced=sync)`` and send the Ack it returns. A failed write is never acknowledged:
       fail-stop, or ``reset`` the follower from the store's meta and close the stream.
    """

    truncate_after_lsn: int | None
    entries: Sequence[E]
    sync: bool
    last_lsn: int
    ack_now: Ack | None

    @property
    def write_needed(self) -> bool:
        """Whether the store has anything to do."""
        return self.truncate_after_lsn is not None or bool(self.entries)


@dataclass(frozen=True, slots=True)
class SnapshotAccepted:
    """An accepted snapshot chunk: stage its records.

    On the ``install`` chunk (the last), atomically replace the store's state with the
    staged records, its log empty and ending at ``snapshot_lsn`` with ``history``, then
    call ``on_written(snapshot_lsn, synced=...)`` and send the Ack it returns.
    """

    index: int
    install: bool
    snapshot_lsn: int
    history: History


@dataclass(frozen=True, slots=True)
class FollowerState:
    """Everything the follower holds, for status and for checking a refusal changed nothing."""

    node_id: str
    cluster_id: str
    epoch: int
    master_id: str
    last_lsn: int
    last_epoch: int
    history: History
    known_commit_lsn: int
    received_lsn: int
    written_lsn: int
    synced_lsn: int
    snapshot_lsn: int
    stream_open: bool
    snapshot_next_index: int
    snapshot_staging_lsn: int


@dataclass(frozen=True, slots=True)
class EntryProblem:
    """Why a run of entries cannot continue a log: the offending LSN and a sentence."""

    code: RefusalCode
    lsn: int
    detail: str


@dataclass(frozen=True, slots=True)
class EntriesChecked:
    """A run of entries that continues the log: where it ends and the epoch boundaries
    it adds to the history (``(epoch, start_lsn)``, oldest first)."""

    last_lsn: int
    last_epoch: int
    new_boundaries: list[tuple[int, int]]


def check_entries(
    entries: Sequence[EntryLike], *, prev_lsn: int, prev_epoch: int, max_epoch: int
) -> EntriesChecked | EntryProblem:
    """Checks that ``entries`` continue a log ending at ``prev_lsn`` (of ``prev_epoch``):
    LSNs consecutive, epochs in 1..``max_epoch`` and never decreasing, each entry's
    CRC-32 over its operation. The rules of a streamed batch (``Follower.on_batch``) and
    of a reorganization fetch (``TakingMaster._sync_from``) alike."""
    new_boundaries: list[tuple[int, int]] = []
    for entry in entries:
        lsn, entry_epoch = entry.lsn, entry.epoch
        if lsn != prev_lsn + 1:
            return EntryProblem(
                RefusalCode.LSN_GAP, lsn, f"entry LSN {lsn} does not follow LSN {prev_lsn}"
            )
        if not 0 < entry_epoch <= max_epoch:
            return EntryProblem(
                RefusalCode.BAD_ENTRY_EPOCH,
                lsn,
                f"entry of epoch {entry_epoch} from the master of epoch {max_epoch}",
            )
        if entry_epoch < prev_epoch:
            return EntryProblem(
                RefusalCode.OLD_EPOCH,
                lsn,
                f"entry of epoch {entry_epoch} after an entry of epoch {prev_epoch}",
            )
        if zlib.crc32(entry.operation) != entry.checksum:
            return EntryProblem(
                RefusalCode.BAD_CHECKSUM,
                lsn,
                f"checksum {entry.checksum:#010x} does not match the operation's "
                f"{zlib.crc32(entry.operation):#010x}",
            )
        if entry_epoch > prev_epoch:
            new_boundaries.append((entry_epoch, lsn))
        prev_lsn, prev_epoch = lsn, entry_epoch
    return EntriesChecked(prev_lsn, prev_epoch, new_boundaries)


class Follower:
    """One slave's replication state: its epoch and master, its log's tail, its acks."""

    def __init__(
        self,
        config: FollowerConfig,
        *,
        cluster_id: str,
        epoch: int,
        master_id: str,
        last_lsn: int,
        history: Iterable[tuple[int, int] | BoundaryLike],
        commit_lsn: int = 0,
        synced_lsn: int = 0,
        snapshot_lsn: int = 0,
    ) -> None:
        """A follower of ``master_id`` in ``epoch``, over a store whose log ends at last_lsn.

        ``synced_lsn``: what is known flushed (0 if unknown; ``on_synced`` raises it);
        ``snapshot_lsn``: the LSN of the snapshot the log continues from (0: none).
        """
        config.validate()
        self.config = config
        try:
            self._history = check_history(history, last_lsn)
        except HistoryError as exc:
            raise FollowerError(f"the store's own log: {exc}") from None
        if not 0 <= epoch <= UINT64_MAX:
            raise FollowerError(f"epoch {epoch} is not a uint64")
        if not 0 <= synced_lsn <= last_lsn or not 0 <= snapshot_lsn <= last_lsn:
            raise FollowerError(
                f"synced LSN {synced_lsn} and snapshot LSN {snapshot_lsn} must be within "
                f"0..{last_lsn}"
            )
        if commit_lsn < 0:
            raise FollowerError(f"commit LSN {commit_lsn} is negative")
        self._cluster_id = cluster_id
        self._epoch = epoch
        self._master_id = master_id
        self._last_lsn = last_lsn
        self._last_epoch = epoch_at(self._history, last_lsn)
        if self._last_epoch > epoch:
            raise FollowerError(f"the log holds epoch {self._last_epoch}, newer than {epoch}")
        self._known_commit = commit_lsn
        self._received = last_lsn
        self._written = last_lsn
        self._synced = synced_lsn
        self._snapshot_lsn = snapshot_lsn
        self._stream_open = False
        self._snap_next = 0  # the next chunk index expected
        self._snap_lsn = -1  # the staged snapshot's LSN, -1 when none is in progress
        self._snap_epoch = 0

    # --- queries

    @property
    def epoch(self) -> int:
        """The epoch this replica follows."""
        return self._epoch

    @property
    def last_lsn(self) -> int:
        """The last LSN accepted (received)."""
        return self._last_lsn

    @property
    def commit_lsn(self) -> int:
        """The highest LSN committed reads may serve here: known committed and written."""
        return min(self._known_commit, self._written)

    def ack(self) -> Ack:
        """The current ack."""
        return Ack(self._received, self._written, self._synced)

    def state(self) -> FollowerState:
        """A frozen copy of everything the follower holds."""
        return FollowerState(
            node_id=self.config.node_id,
            cluster_id=self._cluster_id,
            epoch=self._epoch,
            master_id=self._master_id,
            last_lsn=self._last_lsn,
            last_epoch=self._last_epoch,
            history=self._history,
            known_commit_lsn=self._known_commit,
            received_lsn=self._received,
            written_lsn=self._written,
            synced_lsn=self._synced,
            snapshot_lsn=self._snapshot_lsn,
            stream_open=self._stream_open,
            snapshot_next_index=self._snap_next,
            snapshot_staging_lsn=self._snap_lsn,
        )

    # --- role and local store

    def set_role(self, epoch: int, master_id: str) -> None:
        """The coordinator's role command (already persisted): follow master_id in epoch.

        Any open stream is closed: the next message must be a Hello of this epoch.
        """
        if epoch < self._epoch:
            raise FollowerError(f"role epoch {epoch} is older than the current {self._epoch}")
        if not master_id or master_id == self.config.node_id:
            raise FollowerError(f"master id {master_id!r}: a slave follows another node")
        self._epoch = epoch
        self._master_id = master_id
        self._close_stream()

    def reset(
        self,
        *,
        last_lsn: int,
        history: Iterable[tuple[int, int] | BoundaryLike],
        synced_lsn: int = 0,
        commit_lsn: int | None = None,
    ) -> None:
        """Re-reads the log's tail from the store (after a failed write); closes the stream.

        ``commit_lsn``: the commit LSN the store recorded, when the write failed. The
        failed batch's commit LSN may cover entries that batch was to truncate and the
        store still holds: kept, it would refuse every later truncation of them as
        removing committed entries, and the slave could never follow again (found by the
        replication simulator, tests/sim/replication_sim.py, once a slave's store could be
        full)."""
        try:
            self._history = check_history(history, last_lsn)
        except HistoryError as exc:
            raise FollowerError(f"the store's own log: {exc}") from None
        if not 0 <= synced_lsn <= last_lsn:
            raise FollowerError(f"synced LSN {synced_lsn} outside 0..{last_lsn}")
        self._last_lsn = self._received = self._written = last_lsn
        self._last_epoch = epoch_at(self._history, last_lsn)
        self._synced = synced_lsn
        self._snapshot_lsn = min(self._snapshot_lsn, last_lsn)
        if commit_lsn is not None:
            self._known_commit = min(self._known_commit, commit_lsn)
        self._close_stream()

    def on_written(self, lsn: int, *, synced: bool) -> Ack:
        """The store wrote everything accepted up to lsn (and flushed it when synced)."""
        if not self._written <= lsn <= self._received:
            raise FollowerError(
                f"written LSN {lsn} outside {self._written}..{self._received} (accepted)"
            )
        self._written = lsn
        if synced:
            self._synced = lsn
        return self.ack()

    def on_synced(self, lsn: int) -> Ack:
        """The store flushed everything up to lsn (an OS or periodic flush)."""
        if lsn > self._written:
            raise FollowerError(f"synced LSN {lsn} beyond the written LSN {self._written}")
        self._synced = max(self._synced, lsn)
        return self.ack()

    # --- the stream

    def on_hello(self, *, master_id: str, epoch: int, cluster_id: str) -> HelloAccepted | Refusal:
        """A master opens a stream. Accepted only from this epoch's master, of this cluster.

        Answer a Hello only once every accepted entry is written (``on_written``), so the
        Position reports a log the store holds.
        """
        if not cluster_id:
            return self._refuse(RefusalCode.WRONG_CLUSTER, "a Hello without a cluster id")
        if self._cluster_id and cluster_id != self._cluster_id:
            return self._refuse(
                RefusalCode.WRONG_CLUSTER,
                f"cluster {_show(cluster_id)} is not this store's cluster {self._cluster_id}",
            )
        refusal = self._check_epoch(epoch, master_id)
        if refusal is not None:
            return refusal
        if self._written != self._received:
            raise FollowerError(
                f"Hello answered with LSNs {self._written + 1}..{self._received} not written"
            )
        adopt = "" if self._cluster_id else cluster_id
        self._cluster_id = cluster_id
        discard = self._snap_lsn >= 0
        self._close_stream()
        self._stream_open = True
        position = Position(self.config.node_id, self._last_epoch, self._last_lsn, self._history)
        return HelloAccepted(position, adopt_cluster_id=adopt, discard_snapshot=discard)

    def on_heartbeat(self, *, epoch: int, commit_lsn: int) -> Ack | Refusal:
        """A heartbeat: learns the commit LSN; answer with the returned Ack."""
        refusal = self._check_stream(epoch)
        if refusal is not None:
            return refusal
        if not 0 <= commit_lsn <= UINT64_MAX:
            return self._refuse(RefusalCode.OUT_OF_ORDER, f"commit LSN {commit_lsn}")
        self._known_commit = max(self._known_commit, commit_lsn)
        return self.ack()

    def on_batch(
        self,
        *,
        epoch: int,
        entries: Sequence[E],
        commit_lsn: int,
        truncate_after_lsn: int | None,
    ) -> BatchAccepted[E] | Refusal:
        """Checks a batch completely, then accepts it; a refusal changes nothing."""
        refusal = self._check_stream(epoch)
        if refusal is not None:
            return refusal
        if self._snap_lsn >= 0:
            return self._refuse(RefusalCode.OUT_OF_ORDER, "an entry batch inside a snapshot")
        if not 0 <= commit_lsn <= UINT64_MAX:
            return self._refuse(RefusalCode.OUT_OF_ORDER, f"commit LSN {commit_lsn}")
        cfg = self.config
        if len(entries) > cfg.inflight_entries_max:
            return self._refuse(
                RefusalCode.TOO_LARGE,
                f"a batch of {len(entries)} entries; at most {cfg.inflight_entries_max}",
            )
        if len(entries) > 1:
            size_bytes = sum(entry_size_bytes(entry) for entry in entries)
            if size_bytes > cfg.inflight_bytes_max:
                return self._refuse(
                    RefusalCode.TOO_LARGE,
                    f"a batch of {size_bytes} bytes; at most {cfg.inflight_bytes_max}",
                )
        base_lsn, history = self._last_lsn, self._history
        truncate: int | None = None
        if truncate_after_lsn is not None and truncate_after_lsn != self._last_lsn:
            t = truncate_after_lsn
            if not 0 <= t < self._last_lsn:
                return self._refuse(
                    RefusalCode.LSN_GAP,
                    f"truncate after LSN {t}, beyond the log's end {self._last_lsn}",
                    lsn=t,
                )
            if t < self._known_commit:
                return self._refuse(
                    RefusalCode.TRUNCATE_BELOW_COMMIT,
                    f"truncate after LSN {t} would remove committed entries "
                    f"(commit LSN {self._known_commit})",
                    lsn=t,
                )
            if t < self._snapshot_lsn:
                return self._refuse(
                    RefusalCode.TRUNCATE_BELOW_SNAPSHOT,
                    f"truncate after LSN {t}, inside the snapshot at {self._snapshot_lsn}",
                    lsn=t,
                )
            truncate, base_lsn, history = t, t, truncate_history(self._history, t)
        checked = check_entries(
            entries, prev_lsn=base_lsn, prev_epoch=epoch_at(history, base_lsn), max_epoch=epoch
        )
        if isinstance(checked, EntryProblem):
            return self._refuse(checked.code, checked.detail, lsn=checked.lsn)
        new_boundaries = checked.new_boundaries
        prev_lsn, prev_epoch = checked.last_lsn, checked.last_epoch
        if len(history) + len(new_boundaries) > HISTORY_BOUNDARIES_MAX:
            return self._refuse(RefusalCode.TOO_LARGE, "the epoch history would grow too long")
        # Everything checked: accept.
        if truncate is not None:
            self._written = min(self._written, truncate)
            self._synced = min(self._synced, truncate)
        if new_boundaries:
            self._history = (*history, *new_boundaries)
        else:
            self._history = history
        self._last_lsn, self._last_epoch = prev_lsn, prev_epoch
        self._received = prev_lsn
        self._known_commit = max(self._known_commit, commit_lsn)
        write_needed = truncate is not None or bool(entries)
        ack_now = None
        if not write_needed or self.config.sync_policy == SyncPolicy.NO_SYNC:
            ack_now = self.ack()
        return BatchAccepted(
            truncate_after_lsn=truncate,
            entries=entries,
            sync=self.config.sync_policy == SyncPolicy.SYNC,
            last_lsn=prev_lsn,
            ack_now=ack_now,
        )

    def on_snapshot_chunk(
        self,
        *,
        index: int,
        snapshot_lsn: int,
        snapshot_epoch: int,
        last: bool,
        history: Iterable[tuple[int, int] | BoundaryLike] = (),
    ) -> SnapshotAccepted | Refusal:
        """One chunk of a snapshot on the open stream (the last carries the history)."""
        if not self._stream_open:
            return self._refuse(RefusalCode.NO_STREAM, "a snapshot chunk before a Hello")
        if index == 0:
            if not 0 <= snapshot_lsn <= UINT64_MAX:
                return self._refuse(RefusalCode.BAD_SNAPSHOT, f"snapshot LSN {snapshot_lsn}")
            if snapshot_lsn < min(self._known_commit, self._last_lsn):
                return self._refuse(
                    RefusalCode.BAD_SNAPSHOT,
                    f"a snapshot at LSN {snapshot_lsn} is older than this replica's committed "
                    f"LSN {min(self._known_commit, self._last_lsn)}",
                    lsn=snapshot_lsn,
                )
            if self._written != self._received:
                raise FollowerError("a snapshot begun with accepted entries not yet written")
        elif self._snap_lsn < 0 or index != self._snap_next:
            return self._refuse(
                RefusalCode.BAD_SNAPSHOT,
                f"snapshot chunk {index}; expected "
                + (str(self._snap_next) if self._snap_lsn >= 0 else "chunk 0"),
            )
        elif snapshot_lsn != self._snap_lsn or snapshot_epoch != self._snap_epoch:
            return self._refuse(
                RefusalCode.BAD_SNAPSHOT,
                f"chunk {index} is of the snapshot at LSN {snapshot_lsn} epoch {snapshot_epoch}, "
                f"not {self._snap_lsn} epoch {self._snap_epoch}",
                lsn=snapshot_lsn,
            )
        snap_history: History = ()
        if last:
            try:
                snap_history = as_history(history)
            except (HistoryError, TypeError, ValueError) as exc:
                return self._refuse(RefusalCode.BAD_SNAPSHOT, f"bad epoch history: {exc}")
            problem = history_problem(snap_history, snapshot_lsn)
            if problem is None and epoch_at(snap_history, snapshot_lsn) != snapshot_epoch:
                problem = (
                    f"snapshot epoch {snapshot_epoch}, but the history gives "
                    f"{epoch_at(snap_history, snapshot_lsn)}"
                )
            if problem is None and snapshot_epoch > self._epoch:
                problem = f"snapshot epoch {snapshot_epoch} is newer than epoch {self._epoch}"
            if problem is not None:
                return self._refuse(RefusalCode.BAD_SNAPSHOT, problem, lsn=snapshot_lsn)
        # Accepted.
        if index == 0:
            self._snap_lsn, self._snap_epoch = snapshot_lsn, snapshot_epoch
        self._snap_next = index + 1
        if not last:
            return SnapshotAccepted(index, install=False, snapshot_lsn=snapshot_lsn, history=())
        self._history = snap_history
        self._last_lsn = self._received = snapshot_lsn
        self._last_epoch = snapshot_epoch
        self._snapshot_lsn = snapshot_lsn
        # The old log is being replaced: nothing counts as written until the install is.
        self._written = self._synced = 0
        self._snap_lsn, self._snap_next, self._snap_epoch = -1, 0, 0
        return SnapshotAccepted(
            index, install=True, snapshot_lsn=snapshot_lsn, history=snap_history
        )

    # --- internals

    def _close_stream(self) -> None:
        self._stream_open = False
        self._snap_lsn, self._snap_next, self._snap_epoch = -1, 0, 0

    def _check_epoch(self, epoch: int, master_id: str) -> Refusal | None:
        if epoch < self._epoch:
            return self._refuse(
                RefusalCode.STALE_EPOCH, f"epoch {epoch} is older than this replica's epoch"
            )
        if epoch > self._epoch:
            return self._refuse(
                RefusalCode.FUTURE_EPOCH, f"epoch {epoch} is not yet this replica's epoch"
            )
        if master_id != self._master_id:
            return self._refuse(
                RefusalCode.WRONG_MASTER,
                f"node {_show(master_id)} is not epoch {epoch}'s master {self._master_id}",
            )
        return None

    def _check_stream(self, epoch: int) -> Refusal | None:
        if epoch < self._epoch:
            return self._refuse(
                RefusalCode.STALE_EPOCH, f"epoch {epoch} is older than this replica's epoch"
            )
        if epoch > self._epoch:
            return self._refuse(
                RefusalCode.FUTURE_EPOCH, f"epoch {epoch} is not yet this replica's epoch"
            )
        if not self._stream_open:
            return self._refuse(RefusalCode.NO_STREAM, "no Hello accepted on this stream")
        return None

    def _refuse(self, code: RefusalCode, detail: str, *, lsn: int | None = None) -> Refusal:
        return Refusal(
            code=code,
            node_id=self.config.node_id,
            epoch=self._epoch,
            lsn=self._last_lsn if lsn is None else lsn,
            last_lsn=self._last_lsn,
            detail=detail,
        )


def _show(text: str) -> str:
    """A peer-supplied string, quoted and cut short for a message."""
    if len(text) > _SHOWN_CHARS_MAX:
        return repr(text[:_SHOWN_CHARS_MAX] + "...")
    return repr(text)
