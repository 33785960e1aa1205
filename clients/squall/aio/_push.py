"""The asyncio push endpoint: serves squall.v1.PushSubscriber on a `grpc.aio` server.

Same contract as the threaded `squall.PushEndpoint` (see `squall._push`): one callback per
subscriber id, here a coroutine function awaited per delivered batch on the app's event
loop; returning acknowledges the batch (the master moves the durable cursor), raising
fails the delivery (INTERNAL, counted against `retry_count`); an id the endpoint does not
host is answered NOT_FOUND, which removes that subscription.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from squall._push import (
    ENDPOINT_MESSAGE_BYTES_MAX,
    PushDelivery,
    callback_failed,
    delivery_from_pb,
    endpoint_bind_options,
    not_hosted,
    result_pb,
)
from squall._tls import TlsOptions
from squall.v1 import push_pb2, push_pb2_grpc

AsyncDeliveryCallback = Callable[[PushDelivery], Awaitable[None]]


class _Servicer(push_pb2_grpc.PushSubscriberServicer):
    def __init__(self, endpoint: PushEndpoint) -> None:
        self._endpoint = endpoint

    async def _outcome(self, request: push_pb2.PushDeliverRequest) -> tuple[grpc.StatusCode, str]:
        """Hands one request to its callback: the status Deliver answers with."""
        callback = self._endpoint.callback(request.subscriber_id)
        if callback is None:
            return grpc.StatusCode.NOT_FOUND, not_hosted(request)
        if request.probe:
            return grpc.StatusCode.OK, ""
        try:
            await callback(delivery_from_pb(request))
        except Exception as exc:  # the app's failure: the master retries per retry_count
            return callback_failed(request, exc)
        return grpc.StatusCode.OK, ""

    async def Deliver(
        self, request: push_pb2.PushDeliverRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> push_pb2.PushDeliverResponse:
        code, details = await self._outcome(request)
        if code != grpc.StatusCode.OK:
            await context.abort(code, details)
        return push_pb2.PushDeliverResponse()

    async def DeliverStream(
        self,
        request_iterator: AsyncIterator[push_pb2.PushDeliverRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[push_pb2.PushDeliverResult]:
        endpoint, handler = self._endpoint, asyncio.current_task()
        requests = aiter(request_iterator)
        while endpoint._wait_on_stream(handler):
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # close() ending a stream with no delivery in progress: returning ends the
                # call (grpc.aio leaves a cancelled handler's call open until shutdown).
                if not endpoint._closed or handler is None:
                    raise
                handler.uncancel()
                return
            finally:
                endpoint._stream_busy(handler)
            yield result_pb(*await self._outcome(request))


class PushEndpoint:
    """Serves squall.v1.PushSubscriber on this event loop; one coroutine callback per id.

    `bind`, `advertise`, `max_message_bytes` and `tls` as for `squall.PushEndpoint`. The
    port is bound here (so `address` is known at once); `async with` starts and stops
    it, or call `await start()` and `await close()`.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        *,
        advertise: str | None = None,
        max_message_bytes: int = ENDPOINT_MESSAGE_BYTES_MAX,
        tls: TlsOptions | None = None,
    ) -> None:
        host, options = endpoint_bind_options(bind, max_message_bytes)
        self._callbacks: dict[str, AsyncDeliveryCallback] = {}
        self._server = grpc.aio.server(options=options)
        push_pb2_grpc.add_PushSubscriberServicer_to_server(_Servicer(self), self._server)
        try:
            if tls is None:
                port = self._server.add_insecure_port(bind)
            else:
                port = self._server.add_secure_port(bind, tls.server_credentials())
        except RuntimeError as exc:  # grpc's "failed to bind"
            raise ValueError(f"cannot listen on {bind!r}: {exc}") from None
        if port == 0:
            raise ValueError(f"cannot listen on {bind!r}")
        self._address = advertise or f"{host}:{port}"
        self._started = False
        self._closed = False
        # The handlers of streams waiting for the master's next request, cancelled by
        # close(): a master keeps one open per subscriber, and left to the server's grace
        # each would hold close() for all of it, with no delivery in progress.
        self._waiting: set[asyncio.Task[Any] | None] = set()

    @property
    def address(self) -> str:
        """The host:port to give the cluster (subscribe_push does it for you)."""
        return self._address

    async def start(self) -> None:
        """Starts serving (once)."""
        if not self._started:
            self._started = True
            await self._server.start()

    def add(self, subscriber_id: str, callback: AsyncDeliveryCallback) -> None:
        """Hosts a subscriber id here: its deliveries go to callback (replacing any)."""
        if not subscriber_id:
            raise ValueError("subscriber_id must not be empty")
        self._callbacks[subscriber_id] = callback

    def remove(self, subscriber_id: str) -> bool:
        """Stops hosting a subscriber id; the master removes that subscription on its next
        delivery. Returns whether it was hosted."""
        return self._callbacks.pop(subscriber_id, None) is not None

    def callback(self, subscriber_id: str) -> AsyncDeliveryCallback | None:
        """The callback hosting a subscriber id here, or None."""
        return self._callbacks.get(subscriber_id)

    def _wait_on_stream(self, handler: asyncio.Task[Any] | None) -> bool:
        """A stream is about to wait for its next request: False once closed."""
        if self._closed:
            return False
        self._waiting.add(handler)
        return True

    def _stream_busy(self, handler: asyncio.Task[Any] | None) -> None:
        self._waiting.discard(handler)

    async def close(self, grace_s: float = 1.0) -> None:
        """Stops serving: deliveries in progress get grace_s to finish; delivery streams
        with none in progress end at once (the master opens a new one when it next
        delivers, to wherever the subscriber is hosted then)."""
        if self._closed:
            return
        self._closed = True
        waiting, self._waiting = self._waiting, set()
        for handler in waiting:
            if handler is not None:
                handler.cancel()
        await self._server.stop(grace_s)

    async def __aenter__(self) -> PushEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"aio.PushEndpoint({self._address!r})"
