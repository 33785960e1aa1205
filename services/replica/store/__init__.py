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
``begin_snapshot`` (marks meta ``snapshot_pending``), one ``install_chunk`` per chunk (one
transaction each, every record re-verified, written to the staging twin of its database)
and ``finish_snapshot(history)`` (ONE transaction: the live state and log are emptied,
the staged records moved in, and the log is empty and continues at snapshot LSN + 1). An
install holds one chunk in memory at a time. Until it finishes the store keeps, serves
and reports the state and log it held (its last LSN and epoch, its topics), across
restarts too; ``abort_snapshot``, a new ``begin_snapshot`` or an append drops what an
unfinished install staged and nothing else. The price is writing the snapshot twice: a
replica never gives up data before the replacement is whole. The node's own meta
(cluster id, shutdown id, store state, epoch, max seen) is never sent.

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
* ``<db>.staged`` for each database a snapshot carries (``STAGED_DBS``): the records of
  an unfinished snapshot install, as the live database would hold them; empty otherwise.
* ``topics``: name -> topic id, kind, next offset, first offset, creation time and the
  topic's size: the bytes of its records in ``events`` (each sealed value: the serialized
  event and its checksum), kept in the same transaction as the events — a publish adds
  its records' bytes, a destroy deletes the record with the events, a snapshot carries
  it with the events it counts (one read transaction), a truncation replays the log. A
  record written before the count existed has no size field: the size reads as unknown
  (``TopicInfo.size_bytes`` None) until the topic is destroyed, never recounted.
* ``events``: topic id + offset (8 + 8 bytes big-endian) -> serialized ``common_pb2.Event``.
* ``shared``: topic id + length-prefixed subscription name -> a shared subscription's
  settings (``SharedCreateOp``); the same key + offset (8 bytes) -> failed deliveries,
  done flag and last error of an offset above its cursor (deleted as the cursor passes).
* ``cursors``: topic id (8 bytes) + subscription name -> next offset to deliver, followed
  (16 bytes) by the LSN of the seek that last moved it once one has (its seek generation).
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

The package's modules: ``facade`` (``Store``, the one object the rest of the replica
uses), ``records`` (the databases' layout, the record types and their encoding, the meta
records), ``apply`` (a batch of log entries applied in one write transaction),
``snapshot`` (the export of the state as chunks and their install), ``errors``, and the
key-value layer: ``kv`` (the interface), ``kv_lmdb`` and ``kv_memory`` (its twins). Import
what the rest of the code uses from the package itself.
"""

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
from squall_server.replica.store.facade import (
    COMPACT_BATCH_ENTRIES_DEFAULT,
    DEDUPE_WINDOW_DEFAULT,
    SharedState,
    Store,
    TimeLookup,
)
from squall_server.replica.store.records import (
    DATABASES,
    DB_CURSORS,
    DB_DEDUPE,
    DB_EVENTS,
    DB_LOG,
    DB_META,
    DB_PUBLISHERS,
    DB_PUSH,
    DB_TOPICS,
    SNAPSHOT_DBS,
    DedupeHit,
    EpochBoundary,
    PushSubscriber,
    StoreMeta,
    TopicInfo,
    make_entry,
)
from squall_server.replica.store.snapshot import (
    SNAPSHOT_BYTES_MAX_DEFAULT,
    SNAPSHOT_RECORDS_MAX_DEFAULT,
    SNAPSHOT_UNCOMMITTED_MAX,
)

__all__ = [
    "COMPACT_BATCH_ENTRIES_DEFAULT",
    "DATABASES",
    "DB_CURSORS",
    "DB_DEDUPE",
    "DB_EVENTS",
    "DB_LOG",
    "DB_META",
    "DB_PUBLISHERS",
    "DB_PUSH",
    "DB_TOPICS",
    "DEDUPE_WINDOW_DEFAULT",
    "SNAPSHOT_BYTES_MAX_DEFAULT",
    "SNAPSHOT_DBS",
    "SNAPSHOT_RECORDS_MAX_DEFAULT",
    "SNAPSHOT_UNCOMMITTED_MAX",
    "CorruptRecordError",
    "DedupeHit",
    "EpochBoundary",
    "InvalidEntryError",
    "LogCompactedError",
    "PushSubscriber",
    "SharedState",
    "SnapshotError",
    "StaleEpochError",
    "Store",
    "StoreError",
    "StoreFullError",
    "StoreMeta",
    "StoreWriteError",
    "TimeLookup",
    "TopicInfo",
    "UnknownTopicError",
    "make_entry",
]
