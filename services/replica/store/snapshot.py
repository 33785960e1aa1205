"""Snapshots of the store's state: the export as ``SnapshotChunk`` messages from one read
transaction, and the install (begin, chunk by chunk, finish, or abort) with every record
verified again; ``Store`` (``facade``) runs each step in its own transaction.

The install is staged: every chunk's records go to the staging twin of their database
(``STAGED_DBS``), never to the live one, so until ``finish_install`` the replica holds,
serves and reports the state and log it had before (a crash or an abandoned install
leaves them whole). ``finish_install`` swaps in one write transaction: it empties the
live state and log, moves the staged records in and empties the staging databases. The
price is writing the snapshot twice (staged, then live): a replica never gives up the
data it holds before the replacement is complete.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass

from squall.v1 import replica_pb2
from squall_server.replica.divergence import (
    UINT64_MAX,
    BoundaryLike,
    HistoryError,
    check_history,
    epoch_at,
)
from squall_server.replica.store.errors import CorruptRecordError, SnapshotError
from squall_server.replica.store.kv import (
    MAX_KEY_BYTES,
    ReadTxn,
    WriteTxn,
)
from squall_server.replica.store.records import (
    CRC,
    DB_META,
    META_COMMIT,
    META_EPOCH,
    META_HISTORY,
    META_LOG_START,
    META_LOG_TAIL,
    META_SNAPSHOT_KEYS,
    META_SNAPSHOT_PENDING,
    META_UNCOMMITTED,
    SHOWN_CHARS_MAX,
    SNAPSHOT_DBS,
    STAGED_DBS,
    U64X2,
    clear_state,
    encode_uncommitted,
    install_pending,
    put_u64,
    read_history,
    read_log_tail,
    read_u64,
    seal,
    unpack,
    unseal,
)

SNAPSHOT_RECORDS_MAX_DEFAULT = 1000


SNAPSHOT_BYTES_MAX_DEFAULT = 4 << 20


# snapshot lsn, epoch, next chunk index, flags (PENDING_COMPLETE, PENDING_STAGED), db of
# the last record installed (1 + its index in SNAPSHOT_DBS; 0: none yet); then the last
# record's key.
PENDING_RECORD = struct.Struct(">QQQBB")


# The last chunk is installed.
PENDING_COMPLETE = 1


# The chunks go to the staging databases. An install begun by a version without the flag
# wrote them into the live ones, which it had emptied: its chunks cannot be resumed.
PENDING_STAGED = 2


# The most topics a snapshot may list as holding uncommitted publishes (peer input).
SNAPSHOT_UNCOMMITTED_MAX = 1 << 20


# What a SnapshotChunk spends besides its records: index, last, LSN and epoch fields.
CHUNK_HEADER_BYTES = 48


# What a SnapshotRecord in a chunk spends besides its key, value and database name: four
# tags and four length varints (five bytes each covers any record below 4 GiB).
RECORD_OVERHEAD_BYTES = 24


@dataclass
class PendingInstall:
    """The snapshot install in progress, as meta records it."""

    snapshot_lsn: int
    snapshot_epoch: int
    next_index: int
    complete: bool  # the last chunk is installed
    last_db: int  # 1 + SNAPSHOT_DBS index of the last record installed; 0: none yet
    last_key: bytes
    staged: bool = True  # False: begun by an older version, in the live databases

    def encode(self) -> bytes:
        """The sealed record."""
        flags = (PENDING_COMPLETE if self.complete else 0) | (PENDING_STAGED if self.staged else 0)
        head = PENDING_RECORD.pack(
            self.snapshot_lsn, self.snapshot_epoch, self.next_index, flags, self.last_db
        )
        return seal(META_SNAPSHOT_PENDING, head + self.last_key)


def read_pending(txn: ReadTxn) -> PendingInstall | None:
    """Reads the snapshot install in progress, or None."""
    value = txn.get(DB_META, META_SNAPSHOT_PENDING)
    if value is None:
        return None
    body = unseal(DB_META, META_SNAPSHOT_PENDING, value)
    lsn, epoch, index, flags, last_db = unpack(DB_META, META_SNAPSHOT_PENDING, PENDING_RECORD, body)
    key = body[PENDING_RECORD.size :]
    complete, staged = bool(flags & PENDING_COMPLETE), bool(flags & PENDING_STAGED)
    return PendingInstall(lsn, epoch, index, complete, last_db, key, staged)


def _check_staged(pending: PendingInstall, where: str) -> None:
    """Refuses to go on with an install an older version began (see PENDING_STAGED)."""
    if not pending.staged:
        raise SnapshotError(
            f"{where}: the install in progress was begun by an older version, which wrote "
            "its chunks into the live databases: begin the snapshot again"
        )


def uncommitted_problem(
    items: Sequence[tuple[str, int, int]], commit_lsn: int, snapshot_lsn: int
) -> str | None:
    """What is wrong with a snapshot's list of uncommitted publishes, or None."""
    seen: set[str] = set()
    for topic, first_offset, last_lsn in items:
        if not topic or len(topic.encode()) > 0xFFFF:
            return f"an uncommitted publish with a topic name of {len(topic.encode())} bytes"
        if topic in seen:
            return f"topic {topic[:SHOWN_CHARS_MAX]!r} listed twice as uncommitted"
        seen.add(topic)
        if not commit_lsn < last_lsn <= snapshot_lsn:
            return (
                f"an uncommitted publish of {topic[:SHOWN_CHARS_MAX]!r} at LSN {last_lsn}, "
                f"outside {commit_lsn + 1}..{snapshot_lsn}"
            )
        if not 0 <= first_offset <= UINT64_MAX:
            return f"first offset {first_offset} is not a uint64"
    return None


