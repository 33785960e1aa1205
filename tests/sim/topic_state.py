"""Topics, events and publisher dedupe in the replication simulator, with the real code.

The simulator's log entries are opaque bytes; a topic command's entry carries ``TOPIC_OP``
followed by a real serialized ``replica_pb2.Operation``. The state those entries build on
a node is kept in a real in-memory ``Store`` (the production store's twin), fed with the
node's topic entries in log order (store LSN k is the k-th topic entry, in the sim entry's
epoch), and a master plans topic commands with the real ``BatchBuilder`` over it, so
deduplication, destroy and re-creation run the production code. The store is rebuilt from
the log when the log changed below what it reflects (a truncation or a snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.replica import commands
from squall_server.replica.store import Store, make_entry
from tests.sim.replication_checker import Entry

TOPIC_OP = b"t"
# The topic the workload creates, destroys and re-creates, and its one fixed publisher.
TOPIC = "dd"
PUBLISHER_ID = "pub-fixed"
# Sequences are drawn from 1..SEQUENCES_MAX, so retries and re-used ids are frequent.
SEQUENCES_MAX = 5
LIMITS = LimitsConfig()


@dataclass
class TopicState:
    """The state one node's topic entries build, and where each came from in its log."""

    store: Store = field(default_factory=Store.open_memory)
    sim_lsns: list[int] = field(default_factory=list)  # store LSN k -> sim LSN at [k - 1]
    # The (LSN, epoch) of the last sim entry reflected: log matching makes it name the prefix.
    last: tuple[int, int] = (0, 0)

    def close(self) -> None:
        """Frees the store."""
        self.store.close()


def refreshed(state: TopicState | None, log: Sequence[Entry]) -> TopicState:
    """The state of log, from state when the log only grew since, else rebuilt."""
    lsn, epoch = state.last if state is not None else (0, 0)
    if state is None or lsn > len(log) or (lsn and log[lsn - 1].epoch != epoch):
        if state is not None:
            state.close()
        state, lsn = TopicState(), 0
    entries = []
    for entry in log[lsn:]:
        if entry.operation[:1] == TOPIC_OP:
            store_lsn = len(state.sim_lsns) + 1
            entries.append(make_entry(store_lsn, entry.epoch, _operation(entry)))
            state.sim_lsns.append(entry.lsn)
    if entries:
        state.store.append(entries, sync=False)
    if log:
        state.last = (len(log), log[-1].epoch)
    return state


def _operation(entry: Entry) -> commands.replica_pb2.Operation:
    return commands.replica_pb2.Operation.FromString(entry.operation[len(TOPIC_OP) :])


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


def plan(state: TopicState, kind: str, sequence: int, epoch: int, node_id: str) -> Planned:
    """Plans one command on the node's state with the production planner; raises
    ServiceError when the master refuses it (nothing planned)."""
    meta = state.store.meta()
    builder = commands.BatchBuilder(
        state.store,
        limits=LIMITS,
        node_id=node_id,
        epoch=max(epoch, meta.last_epoch),
        next_lsn=meta.last_lsn + 1,
        now_ms=0,
    )
    planned = builder.add(command(kind, sequence))
    operation = TOPIC_OP + builder.entries[0].operation if builder.entries else None
    receipt = None
    if planned.receipt is not None:
        (ack,) = commands.expand_receipt(planned.receipt)
        topic = builder.topic(TOPIC)
        # A topic created in this very plan has no id yet: the next one the store gives.
        topic_id = topic.topic_id if topic is not None else 0
        receipt = Receipt(topic_id, ack.offset, sequence, ack.duplicate)
    return Planned(operation, receipt)


def event_at(state: TopicState, offset: int) -> tuple[int, str, int] | None:
    """(topic id, publisher id, sequence) of the event stored at offset in the topic as
    the node holds it now, or None."""
    info = state.store.get_topic(TOPIC)
    if info is None or not info.first_offset <= offset < info.next_offset:
        return None
    (event,) = state.store.read_events(TOPIC, offset, 1)
    return info.topic_id, event.publisher_id, event.sequence
