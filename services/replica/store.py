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

Synchronous; one writer and many readers: the replica serializes writes (``append`` and
the meta setters) itself, reads may come from any thread, each seeing one committed
state. Reads: ``meta``, ``read_log``, ``get_topic``, ``list_topics`` (by name),
``read_events`` (verified ``common_pb2.Event`` list), ``get_cursor``,
``list_subscriptions``, ``lookup_sequence``, ``publisher_high_water``. ``make_entry``
builds an entry with its checksum.

The store runs on the ``kv.KV`` interface, with two twins: ``Store.open_lmdb`` and
``Store.open_memory``. Its named databases:

* ``meta``: cluster id, shutdown id, store state, epoch (the newest accepted; never
  decreases), max seen, next topic id, epoch history (epoch, start LSN), and the log
  tail (last LSN, last epoch).
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
  Sequences at or below high water - ``dedupe_window`` are forgotten (pruned).

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
``StaleEpochError``: ``set_epoch`` below the store's epoch. ``UnknownTopicError``: a
topic read (``read_events``, ``list_subscriptions``) of a topic the store does not hold.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from services.replica.kv import (
    KV,
    MAX_KEY_BYTES,
    KVCorruptError,
    KVError,
    KVFullError,
    ReadTxn,
    WriteTxn,
)
from services.replica.store_lmdb import LmdbKV
from services.replica.store_memory import MemoryKV
from squall.v1 import common_pb2, replica_pb2

DB_META = "meta"
DB_LOG = "log"
DB_TOPICS = "topics"
DB_EVENTS = "events"
DB_CURSORS = "cursors"
DB_DEDUPE = "dedupe"
DB_PUBLISHERS = "publishers"
# The databases a KV must hold for the store.
DATABASES = (DB_META, DB_LOG, DB_TOPICS, DB_EVENTS, DB_CURSORS, DB_DEDUPE, DB_PUBLISHERS)

DEDUPE_WINDOW_DEFAULT = 100_000

_META_CLUSTER_ID = b"cluster_id"
_META_SHUTDOWN_ID = b"shutdown_id"
_META_STATE = b"store_state"
_META_EPOCH = b"epoch"
_META_MAX_SEEN = b"max_seen"
_META_NEXT_TOPIC_ID = b"next_topic_id"
_META_HISTORY = b"history"
_META_LOG_TAIL = b"log_tail"

_CRC = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_U64X2 = struct.Struct(">QQ")
_U16 = struct.Struct(">H")
_TOPIC = struct.Struct(">QBQQq")  # topic_id, kind, next_offset, first_offset, created_ms
_DEDUPE = struct.Struct(">QQQQ")  # first sequence, its offset, lsn, epoch; then topic

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


def _read_meta(txn: ReadTxn) -> StoreMeta:
    """Reads every meta record in one transaction."""
    last_lsn, last_epoch = _read_log_tail(txn)
    state = _read_u64(txn, DB_META, _META_STATE)
    return StoreMeta(
        cluster_id=_read_text(txn, _META_CLUSTER_ID),
        shutdown_id=_read_text(txn, _META_SHUTDOWN_ID),
        state=common_pb2.StoreState.ValueType(state or common_pb2.STORE_STATE_EMPTY),
        epoch=_read_u64(txn, DB_META, _META_EPOCH) or 0,
        max_seen=_read_u64(txn, DB_META, _META_MAX_SEEN) or 0,
        last_lsn=last_lsn,
        last_epoch=last_epoch,
        history=tuple(_read_history(txn)),
    )


def _put_u64(txn: WriteTxn, db: str, key: bytes, value: int) -> None:
    """Writes a sealed 8-byte counter."""
    txn.put(db, key, _seal(key, _U64.pack(value)))


