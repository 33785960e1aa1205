"""Bearer tokens: where the library finds one, and the channel wrapper that sends it.

A token is sent as `authorization: Bearer <token>` metadata on every call, including the
calls of publisher proxies straight to the replicas (docs/auth.md). The library takes it
from `squall.connect(token=...)`, else from the `SQUALL_TOKEN` environment variable, else
from the file `SQUALL_TOKEN_FILE` names; none of these: no token is sent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

TOKEN_ENV = "SQUALL_TOKEN"
TOKEN_FILE_ENV = "SQUALL_TOKEN_FILE"
TOKEN_MAX_CHARS = 4096
# Printable ASCII without spaces: what an HTTP/2 header value carries unchanged.
_TOKEN_RE = re.compile(r"[!-~]+")

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


def check_token(token: str, source: str) -> str:
    """The token, or ValueError naming its source (never quoting the token)."""
    if not token:
        raise ValueError(f"the token from {source} is empty")
    if len(token) > TOKEN_MAX_CHARS:
        raise ValueError(f"the token from {source} is longer than {TOKEN_MAX_CHARS} characters")
    if not _TOKEN_RE.fullmatch(token):
        raise ValueError(
            f"the token from {source} holds a space or a character that is not printable ASCII"
        )
    return token


def read_token_file(path: str) -> str:
    """The token in a file (surrounding whitespace ignored); ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(TOKEN_MAX_CHARS + 2)
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or type(error).__name__
        raise ValueError(f"cannot read the token file {path}: {reason}") from None
    return check_token(text.strip(), f"the file {path}")


def resolve_token(token: str | None = None) -> str | None:
    """The token to send: the argument, else $SQUALL_TOKEN, else the $SQUALL_TOKEN_FILE file."""
    if token is not None:
        return check_token(token, "the token argument")
    from_env = os.environ.get(TOKEN_ENV)
    if from_env:
        return check_token(from_env.strip(), f"${TOKEN_ENV}")
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_token_file(path)
    return None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries the token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


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
        kept = [(k, v) for k, v in (details.metadata or ()) if k != "authorization"]
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
    """The channel, sending the token on every call (unchanged without a token)."""
    if not token:
        return channel
    return grpc.intercept_channel(channel, _TokenInterceptor(token))
