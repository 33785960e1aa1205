"""Applying log entries: ``Batch`` verifies each entry of one ``Store.append`` and
applies its operation inside that append's write transaction."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.store.errors import CorruptRecordError, InvalidEntryError
from squall_server.replica.store.kv import (
    MAX_KEY_BYTES,
    WriteTxn,
)
from squall_server.replica.store.records import (
    CRC,
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
    IDX_PUBLISHER,
    IDX_TOPIC,
    KINDS,
    META_EPOCH,
    META_HISTORY,
    META_LOG_TAIL,
    META_NEXT_TOPIC_ID,
    SEQ_END,
    SHARED_ACKED,
    SHARED_DEAD,
    SHARED_PENDING,
    SHARED_RETAIN,
    U16,
    U64,
    U64X2,
    EpochBoundary,
    TopicRow,
    cursor_state,
    decode_push,
    event_matches,
    name_key,
    publisher_prefix,
    put_u64,
    read_history,
    read_log_tail,
    read_topic,
    read_u64,
    seal,
    shared_offset_state,
    shared_offset_value,
    shared_prefix,
    unpack,
    unseal,
)


def read_cursor(txn: WriteTxn, key: bytes) -> int:
    """A subscription's cursor (0 when it has none)."""
    value = txn.get(DB_CURSORS, key)
    return 0 if value is None else cursor_state(key, value)[0]


# The most topic records an append hands to the next (LogTail.topics); more are dropped.
TOPICS_KEPT_MAX = 64


@dataclass(frozen=True, slots=True)
class LogTail:
    """The meta records an append reads and leaves behind: the store keeps them from one
    append to the next while nobody else writes (``WriteTxn.generation``), so a lone
    entry's append reads none of them again."""

    last_lsn: int
    last_epoch: int
    epoch: int
    next_topic_id: int
    history: tuple[EpochBoundary, ...]
    commit_lsn: int | None  # the recorded commit LSN (None: never recorded)
    # The topic records the append read or wrote, as stored (None: no such topic); the
    # next append takes the dict and its rows over (nothing else holds them).
    topics: dict[str, TopicRow | None]


