"""The channel wrapper that sends a bearer token on every call (`squall.with_token`).

Where the token comes from and the metadata that carries it are `squall.wire.auth`, shared
with the services; this module holds only the grpc part: an interceptor that adds that
metadata to every call, including the calls of publisher proxies straight to the replicas
(docs/auth.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from squall.wire.auth import AUTHORIZATION_KEY, token_metadata

if TYPE_CHECKING:
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnary = grpc.StreamUnaryClientInterceptor[Any, Any]
    _StreamStream = grpc.StreamStreamClientInterceptor[Any, Any]
else:
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.UnaryStreamClientInterceptor
    _StreamUnary = grpc.StreamUnaryClientInterceptor
    _StreamStream = grpc.StreamStreamClientInterceptor


class _Details(grpc.ClientCallDetails):
    def __init__(
        self, details: grpc.ClientCallDetails, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _TokenInterceptor(_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream):
    """Adds the authorization metadata to every call (replacing one the caller set)."""

    def __init__(self, token: str) -> None:
        self._pairs = token_metadata(token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        kept = [(k, v) for k, v in (details.metadata or ()) if k != AUTHORIZATION_KEY]
        return _Details(details, (*kept, *self._pairs))

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]
    ) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]
    ) -> Any:
        return continuation(self._details(details), requests)


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """The channel, sending the token on every call (unchanged without a token).

    For apps and tools that call the generated stubs (`squall.v1`) on a channel of their
    own; `squall.connect(token=...)` does this itself.
    """
    if not token:
        return channel
    return grpc.intercept_channel(channel, _TokenInterceptor(token))
