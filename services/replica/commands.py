"""Turns client commands into log entries: validation, offsets and deduplication.

The master's writer takes many commands at once (group commit). A `BatchBuilder` sees
the store as it is plus what earlier commands of the same batch will do, so that a
topic created, an offset handed out or a sequence stored earlier in the batch counts
for the commands after it. It does no I/O of its own beyond reading the store, and a
command it refuses leaves no trace in the batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common import names
from squall_server.common.config import LimitsConfig
from squall_server.common.errors import Code, ServiceError, invalid, not_found
from squall_server.replica import link_rules, seek
from squall_server.replica.store import PushSubscriber, Store, TimeLookup, TopicInfo, make_entry

_log = logging.getLogger(__name__)

# The longest removal reason kept in the log.
_REASON_CHARS_MAX = 500
# The largest count a uint32 proto field holds (PushCursorOp.failures).
UINT32_MAX = 2**32 - 1


class InvariantError(ServiceError):
    """A check of what the master is about to answer failed: a bug, never bad input.

    INTERNAL, so a client classifies it as indeterminate and retries with the same ids.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(Code.INTERNAL, f"invariant violated: {detail}")


@dataclass(frozen=True)
class CreateTopic:
    """Create a topic."""

    name: str
    kind: common_pb2.TopicKind.ValueType


@dataclass(frozen=True)
class DestroyTopic:
    """Destroy a topic with its events and subscriptions."""

    name: str


@dataclass(frozen=True)
class Publish:
    """Append a batch of events to a replicated topic."""

    request: broker_pb2.PublishRequest
    # Made by a topic link's forwarder: only it may use the reserved link publisher ids.
    forwarded: bool = False


@dataclass(frozen=True)
class PublishParts:
    """Append a joined request's parts (``PublishRequest.parts``), each a publish of its
    own (its topic, publisher id and sequences, deduplicated alone; a refused part fails
    alone), in order, as one write: one plan, one wait for the last part's LSN."""

    parts: tuple[broker_pb2.PublishRequest, ...]


@dataclass
class PartOutcome:
    """One part of a ``PublishParts``: its plan, or why it failed; and the LSN it waits
    for (as a ``Publish`` command's, ``PlannedBatch``; the writer sets it)."""

    plan: Planned | None = None
    error: BaseException | None = None
    lsn: int = 0


@dataclass(frozen=True)
class LinkTopic:
    """Link one topic to another (TopicManager.LinkTopic)."""

    from_topic: str
    to_topic: str
    cost: int
    to_cluster: str = ""  # a [[remotes]] name; empty: this cluster
    # to_topic's kind as the remote cluster answered the probe (a remote link only).
    to_kind: common_pb2.TopicKind.ValueType | None = None


@dataclass(frozen=True)
class UnlinkTopic:
    """Remove a topic link (TopicManager.UnlinkTopic)."""

    from_topic: str
    to_topic: str
    to_cluster: str = ""


@dataclass(frozen=True)
class LinkCursor:
    """Move a link to another cluster forward (its forwarder, after the other side acked)."""

    from_topic: str
    to_cluster: str
    to_topic: str
    created_lsn: int
    cursor: int


@dataclass(frozen=True)
class SetCursor:
    """Create a durable subscription (create=True) or move its cursor forward."""

    topic: str
    subscription: str
    cursor: int
    create: bool
    # An ack's AckRequest.seek_generation: refused (ABORTED) when a seek has moved the
    # cursor since. None: no check.
    seek_generation: int | None = None


@dataclass(frozen=True)
class SeekCursor:
    """Move a durable subscription's cursor anywhere (Subscriber.Seek), creating it."""

    topic: str
    subscription: str
    position: broker_pb2.StartPosition.ValueType
    offset: int = 0
    timestamp_ms: int = 0


@dataclass(frozen=True)
class SeekOutcome:
    """What a seek did (SeekResponse)."""

    cursor: int
    seek_generation: int
    created: bool
    previous_cursor: int
    clamped: broker_pb2.SeekClamp.ValueType
    note: str


@dataclass(frozen=True)
class DeleteSubscription:
    """Delete a durable subscription."""

    topic: str
    subscription: str


@dataclass(frozen=True)
class PushSubscribe:
    """Register a push subscriber (fields checked by the servicer; start as in Subscribe)."""

    topic: str
    subscriber_id: str
    endpoint: str
    ordered: bool
    retry_count: int
    start: broker_pb2.StartPosition.ValueType
    offset: int = 0


@dataclass(frozen=True)
class PushUnsubscribe:
    """Remove a push subscriber: unsubscribed, or removed after failed deliveries."""

    topic: str
    subscriber_id: str
    reason: str
    # The LSN that subscribed the one to remove (0: whichever is subscribed now), so a
    # late removal cannot hit a subscriber that unsubscribed and subscribed again.
    lsn: int = 0


@dataclass(frozen=True)
class PushCursor:
    """Move a push subscriber's cursor forward and record its failure count."""

    topic: str
    subscriber_id: str
    cursor: int
    lsn: int  # the LSN that subscribed it, as in PushUnsubscribe
    failures: int = 0  # failed delivery rounds in a row (replicated for the next master)


@dataclass(frozen=True)
class CreateShared:
    """Create a shared subscription (Subscriber.CreateSharedSubscription)."""

    topic: str
    subscription: str
    ack_deadline_ms: int
    max_deliveries: int
    dead_letter_topic: str
    start: broker_pb2.StartPosition.ValueType = broker_pb2.START_POSITION_EARLIEST
    offset: int = 0
    exclusive: bool = False
    exclusive_takeover_ms: int = 0  # 0: ack_deadline_ms


