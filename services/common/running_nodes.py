"""The node ids a server's call guards take for cluster nodes: the config file's until the
running node set is known, then the running set's, so a node added at runtime is accepted
and a removed one refused without a restart (docs/operations.md, "Changing the
membership").

Pure and shared: the coordinator feeds it from its election's node set, a replica from
its role commands, a gateway from the coordinators' group views; the TLS peer guard
(peer_guard.py) and the call guards (call_guard.py) read it on every call.
"""

from __future__ import annotations

from collections.abc import Iterable


class RunningNodes:
    """The current node ids, and the member names (node ids and gateway ids) a member's
    certificate may carry."""

    def __init__(self, file_ids: Iterable[str], gateway_ids: Iterable[str] = ()) -> None:
        """Starts with the config file's nodes; ``gateway_ids`` never change at runtime."""
        self._gateways = frozenset(gateway_ids)
        self._ids = frozenset(file_ids)
        self._members = self._ids | self._gateways

    @property
    def ids(self) -> frozenset[str]:
        """The node ids in force."""
        return self._ids

    @property
    def members(self) -> frozenset[str]:
        """Node ids and gateway ids: every name a member's certificate may carry."""
        return self._members

    def follow(self, ids: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Take ``ids`` (a running node set, learners included) in place of the current
        ones; returns (added, removed). An empty set changes nothing: no set is known."""
        new = frozenset(ids)
        if not new or new == self._ids:
            return frozenset(), frozenset()
        added, removed = new - self._ids, self._ids - new
        self._ids = new
        self._members = new | self._gateways
        return added, removed