def _put_text(txn: WriteTxn, key: bytes, text: str) -> None:
    """Writes a sealed UTF-8 meta value."""
    txn.put(DB_META, key, _seal(key, text.encode()))


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
        self.topics[op.name] = self.dirty_topics[op.name] = None

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
            self.record_sequences(publisher_id, op.topic, runs, lsn, epoch)

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
        topic: str,
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
        tail = topic.encode()
        for run_first, run_last, run_offset in runs:
            # Sequences grow, so only a run starting at or below the high-water mark can
            # overlap a stored one; the master never stores a sequence twice.
            if run_first <= new:
                for key, value in self.txn.scan(DB_DEDUPE, prefix + _U64.pack(run_first)):
                    if key.startswith(prefix) and len(key) == len(prefix) + _U64.size:
                        (stored_first,) = _unpack(
                            DB_DEDUPE, key, _U64, _unseal(DB_DEDUPE, key, value)
                        )
                        if stored_first <= run_last:
                            raise self.refuse(
                                f"publisher {publisher_id!r} sequences "
                                f"{run_first}..{run_last} are already stored"
                            )
                    break
            key = prefix + _U64.pack(run_last)
            body = _DEDUPE.pack(run_first, run_offset, lsn, epoch) + tail
            self.txn.put(DB_DEDUPE, key, _seal(key, body))
            new = max(new, run_last)
        self.high_water[publisher_id] = (prefix, old, new)

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

    def finish(self) -> None:
        """Writes what the batch cached: events, topics, high-water marks, log and meta."""
        txn = self.txn
        self.flush_events()
        for name, row in self.dirty_topics.items():
            if row is None:
                txn.delete(DB_TOPICS, name.encode())
            else:
                txn.put(DB_TOPICS, row.key, row.encode())
        for prefix, old, new in self.high_water.values():
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
    ) -> Store:
        """Opens (or creates) an LMDB store in the directory path."""
        try:
            kv = LmdbKV(path, DATABASES, map_size_bytes=map_size_bytes, max_readers=max_readers)
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

    @contextmanager
    def _reading(self) -> Iterator[ReadTxn]:
        """A read transaction, with KV errors turned into store errors."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            with self._kv.read() as txn:
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

    def append(self, entries: Sequence[replica_pb2.LogEntry], *, sync: bool) -> None:
        """Verifies, stores and applies entries in one transaction; flushed when sync.

        Each entry needs a valid checksum, lsn == last LSN + 1 and an epoch no older than
        the last entry's. An entry of a newer epoch adds an epoch history boundary and
        raises the store's epoch. Any error: nothing of the batch is stored.
        """
        if not entries:
            return
        with self._writing(sync=sync) as txn:
            batch = _Batch(txn, self._dedupe_window)
            for entry in entries:
                batch.entry(entry)
            batch.finish()

    def read_log(self, from_lsn: int, max_entries: int) -> list[replica_pb2.LogEntry]:
        """Up to max_entries verified entries from from_lsn (empty beyond the last)."""
        if from_lsn < 1 or max_entries < 1:
            raise ValueError(f"from_lsn and max_entries must be >= 1 ({from_lsn}, {max_entries})")
        with self._reading() as txn:
            last_lsn, _ = _read_log_tail(txn)
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

    def sync(self) -> None:
        """Flushes everything committed to disk."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            self._kv.sync()
        except KVError as exc:
            raise StoreWriteError(f"sync failed: {exc}") from exc

    # --- state

    def get_topic(self, name: str) -> TopicInfo | None:
        """The topic, or None."""
        with self._reading() as txn:
            row = _read_topic(txn, name)
            return None if row is None else row.info()

    def list_topics(self) -> list[TopicInfo]:
        """Every topic, ordered by name."""
        with self._reading() as txn:
            return [_decode_topic(k, v).info() for k, v in txn.scan(DB_TOPICS)]

    def read_events(
        self,
        topic: str,
        from_offset: int,
        max_events: int,
        end_offset: int = 0,
        *,
        max_bytes: int = 0,
    ) -> list[common_pb2.Event]:
        """Verified events from from_offset up to (not including) end_offset (0: no end).

        Returns at most max_events events and, when max_bytes > 0, stops before the
        payloads and keys exceed it (but returns at least one event). Empty at or beyond
        the topic's end; raises UnknownTopicError for a topic the store does not hold.
        """
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        with self._reading() as txn:
            row = _read_topic(txn, topic)
            if row is None:
                raise UnknownTopicError(f"no topic {topic!r}")
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
            row = _read_topic(txn, topic)
            raw = subscription.encode()
            if row is None or not raw:
                return None
            return _read_u64(txn, DB_CURSORS, _U64.pack(row.topic_id) + raw)

    def list_subscriptions(self, topic: str) -> list[tuple[str, int]]:
        """(name, cursor) of every subscription of the topic, by name."""
        with self._reading() as txn:
            row = _read_topic(txn, topic)
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

    def lookup_sequence(self, publisher_id: str, sequence: int) -> DedupeHit | None:
        """Where (publisher_id, sequence) was stored, if within the dedupe window.

        The window: sequences above the publisher's high-water mark minus dedupe_window.
        """
        if not publisher_id or sequence <= 0:
            return None
        try:
            prefix = _publisher_prefix(publisher_id)
        except InvalidEntryError:
            return None  # an id too long to be stored was never stored
        with self._reading() as txn:
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
                return DedupeHit(topic, first_offset + sequence - first, lsn, epoch)
            return None

    def publisher_high_water(self, publisher_id: str) -> int:
        """The highest sequence stored for the publisher (0 if none)."""
        raw = publisher_id.encode()
        if not raw or len(raw) > MAX_KEY_BYTES:
            return 0
        with self._reading() as txn:
            return _read_u64(txn, DB_PUBLISHERS, raw) or 0
