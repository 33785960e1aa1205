"""The asyncio subscription: one Subscribe stream read as an async iterator, with acks.

Same semantics as the threaded `squall.Subscription` (see `squall._subscriber`): iterate
it with `async for` for `Message`s, or `batches()` for the lists the server sent. A broken
stream (UNAVAILABLE, UNKNOWN, INTERNAL, CANCELLED not asked for, DEADLINE_EXCEEDED) is
opened again through the gateway after a jittered backoff, within the client's retry time
budget per outage, from the durable cursor or the last offset delivered + 1; with
`dedupe=True` (the default) offsets at or below the last one delivered are dropped. The
decisions (`drop_duplicates`, `reconnect_wait_s`, `resume_request`, `ack_request`,
`moved_by_seek`) are the threaded subscription's own, and so is the handling of a seek: the
stream a seek ended (ABORTED) is opened again at once from the new cursor, and acks name
the seek generation their message was delivered under.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from squall._errors import from_rpc_error, rpc_status
from squall._subscriber import (
    ack_request,
    drop_duplicates,
    moved_by_seek,
    reconnect_wait_s,
    resume_request,
)
from squall._types import Message, messages_from_pb
from squall.v1 import broker_pb2
from squall.wire import stages as _stages
from squall.wire.retry import RetryPolicy

log = logging.getLogger("squall")


class Subscription:
    """A stream of one topic's messages: `async for` it, `await ack(...)`, `await close()`."""

    def __init__(
        self,
        stub: Any,
        request: broker_pb2.SubscribeRequest,
        *,
        timeout_s: float,
        retry: RetryPolicy | None = None,
        dedupe: bool = True,
        on_close: Callable[[Subscription], None] | None = None,
    ) -> None:
        self._stub = stub
        self._request = request
        self._timeout_s = timeout_s
        self._retry = retry if retry is not None else RetryPolicy()
        self._retry.validate()
        self._dedupe = dedupe
        self._on_close = on_close
        self._closed = False
        # Wakes a reconnect backoff early when the app closes the subscription.
        self._closing = asyncio.Event()
        self._last_offset = -1
        self._reconnects = 0
        self._duplicates_dropped = 0
        # No deadline: a following subscription lives until the app closes it.
        self._call: Any = stub.Subscribe(request)
        self._current: list[Message] = []
        self._position = 0
        self._failures = 0
        self._outage_started = 0.0
        self._ended = False
        # The seek generation of the current stream (None until its first response).
        self._generation: int | None = None

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

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Message:
        # The bound is the server's: each pass takes one more response off the stream.
        while self._position >= len(self._current):
            batch = await self._next_batch()
            if batch is None:
                raise StopAsyncIteration
            self._current, self._position = batch, 0
        message = self._current[self._position]
        self._position += 1
        return message

    async def batches(self) -> AsyncIterator[list[Message]]:
        """The messages grouped as the server sent them (do not mix with plain iteration)."""
        while (batch := await self._next_batch()) is not None:
            yield batch

    async def _next_batch(self) -> list[Message] | None:
        """The server's next batch (None at the end), across reconnects, deduplicated."""
        # Bounded: each pass either reads a response (and resets the failures) or spends
        # part of the policy's time budget.
        while not self._closed and not self._ended:
            try:
                response = await self._call.read()
            except grpc.aio.AioRpcError as err:
                if not await self._reconnect(err):
                    return None
                continue
            except asyncio.CancelledError:
                if self._closed:
                    return None  # close() cancelled the call
                raise
            if response is grpc.aio.EOF:  # type: ignore[attr-defined]
                self._ended = True
                return None
            self._failures = 0
            self._generation = response.seek_generation
            batch = messages_from_pb(response)
            if _stages.ENABLED and batch:
                _stages.mark("c.d", f"off/{self.topic}/{batch[0].offset}")
            if self._dedupe:
                batch, dropped = drop_duplicates(batch, self._last_offset)
                self._duplicates_dropped += dropped
            if batch:
                self._last_offset = max(self._last_offset, batch[-1].offset)
            return batch
        return None

    async def _reconnect(self, err: grpc.aio.AioRpcError) -> bool:
        """Opens the stream again after a backoff; False if closed meanwhile. Raises the
        SquallError when the code is definite or the budget is spent."""
        if self._closed:
            return False
        code, details = rpc_status(err)
        if moved_by_seek(self._request, code):
            # Not an outage: start again at once from the cursor the seek set.
            log.info("subscription %s on %s: %s", self.name, self.topic, details)
            self._last_offset = -1
            self._generation = None
            self._call = self._stub.Subscribe(self._request)
            self._reconnects += 1
            return True
        if self._failures == 0:
            self._outage_started = time.monotonic()
        self._failures += 1
        elapsed_ms = (time.monotonic() - self._outage_started) * 1000
        wait_s = reconnect_wait_s(self._retry, code, self._failures, elapsed_ms)
        if wait_s is None:
            raise from_rpc_error(err) from None
        log.info(
            "subscription %s on %s: stream ended (%s: %s); reconnecting in %.3f s from offset %d",
            self.name or "(non-durable)",
            self.topic,
            code.name,
            details,
            wait_s,
            self._last_offset + 1,
        )
        try:
            async with asyncio.timeout(wait_s):
                await self._closing.wait()
            return False  # closed while waiting
        except TimeoutError:
            pass
        if self._closed:
            return False
        self._call = self._stub.Subscribe(resume_request(self._request, self._last_offset))
        self._reconnects += 1
        return True

    async def ack(self, message_or_offset: Message | int) -> int:
        """Moves the durable cursor past this message (and all before it); returns the cursor.

        `Aborted` when a seek moved the subscription after the message was delivered.
        ValueError for a non-durable subscription, which has no cursor to move.
        """
        request = ack_request(self._request, message_or_offset, self._generation)
        try:
            response = await self._stub.Ack(request, timeout=self._timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return int(response.cursor)

    async def close(self) -> None:
        """Cancels the stream; iteration then ends quietly."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._call.cancel()
        if self._on_close is not None:
            self._on_close(self)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"aio.Subscription(topic={self.topic!r}, name={self.name!r})"
