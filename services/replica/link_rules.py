"""Topic links' decision rules (IceStorm's federation, docs/federation.md), pure.

What a link may be, which events it forwards and where its forwarding resumes: no grpc,
store, asyncio or clock here. `BatchBuilder` checks a new link with `check_link`; the
master's forwarder (`services/replica/links.py`) asks `plan_forward` what to publish.

The rules, as IceStorm's own code has them (its `SubscriberLink::queue`: "Don't
propagate a message that has already been forwarded. Also, if this link has a non-zero
cost, then don't propagate a message whose cost exceeds the link cost"):

* an event is forwarded over at most one link: an event that arrived over a link is
  never forwarded again, whatever the next link's cost;
* a link of cost 0 forwards every event published on its topic; a link of cost N > 0
  only the events whose cost (`EventData.cost`, IceStorm's "cost" request context) is at
  most N.

Because of the one-hop rule a cycle of links cannot loop an event, so cycles are allowed
as in IceStorm (A -> B and B -> A: each topic gets the other's own events once); only a
link from a topic to itself is refused, since it would store each event twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from squall.v1 import broker_pb2, common_pb2

# The publisher id prefix of forwarded events. Reserved: an app's publish under it is
# refused, so "publisher id starts with it" means "arrived over a link".
LINK_PUBLISHER_PREFIX = "squall-link/"

# Most links out of one topic: each is a task on the master reading the topic.
LINKS_PER_TOPIC_MAX = 64


class LinkRefused(Exception):
    """A link that may not be made: code is a gRPC status name, message names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def link_publisher_id(created_lsn: int, source_cluster: str = "") -> str:
    """The publisher id of a link's forwarded events: unique per link in the cluster's
    log (a link removed and made again is another link, with new sequences); a link to
    another cluster adds this cluster's name, so that links from several clusters into
    one never share an id there."""
    if source_cluster:
        return f"{LINK_PUBLISHER_PREFIX}{source_cluster}/{created_lsn}"
    return f"{LINK_PUBLISHER_PREFIX}{created_lsn}"


def is_forwarded(publisher_id: str) -> bool:
    """Whether an event with this publisher id arrived over a link (of this cluster or
    from another one)."""
    return publisher_id.startswith(LINK_PUBLISHER_PREFIX)


def is_local_link_id(publisher_id: str) -> bool:
    """Whether the id has the form of this cluster's own links' ids: only its forwarder
    may publish under one (ids of other clusters' links arrive through Publish)."""
    return is_forwarded(publisher_id) and "/" not in publisher_id[len(LINK_PUBLISHER_PREFIX) :]


def link_target(to_cluster: str, to_topic: str) -> str:
    """A link's destination as messages and sets name it: the topic's name in this
    cluster, topic@cluster in another."""
    return f"{to_topic}@{to_cluster}" if to_cluster else to_topic


def forwards(link_cost: int, event_cost: int, publisher_id: str) -> bool:
    """Whether a link of link_cost forwards an event (IceStorm's rule)."""
    if is_forwarded(publisher_id):
        return False
    return link_cost == 0 or event_cost <= link_cost


def sequence_of(offset: int) -> int:
    """The sequence a forwarded event carries: its source offset + 1 (0 means none)."""
    return offset + 1


def resume_offset(start_offset: int, high_water: int) -> int:
    """Where a link's forwarding resumes: after the last event the destination holds
    from it (its publisher's high-water mark is that event's offset + 1), never before
    the link's start."""
    return max(start_offset, high_water)


def check_link(
    from_topic: str,
    to_topic: str,
    cost: int,
    *,
    from_kind: common_pb2.TopicKind.ValueType | None,
    to_kind: common_pb2.TopicKind.ValueType | None,
    existing: Iterable[str],
    to_cluster: str = "",
) -> None:
    """Refuses a link that may not be made (LinkRefused); existing holds the targets
    (`link_target`) the topic already links to. Kinds are None for a missing topic; for
    another cluster's topic, the kind its gateway answered."""
    target = link_target(to_cluster, to_topic)
    if from_topic == to_topic and not to_cluster:
        raise LinkRefused(
            "INVALID_ARGUMENT",
            f"topic '{from_topic}' cannot be linked to itself (it would store each event twice)",
        )
    if cost < 0:
        raise LinkRefused(
            "INVALID_ARGUMENT",
            f"link cost {cost} from '{from_topic}' to '{target}' is negative; 0 or more",
        )
    for name, kind in ((from_topic, from_kind), (target, to_kind)):
        if kind is None:
            raise LinkRefused("NOT_FOUND", f"topic '{name}' does not exist")
        if kind == common_pb2.TOPIC_KIND_TRANSIENT:
            raise LinkRefused(
                "INVALID_ARGUMENT",
                f"topic '{name}' is transient: only replicated topics can be linked "
                "(a link forwards stored events exactly once)",
            )
    names = set(existing)
    if target in names:
        raise LinkRefused("ALREADY_EXISTS", f"topic '{from_topic}' is already linked to '{target}'")
    if len(names) >= LINKS_PER_TOPIC_MAX:
        raise LinkRefused(
            "RESOURCE_EXHAUSTED",
            f"topic '{from_topic}' has {len(names)} links, the most one topic may have",
        )


@dataclass(frozen=True)
class ForwardPlan:
    """What one read of the source topic gives the destination."""

    events: list[common_pb2.EventData]  # to publish, in source order
    next_offset: int  # the source offset after the last event examined


def plan_forward(events: Sequence[common_pb2.Event], link_cost: int) -> ForwardPlan:
    """The events of a read (consecutive, in offset order) that the link forwards, each
    with its key, payload, headers and cost and the sequence that makes it exactly once."""
    out: list[common_pb2.EventData] = []
    next_offset = 0
    for event in events:
        next_offset = event.offset + 1
        if not forwards(link_cost, event.cost, event.publisher_id):
            continue
        data = common_pb2.EventData(
            key=event.key,
            payload=event.payload,
            sequence=sequence_of(event.offset),
            cost=event.cost,
        )
        if event.headers:
            data.headers.update(event.headers)
        out.append(data)
    return ForwardPlan(out, next_offset)


def publish_request(
    to_topic: str, created_lsn: int, plan: ForwardPlan, source_cluster: str = ""
) -> broker_pb2.PublishRequest:
    """The publish that stores a plan's events on the destination under the link's id."""
    return broker_pb2.PublishRequest(
        topic=to_topic,
        publisher_id=link_publisher_id(created_lsn, source_cluster),
        events=plan.events,
    )
