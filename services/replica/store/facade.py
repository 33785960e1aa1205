"""The replica's store: the replicated log and the state its entries build.

The log is the only way state changes. ``append(entries, sync=...)`` verifies a batch of
log entries, stores them in ``log`` and applies each entry's ``Operation`` to the state
databases, all in ONE key-value transaction: any error leaves nothing of the batch
visible. Group commit is the caller's job (it passes many entries per call);
``sync=True`` flushes to disk before returning, ``sync=False`` (WRITE_NO_SYNC) leaves it
to the operating system. Each entry needs ``crc32(operation) == checksum``,
``lsn == last LSN + 1`` and an epoch no older than the last entry's; the first entry of
a newer epoch adds an epoch history boundary (epoch, LSN) and raises the store's epoch
if it was lower; an ``EpochStartOp`` must be such a first entry.

Log retention: the log holds ``log_start_lsn()``..last LSN. ``compact_log(keep_from)``
deletes the entries below keep_from (never the last entry), in bounded transactions;
``read_log`` below the start raises ``LogCompactedError``: only a snapshot holds them.

Snapshots (for a replica behind the retained log, or with a divergent suffix, since
applied entries cannot be undone): ``snapshot_chunks`` exports every state record from
ONE read transaction, consistent while writes go on, as ``SnapshotChunk`` messages
reflecting ``snapshot_lsn`` (the last LSN then). The receiver installs them with
``begin_snapshot`` (empties its state and log, marks meta ``snapshot_pending``), one
``install_chunk`` per chunk (one transaction each, every record re-verified) and
``finish_snapshot(history)`` (one transaction: the log is empty and continues at
snapshot LSN + 1). An install holds one chunk in memory at a time. A store that stops
with an install pending reports itself empty (last LSN and last epoch 0, no topics, so
the master sends a fresh snapshot) until a new install finishes (or ``abort_snapshot``,
or an append from LSN 1, leaves it truly empty). The node's own meta (cluster id,
shutdown id, store state, epoch, max seen) is never sent.

Synchronous; one writer and many readers: the replica serializes writes (``append``,
``compact_log``, the snapshot install and the meta setters) itself, reads may come from
any thread, each seeing one committed state. Reads: ``meta``, ``log_start_lsn``,
``read_log``, ``get_topic``, ``list_topics`` (by name), ``read_events`` (verified
``common_pb2.Event`` list), ``get_cursor``, ``list_subscriptions``, ``lookup_sequence``,
``publisher_high_water``, ``get_push_subscriber``, ``list_push_subscribers``,
``snapshot_chunks``. ``make_entry`` builds an entry with its
checksum.

The store runs on the ``kv.KV`` interface, with two twins: ``Store.open_lmdb`` and
``Store.open_memory``. Its named databases:

* ``meta``: cluster id, shutdown id, store state, epoch (the newest accepted; never
  decreases), max seen, next topic id, epoch history (epoch, start LSN), the log tail
  (last LSN, last epoch), the log start (absent: 1), a pending snapshot install
  (its LSN and epoch, the next chunk index, the last record installed), the commit LSN
  the node last recorded (``append(commit_lsn=)``, ``record_commit``; absent in stores
  written before it existed) and, after a snapshot install, the publishes the snapshot
  held above its sender's commit LSN (``snapshot_uncommitted``). A restarted replica
  hides everything above the recorded commit LSN from committed reads.
* ``log``: LSN (8 bytes big-endian) -> serialized ``LogEntry``.
* ``topics``: name -> topic id, kind, next offset, first offset, creation time.
* ``events``: topic id + offset (8 + 8 bytes big-endian) -> serialized ``common_pb2.Event``.
* ``cursors``: topic id (8 bytes) + subscription name -> next offset to deliver.
* ``dedupe``: publisher id (2-byte length + UTF-8) + sequence (8 bytes) -> first
  sequence, its offset, LSN, epoch and topic. One record holds a run of consecutive
  sequences at consecutive offsets of one publish and is keyed by its LAST sequence,
  so a publish of n sequenced events costs one record, not n, and the first record at
  or above a sequence is the only one that can hold it.
* ``publishers``: publisher id -> highest sequence stored (the dedupe high-water mark).
  Sequences at or below high water - ``dedupe_window`` are forgotten (pruned). The same
  database holds the index that ties a publisher's dedupe state to topic incarnations,
  under keys starting with a 0 byte (never the first byte of a publisher id, which is
  printable ASCII): ``\x00t`` + topic id + publisher id (the publishers of a topic) and
  ``\x00p`` + the publisher's dedupe prefix + topic id (the topics of a publisher).
  Destroying a topic deletes, with its events, cursors and push subscribers, every dedupe
  record naming it and its index entries, and a publisher's high-water mark once no
  topic of it is left: a topic created again under the name starts clean (its id, the
  incarnation, is new). Dedupe records written before the index existed, or any record
  whose event is gone, are fenced off where they are read: ``lookup_sequence`` returns a
  hit only when the event it names is stored at that offset, under that publisher,
  sequence and LSN, and ``append`` replaces such a stale run instead of refusing the
  entry (docs/architecture.md, "A topic's incarnation").
* ``push``: topic id (8 bytes) + push subscriber id -> cursor (next offset to deliver)
  and the LSN of the entry that subscribed it (8 + 8 bytes), then the serialized
  ``PushSubscribeOp`` that registered it (docs/push-subscribers.md).

Every value starts with a CRC-32 (``zlib.crc32``) of its key and body, checked on every
read: a mismatch raises ``CorruptRecordError`` naming the database and key, and the bad
data is never returned. Topic ids are never reused, so a topic destroyed and created
again starts empty at offset 0.

Errors: ``InvalidEntryError`` refuses a bad entry before anything is written (bad
checksum, LSN gap, older epoch, an operation whose precondition fails: the master
validates requests before it builds entries, so these are programmer or peer errors);
``StoreFullError`` means the LMDB map (or the memory twin's capacity) is full, the batch
was aborted and the store is intact; ``StoreWriteError`` is any other write failure and
is fail-stop: the replica must stop serving rather than guess what was stored.
``StaleEpochError``: ``set_epoch`` below the store's epoch. ``LogCompactedError``:
``read_log`` below the log start. ``SnapshotError``: a snapshot call out of order or a
chunk that does not fit the install (nothing written; a record failing its checksum
raises ``CorruptRecordError``). ``UnknownTopicError``: a topic read (``read_events``,
``list_subscriptions``) of a topic the store does not hold.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from services.replica.divergence import (
    UINT64_MAX,
    BoundaryLike,
    HistoryError,
    check_history,
    epoch_at,
)
from services.replica.store.kv import (
    KV,
    MAX_KEY_BYTES,
    KVCorruptError,
    KVError,
    KVFullError,
    ReadTxn,
    WriteTxn,
)
from services.replica.store.kv_lmdb import LmdbKV
from services.replica.store.kv_memory import MemoryKV
from squall.v1 import common_pb2, replica_pb2

DB_META = "meta"
DB_LOG = "log"
DB_TOPICS = "topics"
DB_EVENTS = "events"
DB_CURSORS = "cursors"
DB_DEDUPE = "dedupe"
DB_PUBLISHERS = "publishers"
DB_PUSH = "push"
# The databases a KV must hold for the store.
DATABASES = (
    DB_META,
    DB_LOG,
    DB_TOPICS,
    DB_EVENTS,
    DB_CURSORS,
    DB_DEDUPE,
    DB_PUBLISHERS,
    DB_PUSH,
)

# The databases a snapshot carries, in the order it carries them (meta: only the keys
# in _META_SNAPSHOT_KEYS). Everything but the log and the receiving node's own meta.
SNAPSHOT_DBS = (DB_META, DB_TOPICS, DB_EVENTS, DB_CURSORS, DB_DEDUPE, DB_PUBLISHERS, DB_PUSH)
# The state databases a snapshot install (and an abandoned one) empties, with the log.
_CLEARED_DBS = (DB_TOPICS, DB_EVENTS, DB_CURSORS, DB_DEDUPE, DB_PUBLISHERS, DB_PUSH, DB_LOG)

DEDUPE_WINDOW_DEFAULT = 100_000
SNAPSHOT_RECORDS_MAX_DEFAULT = 1000
SNAPSHOT_BYTES_MAX_DEFAULT = 4 << 20
COMPACT_BATCH_ENTRIES_DEFAULT = 10_000

_META_CLUSTER_ID = b"cluster_id"
_META_SHUTDOWN_ID = b"shutdown_id"
_META_STATE = b"store_state"
_META_EPOCH = b"epoch"
_META_MAX_SEEN = b"max_seen"
_META_NEXT_TOPIC_ID = b"next_topic_id"
_META_HISTORY = b"history"
_META_LOG_TAIL = b"log_tail"
_META_LOG_START = b"log_start"
_META_SNAPSHOT_PENDING = b"snapshot_pending"
_META_COMMIT = b"commit_lsn"
_META_UNCOMMITTED = b"snapshot_uncommitted"
# Meta keys that describe state (a snapshot carries them); the others belong to the node
# (cluster id, shutdown id, store state, epoch, max seen) or describe the log.
_META_SNAPSHOT_KEYS = frozenset({_META_NEXT_TOPIC_ID})

_CRC = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_U64X2 = struct.Struct(">QQ")
_U16 = struct.Struct(">H")
_TOPIC = struct.Struct(">QBQQq")  # topic_id, kind, next_offset, first_offset, created_ms
_DEDUPE = struct.Struct(">QQQQ")  # first sequence, its offset, lsn, epoch; then topic
# Index keys in DB_PUBLISHERS (a publisher id never starts with a 0 byte): the publishers
# of a topic id, and the topic ids of a publisher. Values: a sealed empty body.
_IDX_TOPIC = b"\x00t"
_IDX_PUBLISHER = b"\x00p"
# Above every dedupe key of a publisher prefix (a prefix + 8-byte sequence).
_SEQ_END = b"\xff" * (8 + 1)
# snapshot lsn, epoch, next chunk index, last chunk installed (0/1), db of the last record
# installed (1 + its index in SNAPSHOT_DBS; 0: none yet); then the last record's key.
_PENDING = struct.Struct(">QQQBB")
# One uncommitted publish of an installed snapshot: last LSN, first offset, topic length.
_UNCOMMITTED = struct.Struct(">QQH")
# The most topics a snapshot may list as holding uncommitted publishes (peer input).
SNAPSHOT_UNCOMMITTED_MAX = 1 << 20
# What a SnapshotChunk spends besides its records: index, last, LSN and epoch fields.
_CHUNK_HEADER_BYTES = 48
# What a SnapshotRecord in a chunk spends besides its key, value and database name: four
# tags and four length varints (five bytes each covers any record below 4 GiB).
_RECORD_OVERHEAD_BYTES = 24

_STATES = (
    common_pb2.STORE_STATE_EMPTY,
    common_pb2.STORE_STATE_CLEAN,
    common_pb2.STORE_STATE_DIRTY,
)
_KINDS = (common_pb2.TOPIC_KIND_REPLICATED, common_pb2.TOPIC_KIND_TRANSIENT)


class StoreError(Exception):
    """Base of every error the store raises."""


class StoreFullError(StoreError):
    """The LMDB map (or the memory twin's capacity) is full: the write was aborted."""


class StoreWriteError(StoreError):
    """A write failed for another reason: fail-stop, the replica stops serving."""


class InvalidEntryError(StoreError):
    """An entry was refused before anything was written."""


class StaleEpochError(StoreError):
    """An epoch older than the store's newest accepted epoch."""


class UnknownTopicError(StoreError):
    """A read named a topic the store does not hold."""


class LogCompactedError(StoreError):
    """The log entries asked for were compacted away: only a snapshot holds them now."""

    def __init__(self, from_lsn: int, log_start_lsn: int) -> None:
        super().__init__(
            f"log entry LSN {from_lsn} was compacted: the log starts at LSN {log_start_lsn}"
        )
        self.from_lsn = from_lsn
        self.log_start_lsn = log_start_lsn


class SnapshotError(StoreError):
    """A snapshot call out of order, or a chunk that does not fit the install in progress.

    Nothing was written. (A chunk whose record fails its checksum raises
    ``CorruptRecordError`` instead.)
    """


class CorruptRecordError(StoreError):
    """A stored record failed its checks; its data is not returned."""

    def __init__(self, db: str, key: bytes, detail: str) -> None:
        super().__init__(f"corrupt record in {db} at key {key.hex() or '?'}: {detail}")
        self.db = db
        self.key = key


@dataclass(frozen=True)
class TopicInfo:
    """A topic as the store holds it."""

    name: str
    topic_id: int
    kind: common_pb2.TopicKind.ValueType
    next_offset: int
    first_offset: int
    created_ms: int


@dataclass(frozen=True)
class PushSubscriber:
    """A push subscriber as the store holds it."""

    topic: str
    subscriber_id: str
    endpoint: str
    ordered: bool
    retry_count: int  # -1: retry forever
    cursor: int  # the next offset to deliver
    created_ms: int
    lsn: int  # the entry that subscribed it: tells a re-subscription from the old one


@dataclass(frozen=True)
class EpochBoundary:
    """Where an epoch's entries start in this store's log (replica_pb2.EpochBoundary)."""

    epoch: int
    start_lsn: int


@dataclass(frozen=True)
class StoreMeta:
    """The store's metadata, read in one transaction."""

    cluster_id: str
    shutdown_id: str
    state: common_pb2.StoreState.ValueType
    epoch: int  # the newest accepted epoch
    max_seen: int
    last_lsn: int
    last_epoch: int
    history: tuple[EpochBoundary, ...]
    log_start_lsn: int = 1  # the first LSN still in the log (last_lsn + 1: empty log)
    snapshot_pending: bool = False  # an install began and did not finish: the store is empty
    # The highest LSN this store's node knew committed (and held) when it last recorded
    # it; None for a store that never recorded one (written before the record existed).
    commit_lsn: int | None = None


@dataclass(frozen=True)
class DedupeHit:
    """Where an event stored under a (publisher id, sequence) pair went."""

    topic: str
    offset: int
    lsn: int
    epoch: int


def make_entry(lsn: int, epoch: int, op: replica_pb2.Operation) -> replica_pb2.LogEntry:
    """Builds a log entry for op, with its checksum filled in."""
    data = op.SerializeToString()
    return replica_pb2.LogEntry(lsn=lsn, epoch=epoch, checksum=zlib.crc32(data), operation=data)


# --- record encoding


def _seal(key: bytes, body: bytes) -> bytes:
    """Prefixes body with the CRC-32 of key and body, so a value moved to another key fails."""
    return _CRC.pack(zlib.crc32(body, zlib.crc32(key))) + body


def _unseal(db: str, key: bytes, value: bytes) -> bytes:
    """Returns the body of a sealed value, or raises CorruptRecordError."""
    if len(value) < _CRC.size:
        raise CorruptRecordError(db, key, f"value of {len(value)} bytes has no checksum")
    body = value[_CRC.size :]
    if _CRC.unpack_from(value)[0] != zlib.crc32(body, zlib.crc32(key)):
        raise CorruptRecordError(db, key, "checksum mismatch")
    return body


def _unpack(db: str, key: bytes, fmt: struct.Struct, body: bytes) -> tuple[int, ...]:
    """Unpacks a fixed-size prefix of a verified body."""
    if len(body) < fmt.size:
        raise CorruptRecordError(db, key, f"record of {len(body)} bytes, {fmt.size} expected")
    values: tuple[int, ...] = fmt.unpack_from(body)
    return values


def _key(what: str, text: str, prefix: bytes = b"") -> bytes:
    """Encodes a name into a key, refusing names the KV cannot hold."""
    raw = text.encode()
    if not raw or len(prefix) + len(raw) > MAX_KEY_BYTES:
        raise InvalidEntryError(f"{what} of {len(raw)} bytes (1..{MAX_KEY_BYTES - len(prefix)})")
    return prefix + raw


def _publisher_prefix(publisher_id: str) -> bytes:
    """The dedupe key prefix: length-prefixed, so no publisher's keys fall in another's range.

    The publisher's key in ``publishers`` is this prefix without its 2-byte length.
    """
    raw = publisher_id.encode()
    if not 0 < len(raw) <= MAX_KEY_BYTES - _U16.size - _U64.size:
        raise InvalidEntryError(
            f"publisher id of {len(raw)} bytes (1..{MAX_KEY_BYTES - _U16.size - _U64.size})"
        )
    return _U16.pack(len(raw)) + raw


class _TopicRow:
    """A topic record being read or changed."""

    __slots__ = ("created_ms", "first_offset", "key", "kind", "name", "next_offset", "topic_id")

    def __init__(
        self,
        name: str,
        key: bytes,
        topic_id: int,
        kind: int,
        next_offset: int,
        first_offset: int,
        created_ms: int,
    ) -> None:
        self.name = name
        self.key = key
        self.topic_id = topic_id
        self.kind = kind
        self.next_offset = next_offset
        self.first_offset = first_offset
        self.created_ms = created_ms

    def encode(self) -> bytes:
        """The sealed record."""
        body = _TOPIC.pack(
            self.topic_id, self.kind, self.next_offset, self.first_offset, self.created_ms
        )
        return _seal(self.key, body)

    def info(self) -> TopicInfo:
        """The public, frozen view."""
        return TopicInfo(
            name=self.name,
            topic_id=self.topic_id,
            kind=common_pb2.TopicKind.ValueType(self.kind),
            next_offset=self.next_offset,
            first_offset=self.first_offset,
            created_ms=self.created_ms,
        )


def _decode_push(key: bytes, value: bytes) -> tuple[int, int, replica_pb2.PushSubscribeOp]:
    """Decodes and verifies a push record: (cursor, subscribing LSN, the subscribe op)."""
    body = _unseal(DB_PUSH, key, value)
    cursor, lsn = _unpack(DB_PUSH, key, _U64X2, body)
    try:
        op = replica_pb2.PushSubscribeOp.FromString(body[_U64X2.size :])
    except DecodeError:
        raise CorruptRecordError(DB_PUSH, key, "subscribe record does not parse") from None
    if key[_U64.size :] != op.subscriber_id.encode():
        raise CorruptRecordError(DB_PUSH, key, "subscriber id does not match its key")
    return cursor, lsn, op


def _push_subscriber(topic: str, key: bytes, value: bytes) -> PushSubscriber:
    cursor, lsn, op = _decode_push(key, value)
    return PushSubscriber(
        topic=topic,
        subscriber_id=op.subscriber_id,
        endpoint=op.endpoint,
        ordered=op.ordered,
        retry_count=op.retry_count,
        cursor=cursor,
        created_ms=op.created_ms,
        lsn=lsn,
    )


def _decode_topic(key: bytes, value: bytes) -> _TopicRow:
    """Decodes and verifies a topics record."""
    body = _unseal(DB_TOPICS, key, value)
    topic_id, kind, next_offset, first_offset, created_ms = _unpack(DB_TOPICS, key, _TOPIC, body)
    try:
        name = key.decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(DB_TOPICS, key, "topic name is not UTF-8") from None
    return _TopicRow(name, key, topic_id, kind, next_offset, first_offset, created_ms)


def _read_topic(txn: ReadTxn, name: str) -> _TopicRow | None:
    """Reads a topic record by name; None when absent (or the name cannot be a key)."""
    raw = name.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        return None
    value = txn.get(DB_TOPICS, raw)
    return None if value is None else _decode_topic(raw, value)


def _event_matches(
    txn: ReadTxn, row: _TopicRow, offset: int, publisher_id: str, sequence: int, lsn: int
) -> bool:
    """Whether the topic holds, at offset, the event of (publisher_id, sequence) stored
    by the entry at lsn: what a dedupe record must point at to count."""
    if not row.first_offset <= offset < row.next_offset:
        return False
    key = _U64X2.pack(row.topic_id, offset)
    value = txn.get(DB_EVENTS, key)
    if value is None:
        return False
    try:
        ev = common_pb2.Event.FromString(_unseal(DB_EVENTS, key, value))
    except DecodeError:
        raise CorruptRecordError(DB_EVENTS, key, "event does not parse") from None
    return ev.publisher_id == publisher_id and ev.sequence == sequence and ev.lsn == lsn


def _read_u64(txn: ReadTxn, db: str, key: bytes) -> int | None:
    """Reads a sealed 8-byte counter."""
    value = txn.get(db, key)
    if value is None:
        return None
    return _unpack(db, key, _U64, _unseal(db, key, value))[0]


def _read_text(txn: ReadTxn, key: bytes) -> str:
    """Reads a sealed UTF-8 meta value ("" when absent)."""
    value = txn.get(DB_META, key)
    if value is None:
        return ""
    try:
        return _unseal(DB_META, key, value).decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(DB_META, key, "not UTF-8") from None


def _read_history(txn: ReadTxn) -> list[EpochBoundary]:
    """Reads the epoch history, oldest first."""
    value = txn.get(DB_META, _META_HISTORY)
    if value is None:
        return []
    body = _unseal(DB_META, _META_HISTORY, value)
    if len(body) % _U64X2.size:
        raise CorruptRecordError(DB_META, _META_HISTORY, f"history of {len(body)} bytes")
    return [EpochBoundary(e, s) for e, s in _U64X2.iter_unpack(body)]


def _read_log_tail(txn: ReadTxn) -> tuple[int, int]:
    """Reads (last LSN, last epoch)."""
    value = txn.get(DB_META, _META_LOG_TAIL)
    if value is None:
        return 0, 0
    lsn, epoch = _unpack(DB_META, _META_LOG_TAIL, _U64X2, _unseal(DB_META, _META_LOG_TAIL, value))
    return lsn, epoch


def _read_log_start(txn: ReadTxn) -> int:
    """Reads the first LSN still in the log (1 for a log never compacted)."""
    return _read_u64(txn, DB_META, _META_LOG_START) or 1


def _pending(txn: ReadTxn) -> bool:
    """Whether a snapshot install began and has not finished (the state is partial)."""
    return txn.get(DB_META, _META_SNAPSHOT_PENDING) is not None


@dataclass
class _PendingInstall:
    """The snapshot install in progress, as meta records it."""

    snapshot_lsn: int
    snapshot_epoch: int
    next_index: int
    complete: bool  # the last chunk is installed
    last_db: int  # 1 + SNAPSHOT_DBS index of the last record installed; 0: none yet
    last_key: bytes

    def encode(self) -> bytes:
        """The sealed record."""
        head = _PENDING.pack(
            self.snapshot_lsn, self.snapshot_epoch, self.next_index, self.complete, self.last_db
        )
        return _seal(_META_SNAPSHOT_PENDING, head + self.last_key)


def _read_pending(txn: ReadTxn) -> _PendingInstall | None:
    """Reads the snapshot install in progress, or None."""
    value = txn.get(DB_META, _META_SNAPSHOT_PENDING)
    if value is None:
        return None
    body = _unseal(DB_META, _META_SNAPSHOT_PENDING, value)
    lsn, epoch, index, complete, last_db = _unpack(DB_META, _META_SNAPSHOT_PENDING, _PENDING, body)
    return _PendingInstall(lsn, epoch, index, bool(complete), last_db, body[_PENDING.size :])


def _clear_state(txn: WriteTxn) -> None:
    """Empties the state databases and the log, and forgets the log's meta.

    The node's own meta (cluster id, shutdown id, store state, epoch, max seen) stays.
    """
    for db in _CLEARED_DBS:
        txn.clear(db)
    for key in (
        _META_NEXT_TOPIC_ID,
        _META_LOG_TAIL,
        _META_HISTORY,
        _META_LOG_START,
        _META_UNCOMMITTED,
    ):
        txn.delete(DB_META, key)
    _put_u64(txn, DB_META, _META_COMMIT, 0)  # an empty log: nothing committed here


def _read_meta(txn: ReadTxn) -> StoreMeta:
    """Reads every meta record in one transaction."""
    last_lsn, last_epoch = _read_log_tail(txn)
    state = _read_u64(txn, DB_META, _META_STATE)
    pending = _pending(txn)
    if pending:
        # begin_snapshot removed the log's meta; this keeps the promise whatever a
        # damaged or older store holds: a pending install has no data to report.
        last_lsn = last_epoch = 0
    return StoreMeta(
        cluster_id=_read_text(txn, _META_CLUSTER_ID),
        shutdown_id=_read_text(txn, _META_SHUTDOWN_ID),
        state=common_pb2.StoreState.ValueType(state or common_pb2.STORE_STATE_EMPTY),
        epoch=_read_u64(txn, DB_META, _META_EPOCH) or 0,
        max_seen=_read_u64(txn, DB_META, _META_MAX_SEEN) or 0,
        last_lsn=last_lsn,
        last_epoch=last_epoch,
        history=() if pending else tuple(_read_history(txn)),
        log_start_lsn=1 if pending else _read_log_start(txn),
        snapshot_pending=pending,
        commit_lsn=0 if pending else _read_u64(txn, DB_META, _META_COMMIT),
    )


def _raise_commit(txn: WriteTxn, commit_lsn: int, last_lsn: int) -> int:
    """Records min(commit_lsn, last_lsn) as the commit LSN if above the recorded one.

    A committed LSN stays committed, so the record only grows (truncations and snapshot
    installs, which may lower it, write it directly). Returns the recorded value.
    """
    held = min(commit_lsn, last_lsn)
    current = _read_u64(txn, DB_META, _META_COMMIT)
    if current is not None and current >= held:
        return current
    _put_u64(txn, DB_META, _META_COMMIT, held)
    return held


def _encode_uncommitted(items: Sequence[tuple[str, int, int]]) -> bytes:
    """(topic, first offset, last LSN) triples as one meta value body."""
    parts: list[bytes] = []
    for topic, first_offset, last_lsn in items:
        name = topic.encode()
        parts.append(_UNCOMMITTED.pack(last_lsn, first_offset, len(name)) + name)
    return b"".join(parts)


def _decode_uncommitted(body: bytes) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    at = 0
    while at < len(body):
        if len(body) - at < _UNCOMMITTED.size:
            raise CorruptRecordError(DB_META, _META_UNCOMMITTED, "truncated record")
        last_lsn, first_offset, size = _UNCOMMITTED.unpack_from(body, at)
        at += _UNCOMMITTED.size
        if len(body) - at < size:
            raise CorruptRecordError(DB_META, _META_UNCOMMITTED, "truncated topic name")
        try:
            topic = body[at : at + size].decode()
        except UnicodeDecodeError:
            raise CorruptRecordError(DB_META, _META_UNCOMMITTED, "topic not UTF-8") from None
        at += size
        out.append((topic, first_offset, last_lsn))
    return out


def _put_u64(txn: WriteTxn, db: str, key: bytes, value: int) -> None:
    """Writes a sealed 8-byte counter."""
    txn.put(db, key, _seal(key, _U64.pack(value)))


def _put_text(txn: WriteTxn, key: bytes, text: str) -> None:
    """Writes a sealed UTF-8 meta value."""
    txn.put(DB_META, key, _seal(key, text.encode()))


def _uncommitted_problem(
    items: Sequence[tuple[str, int, int]], commit_lsn: int, snapshot_lsn: int
) -> str | None:
    """What is wrong with a snapshot's list of uncommitted publishes, or None."""
    seen: set[str] = set()
    for topic, first_offset, last_lsn in items:
        if not topic or len(topic.encode()) > 0xFFFF:
            return f"an uncommitted publish with a topic name of {len(topic.encode())} bytes"
        if topic in seen:
            return f"topic {topic[:_SHOWN_CHARS_MAX]!r} listed twice as uncommitted"
        seen.add(topic)
        if not commit_lsn < last_lsn <= snapshot_lsn:
            return (
                f"an uncommitted publish of {topic[:_SHOWN_CHARS_MAX]!r} at LSN {last_lsn}, "
                f"outside {commit_lsn + 1}..{snapshot_lsn}"
            )
        if not 0 <= first_offset <= UINT64_MAX:
            return f"first offset {first_offset} is not a uint64"
    return None


# --- snapshot records


# A database's place in a snapshot: 1 + its index in SNAPSHOT_DBS (0: before any record).
_SNAPSHOT_DB_RANK = {db: i + 1 for i, db in enumerate(SNAPSHOT_DBS)}
# Longest peer-supplied text quoted in an error.
_SHOWN_CHARS_MAX = 40


def _snapshot_records(txn: ReadTxn, db: str) -> Iterable[tuple[bytes, bytes]]:
    """(key, sealed value) of a database's records a snapshot carries, in key order."""
    if db != DB_META:
        return txn.scan(db)
    return [
        (key, value)
        for key in sorted(_META_SNAPSHOT_KEYS)
        if (value := txn.get(DB_META, key)) is not None
    ]


def _check_records(
    chunk: replica_pb2.SnapshotChunk, pending: _PendingInstall, where: str
) -> list[tuple[str, list[tuple[bytes, bytes]]]]:
    """Verifies a chunk's records; returns them as runs of one database each.

    Records must follow the snapshot order strictly (database, then key, above the last
    record installed) — which is also what lets LMDB append them; keys must fit the KV;
    of meta only the state keys may come; every value's checksum must hold. Advances
    pending's last record. Raises SnapshotError or CorruptRecordError.
    """
    crc32, unpack_crc, crc_size = zlib.crc32, _CRC.unpack_from, _CRC.size
    last_rank, last_key = pending.last_db, pending.last_key
    runs: list[tuple[str, list[tuple[bytes, bytes]]]] = []
    items: list[tuple[bytes, bytes]] = []
    run_db, meta_run = "", False
    # The hot loop of an install (one pass per record): the checks on a new database
    # run once per run, the per-record ones are kept few and flat.
    for record in chunk.records:
        db, key, value = record.db, record.key, record.value
        if db != run_db:
            rank = _SNAPSHOT_DB_RANK.get(db, 0)
            if not rank:
                raise SnapshotError(f"{where}: a record of database {db[:_SHOWN_CHARS_MAX]!r}")
            if rank < last_rank:
                raise SnapshotError(f"{where}: a {db} record after {SNAPSHOT_DBS[last_rank - 1]}")
            if rank > last_rank:
                last_rank, last_key = rank, b""  # a new database: any non-empty key follows
            items = []
            runs.append((db, items))
            run_db, meta_run = db, db == DB_META
        if key <= last_key:
            detail = f"key {key.hex()[:_SHOWN_CHARS_MAX]} is out of order" if key else "empty key"
            raise SnapshotError(f"{where}: a {db} record with an {detail}")
        if len(key) > MAX_KEY_BYTES:
            raise SnapshotError(f"{where}: a {db} key of {len(key)} bytes")
        if meta_run and key not in _META_SNAPSHOT_KEYS:
            raise SnapshotError(
                f"{where}: meta key {key[:_SHOWN_CHARS_MAX]!r} is not state a snapshot carries"
            )
        if len(value) < crc_size or unpack_crc(value)[0] != crc32(value[crc_size:], crc32(key)):
            raise CorruptRecordError(db, key, f"checksum mismatch in snapshot {where}")
        items.append((key, value))
        last_key = key
    pending.last_db, pending.last_key = last_rank, last_key
    return runs


# --- applying entries


class _Batch:
    """Applies one append's entries inside its write transaction.

    Topic records, publisher high-water marks, new events, log entries and meta are
    cached for the batch and written by ``finish`` (events earlier when a destroy needs
    them in place): a batch of many small publishes then costs few KV calls per entry.
    """

    def __init__(self, txn: WriteTxn, dedupe_window: int) -> None:
        self.txn = txn
        self.dedupe_window = dedupe_window
        self.last_lsn, self.last_epoch = _read_log_tail(txn)
        self.epoch = self.epoch_before = _read_u64(txn, DB_META, _META_EPOCH) or 0
        self.next_topic_id = _read_u64(txn, DB_META, _META_NEXT_TOPIC_ID) or 1
        self.next_topic_id_before = self.next_topic_id
        self.history = _read_history(txn)
        self.history_len_before = len(self.history)
        self.topics: dict[str, _TopicRow | None] = {}
        self.dirty_topics: dict[str, _TopicRow | None] = {}
        self.events: dict[int, list[tuple[bytes, bytes]]] = {}  # topic id -> new records
        self.high_water: dict[str, tuple[bytes, int, int]] = {}  # pid -> (prefix, old, new)
        # (topic id, publisher id) -> dedupe prefix: the index entries the batch adds.
        self.pairs: dict[tuple[int, str], bytes] = {}
        self.log: list[tuple[bytes, bytes]] = []
        self.lsn = self.entry_epoch = 0  # the entry being applied, for error messages
        # Reused messages and the serialized per-publisher Event fields, so that building
        # events costs as few protobuf calls as possible.
        self.event = common_pb2.Event()
        self.dynamic = common_pb2.Event()
        self.static: dict[tuple[str, str, str], bytes] = {}

    def entry(self, entry: replica_pb2.LogEntry) -> None:
        """Verifies one entry and applies its operation."""
        lsn = self.lsn = entry.lsn
        epoch = self.entry_epoch = entry.epoch
        if lsn != self.last_lsn + 1:
            raise self.refuse(f"does not follow the last LSN {self.last_lsn}")
        if epoch < self.last_epoch:
            raise self.refuse(f"older than the last entry's epoch {self.last_epoch}")
        if epoch == 0:
            raise self.refuse("epochs start at 1")
        operation = entry.operation
        if zlib.crc32(operation) != entry.checksum:
            raise self.refuse("checksum mismatch")
        try:
            op = replica_pb2.Operation.FromString(operation)
        except DecodeError as exc:
            raise self.refuse(f"operation does not parse: {exc}") from None
        if epoch > self.last_epoch:
            self.history.append(EpochBoundary(epoch, lsn))
        # An entry of a newer epoch means the store has accepted that epoch.
        self.epoch = max(self.epoch, epoch)
        kind = op.WhichOneof("op")
        if kind == "publish":
            self.publish(op.publish, lsn, epoch)
        elif kind == "set_cursor":
            self.set_cursor(op.set_cursor)
        elif kind == "epoch_start":
            # An epoch's log starts with its master's EpochStartOp, once.
            if (
                op.epoch_start.epoch != epoch
                or not self.history
                or self.history[-1].start_lsn != lsn
            ):
                raise self.refuse(f"starts epoch {op.epoch_start.epoch}, not a new epoch {epoch}")
        elif kind == "create_topic":
            self.create_topic(op.create_topic)
        elif kind == "destroy_topic":
            self.destroy_topic(op.destroy_topic)
        elif kind == "delete_subscription":
            self.delete_subscription(op.delete_subscription)
        elif kind == "push_subscribe":
            self.push_subscribe(op.push_subscribe, lsn)
        elif kind == "push_unsubscribe":
            self.push_unsubscribe(op.push_unsubscribe)
        elif kind == "push_cursor":
            self.push_cursor(op.push_cursor)
        else:
            raise self.refuse("no operation")
        key = _U64.pack(lsn)
        self.log.append((key, _seal(key, entry.SerializeToString())))
        self.last_lsn, self.last_epoch = lsn, epoch

    def refuse(self, detail: str) -> InvalidEntryError:
        """The error refusing the entry being applied (the store knows no node id)."""
        return InvalidEntryError(f"entry LSN {self.lsn} (epoch {self.entry_epoch}): {detail}")

    def key(self, what: str, text: str, prefix: bytes = b"") -> bytes:
        """A name's key, refusing the entry if the name cannot be one."""
        try:
            return _key(what, text, prefix)
        except InvalidEntryError as exc:
            raise self.refuse(str(exc)) from None

    def topic(self, name: str) -> _TopicRow:
        """The topic's record as this batch has left it; refuses an unknown topic."""
        if name in self.topics:
            row = self.topics[name]
        else:
            row = self.topics[name] = _read_topic(self.txn, name)
        if row is None:
            raise self.refuse(f"no topic {name!r}")
        return row

    def create_topic(self, op: replica_pb2.CreateTopicOp) -> None:
        """Creates a topic with a fresh id."""
        key = self.key("topic name", op.name)
        if op.name not in self.topics:
            self.topics[op.name] = _read_topic(self.txn, op.name)
        if self.topics[op.name] is not None:
            raise self.refuse(f"topic {op.name!r} already exists")
        kind = op.kind or common_pb2.TOPIC_KIND_REPLICATED
        if kind not in _KINDS:
            raise self.refuse(f"unknown topic kind {kind}")
        row = _TopicRow(op.name, key, self.next_topic_id, kind, 0, 0, op.created_ms)
        self.next_topic_id += 1
        self.topics[op.name] = self.dirty_topics[op.name] = row

    def destroy_topic(self, op: replica_pb2.DestroyTopicOp) -> None:
        """Removes a topic with its events and subscriptions."""
        row = self.topic(op.name)
        self.flush_events()
        lo, hi = _U64.pack(row.topic_id), _U64.pack(row.topic_id + 1)
        self.txn.delete_range(DB_EVENTS, lo, hi)
        self.txn.delete_range(DB_CURSORS, lo, hi)
        self.txn.delete_range(DB_PUSH, lo, hi)
        self.forget_publishers(row)
        self.topics[op.name] = self.dirty_topics[op.name] = None

    def forget_publishers(self, row: _TopicRow) -> None:
        """Deletes the dedupe state of the topic's publishers that names the topic.

        A publisher left with no topic (none in the index, no dedupe record naming another
        topic) loses its high-water mark too, so it starts again from any sequence; one
        that still has a topic keeps it (its sequences are one space across topics, and
        a lower mark could let a pruned sequence of the other topic in twice).
        """
        txn, topic_id = self.txn, row.topic_id
        lo = _IDX_TOPIC + _U64.pack(topic_id)
        hi = _IDX_TOPIC + _U64.pack(topic_id + 1)
        publishers = {key[len(lo) :].decode() for key, _ in txn.scan(DB_PUBLISHERS, lo, hi)}
        publishers.update(pid for tid, pid in self.pairs if tid == topic_id)
        txn.delete_range(DB_PUBLISHERS, lo, hi)
        name = row.name.encode()
        for publisher_id in sorted(publishers):
            self.pairs.pop((topic_id, publisher_id), None)
            prefix = _publisher_prefix(publisher_id)
            txn.delete(DB_PUBLISHERS, _IDX_PUBLISHER + prefix + _U64.pack(topic_id))
            other_topic = False
            stale: list[bytes] = []
            for key, value in txn.scan(DB_DEDUPE, prefix, prefix + _SEQ_END):
                if _unseal(DB_DEDUPE, key, value)[_DEDUPE.size :] == name:
                    stale.append(key)
                else:
                    other_topic = True
            for key in stale:
                txn.delete(DB_DEDUPE, key)
            if other_topic or self.has_topics(publisher_id, prefix):
                continue
            if publisher_id in self.high_water:
                old = self.high_water[publisher_id][1]
            else:
                old = _read_u64(txn, DB_PUBLISHERS, prefix[_U16.size :]) or 0
            self.high_water[publisher_id] = (prefix, old, 0)  # finish deletes the mark

    def has_topics(self, publisher_id: str, prefix: bytes) -> bool:
        """Whether the index (stored or this batch's) ties the publisher to a topic."""
        if any(pid == publisher_id for _, pid in self.pairs):
            return True
        lo = _IDX_PUBLISHER + prefix
        for _ in self.txn.scan(DB_PUBLISHERS, lo, lo + _SEQ_END):
            return True
        return False

    def publish(self, op: replica_pb2.PublishOp, lsn: int, epoch: int) -> None:
        """Builds the event records at consecutive offsets and records their sequences."""
        row = self.topic(op.topic)
        if row.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            raise self.refuse(f"topic {op.topic!r} is transient")
        first = op.first_offset
        if first != row.next_offset:
            raise self.refuse(
                f"publish at offset {first}, topic {op.topic!r} is at {row.next_offset}"
            )
        publisher_id = op.publisher_id
        # The fields every event of the op shares are serialized once; protobuf merges
        # concatenated encodings, so static + dynamic + per-event bytes is one Event.
        topic, session_token = op.topic, op.session_token
        static = self.static.get((topic, publisher_id, session_token))
        if static is None:
            static = common_pb2.Event(
                topic=topic, publisher_id=publisher_id, session_token=session_token
            ).SerializeToString()
            self.static[(topic, publisher_id, session_token)] = static
        dynamic = self.dynamic
        dynamic.timestamp_ms = op.timestamp_ms
        dynamic.lsn = lsn
        dynamic.epoch = epoch
        common = static + dynamic.SerializeToString()
        ev = self.event
        pack_key, pack_crc, crc32 = _U64X2.pack, _CRC.pack, zlib.crc32
        topic_id = row.topic_id
        items = self.events.setdefault(topic_id, [])
        # Sequences are kept as runs: consecutive sequences at consecutive offsets.
        runs: list[tuple[int, int, int]] = []
        run_first = run_last = run_offset = 0
        offset = first
        for data in op.events:
            ev.Clear()
            ev.offset = offset
            ev.key = data.key
            ev.payload = data.payload
            sequence = ev.sequence = data.sequence
            if data.headers:
                ev.headers.update(data.headers)
            body = common + ev.SerializeToString()
            key = pack_key(topic_id, offset)
            items.append((key, pack_crc(crc32(body, crc32(key))) + body))
            if sequence:
                if (
                    run_last
                    and sequence == run_last + 1
                    and offset == run_offset + sequence - run_first
                ):
                    run_last = sequence
                else:
                    if run_last:
                        runs.append((run_first, run_last, run_offset))
                    run_first = run_last = sequence
                    run_offset = offset
            offset += 1
        if run_last:
            runs.append((run_first, run_last, run_offset))
        row.next_offset = offset
        self.dirty_topics[op.topic] = row
        if publisher_id and runs:
            self.record_sequences(publisher_id, row, runs, lsn, epoch)

    def flush_events(self) -> None:
        """Writes the batch's new events, topic by topic in key order."""
        newest = self.next_topic_id - 1
        for topic_id in sorted(self.events):
            # MDB_APPEND is valid only above every key: the newest topic's events are.
            self.txn.put_many(DB_EVENTS, self.events[topic_id], append=topic_id == newest)
        self.events.clear()

    def record_sequences(
        self,
        publisher_id: str,
        row: _TopicRow,
        runs: list[tuple[int, int, int]],
        lsn: int,
        epoch: int,
    ) -> None:
        """Stores one dedupe record per run of sequences and raises the high-water mark."""
        if publisher_id in self.high_water:
            prefix, old, new = self.high_water[publisher_id]
        else:
            try:
                prefix = _publisher_prefix(publisher_id)
            except InvalidEntryError as exc:
                raise self.refuse(str(exc)) from None
            old = _read_u64(self.txn, DB_PUBLISHERS, prefix[_U16.size :]) or 0
            new = old
        if (row.topic_id, publisher_id) not in self.pairs:
            if len(_IDX_PUBLISHER + prefix) + _U64.size > MAX_KEY_BYTES:
                raise self.refuse(f"publisher id of {len(prefix) - _U16.size} bytes is too long")
            self.pairs[(row.topic_id, publisher_id)] = prefix
        tail = row.name.encode()
        for run_first, run_last, run_offset in runs:
            # Sequences grow, so only a run starting at or below the high-water mark can
            # overlap a stored one; the master never stores a sequence twice.
            if run_first <= new:
                self.replace_stale_runs(publisher_id, prefix, run_first, run_last)
            key = prefix + _U64.pack(run_last)
            body = _DEDUPE.pack(run_first, run_offset, lsn, epoch) + tail
            self.txn.put(DB_DEDUPE, key, _seal(key, body))
            new = max(new, run_last)
        self.high_water[publisher_id] = (prefix, old, new)

    def replace_stale_runs(
        self, publisher_id: str, prefix: bytes, run_first: int, run_last: int
    ) -> None:
        """Refuses the entry if a stored run overlapping run_first..run_last still names a
        stored event; deletes the overlapping runs that do not (a destroyed incarnation's,
        left by a store written before destroys removed them)."""
        self.flush_events()  # so that a run stored earlier in this batch is seen as live
        start = prefix + _U64.pack(run_first)
        # Each pass deletes one stale run: bounded by the runs within the sequences.
        for _ in range(run_last - run_first + 2):
            found = None
            for key, value in self.txn.scan(DB_DEDUPE, start, prefix + _SEQ_END):
                found = key, _unseal(DB_DEDUPE, key, value)
                break
            if found is None:
                return
            key, body = found
            stored_first, first_offset, stored_lsn, _ = _unpack(DB_DEDUPE, key, _DEDUPE, body)
            if stored_first > run_last:
                return
            try:
                name = body[_DEDUPE.size :].decode()
            except UnicodeDecodeError:
                raise CorruptRecordError(DB_DEDUPE, key, "topic is not UTF-8") from None
            holder = self.topics[name] if name in self.topics else _read_topic(self.txn, name)
            if holder is not None and _event_matches(
                self.txn, holder, first_offset, publisher_id, stored_first, stored_lsn
            ):
                raise self.refuse(
                    f"publisher {publisher_id!r} sequences {run_first}..{run_last} are "
                    "already stored"
                )
            self.txn.delete(DB_DEDUPE, key)
        raise self.refuse(f"publisher {publisher_id!r}: too many stale dedupe runs")

    def set_cursor(self, op: replica_pb2.SetCursorOp) -> None:
        """Creates a subscription or moves its cursor forward (a lower cursor is ignored)."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(
                f"cursor {op.cursor} beyond topic {op.topic!r}'s end {row.next_offset}"
            )
        key = self.key("subscription name", op.subscription, _U64.pack(row.topic_id))
        old = _read_u64(self.txn, DB_CURSORS, key)
        # Acks can arrive out of order, so a lower cursor is normal, not an error.
        if old is None or op.cursor > old:
            _put_u64(self.txn, DB_CURSORS, key, op.cursor)

    def delete_subscription(self, op: replica_pb2.DeleteSubscriptionOp) -> None:
        """Deletes a subscription's cursor."""
        row = self.topic(op.topic)
        key = self.key("subscription name", op.subscription, _U64.pack(row.topic_id))
        if not self.txn.delete(DB_CURSORS, key):
            raise self.refuse(f"no subscription {op.subscription!r} on {op.topic!r}")

    def push_subscribe(self, op: replica_pb2.PushSubscribeOp, lsn: int) -> None:
        """Registers a push subscriber at its start cursor."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(
                f"push cursor {op.cursor} beyond topic {op.topic!r}'s end {row.next_offset}"
            )
        key = self.key("push subscriber id", op.subscriber_id, _U64.pack(row.topic_id))
        if self.txn.get(DB_PUSH, key) is not None:
            raise self.refuse(f"push subscriber {op.subscriber_id!r} of {op.topic!r} exists")
        body = _U64X2.pack(op.cursor, lsn) + op.SerializeToString()
        self.txn.put(DB_PUSH, key, _seal(key, body))

    def push_unsubscribe(self, op: replica_pb2.PushUnsubscribeOp) -> None:
        """Removes a push subscriber."""
        row = self.topic(op.topic)
        key = self.key("push subscriber id", op.subscriber_id, _U64.pack(row.topic_id))
        if not self.txn.delete(DB_PUSH, key):
            raise self.refuse(f"no push subscriber {op.subscriber_id!r} on {op.topic!r}")

    def push_cursor(self, op: replica_pb2.PushCursorOp) -> None:
        """Moves a push subscriber's cursor forward (a lower cursor is ignored)."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(
                f"push cursor {op.cursor} beyond topic {op.topic!r}'s end {row.next_offset}"
            )
        key = self.key("push subscriber id", op.subscriber_id, _U64.pack(row.topic_id))
        value = self.txn.get(DB_PUSH, key)
        if value is None:
            raise self.refuse(f"no push subscriber {op.subscriber_id!r} on {op.topic!r}")
        body = _unseal(DB_PUSH, key, value)
        cursor, lsn = _unpack(DB_PUSH, key, _U64X2, body)
        if op.cursor > cursor:
            body = _U64X2.pack(op.cursor, lsn) + body[_U64X2.size :]
            self.txn.put(DB_PUSH, key, _seal(key, body))

    def finish(self) -> None:
        """Writes what the batch cached: events, topics, high-water marks, log and meta."""
        txn = self.txn
        self.flush_events()
        for name, row in self.dirty_topics.items():
            if row is None:
                txn.delete(DB_TOPICS, name.encode())
            else:
                txn.put(DB_TOPICS, row.key, row.encode())
        for (topic_id, publisher_id), prefix in self.pairs.items():
            by_topic = _IDX_TOPIC + _U64.pack(topic_id) + publisher_id.encode()
            if txn.get(DB_PUBLISHERS, by_topic) is None:
                txn.put(DB_PUBLISHERS, by_topic, _seal(by_topic, b""))
                by_publisher = _IDX_PUBLISHER + prefix + _U64.pack(topic_id)
                txn.put(DB_PUBLISHERS, by_publisher, _seal(by_publisher, b""))
        for prefix, old, new in self.high_water.values():
            if new == 0:
                # Every topic of the publisher was destroyed (forget_publishers).
                txn.delete(DB_PUBLISHERS, prefix[_U16.size :])
                continue
            if new != old:
                _put_u64(txn, DB_PUBLISHERS, prefix[_U16.size :], new)
            if new > self.dedupe_window:
                # Runs ending at or below new - window hold only pruned sequences.
                cut = new - self.dedupe_window + 1
                txn.delete_range(DB_DEDUPE, prefix + _U64.pack(0), prefix + _U64.pack(cut))
        txn.put_many(DB_LOG, self.log, append=True)
        tail = _U64X2.pack(self.last_lsn, self.last_epoch)
        txn.put(DB_META, _META_LOG_TAIL, _seal(_META_LOG_TAIL, tail))
        if self.epoch != self.epoch_before:
            _put_u64(txn, DB_META, _META_EPOCH, self.epoch)
        if self.next_topic_id != self.next_topic_id_before:
            _put_u64(txn, DB_META, _META_NEXT_TOPIC_ID, self.next_topic_id)
        if len(self.history) != self.history_len_before:
            body = b"".join(_U64X2.pack(b.epoch, b.start_lsn) for b in self.history)
            txn.put(DB_META, _META_HISTORY, _seal(_META_HISTORY, body))