# A database's place in a snapshot: 1 + its index in SNAPSHOT_DBS (0: before any record).
SNAPSHOT_DB_RANK = {db: i + 1 for i, db in enumerate(SNAPSHOT_DBS)}


def snapshot_records(txn: ReadTxn, db: str) -> Iterable[tuple[bytes, bytes]]:
    """(key, sealed value) of a database's records a snapshot carries, in key order."""
    if db != DB_META:
        return txn.scan(db)
    return [
        (key, value)
        for key in sorted(META_SNAPSHOT_KEYS)
        if (value := txn.get(DB_META, key)) is not None
    ]


def check_records(
    chunk: replica_pb2.SnapshotChunk, pending: PendingInstall, where: str
) -> list[tuple[str, list[tuple[bytes, bytes]]]]:
    """Verifies a chunk's records; returns them as runs of one database each.

    Records must follow the snapshot order strictly (database, then key, above the last
    record installed) — which is also what lets LMDB append them; keys must fit the KV;
    of meta only the state keys may come; every value's checksum must hold. Advances
    pending's last record. Raises SnapshotError or CorruptRecordError.
    """
    crc32, unpack_crc, crc_size = zlib.crc32, CRC.unpack_from, CRC.size
    last_rank, last_key = pending.last_db, pending.last_key
    runs: list[tuple[str, list[tuple[bytes, bytes]]]] = []
    items: list[tuple[bytes, bytes]] = []
    run_db, meta_run = "", False
    # The hot loop of an install (one pass per record): the checks on a new database
    # run once per run, the per-record ones are kept few and flat.
    for record in chunk.records:
        db, key, value = record.db, record.key, record.value
        if db != run_db:
            rank = SNAPSHOT_DB_RANK.get(db, 0)
            if not rank:
                raise SnapshotError(f"{where}: a record of database {db[:SHOWN_CHARS_MAX]!r}")
            if rank < last_rank:
                raise SnapshotError(f"{where}: a {db} record after {SNAPSHOT_DBS[last_rank - 1]}")
            if rank > last_rank:
                last_rank, last_key = rank, b""  # a new database: any non-empty key follows
            items = []
            runs.append((db, items))
            run_db, meta_run = db, db == DB_META
        if key <= last_key:
            detail = f"key {key.hex()[:SHOWN_CHARS_MAX]} is out of order" if key else "empty key"
            raise SnapshotError(f"{where}: a {db} record with an {detail}")
        if len(key) > MAX_KEY_BYTES:
            raise SnapshotError(f"{where}: a {db} key of {len(key)} bytes")
        if meta_run and key not in META_SNAPSHOT_KEYS:
            raise SnapshotError(
                f"{where}: meta key {key[:SHOWN_CHARS_MAX]!r} is not state a snapshot carries"
            )
        if len(value) < crc_size or unpack_crc(value)[0] != crc32(value[crc_size:], crc32(key)):
            raise CorruptRecordError(db, key, f"checksum mismatch in snapshot {where}")
        items.append((key, value))
        last_key = key
    pending.last_db, pending.last_key = last_rank, last_key
    return runs


