"""Shared subscriptions (competing consumers) in the asyncio library.

The same calls and rules as the sync `squall.SharedConsumer` (clients/squall/_shared.py):
`async for message in consumer` yields leased events; `await message.ack()` or
`await message.nack(delay_ms, error)` settles each one, in any order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from squall._errors import SquallError
from squall._shared import (
    MAX_OUTSTANDING_DEFAULT,
    PULL_WAIT_MS_DEFAULT,
    SHARED_RETRIES_MAX,
    SHARED_RETRY_WAIT_S,
    ConsumerSettings,
    SharedMessage,
    extend_request,
    pull_request,
    retried,
    settle_request,
    shared_messages,
)
from squall.wire.long_poll import pull_wait_s


class AsyncSharedConsumer(ConsumerSettings):
    """Iterates the leased events of one shared subscription (asyncio library)."""

    def __init__(
        self,
        subscriber_stub: Any,
        call: Callable[..., Awaitable[Any]],
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
        self._closed = False

    def close(self) -> None:
        """Stops the iteration after the current pull."""
        self._closed = True

    async def __aenter__(self) -> AsyncSharedConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _retrying(
        self, method: Any, request: Any, *, unknown: bool = True, wait_s: float = 0.0
    ) -> Any:
        for attempt in range(SHARED_RETRIES_MAX):
            try:
                return await self._call(method, request, wait_s)
            except SquallError as exc:
                last = attempt == SHARED_RETRIES_MAX - 1 or self._closed
                if last or not retried(exc, unknown=unknown):
                    raise
                await asyncio.sleep(SHARED_RETRY_WAIT_S)
        raise AssertionError("unreachable")

    async def pull(
        self, max_messages: int | None = None, wait_ms: int | None = None
    ) -> list[SharedMessage]:
        """One pull (as `squall.SharedConsumer.pull`)."""
        room = self._outstanding.room()
        wait = self._wait_ms if wait_ms is None else wait_ms
        if room < 0:  # the byte budget is spent: settle something first
            await asyncio.sleep(min(wait, PULL_WAIT_MS_DEFAULT) / 1000)
            return []
        request = pull_request(
            self, max_messages or self._max, wait, self._max_outstanding, max(room, 0)
        )
        response = await self._retrying(self._stub.Pull, request, wait_s=pull_wait_s(wait))
        messages = shared_messages(response, self._settle, self._extend)
        self._outstanding.add(messages)
        return messages

    async def _settle(self, message: SharedMessage, ack: bool, delay_ms: int, error: str) -> None:
        request = settle_request(
            self.topic, self.name, self.consumer_id, message, ack, delay_ms, error
        )
        # A nack is not repeated after an UNKNOWN answer: it would count a failure twice.
        method = self._stub.AckMessages if ack else self._stub.Nack
        try:
            await self._retrying(method, request, unknown=ack)
        finally:
            self._outstanding.settled(message.offset)

    async def _extend(self, message: SharedMessage, extension_ms: int) -> int:
        request = extend_request(self.topic, self.name, self.consumer_id, message, extension_ms)
        deadline = int((await self._retrying(self._stub.ExtendDeadline, request)).deadline_ms)
        self._outstanding.extended(message.offset, deadline)
        return deadline

    async def __aiter__(self) -> AsyncIterator[SharedMessage]:
        while not self._closed:
            for message in await self.pull():
                yield message