@dataclass(frozen=True)
class SharedAck:
    """Record acks of a shared subscription's offsets (checked by the master's core)."""

    topic: str
    subscription: str
    offsets: tuple[int, ...]
    consumer_id: str = ""


@dataclass(frozen=True)
class SharedFail:
    """Record one failed delivery of a shared subscription's offset."""

    topic: str
    subscription: str
    offset: int
    error: str
    dead_lettered: bool


@dataclass(frozen=True)
class StartEpoch:
    """A new master's first entry."""

    epoch: int
    master_id: str


Command = (
    CreateTopic
    | DestroyTopic
    | Publish
    | PublishParts
    | SetCursor
    | SeekCursor
    | DeleteSubscription
    | PushSubscribe
    | PushUnsubscribe
    | PushCursor
    | CreateShared
    | SharedAck
    | SharedFail
    | LinkTopic
    | UnlinkTopic
    | LinkCursor
    | StartEpoch
)


@dataclass
class Planned:
    """What a command will have produced once its entry commits."""

    # The entry's index in the batch, or None when the command needs no entry
    # (e.g. a publish made only of duplicates, an ack below the cursor).
    entry_index: int | None
    topic: TopicInfo | None = None
    # A publish's receipts, all at once (stamped with master and holders at commit).
    receipt: common_pb2.BatchReceipt | None = None
    cursor: int = 0
    push: PushSubscriber | None = None
    seek: SeekOutcome | None = None
    created: bool = False  # CreateShared: False when it existed with the same settings
    link: replica_pb2.LinkTopicOp | None = None  # LinkTopic: the link, created_lsn set
    parts: list[PartOutcome] | None = None  # PublishParts: one per part, in order

    @property
    def receipts(self) -> list[common_pb2.AckReceipt]:
        """The publish's receipts one per event (what a non-compact response carries)."""
        return [] if self.receipt is None else expand_receipt(self.receipt)


def fail_parts(parts: Sequence[PartOutcome], error: Callable[[int], BaseException]) -> None:
    """Fails a joined request's planned parts, each with error(its LSN); a refused part
    keeps its refusal."""
    for part in parts:
        if part.plan is not None and part.error is None:
            part.error = error(part.lsn)


def expand_receipt(batch: common_pb2.BatchReceipt) -> list[common_pb2.AckReceipt]:
    """A BatchReceipt as one AckReceipt per event, in request order (see common.proto)."""
    # What every receipt shares, merged into each as bytes (cheaper than copying fields).
    shared = common_pb2.AckReceipt(
        master_id=batch.master_id, holders=batch.holders
    ).SerializeToString()
    duplicates = {d.index: d for d in batch.duplicates}
    lsn, epoch = batch.lsn, batch.epoch
    out: list[common_pb2.AckReceipt] = []
    offset = batch.first_offset
    for index in range(batch.count):
        duplicate = duplicates.get(index) if duplicates else None
        if duplicate is None:
            receipt = common_pb2.AckReceipt(offset=offset, lsn=lsn, epoch=epoch)
            offset += 1
        else:
            receipt = common_pb2.AckReceipt(
                offset=duplicate.offset, lsn=duplicate.lsn, epoch=duplicate.epoch, duplicate=True
            )
        receipt.MergeFromString(shared)
        out.append(receipt)
    return out


