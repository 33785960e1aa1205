"""Subscribing: one Subscribe stream read as an iterator of messages, with acks for durable cursors.

A `Subscription` wraps one server-streaming `Subscribe` call. Iterate it for `Message`s
(or `batches()` for the lists the server sent, which is cheaper per event and tells a
consumer where a good ack point is). A durable subscription (one with a name) keeps a
replicated cursor on the server; `ack` moves it.

Failover (issue 5): when the stream breaks in a way a new stream may fix (UNAVAILABLE,
UNKNOWN, INTERNAL, CANCELLED not asked for, DEADLINE_EXCEEDED — the master died, the
gateway restarted), the subscription opens a new one through the same channel (the
gateway, which goes to the new master), after a jittered exponential backoff bounded by
the client's `RetryPolicy` (attempts and total time per outage; a response resets them).
It resumes from the durable cursor (a durable subscription) or from the last offset it
delivered + 1 (a non-durable one). Delivery is therefore at-least-once: a durable
subscription sees again everything after its last ack. With `dedupe=True` (the default)
the library drops every event whose offset is at or below the last one it delivered, so
the app sees each offset once, in order; `dedupe=False` hands every copy to the app. A
definite error (NOT_FOUND, INVALID_ARGUMENT, ...) or running out of retries raises.

Seek (docs/consumers.md): a seek of a durable subscription ends its streams with ABORTED;
the subscription opens a new one at once from the new cursor and forgets the offsets it
delivered (the seek means "deliver these again"). Each message carries the seek generation
of the stream that delivered it, and `ack` sends it, so an ack of a message delivered
before a seek is refused (`Aborted`) instead of moving the cursor past the replay.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import grpc

from squall._errors import from_rpc_error, rpc_status
from squall._seek import SeekTarget, position_fields
from squall._types import Message, messages_from_pb
from squall.v1 import broker_pb2, broker_pb2_grpc
from squall.wire import stages as _stages
from squall.wire.retry import INDETERMINATE_AFTER_SEND, RetryPolicy

# Where a subscription without a cursor starts: a position, an offset or an aware datetime
# (the first event published at or after it).
Start = SeekTarget

# The server's batch size is bounded too; this only refuses nonsense from the caller.
MAX_BATCH_EVENTS_MAX = 100_000

log = logging.getLogger("squall")

# Codes after which a fresh Subscribe stream may work: the server (or the path to it) went
# away; anything else is the answer and would come again.
RECONNECT_CODES: frozenset[str] = INDETERMINATE_AFTER_SEND


def _cancel(calls: list[Any]) -> None:
    """Cancels the subscription's current stream (a finalizer: holds no reference to it)."""
    for call in calls:
        if call is not None:
            call.cancel()


# Which replicas a gateway may serve a subscription from (None: the gateway's setting).
ReadFrom = Literal["master", "replicas"]
READ_FROM: dict[str, broker_pb2.ReadFrom.ValueType] = {
    "master": broker_pb2.READ_FROM_MASTER,
    "replicas": broker_pb2.READ_FROM_REPLICAS,
}


def subscribe_request(
    topic: str,
    subscription: str | None,
    start: Start,
    follow: bool,
    max_batch_events: int,
    end_offset: int | None = None,
    read_from: ReadFrom | None = None,
) -> broker_pb2.SubscribeRequest:
    """Builds and validates a SubscribeRequest; ValueError names the bad argument."""
    request = broker_pb2.SubscribeRequest(
        topic=topic, subscription=subscription or "", follow=follow
    )
    if read_from is not None:
        if read_from not in READ_FROM:
            raise ValueError(
                f"read_from must be one of {', '.join(map(repr, READ_FROM))} or None, "
                f"not {read_from!r}"
            )
        request.read_from = READ_FROM[read_from]
    try:
        request.start, request.offset, request.timestamp_ms = position_fields(start)
    except ValueError as exc:
        raise ValueError(f"start: {exc}") from None
    if not 0 <= max_batch_events <= MAX_BATCH_EVENTS_MAX:
        raise ValueError(
            f"max_batch_events must be 0..{MAX_BATCH_EVENTS_MAX}, not {max_batch_events}"
        )
    request.max_batch_events = max_batch_events
    if end_offset is not None:
        if end_offset < 1:
            raise ValueError(f"end_offset must be >= 1, not {end_offset}")
        request.end_offset = end_offset
    return request


