"""``Store``: the replica's log and state on a KV, the one object the rest of the replica
uses (the package docstring is its contract). It owns the KV and its transactions and
leaves the records, the batch apply and the snapshots to ``records``, ``apply`` and
``snapshot``."""

from __future__ import annotations

import os
import zlib
from collections.abc import Generator, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType

from google.protobuf.message import DecodeError

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.batch_bytes import framed_event_bytes
from squall_server.replica.divergence import (
    UINT64_MAX,
    BoundaryLike,
)
from squall_server.replica.store.apply import Batch, LogTail
from squall_server.replica.store.errors import (
    CorruptRecordError,
    InvalidEntryError,
    LogCompactedError,
    SnapshotError,
    StaleEpochError,
    StoreError,
    StoreFullError,
    StoreWriteError,
    UnknownTopicError,
)
from squall_server.replica.store.kv import (
    KV,
    MAX_KEY_BYTES,
    KVCorruptError,
    KVError,
    KVFullError,
    ReadTxn,
    WriteTxn,
)
from squall_server.replica.store.kv_lmdb import LmdbKV
from squall_server.replica.store.kv_memory import MemoryKV
from squall_server.replica.store.records import (
    DATABASES,
    DB_CURSORS,
    DB_DEDUPE,
    DB_EVENTS,
    DB_LINKS,
    DB_LOG,
    DB_META,
    DB_PUBLISHERS,
    DB_PUSH,
    DB_SHARED,
    DB_TOPICS,
    DEDUPE_RECORD,
    LIVE_DATABASES,
    META_CLUSTER_ID,
    META_COMMIT,
    META_EPOCH,
    META_LOG_START,
    META_MAX_SEEN,
    META_SHUTDOWN_ID,
    META_SNAPSHOT_PENDING,
    META_STATE,
    META_UNCOMMITTED,
    SHARED_ACKED,
    SHARED_PENDING,
    STATES,
    U16,
    U64,
    U64X2,
    DedupeHit,
    PushSubscriber,
    StoreMeta,
    TopicInfo,
    clear_state,
    cursor_state,
    decode_topic,
    decode_uncommitted,
    event_matches,
    publisher_prefix,
    push_subscriber,
    put_text,
    put_u64,
    raise_commit,
    raise_commit_from,
    read_log_start,
    read_log_tail,
    read_meta,
    read_text,
    read_topic,
    read_u64,
    shared_offset_state,
    shared_prefix,
    unpack,
    unseal,
)
from squall_server.replica.store.snapshot import (
    SNAPSHOT_BYTES_MAX_DEFAULT,
    SNAPSHOT_RECORDS_MAX_DEFAULT,
    SNAPSHOT_UNCOMMITTED_MAX,
    abort_install,
    begin_install,
    export_chunks,
    finish_install,
    install_records,
    read_pending,
)
from squall_server.replica.store.stall import StallMeter

DEDUPE_WINDOW_DEFAULT = 100_000


COMPACT_BATCH_ENTRIES_DEFAULT = 10_000


def _read_error(exc: KVError) -> StoreError:
    """The store error a KV error of a read becomes."""
    if isinstance(exc, KVCorruptError):
        return CorruptRecordError(exc.db, b"", str(exc))
    return StoreError(f"read failed: {exc}")


class _TranslatedRead:
    """A KV read transaction's context manager whose KV errors (opening it, in the
    with-block, closing it) become store errors; a class rather than a generator, as a
    read is a few microseconds and a publish or a delivery opens several."""

    __slots__ = ("_inner",)

    def __init__(self, inner: AbstractContextManager[ReadTxn]) -> None:
        self._inner = inner

    def __enter__(self) -> ReadTxn:
        try:
            return self._inner.__enter__()
        except KVError as exc:
            raise _read_error(exc) from exc

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        try:
            suppressed = bool(self._inner.__exit__(kind, error, traceback))
        except KVError as exc:
            raise _read_error(exc) from exc
        if not suppressed and isinstance(error, KVError):
            raise _read_error(error) from error
        return suppressed


def _write_error(exc: KVError) -> StoreError:
    """The store error a KV error of a write becomes."""
    if isinstance(exc, KVFullError):
        return StoreFullError(f"store full, write aborted: {exc}")
    if isinstance(exc, KVCorruptError):
        return CorruptRecordError(exc.db, b"", str(exc))
    return StoreWriteError(f"write failed: {exc}")


