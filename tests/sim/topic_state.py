"""Topics, events and publisher dedupe in the replication simulator, with the real code.

A topic command's entry carries a real serialized ``replica_pb2.Operation``, planned by the
production ``BatchBuilder`` over the master's real store (the simulator's nodes each keep
one, ``Store`` over ``MemoryKV``), so deduplication, destroy and re-creation run the
production code, and what a node holds of the topic is read from its store.
"""

from __future__ import annotations

from dataclasses import dataclass

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.replica import commands
from squall_server.replica.store import Store

# The topic the workload creates, destroys and re-creates, and its one fixed publisher.
TOPIC = "dd"
PUBLISHER_ID = "pub-fixed"
# Sequences are drawn from 1..SEQUENCES_MAX, so retries and re-used ids are frequent.
SEQUENCES_MAX = 5
LIMITS = LimitsConfig()


@dataclass(frozen=True)
class Receipt:
    """What a master answered a topic publish (one event): where the event is."""

    topic_id: int
    offset: int
    sequence: int
    duplicate: bool


def command(kind: str, sequence: int) -> commands.Command:
    """The workload's command of a kind ("create", "destroy", "publish")."""
    if kind == "create":
        return commands.CreateTopic(TOPIC, common_pb2.TOPIC_KIND_REPLICATED)
    if kind == "destroy":
        return commands.DestroyTopic(TOPIC)
    return commands.Publish(
        broker_pb2.PublishRequest(
            topic=TOPIC,
            publisher_id=PUBLISHER_ID,
            events=[common_pb2.EventData(payload=b"s%d" % sequence, sequence=sequence)],
        )
    )


@dataclass(frozen=True)
class Planned:
    """A planned topic command: the entry's operation (None: no entry), the receipt."""

    operation: bytes | None
    receipt: Receipt | None


def plan(store: Store, kind: str, sequence: int, epoch: int, node_id: str) -> Planned:
    """Plans one command on the master's store with the production planner; raises
    ServiceError when the master refuses it (nothing planned)."""
    meta = store.meta()
    builder = commands.BatchBuilder(
        store,
        limits=LIMITS,
        node_id=node_id,
        epoch=max(epoch, meta.last_epoch),
        next_lsn=meta.last_lsn + 1,
        now_ms=0,
    )
    planned = builder.add(command(kind, sequence))
    operation = builder.entries[0].operation if builder.entries else None
    receipt = None
    if planned.receipt is not None:
        (ack,) = commands.expand_receipt(planned.receipt)
        topic = builder.topic(TOPIC)
        # A topic created in this very plan has no id yet: the next one the store gives.
        topic_id = topic.topic_id if topic is not None else 0
        receipt = Receipt(topic_id, ack.offset, sequence, ack.duplicate)
    return Planned(operation, receipt)


def event_at(store: Store, offset: int) -> tuple[int, str, int] | None:
    """(topic id, publisher id, sequence) of the event stored at offset in the topic as
    the node's store holds it now, or None."""
    info = store.get_topic(TOPIC)
    if info is None or not info.first_offset <= offset < info.next_offset:
        return None
    (event,) = store.read_events(TOPIC, offset, 1)
    return info.topic_id, event.publisher_id, event.sequence