# --- the store


class Store:
    """The replica's log and state on a KV (open it with open_lmdb or open_memory)."""

    def __init__(self, kv: KV, *, dedupe_window: int = DEDUPE_WINDOW_DEFAULT) -> None:
        """Wraps a KV opened with the names in DATABASES."""
        if dedupe_window < 1:
            raise ValueError(f"dedupe_window must be at least 1, got {dedupe_window}")
        self._kv = kv
        self._dedupe_window = dedupe_window
        self._closed = False

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
        return cls(kv, dedupe_window=dedupe_window)

    @classmethod
    def open_memory(
        cls, capacity_bytes: int | None = None, *, dedupe_window: int = DEDUPE_WINDOW_DEFAULT
    ) -> Store:
        """Creates an empty in-memory store (capacity_bytes simulates a full map)."""
        return cls(MemoryKV(DATABASES, capacity_bytes=capacity_bytes), dedupe_window=dedupe_window)

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

    @contextmanager
    def _reading(self, *, long_lived: bool = False) -> Iterator[ReadTxn]:
        """A read transaction, with KV errors turned into store errors.

        long_lived: a KV snapshot transaction, which never blocks the writer.
        """
        if self._closed:
            raise StoreError("the store is closed")
        try:
            with self._kv.snapshot() if long_lived else self._kv.read() as txn:
                yield txn
        except KVCorruptError as exc:
            raise CorruptRecordError(exc.db, b"", str(exc)) from exc
        except KVError as exc:
            raise StoreError(f"read failed: {exc}") from exc

    @contextmanager
    def _writing(self, *, sync: bool) -> Iterator[WriteTxn]:
        """The write transaction, with KV errors turned into store errors."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            with self._kv.write(sync=sync) as txn:
                yield txn
        except KVFullError as exc:
            raise StoreFullError(f"store full, write aborted: {exc}") from exc
        except KVCorruptError as exc:
            raise CorruptRecordError(exc.db, b"", str(exc)) from exc
        except KVError as exc:
            raise StoreWriteError(f"write failed: {exc}") from exc

    # --- meta

    def meta(self) -> StoreMeta:
        """The store's metadata (an empty store: state EMPTY, everything else zero)."""
        with self._reading() as txn:
            return _read_meta(txn)

    def counts(self) -> dict[str, int]:
        """Records per database, from one read transaction; ``publishers`` counts the
        publishers (high-water marks), not the topic index that shares their database."""
        with self._reading() as txn:
            counts = {db: txn.count(db) for db in DATABASES}
            index = sum(1 for _ in txn.scan(DB_PUBLISHERS, b"\x00", b"\x01"))
            counts[DB_PUBLISHERS] -= index
            return counts

    def set_cluster_id(self, cluster_id: str) -> None:
        """Records the cluster id (flushed); refuses to replace a different one."""
        if not cluster_id:
            raise ValueError("cluster_id must not be empty")
        with self._writing(sync=True) as txn:
            current = _read_text(txn, _META_CLUSTER_ID)
            if current and current != cluster_id:
                raise ValueError(f"store belongs to cluster {current!r}, not {cluster_id!r}")
            _put_text(txn, _META_CLUSTER_ID, cluster_id)

    def set_state(self, state: common_pb2.StoreState.ValueType, shutdown_id: str = "") -> None:
        """Records the store state (flushed); CLEAN carries a shutdown id, others none."""
        if state not in _STATES:
            raise ValueError(f"unknown store state {state}")
        if (state == common_pb2.STORE_STATE_CLEAN) != bool(shutdown_id):
            raise ValueError("a shutdown id goes with STORE_STATE_CLEAN and only with it")
        with self._writing(sync=True) as txn:
            _put_u64(txn, DB_META, _META_STATE, state)
            _put_text(txn, _META_SHUTDOWN_ID, shutdown_id)

    def set_epoch(self, epoch: int) -> None:
        """Records a newly accepted epoch (flushed); raises StaleEpochError if lower."""
        if not 0 <= epoch < 1 << 64:
            raise ValueError(f"epoch {epoch} is not a uint64")
        with self._writing(sync=True) as txn:
            current = _read_u64(txn, DB_META, _META_EPOCH) or 0
            if epoch < current:
                raise StaleEpochError(f"epoch {epoch} is older than the store's epoch {current}")
            if epoch > current:
                _put_u64(txn, DB_META, _META_EPOCH, epoch)

    def set_max_seen(self, max_seen: int) -> None:
        """Raises the max seen value (flushed); a lower value is ignored."""
        if not 0 <= max_seen < 1 << 64:
            raise ValueError(f"max_seen {max_seen} is not a uint64")
        with self._writing(sync=True) as txn:
            if max_seen > (_read_u64(txn, DB_META, _META_MAX_SEEN) or 0):
                _put_u64(txn, DB_META, _META_MAX_SEEN, max_seen)

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
        ``StoreMeta.commit_lsn`` after a restart.
        """
        if not entries:
            return
        with self._writing(sync=sync) as txn:
            if _pending(txn):
                # An unfinished install left partial state in a store that reports itself
                # empty: a master that still holds its whole log may fill it from LSN 1.
                if entries[0].lsn != 1:
                    raise InvalidEntryError(
                        f"entry LSN {entries[0].lsn}: an unfinished snapshot install left "
                        "this store empty, its log continues at LSN 1"
                    )
                _clear_state(txn)
                txn.delete(DB_META, _META_SNAPSHOT_PENDING)
            batch = _Batch(txn, self._dedupe_window)
            for entry in entries:
                batch.entry(entry)
            batch.finish()
            if commit_lsn is not None:
                _raise_commit(txn, commit_lsn, batch.last_lsn)

    def record_commit(self, commit_lsn: int, *, sync: bool = False) -> int:
        """Raises the recorded commit LSN to commit_lsn (at most the last LSN); returns
        the value recorded. A write like append: the caller serializes it."""
        if not 0 <= commit_lsn <= UINT64_MAX:
            raise ValueError(f"commit LSN {commit_lsn} is not a uint64")
        with self._writing(sync=sync) as txn:
            if _pending(txn):
                return 0
            return _raise_commit(txn, commit_lsn, _read_log_tail(txn)[0])

    def set_commit_lsn(self, commit_lsn: int, *, sync: bool = False) -> None:
        """Records commit_lsn (at most the last LSN) as the commit LSN, even if lower:
        for a store rebuilt by a truncation. Use record_commit otherwise."""
        if not 0 <= commit_lsn <= UINT64_MAX:
            raise ValueError(f"commit LSN {commit_lsn} is not a uint64")
        with self._writing(sync=sync) as txn:
            _put_u64(txn, DB_META, _META_COMMIT, min(commit_lsn, _read_log_tail(txn)[0]))

    def snapshot_uncommitted(self) -> list[tuple[str, int, int]]:
        """What the installed snapshot held above its sender's commit LSN, per topic:
        (topic, first offset, last LSN), by last LSN (see finish_snapshot)."""
        with self._reading() as txn:
            value = txn.get(DB_META, _META_UNCOMMITTED)
            if value is None or _pending(txn):
                return []
            return _decode_uncommitted(_unseal(DB_META, _META_UNCOMMITTED, value))

    def read_log(self, from_lsn: int, max_entries: int) -> list[replica_pb2.LogEntry]:
        """Up to max_entries verified entries from from_lsn (empty beyond the last).

        Raises LogCompactedError when from_lsn is below the log's start (``log_start_lsn``).
        """
        if from_lsn < 1 or max_entries < 1:
            raise ValueError(f"from_lsn and max_entries must be >= 1 ({from_lsn}, {max_entries})")
        with self._reading() as txn:
            last_lsn, _ = _read_log_tail(txn)
            log_start_lsn = _read_log_start(txn)
            if from_lsn < log_start_lsn:
                raise LogCompactedError(from_lsn, log_start_lsn)
            stop = min(last_lsn + 1, from_lsn + max_entries)
            out: list[replica_pb2.LogEntry] = []
            for key, value in txn.scan(DB_LOG, _U64.pack(from_lsn), _U64.pack(stop)):
                lsn = from_lsn + len(out)
                if key != _U64.pack(lsn):
                    raise CorruptRecordError(DB_LOG, _U64.pack(lsn), "entry missing")
                try:
                    entry = replica_pb2.LogEntry.FromString(_unseal(DB_LOG, key, value))
                except DecodeError:
                    raise CorruptRecordError(DB_LOG, key, "entry does not parse") from None
                if entry.lsn != lsn or zlib.crc32(entry.operation) != entry.checksum:
                    raise CorruptRecordError(DB_LOG, key, "entry LSN or checksum wrong")
                out.append(entry)
            if from_lsn + len(out) < stop:
                raise CorruptRecordError(DB_LOG, _U64.pack(from_lsn + len(out)), "entry missing")
            return out

    def log_start_lsn(self) -> int:
        """The first LSN still in the log: 1 unless compacted or installed from a snapshot.

        The log holds log_start_lsn..last_lsn; log_start_lsn == last_lsn + 1 is an empty
        log continuing from a snapshot at last_lsn.
        """
        with self._reading() as txn:
            return _read_log_start(txn)

    def compact_log(
        self, keep_from_lsn: int, *, batch_entries: int = COMPACT_BATCH_ENTRIES_DEFAULT
    ) -> int:
        """Deletes the log entries below keep_from_lsn; returns how many it deleted.

        Never deletes the last entry, so at most up to min(keep_from_lsn, last LSN).
        Deletes batch_entries per write transaction (not flushed: a crash only leaves more
        log), each also moving the recorded log start, so readers never see a gap. A write
        like append: the caller serializes it with the other writes. Idempotent; nothing
        while a snapshot install is pending.
        """
        if keep_from_lsn < 1 or batch_entries < 1:
            raise ValueError(
                f"keep_from_lsn and batch_entries must be >= 1 ({keep_from_lsn}, {batch_entries})"
            )
        with self._reading() as txn:
            if _pending(txn):
                return 0
            start = _read_log_start(txn)
            target = min(keep_from_lsn, _read_log_tail(txn)[0])
        deleted = 0
        for _ in range(max(0, -(-(target - start) // batch_entries))):
            with self._writing(sync=False) as txn:
                start = _read_log_start(txn)
                if _pending(txn) or start >= target:
                    break  # another writer got here first
                end = min(target, start + batch_entries)
                deleted += txn.delete_range(DB_LOG, _U64.pack(start), _U64.pack(end))
                _put_u64(txn, DB_META, _META_LOG_START, end)
        return deleted

    def sync(self) -> None:
        """Flushes everything committed to disk."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
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
        included: the receiver's log continues from snapshot_lsn + 1. Raises
        SnapshotError if this store itself holds an unfinished install.
        """
        if records_max < 1 or bytes_max < 1:
            raise ValueError(f"records_max {records_max}, bytes_max {bytes_max}: both >= 1")
        return self._export(records_max, bytes_max)

    def _export(
        self, records_max: int, bytes_max: int
    ) -> Generator[replica_pb2.SnapshotChunk, None, None]:
        """The generator behind snapshot_chunks; its with-block releases the transaction."""
        with self._reading(long_lived=True) as txn:
            if _pending(txn):
                raise SnapshotError("this store holds an unfinished snapshot install, not state")
            snapshot_lsn, snapshot_epoch = _read_log_tail(txn)
            history = [
                replica_pb2.EpochBoundary(epoch=b.epoch, start_lsn=b.start_lsn)
                for b in _read_history(txn)
            ]
            # Room for the chunk's other fields, and the history the last chunk carries.
            budget = bytes_max - _CHUNK_HEADER_BYTES - sum(b.ByteSize() + 2 for b in history)
            index = count = size = 0
            chunk = replica_pb2.SnapshotChunk(
                index=0, snapshot_lsn=snapshot_lsn, snapshot_epoch=snapshot_epoch
            )
            add = chunk.records.add
            crc32, unpack_crc, crc_size = zlib.crc32, _CRC.unpack_from, _CRC.size
            for db in SNAPSHOT_DBS:
                overhead = _RECORD_OVERHEAD_BYTES + len(db)
                # The hot loop (one pass per record of the store): kept flat on purpose.
                for key, value in _snapshot_records(txn, db):
                    if len(value) < crc_size or unpack_crc(value)[0] != crc32(
                        value[crc_size:], crc32(key)
                    ):
                        _unseal(db, key, value)  # raises: a damaged record is never sent
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

    def begin_snapshot(self, snapshot_lsn: int, snapshot_epoch: int, *, sync: bool = True) -> None:
        """Starts installing a snapshot: empties the state and the log, marks it pending.

        One transaction (flushed when sync). Until finish_snapshot the store reports
        itself empty (last LSN 0, no topics), across restarts too; a pending install
        from before is discarded, and an append from LSN 1 abandons this one.
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
        pending = _PendingInstall(snapshot_lsn, snapshot_epoch, 0, False, 0, b"")
        with self._writing(sync=sync) as txn:
            _clear_state(txn)
            txn.put(DB_META, _META_SNAPSHOT_PENDING, pending.encode())

    def install_chunk(self, chunk: replica_pb2.SnapshotChunk, *, sync: bool = False) -> int:
        """Writes one chunk's records in one transaction; returns how many.

        The chunk must be the next (index 0, 1, ...) of the snapshot begun, its records
        in snapshot order and each with a valid checksum; otherwise SnapshotError (or
        CorruptRecordError for a checksum) and nothing of the chunk is written. Install
        every chunk, the last included, then call finish_snapshot.
        """
        with self._writing(sync=sync) as txn:
            pending = _read_pending(txn)
            if pending is None:
                raise SnapshotError(f"chunk {chunk.index}: no snapshot install in progress")
            where = f"chunk {chunk.index} of the snapshot at LSN {chunk.snapshot_lsn}"
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
            runs = _check_records(chunk, pending, where)
            for db, items in runs:
                if db == DB_META:
                    for key, value in items:
                        txn.put(db, key, value)
                else:
                    # Ascending above every key installed so far, into a database that
                    # begin_snapshot emptied: LMDB appends and packs pages full.
                    txn.put_many(db, items, append=True)
            pending.next_index += 1
            pending.complete = chunk.last
            txn.put(DB_META, _META_SNAPSHOT_PENDING, pending.encode())
        return len(chunk.records)

    def finish_snapshot(
        self,
        history: Iterable[tuple[int, int] | BoundaryLike],
        *,
        sync: bool = True,
        commit_lsn: int = 0,
        uncommitted: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        """Ends the install: the log ends at the snapshot's LSN and epoch, with history.

        One transaction (flushed when sync): last LSN and epoch, the epoch history, log
        start = snapshot LSN + 1, the store's epoch raised to the snapshot's if lower, and
        the pending mark cleared. SnapshotError (nothing changed) if no install is
        pending, its last chunk is not installed, or the history does not fit it.

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
            pending = _read_pending(txn)
            if pending is None:
                raise SnapshotError("finish: no snapshot install in progress")
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
            problem = _uncommitted_problem(uncommitted, commit, lsn)
            if problem is not None:
                raise SnapshotError(f"finish: the snapshot at LSN {lsn}: {problem}")
            txn.put(DB_META, _META_LOG_TAIL, _seal(_META_LOG_TAIL, _U64X2.pack(lsn, epoch)))
            if checked:
                body = b"".join(_U64X2.pack(e, start) for e, start in checked)
                txn.put(DB_META, _META_HISTORY, _seal(_META_HISTORY, body))
            _put_u64(txn, DB_META, _META_LOG_START, lsn + 1)
            if epoch > (_read_u64(txn, DB_META, _META_EPOCH) or 0):
                _put_u64(txn, DB_META, _META_EPOCH, epoch)
            _put_u64(txn, DB_META, _META_COMMIT, commit)
            if uncommitted:
                body = _encode_uncommitted(sorted(uncommitted, key=lambda item: item[2]))
                txn.put(DB_META, _META_UNCOMMITTED, _seal(_META_UNCOMMITTED, body))
            txn.delete(DB_META, _META_SNAPSHOT_PENDING)

    def abort_snapshot(self) -> bool:
        """Abandons an unfinished install (flushed): the store is left empty of data.

        Returns whether one was pending. Not needed before a new begin_snapshot (which
        discards it too); for a replica that will take its log from LSN 1 instead.
        """
        with self._writing(sync=True) as txn:
            if not _pending(txn):
                return False
            _clear_state(txn)
            txn.delete(DB_META, _META_SNAPSHOT_PENDING)
        return True

    # --- state

    def get_topic(self, name: str) -> TopicInfo | None:
        """The topic, or None."""
        with self._reading() as txn:
            row = None if _pending(txn) else _read_topic(txn, name)
            return None if row is None else row.info()

    def list_topics(self) -> list[TopicInfo]:
        """Every topic, ordered by name."""
        with self._reading() as txn:
            if _pending(txn):
                return []
            return [_decode_topic(k, v).info() for k, v in txn.scan(DB_TOPICS)]

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
        payloads and keys exceed it (but returns at least one event). Empty at or beyond
        the topic's end; raises UnknownTopicError for a topic the store does not hold, or
        (topic_id > 0) whose incarnation is not topic_id: a reader that began on a topic
        destroyed since never reads the one created again under its name.
        """
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        with self._reading() as txn:
            row = None if _pending(txn) else _read_topic(txn, topic)
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
            lo, hi = _U64X2.pack(row.topic_id, start), _U64X2.pack(row.topic_id, stop)
            for key, value in txn.scan(DB_EVENTS, lo, hi):
                if key != _U64X2.pack(row.topic_id, expect):
                    break  # reported as missing below
                try:
                    ev = common_pb2.Event.FromString(_unseal(DB_EVENTS, key, value))
                except DecodeError:
                    raise CorruptRecordError(DB_EVENTS, key, "event does not parse") from None
                if ev.offset != expect or ev.topic != topic:
                    raise CorruptRecordError(DB_EVENTS, key, "event topic or offset wrong")
                size_bytes += len(ev.payload) + len(ev.key)
                if max_bytes > 0 and out and size_bytes > max_bytes:
                    return out
                out.append(ev)
                expect += 1
            if expect < stop:
                raise CorruptRecordError(
                    DB_EVENTS, _U64X2.pack(row.topic_id, expect), "event missing"
                )
            return out

    def get_cursor(self, topic: str, subscription: str) -> int | None:
        """The subscription's cursor (next offset to deliver), or None."""
        with self._reading() as txn:
            row = None if _pending(txn) else _read_topic(txn, topic)
            raw = subscription.encode()
            if row is None or not raw:
                return None
            return _read_u64(txn, DB_CURSORS, _U64.pack(row.topic_id) + raw)

    def list_subscriptions(self, topic: str) -> list[tuple[str, int]]:
        """(name, cursor) of every subscription of the topic, by name."""
        with self._reading() as txn:
            row = None if _pending(txn) else _read_topic(txn, topic)
            if row is None:
                raise UnknownTopicError(f"no topic {topic!r}")
            lo, hi = _U64.pack(row.topic_id), _U64.pack(row.topic_id + 1)
            out = []
            for key, value in txn.scan(DB_CURSORS, lo, hi):
                (cursor,) = _unpack(DB_CURSORS, key, _U64, _unseal(DB_CURSORS, key, value))
                try:
                    out.append((key[_U64.size :].decode(), cursor))
                except UnicodeDecodeError:
                    raise CorruptRecordError(DB_CURSORS, key, "name is not UTF-8") from None
            return out

    def get_push_subscriber(self, topic: str, subscriber_id: str) -> PushSubscriber | None:
        """The topic's push subscriber with this id, or None."""
        raw = subscriber_id.encode()
        with self._reading() as txn:
            row = None if _pending(txn) else _read_topic(txn, topic)
            if row is None or not raw or len(raw) + _U64.size > MAX_KEY_BYTES:
                return None
            key = _U64.pack(row.topic_id) + raw
            value = txn.get(DB_PUSH, key)
            return None if value is None else _push_subscriber(topic, key, value)

    def list_push_subscribers(self, topic: str | None = None) -> list[PushSubscriber]:
        """The push subscribers of one topic (by id), or of every topic (by topic, id).

        Raises UnknownTopicError for a topic the store does not hold.
        """
        with self._reading() as txn:
            if _pending(txn):
                if topic is not None:
                    raise UnknownTopicError(f"no topic {topic!r}")
                return []
            if topic is None:
                rows = [_decode_topic(k, v) for k, v in txn.scan(DB_TOPICS)]
            else:
                row = _read_topic(txn, topic)
                if row is None:
                    raise UnknownTopicError(f"no topic {topic!r}")
                rows = [row]
            out: list[PushSubscriber] = []
            for row in rows:
                lo, hi = _U64.pack(row.topic_id), _U64.pack(row.topic_id + 1)
                out.extend(_push_subscriber(row.name, k, v) for k, v in txn.scan(DB_PUSH, lo, hi))
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
            prefix = _publisher_prefix(publisher_id)
        except InvalidEntryError:
            return None  # an id too long to be stored was never stored
        with self._reading() as txn:
            if _pending(txn):
                return None
            high_water = _read_u64(txn, DB_PUBLISHERS, prefix[_U16.size :]) or 0
            if not high_water - self._dedupe_window < sequence <= high_water:
                return None
            # Records are keyed by the last sequence of a run: the first record at or
            # above the sequence is the only run that can hold it.
            for key, value in txn.scan(DB_DEDUPE, prefix + _U64.pack(sequence)):
                if not key.startswith(prefix) or len(key) != len(prefix) + _U64.size:
                    return None
                body = _unseal(DB_DEDUPE, key, value)
                first, first_offset, lsn, epoch = _unpack(DB_DEDUPE, key, _DEDUPE, body)
                if first > sequence:
                    return None
                try:
                    topic = body[_DEDUPE.size :].decode()
                except UnicodeDecodeError:
                    raise CorruptRecordError(DB_DEDUPE, key, "topic is not UTF-8") from None
                offset = first_offset + sequence - first
                row = _read_topic(txn, topic)
                if row is None or not _event_matches(txn, row, offset, publisher_id, sequence, lsn):
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
            return 0 if _pending(txn) else _read_u64(txn, DB_PUBLISHERS, raw) or 0