class BatchBuilder:
    """Builds one group-commit batch of entries on top of the store's current state."""

    def __init__(
        self,
        store: Store,
        *,
        limits: LimitsConfig,
        node_id: str,
        epoch: int,
        next_lsn: int,
        now_ms: int,
    ) -> None:
        self._store = store
        self._limits = limits
        self._node_id = node_id
        self._epoch = epoch
        self._next_lsn = next_lsn
        self._now_ms = now_ms
        self.entries: list[replica_pb2.LogEntry] = []
        # Effects of earlier commands in this batch; None marks a destroyed topic.
        self._topics: dict[str, TopicInfo | None] = {}
        self._cursors: dict[tuple[str, str], int | None] = {}
        self._generations: dict[tuple[str, str], int] = {}  # seeks planned in this batch
        self._shared_added: set[tuple[str, str]] = set()  # shared ones created in this batch
        self._sequences: dict[tuple[str, int], tuple[str, int, int]] = {}
        self._high_water: dict[str, int] = {}
        self._topic_count_delta = 0
        self._push: dict[tuple[str, str], PushSubscriber | None] = {}
        self._push_added: dict[str, int] = {}  # push subscribers planned per topic
        self._subscriptions_added: dict[str, int] = {}  # durable subscriptions planned
        self._destroyed: set[str] = set()  # topics destroyed earlier in the batch
        # Links made (the op) or removed (None) earlier in the batch: (from, to, to
        # cluster) -> link.
        self._links: dict[tuple[str, str, str], replica_pb2.LinkTopicOp | None] = {}
        # Between begin_joined and end_joined: the one entry the publishes planned go into.
        self._joined: replica_pb2.Operation | None = None

    def add(self, command: Command) -> Planned:
        """Plans one command; raises ServiceError (and changes nothing) if it is refused."""
        if isinstance(command, Publish):
            return self._publish(command.request, forwarded=command.forwarded)
        if isinstance(command, SetCursor):
            return self._set_cursor(command)
        if isinstance(command, SeekCursor):
            return self._seek_cursor(command)
        if isinstance(command, CreateShared):
            return self._create_shared(command)
        if isinstance(command, SharedAck | SharedFail):
            return self._shared_record(command)
        if isinstance(command, CreateTopic):
            return self._create_topic(command)
        if isinstance(command, DestroyTopic):
            return self._destroy_topic(command)
        if isinstance(command, DeleteSubscription):
            return self._delete_subscription(command)
        if isinstance(command, PushCursor):
            return self._push_cursor(command)
        if isinstance(command, PushSubscribe):
            return self._push_subscribe(command)
        if isinstance(command, PushUnsubscribe):
            return self._push_unsubscribe(command)
        if isinstance(command, LinkTopic):
            return self._link_topic(command)
        if isinstance(command, UnlinkTopic):
            return self._unlink_topic(command)
        if isinstance(command, LinkCursor):
            return self._link_cursor(command)
        if isinstance(command, PublishParts):
            raise InvariantError("a joined request's parts are planned one by one")
        return self._start_epoch(command)

    def begin_joined(self) -> None:
        """Publishes planned from here to ``end_joined`` (a joined request's parts, each
        deduplicated and refused alone) go into one ``PublishPartsOp`` entry; nothing
        else may be planned meanwhile. Each one's plan names that entry."""
        if self._joined is not None:
            raise InvariantError("a joined entry is already being planned")
        self._joined = replica_pb2.Operation()

    def end_joined(self) -> None:
        """Emits the joined entry begun by ``begin_joined`` (none when no part has an
        event to store: every one refused, or made only of duplicates)."""
        operation, self._joined = self._joined, None
        if operation is None:
            raise InvariantError("no joined entry is being planned")
        if operation.publish_parts.parts:
            self._emit(operation)

    # --- reads through the batch's overlay

    def topic(self, name: str) -> TopicInfo | None:
        """The topic as it will be after the commands planned so far."""
        if name in self._topics:
            return self._topics[name]
        return self._store.get_topic(name)

    def _existing_topic(self, name: str) -> TopicInfo:
        topic = self.topic(name)
        if topic is None:
            raise not_found(f"topic '{name}' does not exist")
        return topic

    def _cursor(self, topic: str, subscription: str) -> int | None:
        key = (topic, subscription)
        if key in self._cursors:
            return self._cursors[key]
        if topic in self._destroyed:
            return None  # the store's cursor is the destroyed incarnation's
        return self._store.get_cursor(topic, subscription)

    def _generation(self, topic: str, subscription: str) -> int:
        """The subscription's seek generation after the commands planned so far."""
        key = (topic, subscription)
        if key in self._generations:
            return self._generations[key]
        if topic in self._destroyed or key in self._cursors:
            return 0  # created (or deleted) in this batch without a seek
        state = self._store.get_cursor_state(topic, subscription)
        return 0 if state is None else state[1]

    def push_subscriber(self, topic: str, subscriber_id: str) -> PushSubscriber | None:
        """The push subscriber as it will be after the commands planned so far."""
        key = (topic, subscriber_id)
        if key in self._push:
            return self._push[key]
        if topic in self._destroyed:
            return None
        return self._store.get_push_subscriber(topic, subscriber_id)

    # --- planning

    def _emit(self, operation: replica_pb2.Operation) -> int:
        self.entries.append(make_entry(self._next_lsn, self._epoch, operation))
        self._next_lsn += 1
        return len(self.entries) - 1

    @property
    def _lsn(self) -> int:
        """The LSN the next emitted entry gets."""
        return self._next_lsn

    def _create_topic(self, command: CreateTopic) -> Planned:
        _check_name(names.validate_topic_name, command.name)
        _check_length(command.name, "topic name", "max_topic_name_bytes", self._limits)
        if self.topic(command.name) is not None:
            raise ServiceError(Code.ALREADY_EXISTS, f"topic '{command.name}' already exists")
        if command.kind not in (
            common_pb2.TOPIC_KIND_REPLICATED,
            common_pb2.TOPIC_KIND_TRANSIENT,
        ):
            raise invalid(f"unknown topic kind {command.kind}")
        if len(self._store.list_topics()) + self._topic_count_delta >= self._limits.max_topics:
            raise ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"topic limit reached: limits.max_topics is {self._limits.max_topics}",
            )
        index = self._emit(
            replica_pb2.Operation(
                create_topic=replica_pb2.CreateTopicOp(
                    name=command.name, kind=command.kind, created_ms=self._now_ms
                )
            )
        )
        topic = TopicInfo(
            name=command.name,
            topic_id=0,
            kind=command.kind,
            next_offset=0,
            first_offset=0,
            created_ms=self._now_ms,
        )
        self._topics[command.name] = topic
        self._topic_count_delta += 1
        return Planned(index, topic=topic)

    def _destroy_topic(self, command: DestroyTopic) -> Planned:
        self._existing_topic(command.name)
        index = self._emit(
            replica_pb2.Operation(destroy_topic=replica_pb2.DestroyTopicOp(name=command.name))
        )
        self._topics[command.name] = None
        self._topic_count_delta -= 1
        for key in [k for k in self._cursors if k[0] == command.name]:
            self._cursors[key] = None
        for key in [k for k in self._generations if k[0] == command.name]:
            del self._generations[key]
        for key in [k for k in self._push if k[0] == command.name]:
            self._push[key] = None
        # A topic created again later in the batch starts without push subscribers, and
        # its publishers' sequences are new there: the destroy deletes their dedupe state.
        self._destroyed.add(command.name)
        for planned in [k for k, v in self._sequences.items() if v[0] == command.name]:
            del self._sequences[planned]
        self._push_added.pop(command.name, None)
        self._subscriptions_added.pop(command.name, None)
        for link_key in list(self._links):
            if command.name in (link_key[0], link_key[1] if not link_key[2] else ""):
                self._links[link_key] = None
        for link in self._store.list_links():
            if command.name in (link.from_topic, link.to_topic if not link.to_cluster else ""):
                self._links[(link.from_topic, link.to_topic, link.to_cluster)] = None
        return Planned(index)

    def _publish(self, request: broker_pb2.PublishRequest, *, forwarded: bool = False) -> Planned:
        topic = self._existing_topic(request.topic)
        events = request.events
        limits = self._limits
        check_publish_limits(request, limits)
        publisher_id = request.publisher_id
        if publisher_id:
            if not _plain_publisher_id(publisher_id):
                _check_name(names.validate_publisher_id, publisher_id)  # raises, naming why
            if link_rules.is_local_link_id(publisher_id) and not forwarded:
                raise invalid(
                    f"publisher id '{publisher_id}': the prefix "
                    f"'{link_rules.LINK_PUBLISHER_PREFIX}' is reserved for topic links"
                )
            _check_length(publisher_id, "publisher id", "max_publisher_id_bytes", limits)
        lsn = self._lsn
        offset = topic.next_offset
        receipt = common_pb2.BatchReceipt(
            count=len(events), first_offset=offset, lsn=lsn, epoch=self._epoch
        )
        new_events: list[common_pb2.EventData] | None = None
        new_sequences: list[tuple[int, int]] = []
        if not publisher_id:
            count = len(events)
        else:
            high_water = self._publisher_high_water(publisher_id)
            sequences = [event.sequence for event in events]
            first_sequence = sequences[0]
            if first_sequence > high_water and sequences == list(
                range(first_sequence, first_sequence + len(sequences))
            ):
                # The usual publish: the publisher's next sequences, consecutive and all
                # above its high-water mark, so none can be a duplicate and the per-event
                # lookups of _deduplicate would all miss.
                count = len(events)
                new_sequences = list(zip(sequences, range(offset, offset + count), strict=True))
            else:
                kept, new_sequences = self._deduplicate(request, offset, high_water, receipt)
                count = len(kept)
                if count != len(events):
                    new_events = kept
        if count == 0:
            return Planned(None, receipt=receipt)
        # Filled in place: Operation(publish=op) would copy every event once more, and a
        # batch of large events is planned on the event loop (issue 14: it must not stall).
        operation = self._joined
        if operation is None:
            operation = replica_pb2.Operation()
            op = operation.publish
        else:
            op = operation.publish_parts.parts.add()
        op.topic = request.topic
        op.first_offset = offset
        op.publisher_id = publisher_id
        op.session_token = request.session_token
        op.timestamp_ms = self._now_ms
        op.events.extend(events if new_events is None else new_events)
        # A joined entry is emitted at end_joined, next in the batch: nothing else is
        # planned before it.
        index = self._emit(operation) if self._joined is None else len(self.entries)
        self._topics[request.topic] = _with_next_offset(topic, offset + count)
        if new_sequences:
            self._sequences.update(
                ((publisher_id, sequence), (request.topic, event_offset, lsn))
                for sequence, event_offset in new_sequences
            )
            highest = max(new_sequences)[0]
            if highest > self._high_water.get(publisher_id, 0):
                self._high_water[publisher_id] = highest
        return Planned(index, receipt=receipt)

    def _deduplicate(
        self,
        request: broker_pb2.PublishRequest,
        offset: int,
        high_water: int,
        receipt: common_pb2.BatchReceipt,
    ) -> tuple[list[common_pb2.EventData], list[tuple[int, int]]]:
        """Events to store and their (sequence, offset), looking up each sequence; the
        duplicates go into the receipt."""
        publisher_id = request.publisher_id
        window = self._limits.dedupe_window
        new_sequences: list[tuple[int, int]] = []
        seen_here: dict[int, int] = {}
        kept: list[common_pb2.EventData] = []
        for index, event in enumerate(request.events):
            sequence = event.sequence
            if sequence:
                hit = self._lookup(publisher_id, sequence, seen_here, high_water, window)
                if hit is not None:
                    hit_topic, hit_offset, hit_lsn, hit_epoch = hit
                    if hit_topic != request.topic:
                        raise invalid(
                            f"publisher '{publisher_id}' already used sequence {sequence} "
                            f"on topic '{hit_topic}'"
                        )
                    self._check_duplicate(publisher_id, sequence, hit_offset, request.topic)
                    receipt.duplicates.add(
                        index=index, offset=hit_offset, lsn=hit_lsn, epoch=hit_epoch
                    )
                    continue
                seen_here[sequence] = offset + len(kept)
                new_sequences.append((sequence, offset + len(kept)))
            kept.append(event)
        return kept, new_sequences

    def _check_duplicate(self, publisher_id: str, sequence: int, offset: int, topic: str) -> None:
        """The invariant behind every duplicate receipt: it points at an event stored (or
        planned in this batch) in the topic the publisher writes to, now.

        The store's lookup checks the event itself; this catches what the batch's overlay
        could get wrong. A breach is a bug: the publish fails with INTERNAL (retryable,
        nothing stored) rather than answer a receipt for an event that is not there.
        """
        current = self.topic(topic)
        if current is None or not current.first_offset <= offset < current.next_offset:
            error = InvariantError(
                f"a duplicate receipt for publisher '{publisher_id}' sequence {sequence} "
                f"would point at offset {offset} of topic '{topic}', which holds "
                + (
                    "no such topic"
                    if current is None
                    else f"offsets {current.first_offset}..{current.next_offset - 1}"
                )
            )
            _log.error("node %s epoch %d: %s", self._node_id, self._epoch, error.message)
            raise error

    def _publisher_high_water(self, publisher_id: str) -> int:
        if publisher_id not in self._high_water:
            self._high_water[publisher_id] = self._store.publisher_high_water(publisher_id)
        return self._high_water[publisher_id]

    def _lookup(
        self,
        publisher_id: str,
        sequence: int,
        seen_here: dict[int, int],
        high_water: int,
        window: int,
    ) -> tuple[str, int, int, int] | None:
        """The original (topic, offset, lsn, epoch) of a stored sequence; None if new."""
        if sequence in seen_here:
            raise invalid(f"sequence {sequence} appears twice in one publish")
        if sequence > high_water:
            return None  # the common case: sequences grow, so no lookup is needed
        planned = self._sequences.get((publisher_id, sequence))
        if planned is not None:
            return (planned[0], planned[1], planned[2], self._epoch)
        hit = self._store.lookup_sequence(publisher_id, sequence)
        if hit is not None and hit.topic not in self._destroyed:
            # (A hit in a topic destroyed earlier in this batch names the old incarnation,
            # whose dedupe state the destroy deletes: the sequence is new.)
            return (hit.topic, hit.offset, hit.lsn, hit.epoch)
        if sequence + window <= high_water:
            # Below the window we can no longer tell a retry from a new event, and
            # storing it could duplicate one: refuse rather than guess.
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"sequence {sequence} of publisher '{publisher_id}' is older than the "
                f"deduplication window ({window} below its highest, {high_water})",
            )
        return None

    def _set_cursor(self, command: SetCursor) -> Planned:
        _check_name(names.validate_subscription_name, command.subscription)
        topic = self._existing_topic(command.topic)
        current = self._cursor(command.topic, command.subscription)
        if command.create:
            if current is not None:
                return Planned(None, cursor=current)
        elif current is None:
            raise not_found(
                f"subscription '{command.subscription}' on topic '{command.topic}' does not exist"
            )
        if command.cursor > topic.next_offset:
            raise invalid(
                f"offset {command.cursor - 1} is beyond the end of topic '{command.topic}' "
                f"(next offset {topic.next_offset})"
            )
        if command.seek_generation is not None and current is not None:
            generation = self._generation(command.topic, command.subscription)
            if generation != command.seek_generation:
                raise ServiceError(
                    Code.ABORTED,
                    f"ack of offset {command.cursor - 1} refused: subscription "
                    f"'{command.subscription}' on topic '{command.topic}' was moved by a seek "
                    f"(generation {generation}, the ack names {command.seek_generation}) "
                    f"after these events were delivered; its cursor is {current} and they "
                    "will be delivered again from there",
                )
        if current is not None and command.cursor <= current:
            return Planned(None, cursor=current)  # acks may arrive out of order
        if current is None:
            _check_length(
                command.subscription,
                "subscription name",
                "max_subscription_name_bytes",
                self._limits,
            )
            self._check_subscription_room(command.topic)
        index = self._emit(
            replica_pb2.Operation(
                set_cursor=replica_pb2.SetCursorOp(
                    topic=command.topic, subscription=command.subscription, cursor=command.cursor
                )
            )
        )
        self._cursors[(command.topic, command.subscription)] = command.cursor
        if current is None:
            added = self._subscriptions_added.get(command.topic, 0) + 1
            self._subscriptions_added[command.topic] = added
        return Planned(index, cursor=command.cursor)

    def _seek_cursor(self, command: SeekCursor) -> Planned:
        _check_name(names.validate_subscription_name, command.subscription)
        topic = self._existing_topic(command.topic)
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            raise invalid(f"topic '{topic.name}' is transient: it has no durable subscriptions")
        stored = self._store.get_topic(command.topic)
        same = stored is not None and stored.topic_id == topic.topic_id

        def lookup(timestamp_ms: int) -> TimeLookup:
            if not same:  # created in this batch: no event is stored yet
                return TimeLookup(topic.first_offset, topic.first_offset, None)
            return self._store.offset_at_time(command.topic, timestamp_ms)

        target = seek.resolve(
            topic,
            command.position,
            offset=command.offset,
            timestamp_ms=command.timestamp_ms,
            now_ms=self._now_ms,
            lookup=lookup,
        )
        current = self._cursor(command.topic, command.subscription)
        if current is None:
            _check_length(
                command.subscription,
                "subscription name",
                "max_subscription_name_bytes",
                self._limits,
            )
            self._check_subscription_room(command.topic)
        generation = self._lsn
        index = self._emit(
            replica_pb2.Operation(
                seek_cursor=replica_pb2.SeekCursorOp(
                    topic=command.topic, subscription=command.subscription, cursor=target.cursor
                )
            )
        )
        key = (command.topic, command.subscription)
        self._cursors[key] = target.cursor
        self._generations[key] = generation
        if current is None:
            added = self._subscriptions_added.get(command.topic, 0) + 1
            self._subscriptions_added[command.topic] = added
        outcome = SeekOutcome(
            cursor=target.cursor,
            seek_generation=generation,
            created=current is None,
            previous_cursor=current or 0,
            clamped=target.clamped,
            note=target.note,
        )
        return Planned(index, cursor=target.cursor, seek=outcome)

    def _create_shared(self, command: CreateShared) -> Planned:
        _check_name(names.validate_subscription_name, command.subscription)
        if command.max_deliveries < 1:
            raise invalid(f"max_deliveries must be >= 1, not {command.max_deliveries}")
        if command.ack_deadline_ms < 1:
            raise invalid(f"ack_deadline_ms must be >= 1, not {command.ack_deadline_ms}")
        topic = self._existing_topic(command.topic)
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            raise invalid(f"topic '{topic.name}' is transient: it has no durable subscriptions")
        if command.dead_letter_topic:
            if command.dead_letter_topic == command.topic:
                raise invalid(
                    f"dead-letter topic '{command.dead_letter_topic}' is the subscription's own "
                    "topic: dead letters would be delivered to it again"
                )
            if self.topic(command.dead_letter_topic) is None:
                raise not_found(f"dead-letter topic '{command.dead_letter_topic}' does not exist")
        takeover_ms = (command.exclusive_takeover_ms or command.ack_deadline_ms) * (
            1 if command.exclusive else 0
        )
        key = (command.topic, command.subscription)
        current = self._cursor(command.topic, command.subscription)
        if current is not None:
            shared = None if key in self._shared_added else self._store.get_shared_settings(*key)
            same = shared is not None and (
                shared.ack_deadline_ms,
                shared.max_deliveries,
                shared.dead_letter_topic,
                shared.exclusive,
                shared.exclusive_takeover_ms,
            ) == (
                command.ack_deadline_ms,
                command.max_deliveries,
                command.dead_letter_topic,
                command.exclusive,
                takeover_ms,
            )
            if not same:
                what = (
                    "a shared subscription with other settings"
                    if shared
                    else ("a plain durable subscription")
                )
                raise ServiceError(
                    Code.ALREADY_EXISTS,
                    f"subscription '{command.subscription}' on topic '{command.topic}' "
                    f"already exists as {what}",
                )
            return Planned(None, cursor=current)
        _check_length(
            command.subscription, "subscription name", "max_subscription_name_bytes", self._limits
        )
        self._check_subscription_room(command.topic)
        cursor = self._start_cursor(
            topic, command.start or broker_pb2.START_POSITION_EARLIEST, command.offset
        )
        index = self._emit(
            replica_pb2.Operation(
                shared_create=replica_pb2.SharedCreateOp(
                    topic=command.topic,
                    subscription=command.subscription,
                    cursor=cursor,
                    ack_deadline_ms=command.ack_deadline_ms,
                    max_deliveries=command.max_deliveries,
                    dead_letter_topic=command.dead_letter_topic,
                    exclusive=command.exclusive,
                    exclusive_takeover_ms=takeover_ms,
                )
            )
        )
        self._cursors[key] = cursor
        self._shared_added.add(key)
        self._subscriptions_added[command.topic] = (
            self._subscriptions_added.get(command.topic, 0) + 1
        )
        return Planned(index, cursor=cursor, created=True)

    def _shared_record(self, command: SharedAck | SharedFail) -> Planned:
        key = (command.topic, command.subscription)
        self._existing_topic(command.topic)
        if self._cursor(*key) is None or (
            key not in self._shared_added and self._store.get_shared_settings(*key) is None
        ):
            raise not_found(
                f"shared subscription '{command.subscription}' on topic '{command.topic}' "
                "does not exist"
            )
        if isinstance(command, SharedAck):
            if not command.offsets:
                return Planned(None)
            op = replica_pb2.Operation(
                shared_ack=replica_pb2.SharedAckOp(
                    topic=command.topic,
                    subscription=command.subscription,
                    offsets=command.offsets,
                    consumer_id=command.consumer_id,
                )
            )
        else:
            op = replica_pb2.Operation(
                shared_fail=replica_pb2.SharedFailOp(
                    topic=command.topic,
                    subscription=command.subscription,
                    offset=command.offset,
                    error=command.error,
                    dead_lettered=command.dead_lettered,
                )
            )
        return Planned(self._emit(op))

    def _check_subscription_room(self, topic: str) -> None:
        """RESOURCE_EXHAUSTED when the topic already has limits.topic_subscriptions_max."""
        stored = 0 if topic in self._destroyed else len(self._store.list_subscriptions(topic))
        limit = self._limits.topic_subscriptions_max
        if stored + self._subscriptions_added.get(topic, 0) >= limit:
            raise ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"topic '{topic}' has {limit} durable subscriptions: "
                f"limits.topic_subscriptions_max is {limit}",
            )

    def _delete_subscription(self, command: DeleteSubscription) -> Planned:
        self._existing_topic(command.topic)
        if self._cursor(command.topic, command.subscription) is None:
            raise not_found(
                f"subscription '{command.subscription}' on topic '{command.topic}' does not exist"
            )
        index = self._emit(
            replica_pb2.Operation(
                delete_subscription=replica_pb2.DeleteSubscriptionOp(
                    topic=command.topic, subscription=command.subscription
                )
            )
        )
        self._cursors[(command.topic, command.subscription)] = None
        self._generations.pop((command.topic, command.subscription), None)
        return Planned(index)

    def _push_subscribe(self, command: PushSubscribe) -> Planned:
        topic = self._existing_topic(command.topic)
        if self.push_subscriber(command.topic, command.subscriber_id) is not None:
            raise ServiceError(
                Code.ALREADY_EXISTS,
                f"AlreadySubscribed: push subscriber '{command.subscriber_id}' is already "
                f"subscribed to topic '{command.topic}'",
            )
        stored = (
            0
            if command.topic in self._destroyed
            else len(self._store.list_push_subscribers(command.topic))
        )
        _check_length(
            command.subscriber_id, "push subscriber id", "max_subscription_name_bytes", self._limits
        )
        limit = self._limits.push_subscribers_max
        if stored + self._push_added.get(command.topic, 0) >= limit:
            raise ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"topic '{command.topic}' has {limit} push subscribers: "
                f"limits.push_subscribers_max is {limit}",
            )
        cursor = self._start_cursor(topic, command.start, command.offset)
        op = replica_pb2.PushSubscribeOp(
            topic=command.topic,
            subscriber_id=command.subscriber_id,
            endpoint=command.endpoint,
            ordered=command.ordered,
            retry_count=command.retry_count,
            cursor=cursor,
            created_ms=self._now_ms,
        )
        lsn = self._lsn
        index = self._emit(replica_pb2.Operation(push_subscribe=op))
        subscriber = PushSubscriber(
            topic=command.topic,
            subscriber_id=command.subscriber_id,
            endpoint=command.endpoint,
            ordered=command.ordered,
            retry_count=command.retry_count,
            cursor=cursor,
            created_ms=self._now_ms,
            lsn=lsn,
        )
        self._push[(command.topic, command.subscriber_id)] = subscriber
        self._push_added[command.topic] = self._push_added.get(command.topic, 0) + 1
        return Planned(index, cursor=cursor, push=subscriber)

    def _start_cursor(
        self, topic: TopicInfo, start: broker_pb2.StartPosition.ValueType, offset: int
    ) -> int:
        """Where a new push subscriber starts (transient topics: their live end, always)."""
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            return 0  # not used: a transient topic's events are delivered live
        if start in (broker_pb2.START_POSITION_UNSPECIFIED, broker_pb2.START_POSITION_LATEST):
            return topic.next_offset
        if start == broker_pb2.START_POSITION_EARLIEST:
            return topic.first_offset
        if start == broker_pb2.START_POSITION_OFFSET:
            if offset > topic.next_offset:
                raise invalid(
                    f"offset {offset} is beyond the end of topic '{topic.name}' "
                    f"(next offset {topic.next_offset})"
                )
            return max(offset, topic.first_offset)
        raise invalid(f"unknown start position {start}")

    def _existing_push(self, topic: str, subscriber_id: str, lsn: int) -> PushSubscriber:
        self._existing_topic(topic)
        subscriber = self.push_subscriber(topic, subscriber_id)
        if subscriber is None or (lsn and subscriber.lsn != lsn):
            raise not_found(
                f"push subscriber '{subscriber_id}' of topic '{topic}' does not exist"
                + (" (it was unsubscribed and subscribed again)" if subscriber else "")
            )
        return subscriber

    def _push_unsubscribe(self, command: PushUnsubscribe) -> Planned:
        self._existing_push(command.topic, command.subscriber_id, command.lsn)
        index = self._emit(
            replica_pb2.Operation(
                push_unsubscribe=replica_pb2.PushUnsubscribeOp(
                    topic=command.topic,
                    subscriber_id=command.subscriber_id,
                    reason=command.reason[:_REASON_CHARS_MAX],
                )
            )
        )
        self._push[(command.topic, command.subscriber_id)] = None
        return Planned(index)

    def _push_cursor(self, command: PushCursor) -> Planned:
        subscriber = self._existing_push(command.topic, command.subscriber_id, command.lsn)
        topic = self._existing_topic(command.topic)
        if command.cursor > topic.next_offset:
            raise invalid(
                f"push cursor {command.cursor} is beyond the end of topic '{command.topic}' "
                f"(next offset {topic.next_offset})"
            )
        if not 0 <= command.failures <= UINT32_MAX:
            raise invalid(f"push failure count {command.failures} is not a uint32")
        if command.cursor <= subscriber.cursor and command.failures == subscriber.failures:
            return Planned(None, cursor=subscriber.cursor)
        cursor = max(command.cursor, subscriber.cursor)
        index = self._emit(
            replica_pb2.Operation(
                push_cursor=replica_pb2.PushCursorOp(
                    topic=command.topic,
                    subscriber_id=command.subscriber_id,
                    cursor=cursor,
                    failures=command.failures,
                )
            )
        )
        self._push[(command.topic, command.subscriber_id)] = dataclasses.replace(
            subscriber, cursor=cursor, failures=command.failures
        )
        return Planned(index, cursor=cursor)

    def links(self, from_topic: str) -> dict[str, replica_pb2.LinkTopicOp]:
        """The topic's links as they will be after the commands planned so far, by
        target (`link_rules.link_target`)."""
        out = {
            link_rules.link_target(link.to_cluster, link.to_topic): link
            for link in self._store.list_links(from_topic)
            if self._links.get((from_topic, link.to_topic, link.to_cluster), link) is not None
        }
        for (source, to_topic, to_cluster), link in self._links.items():
            target = link_rules.link_target(to_cluster, to_topic)
            if source != from_topic:
                continue
            if link is None:
                out.pop(target, None)
            else:
                out[target] = link
        return out

    def _link_topic(self, command: LinkTopic) -> Planned:
        source = self.topic(command.from_topic)
        if command.to_cluster:
            to_kind = command.to_kind
        else:
            destination = self.topic(command.to_topic)
            to_kind = None if destination is None else destination.kind
        try:
            link_rules.check_link(
                command.from_topic,
                command.to_topic,
                command.cost,
                from_kind=None if source is None else source.kind,
                to_kind=to_kind,
                existing=self.links(command.from_topic) if source is not None else (),
                to_cluster=command.to_cluster,
            )
        except link_rules.LinkRefused as exc:
            raise ServiceError(Code(exc.code), exc.message) from None
        assert source is not None  # check_link refused a missing topic
        lsn = self._lsn
        op = replica_pb2.LinkTopicOp(
            from_topic=command.from_topic,
            to_topic=command.to_topic,
            cost=command.cost,
            start_offset=source.next_offset,
            to_cluster=command.to_cluster,
        )
        index = self._emit(replica_pb2.Operation(link_topic=op))
        link = replica_pb2.LinkTopicOp()
        link.CopyFrom(op)
        link.created_lsn = lsn
        link.cursor = op.start_offset
        self._links[(command.from_topic, command.to_topic, command.to_cluster)] = link
        return Planned(index, link=link)

    def _unlink_topic(self, command: UnlinkTopic) -> Planned:
        self._existing_topic(command.from_topic)
        target = link_rules.link_target(command.to_cluster, command.to_topic)
        if target not in self.links(command.from_topic):
            raise not_found(f"topic '{command.from_topic}' is not linked to '{target}'")
        index = self._emit(
            replica_pb2.Operation(
                unlink_topic=replica_pb2.UnlinkTopicOp(
                    from_topic=command.from_topic,
                    to_topic=command.to_topic,
                    to_cluster=command.to_cluster,
                )
            )
        )
        self._links[(command.from_topic, command.to_topic, command.to_cluster)] = None
        return Planned(index)

    def _link_cursor(self, command: LinkCursor) -> Planned:
        target = link_rules.link_target(command.to_cluster, command.to_topic)
        link = self.links(command.from_topic).get(target)
        if link is None or link.created_lsn != command.created_lsn:
            raise not_found(
                f"topic '{command.from_topic}' has no link to '{target}' of LSN "
                f"{command.created_lsn} (unlinked meanwhile)"
            )
        source = self._existing_topic(command.from_topic)
        if command.cursor > source.next_offset:
            raise invalid(f"link cursor {command.cursor} beyond the source's end")
        if command.cursor <= link.cursor:
            return Planned(None, cursor=link.cursor)
        index = self._emit(
            replica_pb2.Operation(
                link_cursor=replica_pb2.LinkCursorOp(
                    from_topic=command.from_topic,
                    to_cluster=command.to_cluster,
                    to_topic=command.to_topic,
                    created_lsn=command.created_lsn,
                    cursor=command.cursor,
                )
            )
        )
        moved = replica_pb2.LinkTopicOp()
        moved.CopyFrom(link)
        moved.cursor = command.cursor
        self._links[(command.from_topic, command.to_topic, command.to_cluster)] = moved
        return Planned(index, cursor=command.cursor)

    def _start_epoch(self, command: StartEpoch) -> Planned:
        index = self._emit(
            replica_pb2.Operation(
                epoch_start=replica_pb2.EpochStartOp(
                    epoch=command.epoch, master_id=command.master_id
                )
            )
        )
        return Planned(index)


