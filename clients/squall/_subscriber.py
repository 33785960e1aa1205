"""Subscribing: one Subscribe stream read as an iterator of messages, with acks for durable cursors.

A `Subscription` wraps one server-streaming `Subscribe` call. Iterate it for `Message`s
(or `batches()` for the lists the server sent, which is cheaper per event and tells a
consumer where a good ack point is). A durable subscription (one with a name) keeps a
replicated cursor on the server; `ack` moves it. Delivery is at-least-once: after a
reconnect, events after the last ack come again, and their offsets let the app drop
duplicates.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import grpc

from squall._errors import from_rpc_error
from squall._types import Message, messages_from_pb
from squall.v1 import broker_pb2, broker_pb2_grpc

Start = Literal["earliest", "latest"] | int

# The server's batch size is bounded too; this only refuses nonsense from the caller.
MAX_BATCH_EVENTS_MAX = 100_000


def subscribe_request(
    topic: str,
    subscription: str | None,
    start: Start,
    follow: bool,
    max_batch_events: int,
    end_offset: int | None = None,
) -> broker_pb2.SubscribeRequest:
    """Builds and validates a SubscribeRequest; ValueError names the bad argument."""
    request = broker_pb2.SubscribeRequest(
        topic=topic, subscription=subscription or "", follow=follow
    )
    if isinstance(start, bool) or not isinstance(start, str | int):
        raise ValueError(f"start must be 'earliest', 'latest' or an offset, not {start!r}")
    if start == "earliest":
        request.start = broker_pb2.START_POSITION_EARLIEST
    elif start == "latest":
        request.start = broker_pb2.START_POSITION_LATEST
    elif isinstance(start, int) and start >= 0:
        request.start = broker_pb2.START_POSITION_OFFSET
        request.offset = start
    else:
        raise ValueError(f"start must be 'earliest', 'latest' or an offset >= 0, not {start!r}")
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


class Subscription:
    """A stream of one topic's messages; iterate it, ack what you handled, close it."""

    def __init__(
        self,
        stub: broker_pb2_grpc.SubscriberStub,
        request: broker_pb2.SubscribeRequest,
        *,
        timeout_s: float,
    ) -> None:
        self._stub = stub
        self._request = request
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        # No deadline: a following subscription lives until the app closes it.
        self._call: Any = stub.Subscribe(request)
        # An abandoned subscription must not keep a following stream open on the server.
        weakref.finalize(self, self._call.cancel)
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

    def _read_batches(self) -> Iterator[list[Message]]:
        try:
            for response in self._call:
                yield messages_from_pb(response)
        except grpc.RpcError as err:
            with self._lock:
                closed = self._closed
            if closed:
                return
            raise from_rpc_error(err) from None

    def ack(self, message_or_offset: Message | int) -> int:
        """Moves the durable cursor past this message (and all before it); returns the cursor.

        ValueError for a non-durable subscription, which has no cursor to move.
        """
        if not self.durable:
            raise ValueError("ack needs a durable subscription (subscribe with subscription=NAME)")
        if isinstance(message_or_offset, Message):
            offset = message_or_offset.offset
        else:
            offset = message_or_offset
        if isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be >= 0, not {offset!r}")
        request = broker_pb2.AckRequest(
            topic=self._request.topic, subscription=self._request.subscription, offset=offset
        )
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
        self._call.cancel()

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