# --- export


def export_chunks(
    txn: ReadTxn, records_max: int, bytes_max: int
) -> Generator[replica_pb2.SnapshotChunk, None, None]:
    """The state read through txn as snapshot chunks (``Store.snapshot_chunks``, which
    holds the transaction open until the generator is done)."""
    # An unfinished install of this store's own is staged apart: the live state is whole.
    snapshot_lsn, snapshot_epoch = read_log_tail(txn)
    history = [
        replica_pb2.EpochBoundary(epoch=b.epoch, start_lsn=b.start_lsn) for b in read_history(txn)
    ]
    # Room for the chunk's other fields, and the history the last chunk carries.
    budget = bytes_max - CHUNK_HEADER_BYTES - sum(b.ByteSize() + 2 for b in history)
    index = count = size = 0
    chunk = replica_pb2.SnapshotChunk(
        index=0, snapshot_lsn=snapshot_lsn, snapshot_epoch=snapshot_epoch
    )
    add = chunk.records.add
    crc32, unpack_crc, crc_size = zlib.crc32, CRC.unpack_from, CRC.size
    for db in SNAPSHOT_DBS:
        overhead = RECORD_OVERHEAD_BYTES + len(db)
        # The hot loop (one pass per record of the store): kept flat on purpose.
        for key, value in snapshot_records(txn, db):
            if len(value) < crc_size or unpack_crc(value)[0] != crc32(value[crc_size:], crc32(key)):
                unseal(db, key, value)  # raises: a damaged record is never sent
            record_bytes = overhead + len(key) + len(value)
            if count and (count >= records_max or size + record_bytes > budget):
                yield chunk
                index += 1
                count = size = 0
                chunk = replica_pb2.SnapshotChunk(
                    index=index, snapshot_lsn=snapshot_lsn, snapshot_epoch=snapshot_epoch
                )
                add = chunk.records.add
            add(db=db, key=key, value=value)
            count += 1
            size += record_bytes
    chunk.last = True
    chunk.history.extend(history)
    yield chunk


# --- install


def clear_staged(txn: WriteTxn) -> None:
    """Empties the staging databases (the live state and log are not touched), and the
    live ones as well under an install an older version began (``PENDING_STAGED``)."""
    pending = read_pending(txn)
    if pending is not None and not pending.staged:
        clear_state(txn)
    for staged in STAGED_DBS.values():
        txn.clear(staged)


def begin_install(txn: WriteTxn, snapshot_lsn: int, snapshot_epoch: int) -> None:
    """Marks an install of the snapshot pending, with nothing staged yet (what an earlier
    unfinished install staged is dropped); the live state and log stay as they are."""
    pending = PendingInstall(snapshot_lsn, snapshot_epoch, 0, False, 0, b"")
    clear_staged(txn)
    txn.put(DB_META, META_SNAPSHOT_PENDING, pending.encode())


