"""Requests that do not parse as their message type are refused as INVALID_ARGUMENT.

grpcio parses a request before the handler runs, and a request that does not parse
(random bytes from a hostile or broken client) raises inside grpcio, which answers
``UNKNOWN "Unexpected <class 'DecodeError'>..."`` and logs a traceback. UNKNOWN means "may
or may not have happened" to Squall's clients and gateway, so they would retry a request
that can never succeed. ``DecodeGuard`` takes the parsing over: the handler gets bytes,
parses them itself and ends the call with INVALID_ARGUMENT naming the method when they do
not parse. A client stream ends at the message that does not parse, as if the client had
half-closed there (the messages before it are served as usual), and the call then ends with
that INVALID_ARGUMENT unless the servicer ended it otherwise first.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

if TYPE_CHECKING:  # grpc-stubs' generics, not subscriptable at run time
    _Handler = grpc.RpcMethodHandler[Any, Any]
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor


def _refusal(method: str, exc: Exception) -> str:
    return f"{method}: the request does not parse as its message type ({exc})"


class DecodeGuard(_ServerInterceptor):
    """Parses each request in the handler, refusing one that does not parse."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        """The handler with its request parsing moved inside it (bytes handlers untouched)."""
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guarded(handler, handler_call_details.method, handler.request_deserializer)


def _guarded(handler: _Handler, method: str, parse: Callable[[bytes], Any]) -> _Handler:
    async def decoded(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return parse(raw)
        except (DecodeError, ValueError, RuntimeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, exc))

    async def requests(
        raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        # The stream ends at a message that does not parse, with the call's status set:
        # aborting here would happen in whatever task the servicer reads its stream from.
        async for raw in raw_requests:
            try:
                request = parse(raw)
            except (DecodeError, ValueError, RuntimeError) as exc:
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(_refusal(method, exc))
                return
            yield request

    serializer = handler.response_serializer
    if handler.response_streaming:
        behaviour: Any = (
            handler.stream_stream if handler.request_streaming else handler.unary_stream
        )

        async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
            if handler.request_streaming:
                argument = requests(request, context)
            else:
                argument = await decoded(request, context)
            result = behaviour(argument, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            else:  # a handler that writes with context.write()
                await result

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return make(streaming, request_deserializer=None, response_serializer=serializer)

    unary: Any = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def single(request: Any, context: Any) -> Any:
        if handler.request_streaming:
            return await unary(requests(request, context), context)
        return await unary(await decoded(request, context), context)

    make_single = (
        grpc.stream_unary_rpc_method_handler
        if handler.request_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make_single(single, request_deserializer=None, response_serializer=serializer)
