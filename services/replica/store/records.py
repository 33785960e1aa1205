"""The store's records: the databases' layout, the record types and their encoding.

Every value is sealed with a CRC-32 of its key and body (``seal``/``unseal``); the meta
records' reads and writes live here too, shared by the batch apply (``apply``), the
snapshots (``snapshot``) and ``Store`` (``facade``). The package docstring describes each
database.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.store.errors import CorruptRecordError, InvalidEntryError
from squall_server.replica.store.kv import (
    MAX_KEY_BYTES,
    ReadTxn,
    WriteTxn,
)

DB_META = "meta"


DB_LOG = "log"


DB_TOPICS = "topics"


DB_EVENTS = "events"


DB_CURSORS = "cursors"


DB_DEDUPE = "dedupe"


DB_PUBLISHERS = "publishers"


DB_PUSH = "push"


# Shared subscriptions (docs/consumers.md): topic id + length-prefixed name -> settings
# (a serialized SharedCreateOp); the same key + offset -> that offset's state above the
# floor (shared_offset_value).
DB_SHARED = "shared"


# Topic links (docs/federation.md): source topic id + destination name -> the link (a
# serialized LinkTopicOp with created_lsn set).
DB_LINKS = "links"


# The databases holding the replica's log and state (what counts and reads see).
LIVE_DATABASES = (
    DB_META,
    DB_LOG,
    DB_TOPICS,
    DB_EVENTS,
    DB_CURSORS,
    DB_DEDUPE,
    DB_PUBLISHERS,
    DB_PUSH,
    DB_SHARED,
    DB_LINKS,
)


# The databases a snapshot carries, in the order it carries them (meta: only the keys
# in META_SNAPSHOT_KEYS). Everything but the log and the receiving node's own meta.
SNAPSHOT_DBS = (
    DB_META,
    DB_TOPICS,
    DB_EVENTS,
    DB_CURSORS,
    DB_DEDUPE,
    DB_PUBLISHERS,
    DB_PUSH,
    DB_SHARED,
    DB_LINKS,
)


# A snapshot install writes each of SNAPSHOT_DBS into its staging twin, never into the
# live database: the live state and log stay whole (and are what the replica reports and
# serves) until finish_install swaps the staged records in, in one transaction.
STAGED_DBS = {db: f"{db}.staged" for db in SNAPSHOT_DBS}


# The databases a KV must hold for the store: the live ones and the staging twins.
DATABASES = LIVE_DATABASES + tuple(STAGED_DBS.values())


# The state databases a finished snapshot install empties (before moving the staged
# records in), with the log.
CLEARED_DBS = (
    DB_TOPICS,
    DB_EVENTS,
    DB_CURSORS,
    DB_DEDUPE,
    DB_PUBLISHERS,
    DB_PUSH,
    DB_SHARED,
    DB_LINKS,
    DB_LOG,
)


META_CLUSTER_ID = b"cluster_id"


META_SHUTDOWN_ID = b"shutdown_id"


META_STATE = b"store_state"


META_EPOCH = b"epoch"


META_MAX_SEEN = b"max_seen"


META_NEXT_TOPIC_ID = b"next_topic_id"


META_HISTORY = b"history"


META_LOG_TAIL = b"log_tail"


META_LOG_START = b"log_start"


META_SNAPSHOT_PENDING = b"snapshot_pending"


META_COMMIT = b"commit_lsn"


META_UNCOMMITTED = b"snapshot_uncommitted"


# Meta keys that describe state (a snapshot carries them); the others belong to the node
# (cluster id, shutdown id, store state, epoch, max seen) or describe the log.
META_SNAPSHOT_KEYS = frozenset({META_NEXT_TOPIC_ID})


CRC = struct.Struct(">I")


U64 = struct.Struct(">Q")


U64X2 = struct.Struct(">QQ")


U16 = struct.Struct(">H")


TOPIC_RECORD = struct.Struct(">QBQQq")  # topic_id, kind, next_offset, first_offset, created_ms


# Then the bytes of the topic's stored event records (TOPIC_RECORD + 8 bytes); a record
# written before the count existed ends at TOPIC_RECORD.size and its size is unknown.
TOPIC_RECORD_SIZED = struct.Struct(">QBQQqQ")


DEDUPE_RECORD = struct.Struct(">QQQQ")  # first sequence, its offset, lsn, epoch; then topic


# Index keys in DB_PUBLISHERS (a publisher id never starts with a 0 byte): the publishers
# of a topic id, and the topic ids of a publisher. Values: a sealed empty body.
IDX_TOPIC = b"\x00t"


IDX_PUBLISHER = b"\x00p"


# Above every dedupe key of a publisher prefix (a prefix + 8-byte sequence).
SEQ_END = b"\xff" * (8 + 1)


# One uncommitted publish of an installed snapshot: last LSN, first offset, topic length.
UNCOMMITTED_RECORD = struct.Struct(">QQH")


STATES = (
    common_pb2.STORE_STATE_EMPTY,
    common_pb2.STORE_STATE_CLEAN,
    common_pb2.STORE_STATE_DIRTY,
)


KINDS = (common_pb2.TOPIC_KIND_REPLICATED, common_pb2.TOPIC_KIND_TRANSIENT)


@dataclass(frozen=True)
class TopicInfo:
    """A topic as the store holds it."""

    name: str
    topic_id: int
    kind: common_pb2.TopicKind.ValueType
    next_offset: int
    first_offset: int
    created_ms: int
    # The bytes of the event records the store holds for the topic (each sealed value in
    # ``events``: the serialized event with its checksum; keys and page overhead not
    # counted); None for a topic whose record predates the count (docs/console.md).
    size_bytes: int | None = 0


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
    failures: int = 0  # failed delivery rounds in a row, as the log last recorded it


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
    # An install began and did not finish: its records are staged, the live state and
    # log (everything above) are still the ones from before it.
    snapshot_pending: bool = False
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


def publishes(operation: replica_pb2.Operation) -> Sequence[replica_pb2.PublishOp]:
    """The publishes an entry's operation stores: one, a joined request's parts, or
    none."""
    kind = operation.WhichOneof("op")
    if kind == "publish":
        return (operation.publish,)
    if kind == "publish_parts":
        return operation.publish_parts.parts
    return ()


def seal(key: bytes, body: bytes) -> bytes:
    """Prefixes body with the CRC-32 of key and body, so a value moved to another key fails."""
    return CRC.pack(zlib.crc32(body, zlib.crc32(key))) + body


def unseal(db: str, key: bytes, value: bytes) -> bytes:
    """Returns the body of a sealed value, or raises CorruptRecordError."""
    if len(value) < CRC.size:
        raise CorruptRecordError(db, key, f"value of {len(value)} bytes has no checksum")
    body = value[CRC.size :]
    if CRC.unpack_from(value)[0] != zlib.crc32(body, zlib.crc32(key)):
        raise CorruptRecordError(db, key, "checksum mismatch")
    return body


def unpack(db: str, key: bytes, fmt: struct.Struct, body: bytes) -> tuple[int, ...]:
    """Unpacks a fixed-size prefix of a verified body."""
    if len(body) < fmt.size:
        raise CorruptRecordError(db, key, f"record of {len(body)} bytes, {fmt.size} expected")
    values: tuple[int, ...] = fmt.unpack_from(body)
    return values


def name_key(what: str, text: str, prefix: bytes = b"") -> bytes:
    """Encodes a name into a key, refusing names the KV cannot hold."""
    raw = text.encode()
    if not raw or len(prefix) + len(raw) > MAX_KEY_BYTES:
        raise InvalidEntryError(f"{what} of {len(raw)} bytes (1..{MAX_KEY_BYTES - len(prefix)})")
    return prefix + raw


def publisher_prefix(publisher_id: str) -> bytes:
    """The dedupe key prefix: length-prefixed, so no publisher's keys fall in another's range.

    The publisher's key in ``publishers`` is this prefix without its 2-byte length.
    """
    raw = publisher_id.encode()
    if not 0 < len(raw) <= MAX_KEY_BYTES - U16.size - U64.size:
        raise InvalidEntryError(
            f"publisher id of {len(raw)} bytes (1..{MAX_KEY_BYTES - U16.size - U64.size})"
        )
    return U16.pack(len(raw)) + raw


class TopicRow:
    """A topic record being read or changed."""

    __slots__ = (
        "created_ms",
        "first_offset",
        "key",
        "kind",
        "name",
        "next_offset",
        "size_bytes",
        "topic_id",
    )

    def __init__(
        self,
        name: str,
        key: bytes,
        topic_id: int,
        kind: int,
        next_offset: int,
        first_offset: int,
        created_ms: int,
        size_bytes: int | None = 0,
    ) -> None:
        self.name = name
        self.key = key
        self.topic_id = topic_id
        self.kind = kind
        self.next_offset = next_offset
        self.first_offset = first_offset
        self.created_ms = created_ms
        self.size_bytes = size_bytes

    def encode(self) -> bytes:
        """The sealed record (without the byte count while that is unknown)."""
        fields = (self.topic_id, self.kind, self.next_offset, self.first_offset, self.created_ms)
        if self.size_bytes is None:
            return seal(self.key, TOPIC_RECORD.pack(*fields))
        return seal(self.key, TOPIC_RECORD_SIZED.pack(*fields, self.size_bytes))

    def add_events(self, size_bytes: int) -> None:
        """Counts new event records of size_bytes in all (an unknown count stays unknown)."""
        if self.size_bytes is not None:
            self.size_bytes += size_bytes

    def info(self) -> TopicInfo:
        """The public, frozen view."""
        return TopicInfo(
            name=self.name,
            topic_id=self.topic_id,
            kind=common_pb2.TopicKind.ValueType(self.kind),
            next_offset=self.next_offset,
            first_offset=self.first_offset,
            created_ms=self.created_ms,
            size_bytes=self.size_bytes,
        )


def decode_push(key: bytes, value: bytes) -> tuple[int, int, replica_pb2.PushSubscribeOp]:
    """Decodes and verifies a push record: (cursor, subscribing LSN, the subscribe op)."""
    body = unseal(DB_PUSH, key, value)
    cursor, lsn = unpack(DB_PUSH, key, U64X2, body)
    try:
        op = replica_pb2.PushSubscribeOp.FromString(body[U64X2.size :])
    except DecodeError:
        raise CorruptRecordError(DB_PUSH, key, "subscribe record does not parse") from None
    if key[U64.size :] != op.subscriber_id.encode():
        raise CorruptRecordError(DB_PUSH, key, "subscriber id does not match its key")
    return cursor, lsn, op


def push_subscriber(topic: str, key: bytes, value: bytes) -> PushSubscriber:
    cursor, lsn, op = decode_push(key, value)
    return PushSubscriber(
        topic=topic,
        subscriber_id=op.subscriber_id,
        endpoint=op.endpoint,
        ordered=op.ordered,
        retry_count=op.retry_count,
        cursor=cursor,
        created_ms=op.created_ms,
        lsn=lsn,
        failures=op.failures,
    )


def decode_topic(key: bytes, value: bytes) -> TopicRow:
    """Decodes and verifies a topics record."""
    body = unseal(DB_TOPICS, key, value)
    topic_id, kind, next_offset, first_offset, created_ms = unpack(
        DB_TOPICS, key, TOPIC_RECORD, body
    )
    size_bytes: int | None = None  # a record from before the count: unknown
    if len(body) >= TOPIC_RECORD_SIZED.size:
        size_bytes = unpack(DB_TOPICS, key, TOPIC_RECORD_SIZED, body)[-1]
    try:
        name = key.decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(DB_TOPICS, key, "topic name is not UTF-8") from None
    return TopicRow(name, key, topic_id, kind, next_offset, first_offset, created_ms, size_bytes)


def read_topic(txn: ReadTxn, name: str) -> TopicRow | None:
    """Reads a topic record by name; None when absent (or the name cannot be a key)."""
    raw = name.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        return None
    value = txn.get(DB_TOPICS, raw)
    return None if value is None else decode_topic(raw, value)


def event_matches(
    txn: ReadTxn, row: TopicRow, offset: int, publisher_id: str, sequence: int, lsn: int
) -> bool:
    """Whether the topic holds, at offset, the event of (publisher_id, sequence) stored
    by the entry at lsn: what a dedupe record must point at to count."""
    if not row.first_offset <= offset < row.next_offset:
        return False
    key = U64X2.pack(row.topic_id, offset)
    value = txn.get(DB_EVENTS, key)
    if value is None:
        return False
    try:
        ev = common_pb2.Event.FromString(unseal(DB_EVENTS, key, value))
    except DecodeError:
        raise CorruptRecordError(DB_EVENTS, key, "event does not parse") from None
    return ev.publisher_id == publisher_id and ev.sequence == sequence and ev.lsn == lsn


def cursor_state(key: bytes, value: bytes) -> tuple[int, int]:
    """(cursor, seek generation) of a verified cursor record (8 or 16 bytes)."""
    body = unseal(DB_CURSORS, key, value)
    if len(body) >= U64X2.size:
        cursor, generation = U64X2.unpack_from(body)
        return int(cursor), int(generation)
    (cursor,) = unpack(DB_CURSORS, key, U64, body)
    return cursor, 0


def read_u64(txn: ReadTxn, db: str, key: bytes) -> int | None:
    """Reads a sealed 8-byte counter."""
    value = txn.get(db, key)
    if value is None:
        return None
    return unpack(db, key, U64, unseal(db, key, value))[0]


def read_text(txn: ReadTxn, key: bytes) -> str:
    """Reads a sealed UTF-8 meta value ("" when absent)."""
    value = txn.get(DB_META, key)
    if value is None:
        return ""
    try:
        return unseal(DB_META, key, value).decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(DB_META, key, "not UTF-8") from None


def read_history(txn: ReadTxn) -> list[EpochBoundary]:
    """Reads the epoch history, oldest first."""
    value = txn.get(DB_META, META_HISTORY)
    if value is None:
        return []
    body = unseal(DB_META, META_HISTORY, value)
    if len(body) % U64X2.size:
        raise CorruptRecordError(DB_META, META_HISTORY, f"history of {len(body)} bytes")
    return [EpochBoundary(e, s) for e, s in U64X2.iter_unpack(body)]


def read_log_tail(txn: ReadTxn) -> tuple[int, int]:
    """Reads (last LSN, last epoch)."""
    value = txn.get(DB_META, META_LOG_TAIL)
    if value is None:
        return 0, 0
    lsn, epoch = unpack(DB_META, META_LOG_TAIL, U64X2, unseal(DB_META, META_LOG_TAIL, value))
    return lsn, epoch


def read_log_start(txn: ReadTxn) -> int:
    """Reads the first LSN still in the log (1 for a log never compacted)."""
    return read_u64(txn, DB_META, META_LOG_START) or 1


def install_pending(txn: ReadTxn) -> bool:
    """Whether a snapshot install began and has not finished (its records are staged; the
    live state and log are the ones from before it, whole)."""
    return txn.get(DB_META, META_SNAPSHOT_PENDING) is not None


def clear_state(txn: WriteTxn) -> None:
    """Empties the state databases and the log, and forgets the log's meta.

    The node's own meta (cluster id, shutdown id, store state, epoch, max seen) stays.
    """
    for db in CLEARED_DBS:
        txn.clear(db)
    for key in (
        META_NEXT_TOPIC_ID,
        META_LOG_TAIL,
        META_HISTORY,
        META_LOG_START,
        META_UNCOMMITTED,
    ):
        txn.delete(DB_META, key)
    put_u64(txn, DB_META, META_COMMIT, 0)  # an empty log: nothing committed here


def read_meta(txn: ReadTxn) -> StoreMeta:
    """Reads every meta record in one transaction."""
    last_lsn, last_epoch = read_log_tail(txn)
    state = read_u64(txn, DB_META, META_STATE)
    return StoreMeta(
        cluster_id=read_text(txn, META_CLUSTER_ID),
        shutdown_id=read_text(txn, META_SHUTDOWN_ID),
        state=common_pb2.StoreState.ValueType(state or common_pb2.STORE_STATE_EMPTY),
        epoch=read_u64(txn, DB_META, META_EPOCH) or 0,
        max_seen=read_u64(txn, DB_META, META_MAX_SEEN) or 0,
        last_lsn=last_lsn,
        last_epoch=last_epoch,
        history=tuple(read_history(txn)),
        log_start_lsn=read_log_start(txn),
        snapshot_pending=install_pending(txn),
        commit_lsn=read_u64(txn, DB_META, META_COMMIT),
    )


def raise_commit(txn: WriteTxn, commit_lsn: int, last_lsn: int) -> int:
    """Records min(commit_lsn, last_lsn) as the commit LSN if above the recorded one.

    A committed LSN stays committed, so the record only grows (truncations and snapshot
    installs, which may lower it, write it directly). Returns the recorded value.
    """
    return raise_commit_from(txn, commit_lsn, last_lsn, read_u64(txn, DB_META, META_COMMIT))


def raise_commit_from(txn: WriteTxn, commit_lsn: int, last_lsn: int, current: int | None) -> int:
    """``raise_commit`` over a recorded commit LSN the caller knows (None: none recorded)."""
    held = min(commit_lsn, last_lsn)
    if current is not None and current >= held:
        return current
    put_u64(txn, DB_META, META_COMMIT, held)
    return held


def encode_uncommitted(items: Sequence[tuple[str, int, int]]) -> bytes:
    """(topic, first offset, last LSN) triples as one meta value body."""
    parts: list[bytes] = []
    for topic, first_offset, last_lsn in items:
        name = topic.encode()
        parts.append(UNCOMMITTED_RECORD.pack(last_lsn, first_offset, len(name)) + name)
    return b"".join(parts)


def decode_uncommitted(body: bytes) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    at = 0
    while at < len(body):
        if len(body) - at < UNCOMMITTED_RECORD.size:
            raise CorruptRecordError(DB_META, META_UNCOMMITTED, "truncated record")
        last_lsn, first_offset, size = UNCOMMITTED_RECORD.unpack_from(body, at)
        at += UNCOMMITTED_RECORD.size
        if len(body) - at < size:
            raise CorruptRecordError(DB_META, META_UNCOMMITTED, "truncated topic name")
        try:
            topic = body[at : at + size].decode()
        except UnicodeDecodeError:
            raise CorruptRecordError(DB_META, META_UNCOMMITTED, "topic not UTF-8") from None
        at += size
        out.append((topic, first_offset, last_lsn))
    return out


def put_u64(txn: WriteTxn, db: str, key: bytes, value: int) -> None:
    """Writes a sealed 8-byte counter."""
    txn.put(db, key, seal(key, U64.pack(value)))


def put_text(txn: WriteTxn, key: bytes, text: str) -> None:
    """Writes a sealed UTF-8 meta value."""
    txn.put(DB_META, key, seal(key, text.encode()))


# Longest peer-supplied text quoted in an error.
SHOWN_CHARS_MAX = 40


# A shared subscription's per-offset state: failed deliveries, a state byte
# (SHARED_PENDING, SHARED_ACKED, SHARED_DEAD), then text (UTF-8): the last error, or for an
# acked offset the consumer that acked it.
SHARED_OFFSET = struct.Struct(">QB")
SHARED_PENDING = 0
SHARED_ACKED = 1
SHARED_DEAD = 2
# Done offsets' records are kept this many offsets below the cursor (who acked them), then
# deleted (services/replica/shared.py, ACKED_BY_RETAIN).
SHARED_RETAIN = 10_000


def shared_prefix(topic_id: int, subscription: str) -> bytes:
    """A shared subscription's settings key; its offsets' keys add 8 bytes."""
    raw = subscription.encode()
    if not 0 < len(raw) <= MAX_KEY_BYTES - U64.size * 2 - U16.size:
        raise InvalidEntryError(f"subscription name of {len(raw)} bytes")
    return U64.pack(topic_id) + U16.pack(len(raw)) + raw


def shared_offset_value(failures: int, state: int, text: str) -> bytes:
    """The body of a per-offset record."""
    return SHARED_OFFSET.pack(failures, state) + text.encode()


def shared_offset_state(key: bytes, value: bytes) -> tuple[int, int, str]:
    """(failures, state, text) of a verified per-offset record."""
    body = unseal(DB_SHARED, key, value)
    failures, state = unpack(DB_SHARED, key, SHARED_OFFSET, body)
    try:
        text = body[SHARED_OFFSET.size :].decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(DB_SHARED, key, "text is not UTF-8") from None
    return failures, state, text