def install_records(txn: WriteTxn, chunk: replica_pb2.SnapshotChunk) -> None:
    """Checks a chunk against the install in progress and writes its records to the
    staging databases (``Store.install_chunk``); raises before writing anything."""
    pending = read_pending(txn)
    if pending is None:
        raise SnapshotError(f"chunk {chunk.index}: no snapshot install in progress")
    where = f"chunk {chunk.index} of the snapshot at LSN {chunk.snapshot_lsn}"
    _check_staged(pending, where)
    if (chunk.snapshot_lsn, chunk.snapshot_epoch) != (
        pending.snapshot_lsn,
        pending.snapshot_epoch,
    ):
        raise SnapshotError(
            f"{where} epoch {chunk.snapshot_epoch}: the install in progress is at LSN "
            f"{pending.snapshot_lsn} epoch {pending.snapshot_epoch}"
        )
    if pending.complete or chunk.index != pending.next_index:
        expected = "none (the last is in)" if pending.complete else pending.next_index
        raise SnapshotError(f"{where}: the next chunk expected is {expected}")
    runs = check_records(chunk, pending, where)
    for db, items in runs:
        # Ascending above every key staged so far, into a staging database that
        # begin_install emptied: LMDB appends and packs pages full. Staged meta too: the
        # node's live meta is only replaced by finish_install.
        txn.put_many(STAGED_DBS[db], items, append=True)
    pending.next_index += 1
    pending.complete = chunk.last
    txn.put(DB_META, META_SNAPSHOT_PENDING, pending.encode())


def finish_install(
    txn: WriteTxn,
    history: Iterable[tuple[int, int] | BoundaryLike],
    commit_lsn: int,
    uncommitted: Sequence[tuple[str, int, int]],
) -> None:
    """Ends the install in progress (``Store.finish_snapshot``): in txn, the live state
    and log are emptied, the staged records moved in and the staging databases emptied.
    Raises before writing anything (an error of the KV while moving aborts txn: the old
    state and the staged install stay)."""
    pending = read_pending(txn)
    if pending is None:
        raise SnapshotError("finish: no snapshot install in progress")
    _check_staged(pending, "finish")
    lsn, epoch = pending.snapshot_lsn, pending.snapshot_epoch
    if not pending.complete:
        raise SnapshotError(
            f"finish: the snapshot at LSN {lsn} has chunks {pending.next_index}.. "
            "still to install (the last chunk is not in)"
        )
    try:
        checked = check_history(history, lsn)
    except HistoryError as exc:
        raise SnapshotError(f"finish: the snapshot at LSN {lsn}: {exc}") from None
    if epoch_at(checked, lsn) != epoch:
        raise SnapshotError(
            f"finish: the snapshot at LSN {lsn} is of epoch {epoch}, its history "
            f"says {epoch_at(checked, lsn)}"
        )
    commit = min(commit_lsn, lsn)
    problem = uncommitted_problem(uncommitted, commit, lsn)
    if problem is not None:
        raise SnapshotError(f"finish: the snapshot at LSN {lsn}: {problem}")
    clear_state(txn)
    for db in SNAPSHOT_DBS:
        staged = STAGED_DBS[db]
        if db == DB_META:
            for key, value in list(txn.scan(staged)):
                txn.put(DB_META, key, value)
        else:
            # The staged keys in order, into a database clear_state emptied: appended.
            txn.put_many(db, txn.scan(staged), append=True)
        txn.clear(staged)
    txn.put(DB_META, META_LOG_TAIL, seal(META_LOG_TAIL, U64X2.pack(lsn, epoch)))
    if checked:
        body = b"".join(U64X2.pack(e, start) for e, start in checked)
        txn.put(DB_META, META_HISTORY, seal(META_HISTORY, body))
    put_u64(txn, DB_META, META_LOG_START, lsn + 1)
    if epoch > (read_u64(txn, DB_META, META_EPOCH) or 0):
        put_u64(txn, DB_META, META_EPOCH, epoch)
    put_u64(txn, DB_META, META_COMMIT, commit)
    if uncommitted:
        body = encode_uncommitted(sorted(uncommitted, key=lambda item: item[2]))
        txn.put(DB_META, META_UNCOMMITTED, seal(META_UNCOMMITTED, body))
    txn.delete(DB_META, META_SNAPSHOT_PENDING)


def abort_install(txn: WriteTxn) -> bool:
    """Abandons an unfinished install: what it staged is dropped, the live state and log
    stay as they are; whether one was pending."""
    if not install_pending(txn):
        return False
    clear_staged(txn)
    txn.delete(DB_META, META_SNAPSHOT_PENDING)
    return True
