"""The [auth] section: who may call the public API, read from the cluster configuration.

Clients authenticate with bearer tokens (docs/auth.md). The file never holds a token, only
its SHA-256, so a leaked configuration file grants nothing. Each ``[[auth.principals]]``
table names one principal, the hash of its token and what it may do: ``publish`` and
``subscribe`` list topic-name globs (fnmatch: ``*`` ``?`` ``[seq]``), ``admin`` allows topic
creation and destruction, cluster status and the operator commands, and ``link_from``
lists globs of the other clusters whose topic links the principal carries (the only
principals that may publish under ``squall-link/`` publisher ids).

This module raises ``ValueError`` with one sentence naming the key; squall_server.common.config
turns it into a ``ConfigError`` (kept apart so config.py stays one import and one call).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Bounds on the section itself ("put a limit on everything").
PRINCIPALS_MAX = 1000
GLOBS_MAX = 256
GLOB_MAX_CHARS = 255
PRINCIPAL_NAME_MAX_CHARS = 64

_PRINCIPAL_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._@-]*")
_SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}")
# Topic names are [A-Za-z0-9._-]; a glob adds fnmatch's * ? [ ] and ! (negated set).
_GLOB_CHAR_RE = re.compile(r"[A-Za-z0-9._\-*?\[\]!]+")
_AUTH_KEYS = ("enabled", "principals")
_PRINCIPAL_KEYS = ("name", "token_sha256", "publish", "subscribe", "admin", "link_from")


@dataclass(frozen=True)
class PrincipalConfig:
    """One client identity: the hash of its token and what it may do."""

    name: str
    token_sha256: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    admin: bool = False
    # Globs of the source clusters whose topic links this principal carries: it may
    # publish under `squall-link/<cluster>/...` publisher ids (docs/federation.md).
    link_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuthConfig:
    """Whether calls must carry a known token, and the principals those tokens name."""

    enabled: bool = False
    principals: tuple[PrincipalConfig, ...] = field(default_factory=tuple)


def build_auth(table: Mapping[str, Any]) -> AuthConfig:
    """The [auth] table as an AuthConfig (shape only; validate_auth checks the values)."""
    for key in table:
        if key not in _AUTH_KEYS:
            raise ValueError(f"unknown key {key!r} in [auth]; known keys: {', '.join(_AUTH_KEYS)}")
    entries = table.get("principals", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("auth.principals: must be an array of tables written [[auth.principals]]")
    principals = []
    for index, entry in enumerate(entries):
        where = f"auth.principals[{index}]"
        for key in entry:
            if key not in _PRINCIPAL_KEYS:
                raise ValueError(
                    f"unknown key {key!r} in {where}; known keys: {', '.join(_PRINCIPAL_KEYS)}"
                )
        for key in ("name", "token_sha256"):
            if key not in entry:
                raise ValueError(f"{where}.{key}: required key is missing")
        principals.append(
            PrincipalConfig(
                name=entry["name"],
                token_sha256=entry["token_sha256"],
                publish=_tuple(entry.get("publish", []), f"{where}.publish"),
                subscribe=_tuple(entry.get("subscribe", []), f"{where}.subscribe"),
                admin=entry.get("admin", False),
                link_from=_tuple(entry.get("link_from", []), f"{where}.link_from"),
            )
        )
    return AuthConfig(enabled=table.get("enabled", False), principals=tuple(principals))


def _tuple(value: object, field_name: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{field_name}: must be an array of topic-name globs, got {value!r}")
    return tuple(value)


def validate_auth(auth: AuthConfig) -> None:
    """Raise ValueError naming the key for the first wrong value in the section."""
    if not isinstance(auth.enabled, bool):
        raise ValueError(f"auth.enabled: must be true or false, got {auth.enabled!r}")
    # auth.enabled also requires tls.enabled: config.py calls require_tls once [tls] exists.
    if len(auth.principals) > PRINCIPALS_MAX:
        raise ValueError(
            f"auth.principals: at most {PRINCIPALS_MAX} principals, got {len(auth.principals)}"
        )
    if auth.enabled and not auth.principals:
        raise ValueError(
            "auth.enabled: is true but no [[auth.principals]] is configured, so every call "
            "would be refused"
        )
    names: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for index, principal in enumerate(auth.principals):
        where = f"auth.principals[{index}]"
        _validate_principal_name(principal.name, f"{where}.name")
        if principal.name in names:
            raise ValueError(
                f"{where}.name: {principal.name!r} is already the name of "
                f"auth.principals[{names[principal.name]}]"
            )
        names[principal.name] = index
        digest = principal.token_sha256
        if not isinstance(digest, str) or not _SHA256_HEX_RE.fullmatch(digest):
            raise ValueError(
                f"{where}.token_sha256: must be 64 lowercase hex digits (the SHA-256 of the "
                "token; `squall auth hash-token` prints it), got a value that is not"
            )
        if digest in hashes:
            raise ValueError(
                f"{where}.token_sha256: the same token hash as auth.principals"
                f"[{hashes[digest]}]; a token must name exactly one principal"
            )
        hashes[digest] = index
        for key in ("publish", "subscribe", "link_from"):
            _validate_globs(getattr(principal, key), f"{where}.{key}")
        if not isinstance(principal.admin, bool):
            raise ValueError(f"{where}.admin: must be true or false, got {principal.admin!r}")


def require_tls(auth_enabled: bool, tls_enabled: bool) -> None:
    """ValueError unless TLS is on wherever auth is: a token sent in the clear is a gift."""
    if auth_enabled and not tls_enabled:
        raise ValueError(
            "auth.enabled: requires tls.enabled = true, because bearer tokens sent without "
            "TLS can be read and replayed by anyone on the network"
        )


def _validate_principal_name(name: object, field_name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field_name}: must be a non-empty string, got {name!r}")
    if len(name) > PRINCIPAL_NAME_MAX_CHARS or not _PRINCIPAL_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{field_name}: principal names are 1 to {PRINCIPAL_NAME_MAX_CHARS} characters "
            f"from A-Z a-z 0-9 '.' '_' '@' '-', starting with a letter, digit or '_', "
            f"got {name[:80]!r}"
        )


def _validate_globs(globs: Sequence[object], field_name: str) -> None:
    if len(globs) > GLOBS_MAX:
        raise ValueError(f"{field_name}: at most {GLOBS_MAX} globs, got {len(globs)}")
    for position, glob in enumerate(globs):
        where = f"{field_name}[{position}]"
        if not isinstance(glob, str) or not glob:
            raise ValueError(f"{where}: must be a non-empty topic-name glob, got {glob!r}")
        if len(glob) > GLOB_MAX_CHARS or not _GLOB_CHAR_RE.fullmatch(glob):
            raise ValueError(
                f"{where}: {glob[:80]!r} is not a topic-name glob: use topic-name characters "
                "(A-Z a-z 0-9 '.' '_' '-') and the wildcards * ? [...]"
            )
        if glob.count("[") != glob.count("]") or _unbalanced(glob):
            raise ValueError(f"{where}: {glob!r} has an unclosed or stray '[' ... ']' set")


def _unbalanced(glob: str) -> bool:
    """True when brackets do not pair up as non-nested, non-empty [..] sets."""
    depth = 0
    start = -1
    for index, char in enumerate(glob):
        if char == "[":
            if depth:
                return True
            depth = 1
            start = index
        elif char == "]":
            if not depth or index == start + 1:
                return True
            depth = 0
    return depth != 0