def drop_duplicates(batch: list[Message], last_offset: int) -> tuple[list[Message], int]:
    """The messages of a batch after `last_offset` (the last one delivered), and how many
    were dropped as redeliveries."""
    if not batch or batch[0].offset > last_offset:
        return batch, 0
    kept = [m for m in batch if m.offset > last_offset]
    return kept, len(batch) - len(kept)


def reconnect_wait_s(
    policy: RetryPolicy, code: grpc.StatusCode, failures: int, elapsed_ms: float
) -> float | None:
    """How long to wait before reopening a broken stream; None when it must raise instead.

    `failures` counts the breaks of this outage (a response resets it) and `elapsed_ms`
    the time since its first: a definite code, or the policy's budget spent, raises.
    """
    if code.name not in RECONNECT_CODES or policy.exhausted(failures, elapsed_ms):
        return None
    return random.uniform(0, policy.backoff_ceiling_ms(failures) / 1000)


def resume_request(
    request: broker_pb2.SubscribeRequest, last_offset: int
) -> broker_pb2.SubscribeRequest:
    """The request that continues where the app is: the durable cursor, or last + 1."""
    again = broker_pb2.SubscribeRequest()
    again.CopyFrom(request)
    if not again.subscription and last_offset >= 0:
        again.start = broker_pb2.START_POSITION_OFFSET
        again.offset = last_offset + 1
    return again


def moved_by_seek(request: broker_pb2.SubscribeRequest, code: grpc.StatusCode) -> bool:
    """True when a durable subscription's stream ended because a seek moved its cursor."""
    return bool(request.subscription) and code == grpc.StatusCode.ABORTED


def ack_request(
    request: broker_pb2.SubscribeRequest,
    message_or_offset: Message | int,
    generation: int | None = None,
) -> broker_pb2.AckRequest:
    """The Ack moving a durable subscription's cursor past a message or offset.

    A message's ack names the seek generation it was delivered under; an offset's names
    `generation` (the current stream's; None before any response: no check).
    ValueError for a non-durable subscription (it has no cursor) or a negative offset.
    """
    if not request.subscription:
        raise ValueError("ack needs a durable subscription (subscribe with subscription=NAME)")
    if isinstance(message_or_offset, Message):
        offset = message_or_offset.offset
        generation = message_or_offset.seek_generation
    else:
        offset = message_or_offset
    if isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset!r}")
    ack = broker_pb2.AckRequest(
        topic=request.topic, subscription=request.subscription, offset=offset
    )
    if generation is not None:
        ack.seek_generation = generation
    return ack


