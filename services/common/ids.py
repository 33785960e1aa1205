"""Where the cluster id is minted: one function, called by the coordinator that forms the
first group (docs/architecture.md, "The cluster id is minted by the first group's
coordinator"); nothing else creates one — every other node and store takes it from a
role command, a Hello or a fetch."""

from __future__ import annotations

import uuid


def new_cluster_id() -> str:
    """A new cluster id: 32 lowercase hex digits (a random UUID), unique without
    coordination, and within the election's id rule (``election._ID_RE``)."""
    return uuid.uuid4().hex