def _with_next_offset(topic: TopicInfo, next_offset: int) -> TopicInfo:
    return TopicInfo(
        name=topic.name,
        topic_id=topic.topic_id,
        kind=topic.kind,
        next_offset=next_offset,
        first_offset=topic.first_offset,
        created_ms=topic.created_ms,
    )


def _check_length(value: str, what: str, key: str, limits: LimitsConfig) -> None:
    """INVALID_ARGUMENT naming the [limits] key when a new name is longer than it allows.

    Checked where a name is created or used to write, so lowering a limit never hides
    what is stored under a longer name.
    """
    limit: int = getattr(limits, key)
    if len(value) > limit:
        raise invalid(
            f"{what} {names.show_name(value)} is {len(value)} bytes long: limits.{key} is {limit}"
        )


def _plain_publisher_id(publisher_id: str) -> bool:
    """``names.validate_publisher_id``'s rule for a non-empty id, in C calls instead of a
    Python loop over its characters (every publish checks it): printable ASCII without
    space is '!'..'~'."""
    return (
        len(publisher_id) <= names.PUBLISHER_ID_MAX_BYTES
        and publisher_id.isascii()
        and publisher_id.isprintable()
        and " " not in publisher_id
    )


def _check_name(validate: object, value: str) -> None:
    try:
        validate(value)  # type: ignore[operator]
    except ValueError as exc:
        raise invalid(str(exc)) from None


