"""Bearer tokens on the wire: where a caller finds one, what a valid one is, and the
`authorization` metadata that carries it (docs/auth.md).

The library takes the token from `squall.connect(token=...)`, else from the `SQUALL_TOKEN`
environment variable, else from the file `SQUALL_TOKEN_FILE` names; none of these: no
token is sent. The gateway (calling the replicas) and the CLI use the same rules. No grpc
here: the channel wrapper that adds the metadata to every call is `squall.with_token`.
"""

from __future__ import annotations

import os
import re

TOKEN_ENV = "SQUALL_TOKEN"
TOKEN_FILE_ENV = "SQUALL_TOKEN_FILE"
TOKEN_MAX_CHARS = 4096
# The metadata key and scheme a token travels under (`authorization: Bearer <token>`).
AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "
# Printable ASCII without spaces: what an HTTP/2 header value carries unchanged.
_TOKEN_RE = re.compile(r"[!-~]+")


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
    return ((AUTHORIZATION_KEY, f"{BEARER_PREFIX}{token}"),) if token else ()
