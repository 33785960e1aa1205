"""Forwards the public broker API to the current master, byte for byte.

The gateway does not parse what it forwards: a generic handler passes serialized
requests and responses through, so forwarding costs one hop and no protobuf work, and
a status from the replica (code, message, trailing metadata) reaches the app unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.common.grpc_server import Context
from services.gateway.master import MasterTracker, NoMasterError, pairs
from squall.v1 import broker_pb2

log = logging.getLogger("squall.gateway")

# Metadata the gRPC runtime owns; everything else (trace context, app headers) is passed on.
_RESERVED_PREFIXES = (":", "grpc-")
_RESERVED_KEYS = {"user-agent", "content-type", "te", "host"}

FORWARDED_SERVICES = ("TopicManager", "Publisher", "Subscriber")


def _forwardable(context: Context) -> tuple[tuple[str, str | bytes], ...]:
    return tuple(
        (key, value)
        for key, value in pairs(context.invocation_metadata())
        if key not in _RESERVED_KEYS and not key.startswith(_RESERVED_PREFIXES)
    )


async def _relay_error(context: Context, error: grpc.aio.AioRpcError) -> None:
    trailing = error.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(tuple(pairs(trailing)))
    await context.abort(error.code(), error.details() or "")


class Forwarder:
    """Builds the generic handlers that forward every broker method to the master."""

    def __init__(self, masters: MasterTracker, timeout_s: float) -> None:
        self._masters = masters
        self._timeout_s = timeout_s

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        """One generic handler per forwarded service, covering all of its methods."""
        result = []
        for service_name in FORWARDED_SERVICES:
            service = broker_pb2.DESCRIPTOR.services_by_name[service_name]
            methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                methods[method.name] = self._handler(
                    path, method.client_streaming, method.server_streaming
                )
            result.append(grpc.method_handlers_generic_handler(service.full_name, methods))
        return result

    def _handler(
        self, path: str, client_stream: bool, server_stream: bool
    ) -> grpc.RpcMethodHandler[Any, Any]:
        make: Callable[..., grpc.RpcMethodHandler[Any, Any]]
        if client_stream and server_stream:
            make, behaviour = grpc.stream_stream_rpc_method_handler, self._stream_stream(path)
        elif server_stream:
            make, behaviour = grpc.unary_stream_rpc_method_handler, self._unary_stream(path)
        elif client_stream:
            raise ValueError(f"{path}: client-streaming methods are not forwarded")
        else:
            make, behaviour = grpc.unary_unary_rpc_method_handler, self._unary_unary(path)
        return make(behaviour)

    async def _master(self, context: Context) -> grpc.aio.Channel:
        try:
            return await self._masters.channel()
        except NoMasterError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise

    def _unary_unary(self, path: str) -> Callable[..., Any]:
        async def forward(request: bytes, context: Context) -> bytes:
            channel = await self._master(context)
            try:
                response: bytes = await channel.unary_unary(path, None, None)(
                    request, timeout=self._timeout_s, metadata=_forwardable(context)
                )
                return response
            except grpc.aio.AioRpcError as error:
                self._masters.observe_error(error)
                await _relay_error(context, error)
                raise

        return forward

    def _unary_stream(self, path: str) -> Callable[..., Any]:
        async def forward(request: bytes, context: Context) -> AsyncIterator[bytes]:
            channel = await self._master(context)
            call = channel.unary_stream(path, None, None)(request, metadata=_forwardable(context))
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as error:
                self._masters.observe_error(error)
                await _relay_error(context, error)
            finally:
                call.cancel()

        return forward

    def _stream_stream(self, path: str) -> Callable[..., Any]:
        async def forward(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            channel = await self._master(context)
            call = channel.stream_stream(path, None, None)(requests, metadata=_forwardable(context))
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as error:
                self._masters.observe_error(error)
                await _relay_error(context, error)
            finally:
                call.cancel()

        return forward
