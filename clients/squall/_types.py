"""The plain, immutable values the client hands to applications, and their conversions.

Applications never see protobuf messages: topics, receipts, messages and status rows are
frozen dataclasses. Receipts and messages are built once per event on the throughput path,
so `receipts_from_pb` / `messages_from_pb` fill the slots directly, which costs about half
of a frozen dataclass's `__init__` (it pays `object.__setattr__` per field); the objects
are the same as the constructor's. `Receipt.holders` is converted on first read (see
`_LazyHolders`), because converting it costs more than the rest of a receipt.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from squall.v1 import broker_pb2, common_pb2, gateway_pb2

TopicKindName = Literal["replicated", "transient"]

_KIND_TO_PB: dict[str, common_pb2.TopicKind.ValueType] = {
    "replicated": common_pb2.TOPIC_KIND_REPLICATED,
    "transient": common_pb2.TOPIC_KIND_TRANSIENT,
}


def kind_to_pb(kind: str) -> common_pb2.TopicKind.ValueType:
    """Maps "replicated" / "transient" to the proto enum; ValueError for anything else."""
    try:
        return _KIND_TO_PB[kind]
    except KeyError:
        raise ValueError(f"topic kind must be 'replicated' or 'transient', not {kind!r}") from None


def enum_name(enum: Any, value: int, prefix: str) -> str:
    """`NODE_STATE_NORMAL` -> "normal"; an unknown value (a newer server) -> its number."""
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower()


@dataclasses.dataclass(frozen=True, slots=True)
class TopicInfo:
    """A topic as the topic manager reports it."""

    name: str
    kind: TopicKindName
    next_offset: int
    first_offset: int
    created_ms: int
    # Bytes of the topic's stored event records on the answering replica; None when not
    # counted (a transient topic, a store record older than the count, an older server).
    size_bytes: int | None = None

    @classmethod
    def from_pb(cls, topic: common_pb2.Topic) -> TopicInfo:
        """Builds a TopicInfo from the wire message (unspecified kind means replicated)."""
        kind: TopicKindName = (
            "transient" if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT else "replicated"
        )
        size = topic.size_bytes if topic.size_known else None
        return cls(topic.name, kind, topic.next_offset, topic.first_offset, topic.created_ms, size)


@dataclasses.dataclass(frozen=True, slots=True)
class LinkInfo:
    """A link from one topic to another (IceStorm's LinkInfo), with where forwarding is."""

    from_topic: str
    to_topic: str
    cost: int
    start_offset: int  # from_topic's end when the link was made: forwarding starts there
    next_offset: int  # every event of from_topic below it was examined (forwarded or not)
    lag_events: int  # events of from_topic not yet examined
    publisher_id: str  # the forwarded events' publisher id on to_topic
    created_lsn: int
    to_cluster: str = ""  # another cluster's name ([[remotes]]); empty: this cluster
    lag_ms: int = 0  # how long the oldest event not yet examined has waited
    stopped_reason: str = ""  # why forwarding stopped for good; empty while it goes on

    @classmethod
    def from_pb(cls, link: broker_pb2.LinkInfo) -> LinkInfo:
        """Builds a LinkInfo from the wire message."""
        return cls(
            link.from_topic,
            link.to_topic,
            link.cost,
            link.start_offset,
            link.next_offset,
            link.lag_events,
            link.publisher_id,
            link.created_lsn,
            link.to_cluster,
            link.lag_ms,
            link.stopped_reason,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """One replica holding a published event, and how durably ("sync", "write_no_sync", ...)."""

    node_id: str
    durability: str


@dataclasses.dataclass(frozen=True, slots=True)
class Receipt:
    """The acknowledgement of one published event."""

    offset: int
    lsn: int
    epoch: int
    duplicate: bool
    holders: tuple[Holder, ...]
    master_id: str
    rebound: bool = False
    """True on the first receipt after a publisher proxy moved to another replica: the
    order of this publisher's events may have changed there (see Message.session_token)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """One event delivered to a subscriber."""

    offset: int
    key: bytes
    payload: bytes
    timestamp_ms: int
    publisher_id: str
    sequence: int
    # Excluded from hashing only: a dict is unhashable, and offset already identifies it.
    headers: Mapping[str, str] = dataclasses.field(hash=False)
    session_token: str
    """The publisher binding that sent it: a publisher's events keep their order within one
    token; where the token changes (a new stream, a move to another replica) order may not."""
    lsn: int
    epoch: int
    topic: str = ""
    seek_generation: int = dataclasses.field(default=0, compare=False)
    """For a durable subscription, the seek generation of the stream that delivered it:
    `ack` sends it, so an ack of a message delivered before a seek cannot undo the seek."""
    cost: int = 0
    """The event's cost (IceStorm's): a topic link of cost N > 0 forwards it only when it
    is at most N. Published with `publish_many` events that have a `cost` attribute."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlaveProgress:
    """One slave as its master sees it: what it holds, its lag, catch-up rate and ETA."""

    node_id: str
    state: str
    received_lsn: int
    written_lsn: int
    synced_lsn: int
    lag_entries: int
    catch_up_entries_per_s: float
    eta_s: float
    """Seconds until the lag closes at the recent rate; -1 while the slave is not gaining."""
    snapshot_lsn: int
    silent_ms: int = 0
    """How long the master has heard nothing from it (no position, no ack)."""
    catching_up: bool = False
    """It has not yet caught up (held the master's log as of the epoch's start, or the
    commit LSN of when its stream opened if later): under acks "group" commits do not
    wait for it until it has."""


@dataclasses.dataclass(frozen=True, slots=True)
class OperatorRecord:
    """Who did what to a node's election, when (ms since the Unix epoch) and why."""

    at_ms: int
    operator: str
    """The user; `replica` for a fault the replica reported; `auto` for an automatic revert."""
    action: str
    reason: str

    @classmethod
    def from_pb(cls, pb: Any) -> OperatorRecord:
        """From a `squall.v1.OperatorRecord`."""
        return cls(pb.at_ms, pb.operator, pb.action, pb.reason)


@dataclasses.dataclass(frozen=True, slots=True)
class LossEvent:
    """Acknowledged events a node discarded, and the operator action that allowed it
    (docs/operations.md, "Loss reports"); shown until `squall cluster ack-loss ID`."""

    loss_id: str
    node_id: str
    at_ms: int
    cause: str
    """`truncation`, `manual-recovery`, `restore` or `designated-primary-conflict`."""
    operator_action: str
    detail: str
    epoch: int = 0
    first_epoch: int = 0
    last_epoch: int = 0
    first_lsn: int = 0
    """The discarded LSN range (0: unknown)."""
    last_lsn: int = 0
    topics: tuple[tuple[str, int], ...] = ()
    """(topic, events discarded) per topic; empty when unknown."""

    @classmethod
    def from_pb(cls, pb: Any) -> LossEvent:
        """From a `squall.v1.LossEvent`."""
        return cls(
            loss_id=pb.loss_id,
            node_id=pb.node_id,
            at_ms=pb.at_ms,
            cause=pb.cause,
            operator_action=pb.operator_action,
            detail=pb.detail,
            epoch=pb.epoch,
            first_epoch=pb.first_epoch,
            last_epoch=pb.last_epoch,
            first_lsn=pb.first_lsn,
            last_lsn=pb.last_lsn,
            topics=tuple((t.topic, t.events) for t in pb.topics),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node's row of the cluster status table (IceStorm's `replica` command, and more)."""

    node_id: str
    coordinator_id: str
    group_name: str
    state: str
    group: tuple[str, ...]
    max_seen: int
    epoch: int
    role: str
    last_change_reason: str
    last_lsn: int
    commit_lsn: int
    store_state: str
    reachable: bool
    error: str
    replica_address: str
    priority: int = 0
    designated_primary: bool = False
    quorum_override: int = 0
    quorum_required: int = 0
    slaves: tuple[SlaveProgress, ...] = ()
    """On the master: each slave's replication progress."""
    log_start_lsn: int = 0
    last_epoch: int = 0
    """The epoch of the last entry in the node's log."""
    quorum_override_record: OperatorRecord | None = None
    """Who set the quorum override in force, when and why."""
    quarantine: OperatorRecord | None = None
    """Set while the node is quarantined: by whom (or `replica`), when and why."""
    audit: tuple[OperatorRecord, ...] = ()
    """The newest operator actions and automatic reverts on the node, oldest first."""
    invited: tuple[str, ...] = ()
    """On a coordinator: the nodes its last merge invited."""
    sync_source_id: str = ""
    """The member whose log its group adopted when it formed."""
    fault_reason: str = ""
    """A fault the node's replica reported (checksum error, failed store write)."""
    transfer_target: str = ""
    """On a master handing its group over: the node it hands it to."""
    replica_unreachable_since_ms: int = 0
    """Set while the node's coordinator holds it out of every group because its replica
    stopped answering: wall-clock ms since the Unix epoch of the replica's last answer."""
    config_mismatches: tuple[ConfigMismatch, ...] = ()
    """Nodes this node refuses because settings every member must share differ from its
    own, one row per differing setting."""
    losses: tuple[LossEvent, ...] = ()
    """Acknowledged events the node discarded that no operator acknowledged yet."""
    membership: str = ""
    """The node set this node runs with (``v2 (epoch 7): 1:3,2:2,4:1``; v0 is the config
    file's); a runtime membership change moves it."""
    membership_change: str = ""
    """On the master's coordinator: the membership change in progress, or how the last
    one ended."""
    lead_held_off_until_ms: int = 0
    """Set while the node steps aside, out of every group, because its replica kept refusing
    the master or the slave role, or its master replica was cut off: wall-clock ms since
    the Unix epoch the hold-off ends."""
    lead_held_off_reason: str = ""
    """While held off: why (the role refused and the replica's last refusal, or the cut)."""
    frozen_for_shutdown_id: str = ""
    """The cluster shutdown the node's replica is frozen for (no new role, and on the
    master no new write); empty otherwise."""
    freeze_remaining_ms: int = 0
    """While frozen: ms until the freeze lapses by itself, unless its shutdown finishes or
    aborts first."""


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigMismatch:
    """A node refused because a setting every member must share differs (its key, the
    reporting node's value and the refused node's)."""

    node_id: str
    key: str
    local_value: str
    peer_value: str


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterStatus:
    """Every configured node's status as the gateway could reach it, and the master it uses."""

    nodes: tuple[NodeStatus, ...]
    master_id: str
    epoch: int

    @classmethod
    def from_pb(cls, status: gateway_pb2.ClusterStatus) -> ClusterStatus:
        """Builds the status from the gateway's wire message."""
        nodes = tuple(
            NodeStatus(
                node_id=n.node_id,
                coordinator_id=n.coordinator_id,
                group_name=n.group_name,
                state=enum_name(common_pb2.NodeState, n.state, "NODE_STATE_"),
                group=tuple(n.group),
                max_seen=n.max_seen,
                epoch=n.epoch,
                role=enum_name(common_pb2.Role, n.role, "ROLE_"),
                last_change_reason=n.last_change_reason,
                last_lsn=n.last_lsn,
                commit_lsn=n.commit_lsn,
                store_state=enum_name(common_pb2.StoreState, n.store_state, "STORE_STATE_"),
                reachable=n.reachable,
                error=n.error,
                replica_address=n.replica_address,
                priority=n.priority,
                designated_primary=n.designated_primary,
                quorum_override=n.quorum_override,
                quorum_required=n.quorum_required,
                slaves=tuple(
                    SlaveProgress(
                        node_id=p.node_id,
                        state=p.state,
                        received_lsn=p.received_lsn,
                        written_lsn=p.written_lsn,
                        synced_lsn=p.synced_lsn,
                        lag_entries=p.lag_entries,
                        catch_up_entries_per_s=p.catch_up_entries_per_s,
                        eta_s=p.eta_s,
                        snapshot_lsn=p.snapshot_lsn,
                        silent_ms=p.silent_ms,
                        catching_up=p.catching_up,
                    )
                    for p in n.slaves
                ),
                log_start_lsn=n.log_start_lsn,
                last_epoch=n.last_epoch,
                quorum_override_record=(
                    OperatorRecord.from_pb(n.quorum_override_record)
                    if n.HasField("quorum_override_record")
                    else None
                ),
                quarantine=(
                    OperatorRecord.from_pb(n.quarantine) if n.HasField("quarantine") else None
                ),
                audit=tuple(OperatorRecord.from_pb(r) for r in n.audit),
                invited=tuple(n.invited),
                sync_source_id=n.sync_source_id,
                fault_reason=n.fault_reason,
                transfer_target=n.transfer_target,
                replica_unreachable_since_ms=n.replica_unreachable_since_ms,
                config_mismatches=tuple(
                    ConfigMismatch(m.node_id, m.key, m.local_value, m.peer_value)
                    for m in n.config_mismatches
                ),
                losses=tuple(LossEvent.from_pb(e) for e in n.losses),
                membership=n.membership,
                membership_change=n.membership_change,
                lead_held_off_until_ms=n.lead_held_off_until_ms,
                lead_held_off_reason=n.lead_held_off_reason,
                frozen_for_shutdown_id=n.frozen_for_shutdown_id,
                freeze_remaining_ms=n.freeze_remaining_ms,
            )
            for n in status.nodes
        )
        return cls(nodes, status.master_id, status.epoch)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole status."""
        return dataclasses.asdict(self)


def _slot_setters(cls: type, names: Iterable[str]) -> list[Callable[[object, Any], None]]:
    """The slot descriptors' setters of a slotted dataclass, in field order."""
    return [vars(cls)[name].__set__ for name in names]


_new = object.__new__
(_r_offset, _r_lsn, _r_epoch, _r_dup, _r_holders, _r_master, _r_rebound) = _slot_setters(
    Receipt, [f.name for f in dataclasses.fields(Receipt)]
)
_DURABILITY_PREFIX = "SYNC_POLICY_"
# Holder tuples repeat (the same replicas hold every event of a batch), so they are
# interned: receipts then share one tuple and converting a batch allocates little.
_holder_cache: dict[tuple[tuple[str, int], ...], tuple[Holder, ...]] = {}
_HOLDER_CACHE_MAX = 1024


def _holders(pb_holders: Iterable[common_pb2.ReplicaDurability]) -> tuple[Holder, ...]:
    key = tuple([(h.node_id, h.durability) for h in pb_holders])
    found = _holder_cache.get(key)
    if found is None:
        found = tuple(
            Holder(node_id, enum_name(common_pb2.SyncPolicy, durability, _DURABILITY_PREFIX))
            for node_id, durability in key
        )
        if len(_holder_cache) >= _HOLDER_CACHE_MAX:
            _holder_cache.clear()
        _holder_cache[key] = found
    return found


class _LazyHolders:
    """The `Receipt.holders` slot, converting the wire receipt's holders on first read.

    Converting holders costs more than the rest of a receipt, and most publishers never
    look at them; so the fast path stores the wire AckReceipt in the slot and this
    descriptor swaps in the tuple the first time anything (including __eq__, __hash__
    and __repr__) reads it. A Receipt built by its constructor holds the tuple directly.
    """

    def __init__(self, slot: Any) -> None:
        self._slot = slot

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = self._slot.__get__(obj, owner)
        if type(value) is not tuple:
            value = _holders(value.holders) if len(value.holders) else ()
            self._slot.__set__(obj, value)
        return value

    def __set__(self, obj: object, value: Any) -> None:
        self._slot.__set__(obj, value)


Receipt.holders = _LazyHolders(vars(Receipt)["holders"])  # type: ignore[assignment,misc]


def receipt_count(response: broker_pb2.PublishResponse) -> int:
    """How many events a publish response answers, in either form."""
    return response.batch.count if response.HasField("batch") else len(response.receipts)


def receipts_from_pb(response: broker_pb2.PublishResponse) -> list[Receipt]:
    """Converts one publish response's receipts, in order (compact or one per event)."""
    if response.HasField("batch"):
        return _receipts_from_batch(response.batch)
    out: list[Receipt] = []
    append = out.append
    for r in response.receipts:
        receipt = _new(Receipt)
        _r_offset(receipt, r.offset)
        _r_lsn(receipt, r.lsn)
        _r_epoch(receipt, r.epoch)
        _r_dup(receipt, r.duplicate)
        _r_holders(receipt, r)  # converted on first read, see _LazyHolders
        _r_master(receipt, r.master_id)
        _r_rebound(receipt, False)
        append(receipt)
    return out


def _receipts_from_batch(batch: common_pb2.BatchReceipt) -> list[Receipt]:
    """Expands a BatchReceipt (rules in common.proto); holders converted once for all."""
    holders = _holders(batch.holders) if len(batch.holders) else ()
    master_id, lsn, epoch = batch.master_id, batch.lsn, batch.epoch
    duplicates = {d.index: d for d in batch.duplicates}
    offset = batch.first_offset
    out: list[Receipt] = []
    append = out.append
    for index in range(batch.count):
        receipt = _new(Receipt)
        duplicate = duplicates.get(index) if duplicates else None
        if duplicate is None:
            _r_offset(receipt, offset)
            _r_lsn(receipt, lsn)
            _r_epoch(receipt, epoch)
            _r_dup(receipt, False)
            offset += 1
        else:
            _r_offset(receipt, duplicate.offset)
            _r_lsn(receipt, duplicate.lsn)
            _r_epoch(receipt, duplicate.epoch)
            _r_dup(receipt, True)
        _r_holders(receipt, holders)
        _r_master(receipt, master_id)
        _r_rebound(receipt, False)
        append(receipt)
    return out


(
    _m_offset,
    _m_key,
    _m_payload,
    _m_ts,
    _m_pub,
    _m_seq,
    _m_headers,
    _m_token,
    _m_lsn,
    _m_epoch,
    _m_topic,
    _m_generation,
    _m_cost,
) = _slot_setters(Message, [f.name for f in dataclasses.fields(Message)])
_NO_HEADERS: Mapping[str, str] = types.MappingProxyType({})


def messages_from_pb(response: broker_pb2.SubscribeResponse) -> list[Message]:
    """Converts one subscribe response's events, in offset order."""
    return messages_from_events(response.events, response.seek_generation)


def messages_from_events(
    events: Iterable[common_pb2.Event], seek_generation: int = 0
) -> list[Message]:
    """Converts wire events (a subscribe response's, a push delivery's), in their order."""
    out: list[Message] = []
    append = out.append
    for e in events:
        m = _new(Message)
        _m_offset(m, e.offset)
        _m_key(m, e.key)
        _m_payload(m, e.payload)
        _m_ts(m, e.timestamp_ms)
        _m_pub(m, e.publisher_id)
        _m_seq(m, e.sequence)
        headers = e.headers
        _m_headers(m, dict(headers) if len(headers) else _NO_HEADERS)
        _m_token(m, e.session_token)
        _m_lsn(m, e.lsn)
        _m_epoch(m, e.epoch)
        _m_topic(m, e.topic)
        _m_generation(m, seek_generation)
        _m_cost(m, e.cost)
        append(m)
    return out
