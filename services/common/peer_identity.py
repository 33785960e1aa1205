"""Who is calling: the identities a caller's verified TLS client certificate names.

With mutual TLS on (docs/security.md) every service presents a certificate whose subject
alternative names carry its node or gateway id. gRPC has already verified the chain
against the cluster's CA before a handler runs; this module only reads the result, so the
transport checks (services/common/tls.py) and the permission checks
(services/common/auth.py) agree on one answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class HasAuthContext(Protocol):
    def auth_context(self) -> Mapping[str, Sequence[bytes]]: ...


def peer_identities(context: HasAuthContext) -> frozenset[str]:
    """The names (SAN entries and common name) of the caller's verified certificate.

    Empty when the call came without TLS or without a client certificate.
    """
    auth = context.auth_context()
    if not auth.get("x509_pem_cert") and not auth.get("x509_common_name"):
        return frozenset()
    names: set[str] = set()
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        for raw in auth.get(key, ()):
            name = raw.decode("utf-8", errors="replace").strip()
            if name:
                names.add(name)
    return frozenset(names)


def peer_member_id(context: HasAuthContext, members: frozenset[str]) -> str | None:
    """The cluster member (node or gateway id) the caller's certificate names, if exactly one."""
    named = peer_identities(context) & members
    if len(named) == 1:
        return next(iter(named))
    return None
