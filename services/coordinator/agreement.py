"""The configuration settings every member must share, as a digest and as named values.

Members compare them when they form a group (docs/operations.md, "Consistency at start"):
the election carries the digest in every probe and invitation and refuses to merge with,
or accept an invitation from, a node whose digest differs. The values themselves travel
in the answer to a probe whose digest differs, so both nodes can name the setting and
both values in their logs and status. Which settings are in the list, and why, is
``ClusterConfig.agreed_settings`` (squall_server.common.config). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# A setting as (dotted key, value as text).
Setting = tuple[str, str]
Settings = tuple[Setting, ...]

# Hex characters of the SHA-256 kept: enough that two different lists never share one in
# practice, short enough for a log line.
DIGEST_CHARS = 16


def settings_digest(settings: Sequence[Setting]) -> str:
    """The digest of a settings list ("" for an empty list: nothing to compare)."""
    if not settings:
        return ""
    text = "\n".join(f"{key}={value}" for key, value in sorted(settings))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True, slots=True)
class SettingDifference:
    """One setting this node and a peer disagree on ("" for a value one side lacks)."""

    key: str
    local_value: str
    peer_value: str

    def describe(self, peer: str) -> str:
        """``key: this node 'a', n3 'b'``."""
        return f"{self.key}: this node {_shown(self.local_value)}, {peer} {_shown(self.peer_value)}"


def _shown(value: str) -> str:
    return repr(value) if value else "(not set)"


def differences(
    mine: Sequence[Setting], theirs: Sequence[Setting], *, their_digest: str = ""
) -> tuple[SettingDifference, ...]:
    """Every key whose values differ, sorted; the digests when the peer sent no values."""
    if not theirs:
        return (SettingDifference("settings digest", settings_digest(mine), their_digest),)
    local = dict(mine)
    peer = dict(theirs)
    return tuple(
        SettingDifference(key, local.get(key, ""), peer.get(key, ""))
        for key in sorted(local.keys() | peer.keys())
        if local.get(key, "") != peer.get(key, "")
    )
