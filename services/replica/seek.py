"""Where a seek lands: a position (earliest, latest, offset, time) resolved to a cursor.

Pure: the topic, the master's clock reading and a lookup of the held events by time come
in, a cursor (with why it is not where asked, if so) or a refusal comes out. The master
resolves a seek while it plans the entry, so the log holds an offset, never a time, and
every replica applies the same cursor.

The rules (docs/consumers.md, "Seek"):

* A time or an offset before the oldest event held is clamped to that event, and the
  answer says so (`SEEK_CLAMP_BEFORE_FIRST` and a note naming the event). This is what
  Google Pub/Sub (only retained messages are affected) and JetStream (`ByStartTime` picks
  the first message at or after the time) do: "replay since T" delivers all there is.
* A time in the future (beyond the master's clock by more than
  `SEEK_FUTURE_TOLERANCE_MS`) is refused with OUT_OF_RANGE. Pub/Sub and JetStream accept
  it and then behave as "latest"; a seek counts everything before it as handled, so a
  mistyped year or a time in microseconds would silently skip a whole backlog. LATEST
  says that explicitly.
* A time after the newest event but not in the future lands at the topic's end: the next
  event published is the first one at or after it.
* An offset beyond the topic's end is refused with INVALID_ARGUMENT, as `Subscribe` does.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

from squall.v1 import broker_pb2
from squall_server.common.errors import Code, ServiceError, invalid
from squall_server.replica.store import TimeLookup, TopicInfo

# How far past the master's clock a seek time may be and still mean "now": the client's
# clock may run ahead of the master's by this much.
SEEK_FUTURE_TOLERANCE_MS = 5_000


@dataclass(frozen=True)
class SeekTarget:
    """Where a seek lands."""

    cursor: int
    clamped: broker_pb2.SeekClamp.ValueType = broker_pb2.SEEK_CLAMP_NONE
    note: str = ""


def show_ms(timestamp_ms: int) -> str:
    """A time in milliseconds since the Unix epoch as ISO 8601 UTC, for messages."""
    try:
        moment = datetime.datetime.fromtimestamp(timestamp_ms / 1000, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return f"{timestamp_ms} ms"
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def resolve(
    topic: TopicInfo,
    position: broker_pb2.StartPosition.ValueType,
    *,
    offset: int,
    timestamp_ms: int,
    now_ms: int,
    lookup: Callable[[int], TimeLookup],
) -> SeekTarget:
    """The cursor a seek of `topic` to `position` lands on; ServiceError when refused.

    `lookup(timestamp_ms)` finds the first held event at or after a time (the store's
    `offset_at_time`); it is called only for a time seek.
    """
    if position == broker_pb2.START_POSITION_EARLIEST:
        return SeekTarget(topic.first_offset)
    if position == broker_pb2.START_POSITION_LATEST:
        return SeekTarget(topic.next_offset)
    if position == broker_pb2.START_POSITION_OFFSET:
        if offset > topic.next_offset:
            raise invalid(
                f"offset {offset} is beyond the end of topic '{topic.name}' "
                f"(next offset {topic.next_offset})"
            )
        if offset < topic.first_offset:
            return SeekTarget(
                topic.first_offset,
                broker_pb2.SEEK_CLAMP_BEFORE_FIRST,
                f"offset {offset} is before the oldest event held: "
                f"the cursor is at offset {topic.first_offset}",
            )
        return SeekTarget(offset)
    if position == broker_pb2.START_POSITION_TIMESTAMP:
        return _resolve_time(topic, timestamp_ms, now_ms, lookup)
    if position == broker_pb2.START_POSITION_UNSPECIFIED:
        raise invalid("a seek needs a position: earliest, latest, an offset or a time")
    raise invalid(f"unknown seek position {position}")


def _resolve_time(
    topic: TopicInfo, timestamp_ms: int, now_ms: int, lookup: Callable[[int], TimeLookup]
) -> SeekTarget:
    if timestamp_ms < 0:
        raise invalid(
            f"timestamp_ms must be >= 0 (milliseconds since the Unix epoch), not {timestamp_ms}"
        )
    if timestamp_ms > now_ms + SEEK_FUTURE_TOLERANCE_MS:
        raise ServiceError(
            Code.OUT_OF_RANGE,
            f"time {show_ms(timestamp_ms)} is in the future (the master's clock reads "
            f"{show_ms(now_ms)}): nothing was changed; seek to latest to skip everything "
            "published so far",
        )
    found = lookup(timestamp_ms)
    first_ms = found.first_timestamp_ms
    if first_ms is not None and timestamp_ms < first_ms:
        return SeekTarget(
            found.first_offset,
            broker_pb2.SEEK_CLAMP_BEFORE_FIRST,
            f"time {show_ms(timestamp_ms)} is before the oldest event held "
            f"(offset {found.first_offset}, published {show_ms(first_ms)}): "
            f"the cursor is at offset {found.first_offset}",
        )
    return SeekTarget(min(found.offset, topic.next_offset))