class Batch:
    """Applies one append's entries inside its write transaction.

    Topic records, publisher high-water marks, new events, log entries and meta are
    cached for the batch and written by ``finish`` (events earlier when a destroy needs
    them in place): a batch of many small publishes then costs few KV calls per entry.
    """

    def __init__(self, txn: WriteTxn, dedupe_window: int, tail: LogTail | None = None) -> None:
        """An append's batch in txn; `tail`: the meta as the previous append left it, when
        nothing wrote since (``Store.append``), else it is read from txn."""
        self.txn = txn
        self.dedupe_window = dedupe_window
        if tail is None:
            self.last_lsn, self.last_epoch = read_log_tail(txn)
            self.epoch = read_u64(txn, DB_META, META_EPOCH) or 0
            self.next_topic_id = read_u64(txn, DB_META, META_NEXT_TOPIC_ID) or 1
            self.history = read_history(txn)
        else:
            self.last_lsn, self.last_epoch = tail.last_lsn, tail.last_epoch
            self.epoch, self.next_topic_id = tail.epoch, tail.next_topic_id
            self.history = list(tail.history)
        self.epoch_before = self.epoch
        self.next_topic_id_before = self.next_topic_id
        self.history_len_before = len(self.history)
        self.topics: dict[str, TopicRow | None] = {} if tail is None else tail.topics
        self.dirty_topics: dict[str, TopicRow | None] = {}
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
        elif kind == "publish_parts":
            parts = op.publish_parts.parts
            if not parts:
                raise self.refuse("joined publish without parts")
            for part in parts:
                self.publish(part, lsn, epoch)
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
        elif kind == "seek_cursor":
            self.seek_cursor(op.seek_cursor, lsn)
        elif kind == "shared_create":
            self.shared_create(op.shared_create)
        elif kind == "shared_ack":
            self.shared_ack(op.shared_ack)
        elif kind == "shared_fail":
            self.shared_fail(op.shared_fail)
        elif kind == "link_topic":
            self.link_topic(op.link_topic, lsn)
        elif kind == "unlink_topic":
            self.unlink_topic(op.unlink_topic)
        elif kind == "link_cursor":
            self.link_cursor(op.link_cursor)
        elif operation:
            # A newer release's operation parses here as unknown fields alone.
            raise self.refuse(
                "an operation this release does not read: a newer release wrote it, so "
                "this node must run the release the rest of the cluster runs"
            )
        else:
            raise self.refuse("no operation")
        key = U64.pack(lsn)
        self.log.append((key, seal(key, entry.SerializeToString())))
        self.last_lsn, self.last_epoch = lsn, epoch

    def tail(self, commit_lsn: int | None) -> LogTail:
        """The meta as this batch leaves it (after ``finish``), with the commit LSN
        recorded in the same transaction."""
        return LogTail(
            self.last_lsn,
            self.last_epoch,
            self.epoch,
            self.next_topic_id,
            tuple(self.history),
            commit_lsn,
            self.topics if len(self.topics) <= TOPICS_KEPT_MAX else {},
        )

    def refuse(self, detail: str) -> InvalidEntryError:
        """The error refusing the entry being applied (the store knows no node id)."""
        return InvalidEntryError(f"entry LSN {self.lsn} (epoch {self.entry_epoch}): {detail}")

    def key(self, what: str, text: str, prefix: bytes = b"") -> bytes:
        """A name's key, refusing the entry if the name cannot be one."""
        try:
            return name_key(what, text, prefix)
        except InvalidEntryError as exc:
            raise self.refuse(str(exc)) from None

    def topic(self, name: str) -> TopicRow:
        """The topic's record as this batch has left it; refuses an unknown topic."""
        if name in self.topics:
            row = self.topics[name]
        else:
            row = self.topics[name] = read_topic(self.txn, name)
        if row is None:
            raise self.refuse(f"no topic {name!r}")
        return row

    def create_topic(self, op: replica_pb2.CreateTopicOp) -> None:
        """Creates a topic with a fresh id."""
        key = self.key("topic name", op.name)
        if op.name not in self.topics:
            self.topics[op.name] = read_topic(self.txn, op.name)
        if self.topics[op.name] is not None:
            raise self.refuse(f"topic {op.name!r} already exists")
        kind = op.kind or common_pb2.TOPIC_KIND_REPLICATED
        if kind not in KINDS:
            raise self.refuse(f"unknown topic kind {kind}")
        row = TopicRow(op.name, key, self.next_topic_id, kind, 0, 0, op.created_ms)
        self.next_topic_id += 1
        self.topics[op.name] = self.dirty_topics[op.name] = row

    def destroy_topic(self, op: replica_pb2.DestroyTopicOp) -> None:
        """Removes a topic with its events and subscriptions."""
        row = self.topic(op.name)
        self.flush_events()
        lo, hi = U64.pack(row.topic_id), U64.pack(row.topic_id + 1)
        self.txn.delete_range(DB_EVENTS, lo, hi)
        self.txn.delete_range(DB_CURSORS, lo, hi)
        self.txn.delete_range(DB_PUSH, lo, hi)
        self.txn.delete_range(DB_SHARED, lo, hi)
        self.txn.delete_range(DB_LINKS, lo, hi)
        # Links into the topic go with it (IceStorm drops a link whose topic is gone).
        for key, value in list(self.txn.scan(DB_LINKS, b"", None)):
            link = replica_pb2.LinkTopicOp.FromString(unseal(DB_LINKS, key, value))
            if link.to_topic == op.name and not link.to_cluster:
                self.txn.delete(DB_LINKS, key)
        self.forget_publishers(row)
        self.topics[op.name] = self.dirty_topics[op.name] = None

    def forget_publishers(self, row: TopicRow) -> None:
        """Deletes the dedupe state of the topic's publishers that names the topic.

        A publisher left with no topic (none in the index, no dedupe record naming another
        topic) loses its high-water mark too, so it starts again from any sequence; one
        that still has a topic keeps it (its sequences are one space across topics, and
        a lower mark could let a pruned sequence of the other topic in twice).
        """
        txn, topic_id = self.txn, row.topic_id
        lo = IDX_TOPIC + U64.pack(topic_id)
        hi = IDX_TOPIC + U64.pack(topic_id + 1)
        publishers = {key[len(lo) :].decode() for key, _ in txn.scan(DB_PUBLISHERS, lo, hi)}
        publishers.update(pid for tid, pid in self.pairs if tid == topic_id)
        txn.delete_range(DB_PUBLISHERS, lo, hi)
        name = row.name.encode()
        for publisher_id in sorted(publishers):
            self.pairs.pop((topic_id, publisher_id), None)
            prefix = publisher_prefix(publisher_id)
            txn.delete(DB_PUBLISHERS, IDX_PUBLISHER + prefix + U64.pack(topic_id))
            other_topic = False
            stale: list[bytes] = []
            for key, value in txn.scan(DB_DEDUPE, prefix, prefix + SEQ_END):
                if unseal(DB_DEDUPE, key, value)[DEDUPE_RECORD.size :] == name:
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
                old = read_u64(txn, DB_PUBLISHERS, prefix[U16.size :]) or 0
            self.high_water[publisher_id] = (prefix, old, 0)  # finish deletes the mark

    def has_topics(self, publisher_id: str, prefix: bytes) -> bool:
        """Whether the index (stored or this batch's) ties the publisher to a topic."""
        if any(pid == publisher_id for _, pid in self.pairs):
            return True
        lo = IDX_PUBLISHER + prefix
        for _ in self.txn.scan(DB_PUBLISHERS, lo, lo + SEQ_END):
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
        pack_key, pack_crc, crc32 = U64X2.pack, CRC.pack, zlib.crc32
        topic_id = row.topic_id
        items = self.events.setdefault(topic_id, [])
        # Sequences are kept as runs: consecutive sequences at consecutive offsets.
        runs: list[tuple[int, int, int]] = []
        run_first = run_last = run_offset = 0
        offset = first
        size_bytes = 0
        for data in op.events:
            ev.Clear()
            ev.offset = offset
            ev.key = data.key
            ev.payload = data.payload
            sequence = ev.sequence = data.sequence
            if data.headers:
                ev.headers.update(data.headers)
            if data.cost:
                ev.cost = data.cost
            body = common + ev.SerializeToString()
            key = pack_key(topic_id, offset)
            items.append((key, pack_crc(crc32(body, crc32(key))) + body))
            size_bytes += CRC.size + len(body)
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
        row.add_events(size_bytes)
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
        row: TopicRow,
        runs: list[tuple[int, int, int]],
        lsn: int,
        epoch: int,
    ) -> None:
        """Stores one dedupe record per run of sequences and raises the high-water mark."""
        if publisher_id in self.high_water:
            prefix, old, new = self.high_water[publisher_id]
        else:
            try:
                prefix = publisher_prefix(publisher_id)
            except InvalidEntryError as exc:
                raise self.refuse(str(exc)) from None
            old = read_u64(self.txn, DB_PUBLISHERS, prefix[U16.size :]) or 0
            new = old
        if (row.topic_id, publisher_id) not in self.pairs:
            if len(IDX_PUBLISHER + prefix) + U64.size > MAX_KEY_BYTES:
                raise self.refuse(f"publisher id of {len(prefix) - U16.size} bytes is too long")
            self.pairs[(row.topic_id, publisher_id)] = prefix
        tail = row.name.encode()
        for run_first, run_last, run_offset in runs:
            # Sequences grow, so only a run starting at or below the high-water mark can
            # overlap a stored one; the master never stores a sequence twice.
            if run_first <= new:
                self.replace_stale_runs(publisher_id, prefix, run_first, run_last)
            key = prefix + U64.pack(run_last)
            body = DEDUPE_RECORD.pack(run_first, run_offset, lsn, epoch) + tail
            self.txn.put(DB_DEDUPE, key, seal(key, body))
            new = max(new, run_last)
        self.high_water[publisher_id] = (prefix, old, new)

    def replace_stale_runs(
        self, publisher_id: str, prefix: bytes, run_first: int, run_last: int
    ) -> None:
        """Refuses the entry if a stored run overlapping run_first..run_last still names a
        stored event; deletes the overlapping runs that do not (a destroyed incarnation's,
        left by a store written before destroys removed them)."""
        self.flush_events()  # so that a run stored earlier in this batch is seen as live
        start = prefix + U64.pack(run_first)
        # Each pass deletes one stale run: bounded by the runs within the sequences.
        for _ in range(run_last - run_first + 2):
            found = None
            for key, value in self.txn.scan(DB_DEDUPE, start, prefix + SEQ_END):
                found = key, unseal(DB_DEDUPE, key, value)
                break
            if found is None:
                return
            key, body = found
            stored_first, first_offset, stored_lsn, _ = unpack(DB_DEDUPE, key, DEDUPE_RECORD, body)
            if stored_first > run_last:
                return
            try:
                name = body[DEDUPE_RECORD.size :].decode()
            except UnicodeDecodeError:
                raise CorruptRecordError(DB_DEDUPE, key, "topic is not UTF-8") from None
            holder = self.topics[name] if name in self.topics else read_topic(self.txn, name)
            if holder is not None and event_matches(
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
        key = self.key("subscription name", op.subscription, U64.pack(row.topic_id))
        value = self.txn.get(DB_CURSORS, key)
        if value is None:
            put_u64(self.txn, DB_CURSORS, key, op.cursor)
            return
        old, generation = cursor_state(key, value)
        # Acks can arrive out of order, so a lower cursor is normal, not an error.
        if op.cursor > old:
            if generation:
                self.txn.put(DB_CURSORS, key, seal(key, U64X2.pack(op.cursor, generation)))
            else:
                put_u64(self.txn, DB_CURSORS, key, op.cursor)

    def seek_cursor(self, op: replica_pb2.SeekCursorOp, lsn: int) -> None:
        """Sets a subscription's cursor, backwards or forwards, creating it; generation = lsn."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(
                f"seek to {op.cursor} beyond topic {op.topic!r}'s end {row.next_offset}"
            )
        key = self.key("subscription name", op.subscription, U64.pack(row.topic_id))
        self.txn.put(DB_CURSORS, key, seal(key, U64X2.pack(op.cursor, lsn)))
        # A shared subscription forgets every offset's state: all is delivered again.
        prefix = self.shared_key(row, op.subscription)
        self.txn.delete_range(DB_SHARED, prefix + U64.pack(0), prefix + b"\xff" * 9)

    def delete_subscription(self, op: replica_pb2.DeleteSubscriptionOp) -> None:
        """Deletes a subscription's cursor."""
        row = self.topic(op.topic)
        key = self.key("subscription name", op.subscription, U64.pack(row.topic_id))
        if not self.txn.delete(DB_CURSORS, key):
            raise self.refuse(f"no subscription {op.subscription!r} on {op.topic!r}")
        prefix = self.shared_key(row, op.subscription)
        self.txn.delete_range(DB_SHARED, prefix, prefix + b"\xff" * 9)

    def shared_key(self, row: TopicRow, subscription: str) -> bytes:
        """A shared subscription's settings key, refusing a name that cannot be one."""
        try:
            return shared_prefix(row.topic_id, subscription)
        except InvalidEntryError as exc:
            raise self.refuse(str(exc)) from None

    def shared_settings(
        self, op_topic: str, subscription: str
    ) -> tuple[TopicRow, bytes, replica_pb2.SharedCreateOp]:
        """The topic, settings key and settings of a shared subscription, or refuses."""
        row = self.topic(op_topic)
        prefix = self.shared_key(row, subscription)
        value = self.txn.get(DB_SHARED, prefix)
        if value is None:
            raise self.refuse(f"no shared subscription {subscription!r} on {op_topic!r}")
        try:
            settings = replica_pb2.SharedCreateOp.FromString(unseal(DB_SHARED, prefix, value))
        except DecodeError:
            raise CorruptRecordError(DB_SHARED, prefix, "settings do not parse") from None
        return row, prefix, settings

    def shared_create(self, op: replica_pb2.SharedCreateOp) -> None:
        """Creates a shared subscription: its cursor and its settings."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(f"cursor {op.cursor} beyond topic {op.topic!r}'s end")
        key = self.key("subscription name", op.subscription, U64.pack(row.topic_id))
        if self.txn.get(DB_CURSORS, key) is not None:
            raise self.refuse(f"subscription {op.subscription!r} on {op.topic!r} exists")
        if op.max_deliveries < 1:
            raise self.refuse("max_deliveries below 1")
        put_u64(self.txn, DB_CURSORS, key, op.cursor)
        prefix = self.shared_key(row, op.subscription)
        settings = replica_pb2.SharedCreateOp()
        settings.CopyFrom(op)
        settings.dead_lettered = 0
        self.txn.put(DB_SHARED, prefix, seal(prefix, settings.SerializeToString()))

    def link_key(self, from_topic: str, to_cluster: str, to_topic: str) -> bytes:
        """A link's key: its source topic's id and its destination (NUL never occurs in a
        name, so a remote destination cannot collide with a local one)."""
        row = self.topic(from_topic)
        target = f"{to_cluster}\0{to_topic}" if to_cluster else to_topic
        return self.key("link destination", target, U64.pack(row.topic_id))

    def read_link(self, key: bytes) -> replica_pb2.LinkTopicOp | None:
        """The stored link under key, or None."""
        value = self.txn.get(DB_LINKS, key)
        if value is None:
            return None
        try:
            return replica_pb2.LinkTopicOp.FromString(unseal(DB_LINKS, key, value))
        except DecodeError:
            raise CorruptRecordError(DB_LINKS, key, "link does not parse") from None

    def link_topic(self, op: replica_pb2.LinkTopicOp, lsn: int) -> None:
        """Stores a link, with the LSN that names its forwarded events' publisher."""
        source = self.topic(op.from_topic)
        if not op.to_cluster:
            self.topic(op.to_topic)
        if (op.from_topic == op.to_topic and not op.to_cluster) or op.cost < 0:
            raise self.refuse(f"link {op.from_topic!r} -> {op.to_topic!r} cost {op.cost}")
        if op.start_offset > source.next_offset:
            raise self.refuse(f"link start {op.start_offset} beyond {op.from_topic!r}'s end")
        key = self.link_key(op.from_topic, op.to_cluster, op.to_topic)
        if self.txn.get(DB_LINKS, key) is not None:
            raise self.refuse(f"link {op.from_topic!r} -> {op.to_topic!r} exists")
        record = replica_pb2.LinkTopicOp()
        record.CopyFrom(op)
        record.created_lsn = lsn
        record.cursor = op.start_offset
        self.txn.put(DB_LINKS, key, seal(key, record.SerializeToString()))

    def unlink_topic(self, op: replica_pb2.UnlinkTopicOp) -> None:
        """Removes a link."""
        key = self.link_key(op.from_topic, op.to_cluster, op.to_topic)
        if self.txn.get(DB_LINKS, key) is None:
            raise self.refuse(f"no link {op.from_topic!r} -> {op.to_topic!r}")
        self.txn.delete(DB_LINKS, key)

    def link_cursor(self, op: replica_pb2.LinkCursorOp) -> None:
        """Moves a link's cursor forward (never back: a late repeat changes nothing)."""
        key = self.link_key(op.from_topic, op.to_cluster, op.to_topic)
        link = self.read_link(key)
        if link is None or link.created_lsn != op.created_lsn:
            raise self.refuse(
                f"no link {op.from_topic!r} -> {op.to_topic!r} of LSN {op.created_lsn}"
            )
        if op.cursor > link.cursor:
            link.cursor = op.cursor
            self.txn.put(DB_LINKS, key, seal(key, link.SerializeToString()))

    def shared_ack(self, op: replica_pb2.SharedAckOp) -> None:
        """Marks offsets done; the cursor moves over the done prefix."""
        row, prefix, _ = self.shared_settings(op.topic, op.subscription)
        for offset in op.offsets:
            self.shared_mark(
                row, prefix, op.subscription, offset, state=SHARED_ACKED, text=op.consumer_id
            )
        self.shared_advance(row, prefix, op.subscription)

    def shared_fail(self, op: replica_pb2.SharedFailOp) -> None:
        """Counts a failed delivery; a dead-lettered offset is done."""
        row, prefix, settings = self.shared_settings(op.topic, op.subscription)
        state = SHARED_DEAD if op.dead_lettered else SHARED_PENDING
        self.shared_mark(row, prefix, op.subscription, op.offset, state=state, text=op.error)
        if op.dead_lettered:
            settings.dead_lettered += 1
            self.txn.put(DB_SHARED, prefix, seal(prefix, settings.SerializeToString()))
        self.shared_advance(row, prefix, op.subscription)

    def shared_mark(
        self,
        row: TopicRow,
        prefix: bytes,
        subscription: str,
        offset: int,
        *,
        state: int,
        text: str,
    ) -> None:
        """Updates one offset's record (offsets below the cursor are done already)."""
        cursor_key = self.key("subscription name", subscription, U64.pack(row.topic_id))
        cursor = read_cursor(self.txn, cursor_key)
        if offset < cursor:
            return
        if offset >= row.next_offset:
            raise self.refuse(f"offset {offset} beyond topic {row.name!r}'s end")
        key = prefix + U64.pack(offset)
        value = self.txn.get(DB_SHARED, key)
        failures, was, _ = (
            (0, SHARED_PENDING, "") if value is None else shared_offset_state(key, value)
        )
        if was != SHARED_PENDING:
            return
        if state != SHARED_ACKED:
            failures += 1  # a failed delivery (dead-lettered or not)
        self.txn.put(DB_SHARED, key, seal(key, shared_offset_value(failures, state, text)))

    def shared_advance(self, row: TopicRow, prefix: bytes, subscription: str) -> None:
        """Moves the cursor over done offsets (bounded by them); deletes the records that
        fall SHARED_RETAIN below it."""
        cursor_key = self.key("subscription name", subscription, U64.pack(row.topic_id))
        value = self.txn.get(DB_CURSORS, cursor_key)
        if value is None:
            raise self.refuse(f"no subscription {subscription!r} on {row.name!r}")
        cursor, generation = cursor_state(cursor_key, value)
        start = cursor
        while True:
            key = prefix + U64.pack(cursor)
            record = self.txn.get(DB_SHARED, key)
            if record is None or shared_offset_state(key, record)[1] == SHARED_PENDING:
                break
            cursor += 1
        if cursor == start:
            return
        self.txn.delete_range(
            DB_SHARED,
            prefix + U64.pack(max(0, start - SHARED_RETAIN)),
            prefix + U64.pack(max(0, cursor - SHARED_RETAIN)),
        )
        if generation:
            self.txn.put(DB_CURSORS, cursor_key, seal(cursor_key, U64X2.pack(cursor, generation)))
        else:
            put_u64(self.txn, DB_CURSORS, cursor_key, cursor)

    def push_subscribe(self, op: replica_pb2.PushSubscribeOp, lsn: int) -> None:
        """Registers a push subscriber at its start cursor."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(
                f"push cursor {op.cursor} beyond topic {op.topic!r}'s end {row.next_offset}"
            )
        key = self.key("push subscriber id", op.subscriber_id, U64.pack(row.topic_id))
        if self.txn.get(DB_PUSH, key) is not None:
            raise self.refuse(f"push subscriber {op.subscriber_id!r} of {op.topic!r} exists")
        body = U64X2.pack(op.cursor, lsn) + op.SerializeToString()
        self.txn.put(DB_PUSH, key, seal(key, body))

    def push_unsubscribe(self, op: replica_pb2.PushUnsubscribeOp) -> None:
        """Removes a push subscriber."""
        row = self.topic(op.topic)
        key = self.key("push subscriber id", op.subscriber_id, U64.pack(row.topic_id))
        if not self.txn.delete(DB_PUSH, key):
            raise self.refuse(f"no push subscriber {op.subscriber_id!r} on {op.topic!r}")

    def push_cursor(self, op: replica_pb2.PushCursorOp) -> None:
        """Moves a push subscriber's cursor forward (a lower cursor is ignored) and records
        its failure count."""
        row = self.topic(op.topic)
        if op.cursor > row.next_offset:
            raise self.refuse(
                f"push cursor {op.cursor} beyond topic {op.topic!r}'s end {row.next_offset}"
            )
        key = self.key("push subscriber id", op.subscriber_id, U64.pack(row.topic_id))
        value = self.txn.get(DB_PUSH, key)
        if value is None:
            raise self.refuse(f"no push subscriber {op.subscriber_id!r} on {op.topic!r}")
        cursor, lsn, stored = decode_push(key, value)
        if op.cursor <= cursor and op.failures == stored.failures:
            return
        stored.failures = op.failures
        body = U64X2.pack(max(op.cursor, cursor), lsn) + stored.SerializeToString()
        self.txn.put(DB_PUSH, key, seal(key, body))

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
            by_topic = IDX_TOPIC + U64.pack(topic_id) + publisher_id.encode()
            if txn.get(DB_PUBLISHERS, by_topic) is None:
                txn.put(DB_PUBLISHERS, by_topic, seal(by_topic, b""))
                by_publisher = IDX_PUBLISHER + prefix + U64.pack(topic_id)
                txn.put(DB_PUBLISHERS, by_publisher, seal(by_publisher, b""))
        for prefix, old, new in self.high_water.values():
            if new == 0:
                # Every topic of the publisher was destroyed (forget_publishers).
                txn.delete(DB_PUBLISHERS, prefix[U16.size :])
                continue
            if new != old:
                put_u64(txn, DB_PUBLISHERS, prefix[U16.size :], new)
            if new > self.dedupe_window:
                # Runs ending at or below new - window hold only pruned sequences.
                cut = new - self.dedupe_window + 1
                txn.delete_range(DB_DEDUPE, prefix + U64.pack(0), prefix + U64.pack(cut))
        txn.put_many(DB_LOG, self.log, append=True)
        tail = U64X2.pack(self.last_lsn, self.last_epoch)
        txn.put(DB_META, META_LOG_TAIL, seal(META_LOG_TAIL, tail))
        if self.epoch != self.epoch_before:
            put_u64(txn, DB_META, META_EPOCH, self.epoch)
        if self.next_topic_id != self.next_topic_id_before:
            put_u64(txn, DB_META, META_NEXT_TOPIC_ID, self.next_topic_id)
        if len(self.history) != self.history_len_before:
            body = b"".join(U64X2.pack(b.epoch, b.start_lsn) for b in self.history)
            txn.put(DB_META, META_HISTORY, seal(META_HISTORY, body))
