"""Shared subscriptions (competing consumers) in the sync library; the rules both clients share.

A `SharedConsumer` pulls leased events of one shared subscription (Subscriber.Pull) and
yields `SharedMessage`s; the app calls `message.ack()` or `message.nack(delay_ms, error)`
on each, in any order. An event not acknowledged before its ack deadline is delivered
again, to any consumer; after `max_deliveries` failed deliveries it goes to the
dead-letter topic (docs/consumers.md, "Shared subscriptions"). Pulls and acks that meet a
failover are retried (bounded): a lost lease is delivered again, never lost.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from squall._errors import DeadlineExceeded, Indeterminate, SquallError, Unavailable
from squall._types import Message, messages_from_events
from squall.v1 import broker_pb2

# How often a consumer retries a pull or an ack that met a failover, and how long it waits
# between tries (a master election takes a few seconds).
SHARED_RETRIES_MAX = 40
SHARED_RETRY_WAIT_S = 0.25
# How long one pull waits on the server for an event.
PULL_WAIT_MS_DEFAULT = 1_000
# The errors of a call that may be retried: the master moved or the answer was lost.
RETRIED = (Unavailable, Indeterminate, DeadlineExceeded)


def retried(error: SquallError, *, unknown: bool) -> bool:
    """Whether a pull or ack may be sent again after `error`. An UNKNOWN answer (the
    gateway's "an earlier attempt may have been applied") is retried for calls that are
    safe to repeat: an ack repeated by the consumer that made it answers ok."""
    if isinstance(error, RETRIED):
        return True
    return unknown and error.code == grpc.StatusCode.UNKNOWN


@dataclasses.dataclass(frozen=True)
class SharedSettings:
    """A shared subscription's rules (CreateSharedSubscription)."""

    ack_deadline_ms: int = 30_000
    max_deliveries: int = 5
    dead_letter_topic: str = ""
    exclusive: bool = False  # one consumer at a time, in offset order
    exclusive_takeover_ms: int = 0  # a silent holder's grace (0: ack_deadline_ms)


def create_request(
    topic: str, name: str, settings: SharedSettings
) -> broker_pb2.CreateSharedSubscriptionRequest:
    """The CreateSharedSubscriptionRequest; ValueError names a bad setting."""
    if settings.max_deliveries < 1:
        raise ValueError(f"max_deliveries must be >= 1, not {settings.max_deliveries}")
    if settings.ack_deadline_ms < 1:
        raise ValueError(f"ack_deadline_ms must be >= 1, not {settings.ack_deadline_ms}")
    return broker_pb2.CreateSharedSubscriptionRequest(
        topic=topic,
        subscription=name,
        ack_deadline_ms=settings.ack_deadline_ms,
        max_deliveries=settings.max_deliveries,
        dead_letter_topic=settings.dead_letter_topic,
        start=broker_pb2.START_POSITION_EARLIEST,
        exclusive=settings.exclusive,
        exclusive_takeover_ms=settings.exclusive_takeover_ms,
    )


def new_consumer_id() -> str:
    """A consumer id unique to this process and consumer."""
    return f"consumer-{uuid.uuid4().hex[:12]}"


@dataclasses.dataclass(frozen=True)
class SharedMessage:
    """One leased event of a shared subscription: ack or nack it."""

    message: Message
    delivery_attempt: int  # 1 for the first delivery
    lease_epoch: int
    deadline_ms: int  # the master's wall clock when the lease ends
    _settle: Callable[[SharedMessage, bool, int, str], Any] = dataclasses.field(
        repr=False, compare=False
    )

    @property
    def offset(self) -> int:
        """The event's offset."""
        return self.message.offset

    @property
    def payload(self) -> bytes:
        """The event's payload."""
        return self.message.payload

    def ack(self) -> Any:
        """Acknowledges it (in the asyncio library: a coroutine)."""
        return self._settle(self, True, 0, "")

    def nack(self, delay_ms: int = 0, error: str = "") -> Any:
        """Gives it back: delivered again after delay_ms, or dead-lettered once it failed
        max_deliveries times; `error` becomes its last error."""
        return self._settle(self, False, delay_ms, error)


def shared_messages(
    response: broker_pb2.PullResponse,
    settle: Callable[[SharedMessage, bool, int, str], Any],
) -> list[SharedMessage]:
    """The leased events of a PullResponse, each settled through `settle`."""
    messages = messages_from_events(m.event for m in response.messages)
    return [
        SharedMessage(message, pb.delivery_attempt, pb.lease_epoch, pb.deadline_ms, settle)
        for message, pb in zip(messages, response.messages, strict=True)
    ]


def settle_request(
    topic: str,
    name: str,
    consumer_id: str,
    message: SharedMessage,
    ack: bool,
    delay_ms: int,
    error: str,
) -> broker_pb2.AckMessagesRequest | broker_pb2.NackRequest:
    """The AckMessagesRequest or NackRequest settling one message."""
    if ack:
        return broker_pb2.AckMessagesRequest(
            topic=topic,
            subscription=name,
            consumer_id=consumer_id,
            offsets=[message.offset],
            lease_epoch=message.lease_epoch,
        )
    if delay_ms < 0:
        raise ValueError(f"a nack's delay must be >= 0 ms, not {delay_ms}")
    return broker_pb2.NackRequest(
        topic=topic,
        subscription=name,
        consumer_id=consumer_id,
        offsets=[message.offset],
        lease_epoch=message.lease_epoch,
        delay_ms=delay_ms,
        error=error,
    )


class SharedConsumer:
    """Iterates the leased events of one shared subscription (sync library)."""

    def __init__(
        self,
        subscriber_stub: Any,
        call: Callable[[Any, Any], Any],
        topic: str,
        name: str,
        *,
        consumer_id: str | None = None,
        max_messages: int = 10,
        wait_ms: int = PULL_WAIT_MS_DEFAULT,
    ) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, not {max_messages}")
        self._stub = subscriber_stub
        self._call = call
        self.topic = topic
        self.name = name
        self.consumer_id = consumer_id or new_consumer_id()
        self._max = max_messages
        self._wait_ms = wait_ms
        self._closed = threading.Event()

    def close(self) -> None:
        """Stops the iteration after the current pull."""
        self._closed.set()

    def __enter__(self) -> SharedConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retrying(self, method: Any, request: Any, *, unknown: bool = True) -> Any:
        for attempt in range(SHARED_RETRIES_MAX):
            try:
                return self._call(method, request)
            except SquallError as exc:
                last = attempt == SHARED_RETRIES_MAX - 1 or self._closed.is_set()
                if last or not retried(exc, unknown=unknown):
                    raise
                time.sleep(SHARED_RETRY_WAIT_S)
        raise AssertionError("unreachable")

    def pull(
        self, max_messages: int | None = None, wait_ms: int | None = None
    ) -> list[SharedMessage]:
        """One pull: up to max_messages leased events (empty when none came in wait_ms)."""
        request = broker_pb2.PullRequest(
            topic=self.topic,
            subscription=self.name,
            consumer_id=self.consumer_id,
            max_messages=max_messages or self._max,
            wait_ms=self._wait_ms if wait_ms is None else wait_ms,
        )
        return shared_messages(self._retrying(self._stub.Pull, request), self._settle)

    def _settle(self, message: SharedMessage, ack: bool, delay_ms: int, error: str) -> None:
        request = settle_request(
            self.topic, self.name, self.consumer_id, message, ack, delay_ms, error
        )
        # A nack is not repeated after an UNKNOWN answer: it would count a failure twice.
        self._retrying(self._stub.AckMessages if ack else self._stub.Nack, request, unknown=ack)

    def __iter__(self) -> Iterator[SharedMessage]:
        while not self._closed.is_set():
            yield from self.pull()
