"""Seek and subscription info: the requests and results both clients share (pure).

`seek_request` turns what an app says ("earliest", "latest", an offset, an aware
`datetime`) into a `SeekRequest`; `SeekResult` and `SubscriptionInfo` are what the server
answers. See docs/consumers.md ("Seek") for where a seek lands and what it refuses.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Literal

from squall._errors import NotFound
from squall.v1 import broker_pb2

# Where a seek (or a subscription's start) may go: a position, an offset or a time.
SeekTarget = Literal["earliest", "latest"] | int | datetime.datetime


def time_ms(moment: datetime.datetime) -> int:
    """An aware datetime as milliseconds since the Unix epoch; ValueError for a naive one."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(
            f"a time needs a timezone (e.g. datetime.now(timezone.utc)), not {moment!r}"
        )
    return int(moment.timestamp() * 1000)


def position_fields(
    to: object,
) -> tuple[broker_pb2.StartPosition.ValueType, int, int]:
    """(position, offset, timestamp_ms) for a seek target; ValueError names a bad one."""
    if isinstance(to, datetime.datetime):
        return broker_pb2.START_POSITION_TIMESTAMP, 0, time_ms(to)
    if to == "earliest":
        return broker_pb2.START_POSITION_EARLIEST, 0, 0
    if to == "latest":
        return broker_pb2.START_POSITION_LATEST, 0, 0
    if isinstance(to, int) and not isinstance(to, bool) and to >= 0:
        return broker_pb2.START_POSITION_OFFSET, to, 0
    raise ValueError(
        f"a position must be 'earliest', 'latest', an offset >= 0 or an aware datetime, not {to!r}"
    )


def seek_request(topic: str, subscription: str, to: SeekTarget) -> broker_pb2.SeekRequest:
    """The SeekRequest moving `subscription` of `topic` to `to`."""
    if not subscription:
        raise ValueError("seek needs a durable subscription name")
    position, offset, timestamp_ms = position_fields(to)
    return broker_pb2.SeekRequest(
        topic=topic,
        subscription=subscription,
        position=position,
        offset=offset,
        timestamp_ms=timestamp_ms,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SeekResult:
    """Where a seek moved a durable subscription's cursor."""

    topic: str
    subscription: str
    cursor: int  # the next offset it will deliver
    previous_cursor: int  # 0 when the seek created the subscription
    created: bool
    clamped: bool  # True when the time or offset was before the oldest event held
    note: str  # why it was clamped, "" otherwise
    seek_generation: int

    @classmethod
    def from_pb(
        cls, request: broker_pb2.SeekRequest, response: broker_pb2.SeekResponse
    ) -> SeekResult:
        """The result of `request` as the server answered it."""
        return cls(
            topic=request.topic,
            subscription=request.subscription,
            cursor=response.cursor,
            previous_cursor=response.previous_cursor,
            created=response.created,
            clamped=response.clamped != broker_pb2.SEEK_CLAMP_NONE,
            note=response.note,
            seek_generation=response.seek_generation,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SubscriptionInfo:
    """A durable subscription: where it is and how much is left to read."""

    topic: str
    name: str
    cursor: int  # the next offset it will deliver
    backlog: int  # events from the cursor to the topic's end
    seek_generation: int  # the LSN of the seek that last moved it (0: never)
    shared: bool = False  # a shared subscription (competing consumers)
    outstanding: int = 0  # shared: events leased to consumers now
    dead_lettered: int = 0  # shared: events published to its dead-letter topic

    @classmethod
    def from_pb(cls, topic: str, info: broker_pb2.SubscriptionInfo) -> SubscriptionInfo:
        """Builds it from ListSubscriptions' wire message."""
        return cls(
            topic,
            info.name,
            info.cursor,
            info.backlog,
            info.seek_generation,
            info.shared,
            info.outstanding,
            info.dead_lettered,
        )


def subscription_named(infos: list[SubscriptionInfo], topic: str, name: str) -> SubscriptionInfo:
    """The one named `name`; NotFound (as the server words it) when there is none."""
    for info in infos:
        if info.name == name:
            return info
    raise NotFound(f"subscription '{name}' on topic '{topic}' does not exist")
