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
from typing import Any, Protocol

import grpc

from squall._errors import DeadlineExceeded, Indeterminate, SquallError, Unavailable
from squall._types import Message, messages_from_events
from squall.v1 import broker_pb2
from squall.wire.long_poll import pull_wait_s

# How often a consumer retries a pull or an ack that met a failover, and how long it waits
# between tries (a master election takes a few seconds).
SHARED_RETRIES_MAX = 40
SHARED_RETRY_WAIT_S = 0.25
# How long one pull waits on the server for an event.
PULL_WAIT_MS_DEFAULT = 1_000
# Events a consumer holds at once unless it says otherwise (its flow control).
MAX_OUTSTANDING_DEFAULT = 100
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


class Outstanding:
    """What a consumer holds (unsettled, lease not passed): its byte budget for a pull."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: dict[int, tuple[int, int]] = {}  # offset -> (bytes, lease deadline ms)
        self._lock = threading.Lock()

    def room(self) -> int:
        """Bytes a pull may bring: 0 means no limit, -1 that the budget is spent."""
        if not self.max_bytes:
            return 0
        now_ms = int(time.time() * 1000)
        with self._lock:
            # A lapsed lease is the master's again: it no longer counts here.
            for offset in [o for o, (_, d) in self._held.items() if d <= now_ms]:
                del self._held[offset]
            used = sum(size for size, _ in self._held.values())
        return self.max_bytes - used if used < self.max_bytes else -1

    def add(self, messages: list[SharedMessage]) -> None:
        """Counts pulled messages."""
        with self._lock:
            for m in messages:
                size = len(m.message.key) + len(m.payload)
                self._held[m.offset] = (size, m.deadline_ms)

    def extended(self, offset: int, deadline_ms: int) -> None:
        """A message's lease now ends later."""
        with self._lock:
            if offset in self._held:
                self._held[offset] = (self._held[offset][0], deadline_ms)

    def settled(self, offset: int) -> None:
        """Stops counting a message (acked, nacked, or refused as not ours)."""
        with self._lock:
            self._held.pop(offset, None)


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
    _extend: Callable[[SharedMessage, int], Any] | None = dataclasses.field(
        default=None, repr=False, compare=False
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

    def extend(self, extension_ms: int) -> Any:
        """Pushes its ack deadline back to now + extension_ms (long work); FailedPrecondition
        once it is no longer held (its deadline passed)."""
        if self._extend is None:
            raise ValueError("this message cannot be extended")
        return self._extend(self, extension_ms)

    def nack(self, delay_ms: int = 0, error: str = "") -> Any:
        """Gives it back: delivered again after delay_ms, or dead-lettered once it failed
        max_deliveries times; `error` becomes its last error."""
        return self._settle(self, False, delay_ms, error)


def shared_messages(
    response: broker_pb2.PullResponse,
    settle: Callable[[SharedMessage, bool, int, str], Any],
    extend: Callable[[SharedMessage, int], Any] | None = None,
) -> list[SharedMessage]:
    """The leased events of a PullResponse, each settled through `settle`."""
    messages = messages_from_events(m.event for m in response.messages)
    return [
        SharedMessage(message, pb.delivery_attempt, pb.lease_epoch, pb.deadline_ms, settle, extend)
        for message, pb in zip(messages, response.messages, strict=True)
    ]


def extend_request(
    topic: str, name: str, consumer_id: str, message: SharedMessage, extension_ms: int
) -> broker_pb2.ExtendDeadlineRequest:
    """The ExtendDeadlineRequest of one message."""
    if extension_ms < 1:
        raise ValueError(f"a deadline extension must be >= 1 ms, not {extension_ms}")
    return broker_pb2.ExtendDeadlineRequest(
        topic=topic,
        subscription=name,
        consumer_id=consumer_id,
        offsets=[message.offset],
        lease_epoch=message.lease_epoch,
        extension_ms=extension_ms,
    )


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


def check_limits(max_messages: int, max_outstanding: int, max_outstanding_bytes: int) -> None:
    """ValueError naming a bad flow-control setting."""
    if max_messages < 1:
        raise ValueError(f"max_messages must be >= 1, not {max_messages}")
    if max_outstanding < 1:
        raise ValueError(f"max_outstanding must be >= 1, not {max_outstanding}")
    if max_outstanding_bytes < 0:
        raise ValueError(f"max_outstanding_bytes must be >= 0, not {max_outstanding_bytes}")


class _Named(Protocol):
    topic: str
    name: str
    consumer_id: str


def pull_request(
    consumer: _Named, max_messages: int, wait_ms: int, max_outstanding: int, max_bytes: int
) -> broker_pb2.PullRequest:
    """The PullRequest of one pull."""
    return broker_pb2.PullRequest(
        topic=consumer.topic,
        subscription=consumer.name,
        consumer_id=consumer.consumer_id,
        max_messages=max_messages,
        wait_ms=wait_ms,
        max_outstanding=max_outstanding,
        max_bytes=max_bytes,
    )


class ConsumerSettings:
    """What a shared subscription's consumer is, in both libraries: where it pulls from,
    as whom, how many at a time, and its flow-control limits (checked here)."""

    def __init__(
        self,
        topic: str,
        name: str,
        *,
        consumer_id: str | None,
        max_messages: int,
        wait_ms: int,
        max_outstanding: int,
        max_outstanding_bytes: int,
    ) -> None:
        check_limits(max_messages, max_outstanding, max_outstanding_bytes)
        self._max_outstanding = max_outstanding
        self._outstanding = Outstanding(max_outstanding_bytes)
        self.topic = topic
        self.name = name
        self.consumer_id = consumer_id or new_consumer_id()
        self._max = max_messages
        self._wait_ms = wait_ms


class SharedConsumer(ConsumerSettings):
    """Iterates the leased events of one shared subscription (sync library)."""

    def __init__(
        self,
        subscriber_stub: Any,
        call: Callable[..., Any],
        topic: str,
        name: str,
        *,
        consumer_id: str | None = None,
        max_messages: int = 10,
        wait_ms: int = PULL_WAIT_MS_DEFAULT,
        max_outstanding: int = MAX_OUTSTANDING_DEFAULT,
        max_outstanding_bytes: int = 0,
    ) -> None:
        super().__init__(
            topic,
            name,
            consumer_id=consumer_id,
            max_messages=max_messages,
            wait_ms=wait_ms,
            max_outstanding=max_outstanding,
            max_outstanding_bytes=max_outstanding_bytes,
        )
        self._stub = subscriber_stub
        self._call = call
        self._closed = threading.Event()

    def close(self) -> None:
        """Stops the iteration after the current pull."""
        self._closed.set()

    def __enter__(self) -> SharedConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retrying(
        self, method: Any, request: Any, *, unknown: bool = True, wait_s: float = 0.0
    ) -> Any:
        for attempt in range(SHARED_RETRIES_MAX):
            try:
                return self._call(method, request, wait_s)
            except SquallError as exc:
                last = attempt == SHARED_RETRIES_MAX - 1 or self._closed.is_set()
                if last or not retried(exc, unknown=unknown):
                    raise
                time.sleep(SHARED_RETRY_WAIT_S)
        raise AssertionError("unreachable")

    def pull(
        self, max_messages: int | None = None, wait_ms: int | None = None
    ) -> list[SharedMessage]:
        """One pull: up to max_messages leased events (empty when none came in wait_ms),
        within max_outstanding events and max_outstanding_bytes held at once."""
        room = self._outstanding.room()
        wait = self._wait_ms if wait_ms is None else wait_ms
        if room < 0:  # the byte budget is spent: settle something first
            time.sleep(min(wait, PULL_WAIT_MS_DEFAULT) / 1000)
            return []
        request = pull_request(
            self, max_messages or self._max, wait, self._max_outstanding, max(room, 0)
        )
        response = self._retrying(self._stub.Pull, request, wait_s=pull_wait_s(wait))
        messages = shared_messages(response, self._settle, self._extend)
        self._outstanding.add(messages)
        return messages

    def _settle(self, message: SharedMessage, ack: bool, delay_ms: int, error: str) -> None:
        request = settle_request(
            self.topic, self.name, self.consumer_id, message, ack, delay_ms, error
        )
        try:
            # A nack is not repeated after an UNKNOWN answer: it would count a failure twice.
            method = self._stub.AckMessages if ack else self._stub.Nack
            self._retrying(method, request, unknown=ack)
        finally:
            self._outstanding.settled(message.offset)

    def _extend(self, message: SharedMessage, extension_ms: int) -> int:
        request = extend_request(self.topic, self.name, self.consumer_id, message, extension_ms)
        deadline = int(self._retrying(self._stub.ExtendDeadline, request).deadline_ms)
        self._outstanding.extended(message.offset, deadline)
        return deadline

    def __iter__(self) -> Iterator[SharedMessage]:
        while not self._closed.is_set():
            yield from self.pull()