# From this many events on, check_publish_limits first tries the encoded size (one C call
# instead of a Python loop over the events).
_SIZE_BY_ENCODING_EVENTS_MIN = 64


def _headers_bytes(headers: Mapping[str, str]) -> int:
    return sum(len(name.encode()) + len(value.encode()) for name, value in headers.items())


# What a PublishOp spends beyond its events' keys, payloads and headers, generously: field
# tags and lengths, the offset and timestamp; per event, its tags, lengths, sequence and
# cost; per header, its map entry's framing.
_OP_OVERHEAD_BYTES = 64
_EVENT_OVERHEAD_BYTES = 32
_HEADER_OVERHEAD_BYTES = 8


def op_bytes_bound(request: broker_pb2.PublishRequest) -> int:
    """At least the bytes the request's ``PublishOp`` takes in a log entry, from lengths
    alone (encoding a part of large events to measure it would copy megabytes)."""
    size = (
        _OP_OVERHEAD_BYTES
        + len(request.topic)
        + len(request.publisher_id)
        + len(request.session_token)
    )
    for event in request.events:
        size += len(event.payload) + len(event.key) + _EVENT_OVERHEAD_BYTES
        if event.headers:
            size += _headers_bytes(event.headers) + _HEADER_OVERHEAD_BYTES * len(event.headers)
    return size