class _TranslatedWrite:
    """The KV's write transaction as a context manager whose KV errors (opening it, in
    the with-block, committing it) become store errors, timed by the stall meter when
    there is one; a class rather than a generator, as every append opens one."""

    __slots__ = ("_inner", "_kv", "_running", "_sync")

    def __init__(self, kv: KV, sync: bool, meter: StallMeter | None) -> None:
        self._kv = kv
        self._sync = sync
        self._running = None if meter is None else meter.running()
        self._inner: AbstractContextManager[WriteTxn] | None = None

    def __enter__(self) -> WriteTxn:
        running = self._running
        if running is not None:
            running.__enter__()
        try:
            inner = self._inner = self._kv.write(sync=self._sync)
            return inner.__enter__()
        except BaseException as exc:
            if running is not None:
                running.__exit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, KVError):
                raise _write_error(exc) from exc
            raise

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            inner = self._inner
            if inner is not None:
                inner.__exit__(kind, error, traceback)
        except KVError as exc:
            raise _write_error(exc) from exc
        finally:
            if self._running is not None:
                self._running.__exit__(kind, error, traceback)
        if isinstance(error, KVError):
            raise _write_error(error) from error


class Store:
    """The replica's log and state on a KV (open it with open_lmdb or open_memory)."""

    def __init__(self, kv: KV, *, dedupe_window: int = DEDUPE_WINDOW_DEFAULT) -> None:
        """Wraps a KV opened with the names in DATABASES."""
        if dedupe_window < 1:
            raise ValueError(f"dedupe_window must be at least 1, got {dedupe_window}")
        self._kv = kv
        self._dedupe_window = dedupe_window
        self._closed = False
        # (generation, meta) the last append left, for the next (apply.LogTail).
        self._tail: tuple[int, LogTail] | None = None
        # Times each write and flush, so a stuck disk is seen (stall.py); the replica
        # installs one on its clock, a store without one is not timed.
        self.stall_meter: StallMeter | None = None
        # Snapshots installed through this object: the one change of its log below its
        # end it survives (a truncation replaces the object), so a copy of its log's
        # prefix stays one while this is unchanged (rebuild.LmdbTruncator resumes one).
        self.snapshots_installed = 0

    def _timed(self) -> AbstractContextManager[None]:
        """The stall meter's watch over one write or flush (nothing without a meter)."""
        return nullcontext() if self.stall_meter is None else self.stall_meter.running()

    @classmethod
    def open_lmdb(
        cls,
        path: str | os.PathLike[str],
        map_size_bytes: int,
        *,
        dedupe_window: int = DEDUPE_WINDOW_DEFAULT,
        max_readers: int = 126,
        readonly: bool = False,
        lock: bool = True,
    ) -> Store:
        """Opens (or creates) an LMDB store in the directory path.

        readonly: an existing store, read only (the offline tools); lock=False too when no
        process has it open, so nothing at all is written.
        """
        try:
            kv = LmdbKV(
                path,
                DATABASES,
                map_size_bytes=map_size_bytes,
                max_readers=max_readers,
                readonly=readonly,
                lock=lock,
            )
        except KVError as exc:
            raise StoreError(str(exc)) from exc
        store = cls(kv, dedupe_window=dedupe_window)
        if not readonly:
            try:
                store._forget_unstaged_install()
            except BaseException:
                store.close()
                raise
        return store

    def _forget_unstaged_install(self) -> None:
        """An install an older version left unfinished had emptied the live databases and
        written its chunks there (``snapshot.PENDING_STAGED``): empties them, as that
        version's abort did, so the store is as empty as it reported itself (last LSN 0)
        and shows no part of a snapshot."""
        with self._reading() as txn:
            pending = read_pending(txn)
            if pending is None or pending.staged:
                return
        with self._writing(sync=True) as txn:
            clear_state(txn)
            txn.delete(DB_META, META_SNAPSHOT_PENDING)

    @classmethod
    def open_memory(
        cls,
        capacity_bytes: int | None = None,
        *,
        dedupe_window: int = DEDUPE_WINDOW_DEFAULT,
        keep_unsynced: bool = False,
    ) -> Store:
        """Creates an empty in-memory store (capacity_bytes simulates a full map;
        keep_unsynced lets ``MemoryKV.lose_unsynced`` simulate a machine crash)."""
        return cls(
            MemoryKV(DATABASES, capacity_bytes=capacity_bytes, keep_unsynced=keep_unsynced),
            dedupe_window=dedupe_window,
        )

    def close(self) -> None:
        """Closes the store; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._kv.close()

    def size_bytes(self) -> int:
        """Bytes the store occupies (0 once closed)."""
        if self._closed:
            return 0
        try:
            return self._kv.size_bytes()
        except KVError as exc:
            raise StoreError(f"cannot read the store's size: {exc}") from exc

    def _reading(self, *, long_lived: bool = False) -> AbstractContextManager[ReadTxn]:
        """A read transaction, with KV errors turned into store errors.

        long_lived: a KV snapshot transaction, which never blocks the writer.
        """
        if self._closed:
            raise StoreError("the store is closed")
        try:
            return _TranslatedRead(self._kv.snapshot() if long_lived else self._kv.read())
        except KVError as exc:
            raise _read_error(exc) from exc

    def _writing(self, *, sync: bool) -> AbstractContextManager[WriteTxn]:
        """The write transaction, with KV errors turned into store errors."""
        if self._closed:
            raise StoreError("the store is closed")
        return _TranslatedWrite(self._kv, sync, self.stall_meter)

    # --- meta

    def meta(self) -> StoreMeta:
        """The store's metadata (an empty store: state EMPTY, everything else zero)."""
        with self._reading() as txn:
            return read_meta(txn)

    def counts(self) -> dict[str, int]:
        """Records per live database (a staged install's are not counted), from one read
        transaction; ``publishers`` counts the publishers (high-water marks), not the
        topic index that shares their database."""
        with self._reading() as txn:
            counts = {db: txn.count(db) for db in LIVE_DATABASES}
            index = sum(1 for _ in txn.scan(DB_PUBLISHERS, b"\x00", b"\x01"))
            counts[DB_PUBLISHERS] -= index
            return counts

    def set_cluster_id(self, cluster_id: str) -> None:
        """Records the cluster id (flushed); refuses to replace a different one."""
        if not cluster_id:
            raise ValueError("cluster_id must not be empty")
        with self._writing(sync=True) as txn:
            current = read_text(txn, META_CLUSTER_ID)
            if current and current != cluster_id:
                raise ValueError(f"store belongs to cluster {current!r}, not {cluster_id!r}")
            put_text(txn, META_CLUSTER_ID, cluster_id)

    def set_state(self, state: common_pb2.StoreState.ValueType, shutdown_id: str = "") -> None:
        """Records the store state (flushed); CLEAN carries a shutdown id, others none."""
        if state not in STATES:
            raise ValueError(f"unknown store state {state}")
        if (state == common_pb2.STORE_STATE_CLEAN) != bool(shutdown_id):
            raise ValueError("a shutdown id goes with STORE_STATE_CLEAN and only with it")
        with self._writing(sync=True) as txn:
            put_u64(txn, DB_META, META_STATE, state)
            put_text(txn, META_SHUTDOWN_ID, shutdown_id)

    def set_epoch(self, epoch: int) -> None:
        """Records a newly accepted epoch (flushed); raises StaleEpochError if lower."""
        if not 0 <= epoch < 1 << 64:
            raise ValueError(f"epoch {epoch} is not a uint64")
        with self._writing(sync=True) as txn:
            current = read_u64(txn, DB_META, META_EPOCH) or 0
            if epoch < current:
                raise StaleEpochError(f"epoch {epoch} is older than the store's epoch {current}")
            if epoch > current:
                put_u64(txn, DB_META, META_EPOCH, epoch)

    def set_max_seen(self, max_seen: int) -> None:
        """Raises the max seen value (flushed); a lower value is ignored."""
        if not 0 <= max_seen < 1 << 64:
            raise ValueError(f"max_seen {max_seen} is not a uint64")
        with self._writing(sync=True) as txn:
            if max_seen > (read_u64(txn, DB_META, META_MAX_SEEN) or 0):
                put_u64(txn, DB_META, META_MAX_SEEN, max_seen)

    # --- the log

    def append(
        self,
        entries: Sequence[replica_pb2.LogEntry],
        *,
        sync: bool,
        commit_lsn: int | None = None,
    ) -> None:
        """Verifies, stores and applies entries in one transaction; flushed when sync.

        Each entry needs a valid checksum, lsn == last LSN + 1 and an epoch no older than
        the last entry's. An entry of a newer epoch adds an epoch history boundary and
        raises the store's epoch. Any error: nothing of the batch is stored.
        commit_lsn: the highest LSN the caller knows committed; the same transaction
        raises the recorded commit LSN to it (at most the new last LSN), for
        ``StoreMeta.commit_lsn`` after a restart. The entries continue the live log: an
        unfinished snapshot install (a stream that ended mid-install; a stream refuses
        entries inside a snapshot, ``Follower.on_batch``) is dropped in the same
        transaction, and kept when the batch is refused. The meta an append leaves (and
        the topic records it touched) is kept for the next one, which reads them again
        only when anyone wrote in between (``WriteTxn.generation``).
        """
        if not entries:
            return
        with self._writing(sync=sync) as txn:
            known, self._tail = self._tail, None
            generation = txn.generation()
            tail = known[1] if known is not None and known[0] == generation else None
            if tail is None:
                abort_install(txn)
                recorded = read_u64(txn, DB_META, META_COMMIT)
            else:
                # Nothing wrote since the last append, which left no install pending.
                recorded = tail.commit_lsn
            batch = Batch(txn, self._dedupe_window, tail)
            for entry in entries:
                batch.entry(entry)
            batch.finish()
            if commit_lsn is not None:
                recorded = raise_commit_from(txn, commit_lsn, batch.last_lsn, recorded)
        # Committed: the next append begins from this state unless someone writes first.
        self._tail = (generation + 1, batch.tail(recorded))

    def record_commit(self, commit_lsn: int, *, sync: bool = False) -> int:
        """Raises the recorded commit LSN to commit_lsn (at most the last LSN); returns
        the value recorded. A write like append: the caller serializes it."""
        if not 0 <= commit_lsn <= UINT64_MAX:
            raise ValueError(f"commit LSN {commit_lsn} is not a uint64")
        with self._writing(sync=sync) as txn:
            return raise_commit(txn, commit_lsn, read_log_tail(txn)[0])

    def set_commit_lsn(self, commit_lsn: int, *, sync: bool = False) -> None:
        """Records commit_lsn (at most the last LSN) as the commit LSN, even if lower:
        for a store rebuilt by a truncation. Use record_commit otherwise."""
        if not 0 <= commit_lsn <= UINT64_MAX:
            raise ValueError(f"commit LSN {commit_lsn} is not a uint64")
        with self._writing(sync=sync) as txn:
            put_u64(txn, DB_META, META_COMMIT, min(commit_lsn, read_log_tail(txn)[0]))

    def snapshot_uncommitted(self) -> list[tuple[str, int, int]]:
        """What the installed snapshot held above its sender's commit LSN, per topic:
        (topic, first offset, last LSN), by last LSN (see finish_snapshot)."""
        with self._reading() as txn:
            value = txn.get(DB_META, META_UNCOMMITTED)
            if value is None:
                return []
            return decode_uncommitted(unseal(DB_META, META_UNCOMMITTED, value))

    def read_log(self, from_lsn: int, max_entries: int) -> list[replica_pb2.LogEntry]:
        """Up to max_entries verified entries from from_lsn (empty beyond the last).

        Raises LogCompactedError when from_lsn is below the log's start (``log_start_lsn``).
        """
        if from_lsn < 1 or max_entries < 1:
            raise ValueError(f"from_lsn and max_entries must be >= 1 ({from_lsn}, {max_entries})")
        with self._reading() as txn:
            last_lsn, _ = read_log_tail(txn)
            log_start_lsn = read_log_start(txn)
            if from_lsn < log_start_lsn:
                raise LogCompactedError(from_lsn, log_start_lsn)
            stop = min(last_lsn + 1, from_lsn + max_entries)
            out: list[replica_pb2.LogEntry] = []
            for key, value in txn.scan(DB_LOG, U64.pack(from_lsn), U64.pack(stop)):
                lsn = from_lsn + len(out)
                if key != U64.pack(lsn):
                    raise CorruptRecordError(DB_LOG, U64.pack(lsn), "entry missing")
                try:
                    entry = replica_pb2.LogEntry.FromString(unseal(DB_LOG, key, value))
                except DecodeError:
                    raise CorruptRecordError(DB_LOG, key, "entry does not parse") from None
                if entry.lsn != lsn or zlib.crc32(entry.operation) != entry.checksum:
                    raise CorruptRecordError(DB_LOG, key, "entry LSN or checksum wrong")
                out.append(entry)
            if from_lsn + len(out) < stop:
                raise CorruptRecordError(DB_LOG, U64.pack(from_lsn + len(out)), "entry missing")
            return out

    def log_start_lsn(self) -> int:
        """The first LSN still in the log: 1 unless compacted or installed from a snapshot.

        The log holds log_start_lsn..last_lsn; log_start_lsn == last_lsn + 1 is an empty
        log continuing from a snapshot at last_lsn.
        """
        with self._reading() as txn:
            return read_log_start(txn)

    def compact_log(
        self, keep_from_lsn: int, *, batch_entries: int = COMPACT_BATCH_ENTRIES_DEFAULT
    ) -> int:
        """Deletes the log entries below keep_from_lsn; returns how many it deleted.

        Never deletes the last entry, so at most up to min(keep_from_lsn, last LSN).
        Deletes batch_entries per write transaction (not flushed: a crash only leaves more
        log), each also moving the recorded log start, so readers never see a gap. A write
        like append: the caller serializes it with the other writes. Idempotent. The live
        log is compacted even while a snapshot install is staged (it is the log served
        until the install finishes).
        """
        if keep_from_lsn < 1 or batch_entries < 1:
            raise ValueError(
                f"keep_from_lsn and batch_entries must be >= 1 ({keep_from_lsn}, {batch_entries})"
            )
        with self._reading() as txn:
            start = read_log_start(txn)
            target = min(keep_from_lsn, read_log_tail(txn)[0])
        deleted = 0
        for _ in range(max(0, -(-(target - start) // batch_entries))):
            with self._writing(sync=False) as txn:
                start = read_log_start(txn)
                if start >= target:
                    break  # another writer got here first
                end = min(target, start + batch_entries)
                deleted += txn.delete_range(DB_LOG, U64.pack(start), U64.pack(end))
                put_u64(txn, DB_META, META_LOG_START, end)
        return deleted

    def sync(self) -> None:
        """Flushes everything committed to disk."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            with self._timed():
                self._kv.sync()
        except KVError as exc:
            raise StoreWriteError(f"sync failed: {exc}") from exc

    # --- snapshots

    def snapshot_chunks(
        self,
        records_max: int = SNAPSHOT_RECORDS_MAX_DEFAULT,
        bytes_max: int = SNAPSHOT_BYTES_MAX_DEFAULT,
    ) -> Generator[replica_pb2.SnapshotChunk, None, None]:
        """The store's state as snapshot chunks, all read from ONE read transaction.

        The transaction opens when the first chunk is asked for, so the first chunk's
        ``snapshot_lsn`` (the last LSN then) is the snapshot's; writes may go on while
        the chunks are consumed and none of them shows. The generator holds the
        transaction until it is exhausted or closed: the caller MUST close it if it stops
        early (``with contextlib.closing(store.snapshot_chunks()) as chunks:``); on LMDB
        an open export keeps the pages it reads from being reused.

        Each chunk has at most records_max records and, unless one record alone is
        bigger, serializes to at most bytes_max bytes. Records: every record of
        ``SNAPSHOT_DBS`` in that order and key order (of meta only the state keys), each
        verified before it is sent. Every chunk carries index (from 0), snapshot_lsn and
        snapshot_epoch; the last one ``last`` and the epoch history. The log is not
        included: the receiver's log continues from snapshot_lsn + 1. An unfinished
        install of this store's own is not part of it (it is staged apart).
        """
        if records_max < 1 or bytes_max < 1:
            raise ValueError(f"records_max {records_max}, bytes_max {bytes_max}: both >= 1")
        return self._export(records_max, bytes_max)

    def _export(
        self, records_max: int, bytes_max: int
    ) -> Generator[replica_pb2.SnapshotChunk, None, None]:
        """The generator behind snapshot_chunks; its with-block releases the transaction."""
        with self._reading(long_lived=True) as txn:
            yield from export_chunks(txn, records_max, bytes_max)

    def begin_snapshot(self, snapshot_lsn: int, snapshot_epoch: int, *, sync: bool = True) -> None:
        """Starts installing a snapshot: marks it pending, with nothing staged yet.

        One transaction (flushed when sync). The chunks are staged apart: until
        finish_snapshot swaps them in, the store keeps, serves and reports the state and
        log it held (its last LSN and epoch, its topics), across restarts too. A pending
        install from before is discarded (what it staged is dropped), and so is this one
        by an append (entries continue the live log) or abort_snapshot.
        """
        if (
            not 0 <= snapshot_lsn <= UINT64_MAX
            or not 0 <= snapshot_epoch <= UINT64_MAX
            or (snapshot_lsn == 0) != (snapshot_epoch == 0)
        ):
            raise SnapshotError(
                f"a snapshot at LSN {snapshot_lsn} epoch {snapshot_epoch}: LSN and epoch are "
                "uint64s, both 0 or neither"
            )
        with self._writing(sync=sync) as txn:
            begin_install(txn, snapshot_lsn, snapshot_epoch)

    def install_chunk(self, chunk: replica_pb2.SnapshotChunk, *, sync: bool = False) -> int:
        """Stages one chunk's records in one transaction; returns how many.

        The chunk must be the next (index 0, 1, ...) of the snapshot begun, its records
        in snapshot order and each with a valid checksum; otherwise SnapshotError (or
        CorruptRecordError for a checksum) and nothing of the chunk is written. Install
        every chunk, the last included, then call finish_snapshot.
        """
        with self._writing(sync=sync) as txn:
            install_records(txn, chunk)
        return len(chunk.records)

    def finish_snapshot(
        self,
        history: Iterable[tuple[int, int] | BoundaryLike],
        *,
        sync: bool = True,
        commit_lsn: int = 0,
        uncommitted: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        """Ends the install: the state is the snapshot's, the log ends at its LSN and epoch.

        One transaction (flushed when sync): the live state and log emptied, the staged
        records moved in (the staging databases emptied), last LSN and epoch, the epoch
        history, log start = snapshot LSN + 1, the store's epoch raised to the snapshot's
        if lower, and the pending mark cleared. SnapshotError (nothing changed) if no
        install is pending, its last chunk is not installed, or the history does not fit
        it; any failure leaves the old state and the staged install as they were.

        commit_lsn: the sender's commit LSN (recorded, at most the snapshot's LSN);
        uncommitted: (topic, first offset, last LSN) per topic with publishes in the
        snapshot above it, recorded for ``snapshot_uncommitted``: the snapshot's state
        cannot be hidden event by event from its log, which it does not include.
        SnapshotError for a malformed list (a last LSN outside commit_lsn+1..snapshot
        LSN, an empty topic, a topic twice, too many).
        """
        if len(uncommitted) > SNAPSHOT_UNCOMMITTED_MAX:
            raise SnapshotError(
                f"finish: {len(uncommitted)} topics with uncommitted publishes; at most "
                f"{SNAPSHOT_UNCOMMITTED_MAX}"
            )
        with self._writing(sync=sync) as txn:
            finish_install(txn, history, commit_lsn, uncommitted)
        self.snapshots_installed += 1

    def abort_snapshot(self) -> bool:
        """Abandons an unfinished install (flushed): what it staged is dropped, the state
        and log stay the ones the store held before it.

        Returns whether one was pending. Not needed before a new begin_snapshot or an
        append (which discard it too).
        """
        with self._writing(sync=True) as txn:
            return abort_install(txn)

    # --- state

    def get_topic(self, name: str) -> TopicInfo | None:
        """The topic, or None."""
        with self._reading() as txn:
            row = read_topic(txn, name)
            return None if row is None else row.info()

    def list_topics(self) -> list[TopicInfo]:
        """Every topic, ordered by name."""
        with self._reading() as txn:
            return [decode_topic(k, v).info() for k, v in txn.scan(DB_TOPICS)]

    def read_events(
        self,
        topic: str,
        from_offset: int,
        max_events: int,
        end_offset: int = 0,
        *,
        max_bytes: int = 0,
        topic_id: int = 0,
    ) -> list[common_pb2.Event]:
        """Verified events from from_offset up to (not including) end_offset (0: no end).

        Returns at most max_events events and, when max_bytes > 0, stops before the
        events' encoded bytes in a response message exceed it (batch_bytes.py; but returns
        at least one event). Empty at or beyond
        the topic's end; raises UnknownTopicError for a topic the store does not hold, or
        (topic_id > 0) whose incarnation is not topic_id: a reader that began on a topic
        destroyed since never reads the one created again under its name.
        """
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        with self._reading() as txn:
            row = read_topic(txn, topic)
            if row is None:
                raise UnknownTopicError(f"no topic {topic!r}")
            if topic_id and row.topic_id != topic_id:
                raise UnknownTopicError(f"topic {topic!r} was destroyed (and created again)")
            start = max(from_offset, row.first_offset)
            stop = row.next_offset if end_offset <= 0 else min(end_offset, row.next_offset)
            stop = min(stop, start + max_events)
            out: list[common_pb2.Event] = []
            if start >= stop:
                return out
            size_bytes = 0
            expect = start
            lo, hi = U64X2.pack(row.topic_id, start), U64X2.pack(row.topic_id, stop)
            for key, value in txn.scan(DB_EVENTS, lo, hi):
                if key != U64X2.pack(row.topic_id, expect):
                    break  # reported as missing below
                encoded = unseal(DB_EVENTS, key, value)
                try:
                    ev = common_pb2.Event.FromString(encoded)
                except DecodeError:
                    raise CorruptRecordError(DB_EVENTS, key, "event does not parse") from None
                if ev.offset != expect or ev.topic != topic:
                    raise CorruptRecordError(DB_EVENTS, key, "event topic or offset wrong")
                size_bytes += framed_event_bytes(len(encoded))
                if max_bytes > 0 and out and size_bytes > max_bytes:
                    return out
                out.append(ev)
                expect += 1
            if expect < stop:
                raise CorruptRecordError(
                    DB_EVENTS, U64X2.pack(row.topic_id, expect), "event missing"
                )
            return out

    def get_cursor(self, topic: str, subscription: str) -> int | None:
        """The subscription's cursor (next offset to deliver), or None."""
        with self._reading() as txn:
            row = read_topic(txn, topic)
            raw = subscription.encode()
            if row is None or not raw:
                return None
            return read_u64(txn, DB_CURSORS, U64.pack(row.topic_id) + raw)

    def list_subscriptions(self, topic: str) -> list[tuple[str, int]]:
        """(name, cursor) of every subscription of the topic, by name."""
        with self._reading() as txn:
            row = read_topic(txn, topic)
            if row is None:
                raise UnknownTopicError(f"no topic {topic!r}")
            lo, hi = U64.pack(row.topic_id), U64.pack(row.topic_id + 1)
            out = []
            for key, value in txn.scan(DB_CURSORS, lo, hi):
                (cursor,) = unpack(DB_CURSORS, key, U64, unseal(DB_CURSORS, key, value))
                try:
                    out.append((key[U64.size :].decode(), cursor))
                except UnicodeDecodeError:
                    raise CorruptRecordError(DB_CURSORS, key, "name is not UTF-8") from None
            return out

    def get_shared_settings(
        self, topic: str, subscription: str
    ) -> replica_pb2.SharedCreateOp | None:
        """A shared subscription's settings (one read, no scan), or None."""
        with self._reading() as txn:
            row = read_topic(txn, topic)
            raw = subscription.encode()
            if row is None or not raw or len(raw) > 400:
                return None
            prefix = shared_prefix(row.topic_id, subscription)
            value = txn.get(DB_SHARED, prefix)
            if value is None:
                return None
            try:
                return replica_pb2.SharedCreateOp.FromString(unseal(DB_SHARED, prefix, value))
            except DecodeError:
                raise CorruptRecordError(DB_SHARED, prefix, "settings do not parse") from None

    def list_links(self, topic: str | None = None) -> list[replica_pb2.LinkTopicOp]:
        """The topic links (each with created_lsn set), of one source topic or all,
        ordered by source topic id and destination name."""
        with self._reading() as txn:
            lo, hi = b"", None
            if topic is not None:
                row = read_topic(txn, topic)
                if row is None:
                    return []
                lo, hi = U64.pack(row.topic_id), U64.pack(row.topic_id + 1)
            links: list[replica_pb2.LinkTopicOp] = []
            for key, value in txn.scan(DB_LINKS, lo, hi):
                try:
                    links.append(replica_pb2.LinkTopicOp.FromString(unseal(DB_LINKS, key, value)))
                except DecodeError:
                    raise CorruptRecordError(DB_LINKS, key, "link does not parse") from None
            return links

    def get_shared(self, topic: str, subscription: str) -> SharedState | None:
        """A shared subscription's settings, cursor and per-offset state, or None."""
        with self._reading() as txn:
            row = read_topic(txn, topic)
            raw = subscription.encode()
            if row is None or not raw or len(raw) > 400:
                return None
            prefix = shared_prefix(row.topic_id, subscription)
            value = txn.get(DB_SHARED, prefix)
            cursor_value = txn.get(DB_CURSORS, U64.pack(row.topic_id) + raw)
            if value is None or cursor_value is None:
                return None
            try:
                settings = replica_pb2.SharedCreateOp.FromString(unseal(DB_SHARED, prefix, value))
            except DecodeError:
                raise CorruptRecordError(DB_SHARED, prefix, "settings do not parse") from None
            cursor, generation = cursor_state(U64.pack(row.topic_id) + raw, cursor_value)
            state = SharedState(settings, row.topic_id, cursor, generation, set(), {}, {}, {})
            lo, hi = prefix + U64.pack(0), prefix + b"\xff" * 9
            for key, record in txn.scan(DB_SHARED, lo, hi):
                (offset,) = U64.unpack_from(key, len(prefix))
                failures, kind, text = shared_offset_state(key, record)
                if kind == SHARED_PENDING:
                    if failures and offset >= cursor:
                        state.failures[offset] = failures
                        state.errors[offset] = text
                    continue
                state.acked_by[offset] = text if kind == SHARED_ACKED else ""
                if offset >= cursor:
                    state.done.add(offset)
            return state

    def get_cursor_state(self, topic: str, subscription: str) -> tuple[int, int] | None:
        """(cursor, seek generation) of the subscription, or None; generation 0: never seeked.

        A cursor record is the cursor (8 bytes), followed by the LSN of the seek that last
        moved it once one has (16 bytes): readers of the cursor alone read its first 8.
        """
        with self._reading() as txn:
            row = read_topic(txn, topic)
            raw = subscription.encode()
            if row is None or not raw:
                return None
            key = U64.pack(row.topic_id) + raw
            value = txn.get(DB_CURSORS, key)
            return None if value is None else cursor_state(key, value)

    def list_subscription_states(self, topic: str) -> list[tuple[str, int, int]]:
        """(name, cursor, seek generation) of every subscription of the topic, by name."""
        with self._reading() as txn:
            row = read_topic(txn, topic)
            if row is None:
                raise UnknownTopicError(f"no topic {topic!r}")
            lo, hi = U64.pack(row.topic_id), U64.pack(row.topic_id + 1)
            out = []
            for key, value in txn.scan(DB_CURSORS, lo, hi):
                cursor, generation = cursor_state(key, value)
                try:
                    out.append((key[U64.size :].decode(), cursor, generation))
                except UnicodeDecodeError:
                    raise CorruptRecordError(DB_CURSORS, key, "name is not UTF-8") from None
            return out

    def offset_at_time(self, topic: str, timestamp_ms: int) -> TimeLookup:
        """The first offset whose event has timestamp_ms at or after the given time.

        Binary search over the held events by offset, O(log n) reads. Timestamps are the
        master's wall clock at publish time, so they grow with offsets except across a
        failover to a master whose clock is behind: there the answer is an event at or
        after the time whose predecessor is before it, off by at most the clocks' skew.
        The topic's next offset when every held event is older.
        """
        with self._reading() as txn:
            row = read_topic(txn, topic)
            if row is None:
                raise UnknownTopicError(f"no topic {topic!r}")
            lo, hi = row.first_offset, row.next_offset
            if lo >= hi:
                return TimeLookup(hi, row.first_offset, None)
            first_ms = _event_at(txn, row.topic_id, lo).timestamp_ms
            # Invariant: every offset below lo is older than the time, hi is at or after it.
            while lo < hi:
                mid = (lo + hi) // 2
                if _event_at(txn, row.topic_id, mid).timestamp_ms >= timestamp_ms:
                    hi = mid
                else:
                    lo = mid + 1
            return TimeLookup(lo, row.first_offset, first_ms)

    def get_push_subscriber(self, topic: str, subscriber_id: str) -> PushSubscriber | None:
        """The topic's push subscriber with this id, or None."""
        raw = subscriber_id.encode()
        with self._reading() as txn:
            row = read_topic(txn, topic)
            if row is None or not raw or len(raw) + U64.size > MAX_KEY_BYTES:
                return None
            key = U64.pack(row.topic_id) + raw
            value = txn.get(DB_PUSH, key)
            return None if value is None else push_subscriber(topic, key, value)

    def list_push_subscribers(self, topic: str | None = None) -> list[PushSubscriber]:
        """The push subscribers of one topic (by id), or of every topic (by topic, id).

        Raises UnknownTopicError for a topic the store does not hold.
        """
        with self._reading() as txn:
            if topic is None:
                rows = [decode_topic(k, v) for k, v in txn.scan(DB_TOPICS)]
            else:
                row = read_topic(txn, topic)
                if row is None:
                    raise UnknownTopicError(f"no topic {topic!r}")
                rows = [row]
            out: list[PushSubscriber] = []
            for row in rows:
                lo, hi = U64.pack(row.topic_id), U64.pack(row.topic_id + 1)
                out.extend(push_subscriber(row.name, k, v) for k, v in txn.scan(DB_PUSH, lo, hi))
            return out

    def lookup_sequence(self, publisher_id: str, sequence: int) -> DedupeHit | None:
        """Where (publisher_id, sequence) was stored, if within the dedupe window.

        The window: sequences above the publisher's high-water mark minus dedupe_window.
        A hit always names an event stored now, in the topic as it is now, with this
        publisher id, sequence and LSN: a record whose event is not there (left by an
        incarnation of the topic destroyed since) is not a hit.
        """
        if not publisher_id or sequence <= 0:
            return None
        try:
            prefix = publisher_prefix(publisher_id)
        except InvalidEntryError:
            return None  # an id too long to be stored was never stored
        with self._reading() as txn:
            high_water = read_u64(txn, DB_PUBLISHERS, prefix[U16.size :]) or 0
            if not high_water - self._dedupe_window < sequence <= high_water:
                return None
            # Records are keyed by the last sequence of a run: the first record at or
            # above the sequence is the only run that can hold it.
            for key, value in txn.scan(DB_DEDUPE, prefix + U64.pack(sequence)):
                if not key.startswith(prefix) or len(key) != len(prefix) + U64.size:
                    return None
                body = unseal(DB_DEDUPE, key, value)
                first, first_offset, lsn, epoch = unpack(DB_DEDUPE, key, DEDUPE_RECORD, body)
                if first > sequence:
                    return None
                try:
                    topic = body[DEDUPE_RECORD.size :].decode()
                except UnicodeDecodeError:
                    raise CorruptRecordError(DB_DEDUPE, key, "topic is not UTF-8") from None
                offset = first_offset + sequence - first
                row = read_topic(txn, topic)
                if row is None or not event_matches(txn, row, offset, publisher_id, sequence, lsn):
                    # A record of a destroyed incarnation of the topic (a store written
                    # before destroys removed them): its event is gone, so it proves
                    # nothing and the sequence is new.
                    return None
                return DedupeHit(topic, offset, lsn, epoch)
            return None

    def publisher_high_water(self, publisher_id: str) -> int:
        """The highest sequence stored for the publisher (0 if none)."""
        raw = publisher_id.encode()
        if not raw or len(raw) > MAX_KEY_BYTES:
            return 0
        with self._reading() as txn:
            return read_u64(txn, DB_PUBLISHERS, raw) or 0


@dataclass(frozen=True)
class SharedState:
    """A shared subscription as replicated (Store.get_shared)."""

    settings: replica_pb2.SharedCreateOp
    topic_id: int
    cursor: int  # every offset below it is acked or dead-lettered
    generation: int  # the cursor's seek generation
    done: set[int]  # acked or dead-lettered offsets above the cursor
    failures: dict[int, int]  # failed deliveries of offsets not done
    errors: dict[int, str]  # their last errors
    acked_by: dict[int, str]  # done offsets (also just below the cursor): who acked ("": dead)


@dataclass(frozen=True)
class TimeLookup:
    """Where a time falls in a topic (Store.offset_at_time)."""

    offset: int  # the first event at or after the time (the topic's end when none is)
    first_offset: int  # the oldest event held
    first_timestamp_ms: int | None  # its timestamp; None when the topic holds no event


def _event_at(txn: ReadTxn, topic_id: int, offset: int) -> common_pb2.Event:
    key = U64X2.pack(topic_id, offset)
    value = txn.get(DB_EVENTS, key)
    if value is None:
        raise CorruptRecordError(DB_EVENTS, key, "event missing")
    try:
        return common_pb2.Event.FromString(unseal(DB_EVENTS, key, value))
    except DecodeError:
        raise CorruptRecordError(DB_EVENTS, key, "event does not parse") from None
