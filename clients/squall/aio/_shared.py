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
    PULL_WAIT_MS_DEFAULT,
    SHARED_RETRIES_MAX,
    SHARED_RETRY_WAIT_S,
    SharedMessage,
    new_consumer_id,
    retried,
    settle_request,
    shared_messages,
)
from squall.v1 import broker_pb2


class AsyncSharedConsumer:
    """Iterates the leased events of one shared subscription (asyncio library)."""

    def __init__(
        self,
        subscriber_stub: Any,
        call: Callable[[Any, Any], Awaitable[Any]],
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
        self._closed = False

    def close(self) -> None:
        """Stops the iteration after the current pull."""
        self._closed = True

    async def __aenter__(self) -> AsyncSharedConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _retrying(self, method: Any, request: Any, *, unknown: bool = True) -> Any:
        for attempt in range(SHARED_RETRIES_MAX):
            try:
                return await self._call(method, request)
            except SquallError as exc:
                last = attempt == SHARED_RETRIES_MAX - 1 or self._closed
                if last or not retried(exc, unknown=unknown):
                    raise
                await asyncio.sleep(SHARED_RETRY_WAIT_S)
        raise AssertionError("unreachable")

    async def pull(
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
        response = await self._retrying(self._stub.Pull, request)
        return shared_messages(response, self._settle)

    async def _settle(self, message: SharedMessage, ack: bool, delay_ms: int, error: str) -> None:
        request = settle_request(
            self.topic, self.name, self.consumer_id, message, ack, delay_ms, error
        )
        # A nack is not repeated after an UNKNOWN answer: it would count a failure twice.
        method = self._stub.AckMessages if ack else self._stub.Nack
        await self._retrying(method, request, unknown=ack)

    async def __aiter__(self) -> AsyncIterator[SharedMessage]:
        while not self._closed:
            for message in await self.pull():
                yield message