class Subscription:
    """A stream of one topic's messages; iterate it, ack what you handled, close it."""

    def __init__(
        self,
        stub: broker_pb2_grpc.SubscriberStub,
        request: broker_pb2.SubscribeRequest,
        *,
        timeout_s: float,
        retry: RetryPolicy | None = None,
        dedupe: bool = True,
    ) -> None:
        self._stub = stub
        self._request = request
        self._timeout_s = timeout_s
        self._retry = retry if retry is not None else RetryPolicy()
        self._retry.validate()
        self._dedupe = dedupe
        self._lock = threading.Lock()
        self._closed = False
        # Wakes a reconnect backoff early when the app closes the subscription.
        self._closing = threading.Event()
        # The highest offset handed to the app so far (-1: none yet).
        self._last_offset = -1
        self._reconnects = 0
        self._duplicates_dropped = 0
        # The seek generation of the current stream (None until its first response).
        self._generation: int | None = None
        # No deadline: a following subscription lives until the app closes it. The list
        # holds the one current call, so a reconnect can swap it under the finalizer.
        self._calls: list[Any] = [stub.Subscribe(request)]
        # An abandoned subscription must not keep a following stream open on the server.
        weakref.finalize(self, _cancel, self._calls)
        self._batches = self._read_batches()
        self._current: Iterator[Message] = iter(())

    @property
    def topic(self) -> str:
        """The topic read."""
        return self._request.topic

    @property
    def name(self) -> str | None:
        """The durable subscription's name, or None for a non-durable one."""
        return self._request.subscription or None

    @property
    def durable(self) -> bool:
        """True when the subscription has a server-side cursor that `ack` moves."""
        return bool(self._request.subscription)

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        if self._closed:
            raise StopIteration
        for message in self._current:
            return message
        # The bound is the server's: each pass takes one more response off the stream.
        while True:
            batch = next(self._batches)
            if batch:
                self._current = iter(batch)
                return next(self._current)

    def batches(self) -> Iterator[list[Message]]:
        """The messages grouped as the server sent them (do not mix with plain iteration)."""
        return self._batches

    @property
    def reconnects(self) -> int:
        """How many times the stream was opened again after breaking."""
        return self._reconnects

    @property
    def duplicates_dropped(self) -> int:
        """How many redelivered events deduplication dropped (always 0 with dedupe=False)."""
        return self._duplicates_dropped

    @property
    def last_offset(self) -> int:
        """The highest offset delivered to the app so far (-1 before the first)."""
        return self._last_offset

    def _read_batches(self) -> Iterator[list[Message]]:
        """The server's batches across reconnects, duplicates dropped when deduplicating."""
        failures = 0
        outage_started = 0.0
        # Bounded: each pass either reads a response (and resets `failures`) or spends
        # part of the policy's time budget (and counts toward attempts_max when set).
        while True:
            try:
                for response in self._calls[0]:
                    failures = 0
                    self._generation = response.seek_generation
                    batch = messages_from_pb(response)
                    if _stages.ENABLED and batch:
                        _stages.mark("c.d", f"off/{self.topic}/{batch[0].offset}")
                    if self._dedupe:
                        batch, dropped = drop_duplicates(batch, self._last_offset)
                        self._duplicates_dropped += dropped
                    if batch:
                        self._last_offset = max(self._last_offset, batch[-1].offset)
                    yield batch
                self._forget_call()
                return
            except grpc.RpcError as err:
                self._forget_call()
                if self.closed:
                    return
                code, details = rpc_status(err)
                if moved_by_seek(self._request, code):
                    # Not an outage: start again at once from the cursor the seek set.
                    log.info("subscription %s on %s: %s", self.name, self.topic, details)
                    with self._lock:
                        if self._closed:
                            return
                        self._last_offset = -1
                        self._generation = None
                        self._calls[0] = self._stub.Subscribe(self._request)
                        self._reconnects += 1
                    continue
                if failures == 0:
                    outage_started = time.monotonic()
                failures += 1
                elapsed_ms = (time.monotonic() - outage_started) * 1000
                wait_s = reconnect_wait_s(self._retry, code, failures, elapsed_ms)
                if wait_s is None:
                    raise from_rpc_error(err) from None
                log.info(
                    "subscription %s on %s: stream ended (%s: %s); reconnecting in %.3f s "
                    "from offset %d",
                    self.name or "(non-durable)",
                    self.topic,
                    code.name,
                    details,
                    wait_s,
                    self._last_offset + 1,
                )
                if self._closing.wait(wait_s):
                    return
                with self._lock:
                    if self._closed:
                        return
                    self._calls[0] = self._stub.Subscribe(self._resume_request())
                    self._reconnects += 1

    def _forget_call(self) -> None:
        """Drops the current call once it ended. An ended call is the RpcError it raised,
        whose traceback holds the frames that read it, this subscription's among them:
        left where the finalizer's registry reaches it, it would keep the subscription
        (and its stream's memory) alive for good."""
        with self._lock:
            self._calls[0] = None

    def _resume_request(self) -> broker_pb2.SubscribeRequest:
        """The request that continues where the app is: the durable cursor, or last + 1."""
        return resume_request(self._request, self._last_offset)

    def ack(self, message_or_offset: Message | int) -> int:
        """Moves the durable cursor past this message (and all before it); returns the cursor.

        `Aborted` when a seek moved the subscription after the message was delivered (the
        cursor is where the seek put it). ValueError for a non-durable subscription, which
        has no cursor to move.
        """
        request = ack_request(self._request, message_or_offset, self._generation)
        try:
            response = self._stub.Ack(request, timeout=self._timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return int(response.cursor)

    def close(self) -> None:
        """Cancels the stream; iteration then ends quietly."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            call = self._calls[0]
        self._closing.set()
        if call is not None:  # else it ended already
            call.cancel()

    @property
    def closed(self) -> bool:
        """True after close()."""
        with self._lock:
            return self._closed

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Subscription(topic={self.topic!r}, name={self.name!r})"
