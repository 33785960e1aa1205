"""Tokens on the command line: `--token-file`, and `squall auth hash-token | new-token`.

Every command that calls a service sends the token of `--token-file FILE` (default: the
file $SQUALL_TOKEN_FILE names, or $SQUALL_TOKEN itself) as `authorization: Bearer`. A
token is never taken as a command-line argument: arguments show in `ps` and in shell
history. `squall auth new-token` prints a fresh random token and the SHA-256 line for the
[[auth.principals]] table; `squall auth hash-token` prints the hash of a token read from
stdin. See docs/auth.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from collections.abc import Iterator
from typing import TextIO

from squall.wire.auth import TOKEN_FILE_ENV, check_token, read_token_file, resolve_token
from squall_server.common.auth import token_sha256

# 32 random bytes, URL-safe base64: 43 characters, 256 bits.
_NEW_TOKEN_BYTES = 32


class TokenError(Exception):
    """A token or token file that cannot be used (exit status 2)."""


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    """Adds --token-file to a command that calls a service."""
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file holding the bearer token to send (default: ${TOKEN_FILE_ENV}); "
        "see docs/auth.md",
    )


@contextlib.contextmanager
def token_file_env(path: str | None) -> Iterator[None]:
    """Points $SQUALL_TOKEN_FILE at path for the command (every channel reads it there)."""
    if path is None:
        yield
        return
    try:
        read_token_file(path)
    except ValueError as error:
        raise TokenError(str(error)) from None
    saved = os.environ.get(TOKEN_FILE_ENV)
    saved_token = os.environ.pop("SQUALL_TOKEN", None)  # --token-file wins over $SQUALL_TOKEN
    os.environ[TOKEN_FILE_ENV] = path
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(TOKEN_FILE_ENV, None)
        else:
            os.environ[TOKEN_FILE_ENV] = saved
        if saved_token is not None:
            os.environ["SQUALL_TOKEN"] = saved_token


def cli_token() -> str | None:
    """The token the command sends (None: none configured); TokenError if unusable."""
    try:
        return resolve_token()
    except ValueError as error:
        raise TokenError(str(error)) from None


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `auth hash-token` and `auth new-token`."""
    auth = commands.add_parser("auth", help="make tokens and their hashes for [auth]")
    sub = auth.add_subparsers(dest="auth_command", required=True, metavar="COMMAND")
    hash_token = sub.add_parser(
        "hash-token", help="read a token from stdin and print its SHA-256 for token_sha256"
    )
    hash_token.set_defaults(handler=_hash_token)
    new_token = sub.add_parser(
        "new-token", help="print a new random token and its SHA-256 (keep the token secret)"
    )
    new_token.set_defaults(handler=_new_token)


def _hash_token(args: argparse.Namespace, out: TextIO) -> int:
    text = sys.stdin.read(64 * 1024).strip()
    try:
        token = check_token(text, "stdin")
    except ValueError as error:
        raise TokenError(str(error)) from None
    print(token_sha256(token), file=out)
    return 0


def _new_token(args: argparse.Namespace, out: TextIO) -> int:
    token = secrets.token_urlsafe(_NEW_TOKEN_BYTES)
    print(f"token: {token}", file=out)
    print(f'token_sha256 = "{token_sha256(token)}"', file=out)
    return 0
