"""Reaching the topic from Spark's processes: one short-lived client per call, clear errors.

Spark pickles the data source, its readers and writers, and runs them in separate Python
processes, so nothing here holds a channel between calls: a driver-side check opens a
client, asks, and closes it; an executor task opens its own for the partition it works on.
Failures are turned into sentences that name the gateway and the topic, because Spark
shows them to the user wrapped in a long JVM stack.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import squall
from squall.spark._options import CommonOptions


class SquallSparkError(RuntimeError):
    """A Squall data source failure that is not a bad option: unreachable, missing, lost."""


@contextlib.contextmanager
def connected(common: CommonOptions) -> Iterator[squall.Client]:
    """A client to the gateway, closed on exit."""
    client = squall.connect(common.gateway, timeout_s=common.timeout_s, tls=common.tls)
    try:
        yield client
    finally:
        client.close()


def retrieve(client: squall.Client, common: CommonOptions) -> squall.Topic:
    """The topic's handle; a clear error if it does not exist or the gateway is unreachable."""
    try:
        return client.topic(common.topic)
    except squall.NotFound:
        raise ValueError(
            f"Squall topic {common.topic!r} does not exist (gateway {common.gateway}); "
            f"create it first, e.g. `squall topic create {common.topic}`"
        ) from None
    except (squall.Unavailable, squall.DeadlineExceeded) as exc:
        raise SquallSparkError(
            f"cannot reach the Squall gateway at {common.gateway} (option 'gateway'): {exc.details}"
        ) from None
    except squall.InvalidArgument as exc:
        raise ValueError(f"option 'topic' {common.topic!r} is not valid: {exc.details}") from None


def topic_info(common: CommonOptions, *, readable: bool) -> squall.TopicInfo:
    """The topic as it is now; for a read, refuses a transient topic (nothing is stored)."""
    with connected(common) as client:
        info = retrieve(client, common).info
    if readable and info.kind == "transient":
        raise ValueError(
            f"Squall topic {common.topic!r} is transient: its events are delivered live and "
            "never stored, so Spark cannot read them by offset"
        )
    return info


def offset_at_time(
    common: CommonOptions, info: squall.TopicInfo, timestamp_ms: int, name: str, *, ending: bool
) -> int:
    """The offset of the first event published at or after timestamp_ms, within the topic
    as `info` saw it: its next offset when no held event is that late.

    The replica finds it (a binary search over the events' timestamps, the seek-by-time
    machinery: services/replica/seek.py) for a non-following subscription started at that
    time; a time before the oldest event held gives that event. A time in the future of
    the master's clock is refused by the replica: as an end it means the topic's end (a
    batch read stops at what exists), as a start it is an error naming the option.
    """
    if info.next_offset <= info.first_offset:
        return info.next_offset
    moment = datetime.datetime.fromtimestamp(timestamp_ms / 1000, tz=datetime.UTC)
    with connected(common) as client:
        topic = retrieve(client, common)
        try:
            with topic.subscribe(
                None, start=moment, follow=False, max_batch_events=1, dedupe=False
            ) as subscription:
                first = next(iter(subscription), None)
        except squall.InvalidArgument as exc:
            if ending:
                return info.next_offset
            raise ValueError(f"option {name!r} ({timestamp_ms}): {exc.details}") from None
        except (squall.Unavailable, squall.DeadlineExceeded) as exc:
            raise SquallSparkError(
                f"cannot find the offset at {name} {timestamp_ms} through the gateway at "
                f"{common.gateway}: {exc.details}"
            ) from None
    if first is None:
        return info.next_offset
    return min(first.offset, info.next_offset)