def check_publish_limits(request: broker_pb2.PublishRequest, limits: LimitsConfig) -> None:
    """Refuses a publish that breaks a size limit, naming the limit (nothing is stored)."""
    events = request.events
    if not events:
        raise invalid("a publish needs at least one event")
    if len(events) > limits.max_batch_events:
        raise invalid(
            f"batch of {len(events)} events exceeds max_batch_events ({limits.max_batch_events})"
        )
    # Many small events: the encoded request's size (computed in C) is within both limits,
    # so every event is too. Few events are summed directly: upb computes ByteSize by
    # encoding the request, which for large events is a copy of megabytes on the loop.
    if len(events) > _SIZE_BY_ENCODING_EVENTS_MIN and request.ByteSize() <= min(
        limits.max_event_bytes, limits.max_batch_bytes
    ):
        return
    total_bytes = 0
    for i, event in enumerate(events):
        size = len(event.payload) + len(event.key)
        if event.headers:
            # Headers are stored and delivered with the event, so they count against the
            # same limit: otherwise a small payload could carry megabytes beside it.
            size += _headers_bytes(event.headers)
        if size > limits.max_event_bytes:
            raise invalid(
                f"event {i} is {size} bytes (key + payload + headers); "
                f"max_event_bytes is {limits.max_event_bytes}"
            )
        total_bytes += size
    if total_bytes > limits.max_batch_bytes:
        raise invalid(f"batch is {total_bytes} bytes; max_batch_bytes is {limits.max_batch_bytes}")
