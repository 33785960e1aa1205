"""Committed reads: which stored events a subscriber may see (pure, no I/O).

A replica applies an entry to its store when it appends it, before the entry is
committed (held by enough replicas). Subscribers must only see committed events: an
uncommitted publish may still be truncated by the next master, and a subscriber that
saw it would have read an event that never happened. ``CommitGate`` remembers where
each publish above the commit LSN starts in its topic and hides every offset from
there on until the commit LSN passes it.

Entries stored before the process started are taken as visible: their commit state is
not known at start-up (a gap noted in docs/replication.md).
"""

from __future__ import annotations

from collections import deque


class CommitGate:
    """Hides events of publishes above the commit LSN from committed reads."""

    def __init__(self, commit_lsn: int) -> None:
        """A gate over a store whose entries up to commit_lsn are all visible."""
        self._commit_lsn = commit_lsn
        # (lsn, topic) of every tracked publish, oldest first, and per topic the
        # (lsn, first offset) of its tracked publishes (offsets grow with LSNs).
        self._order: deque[tuple[int, str]] = deque()
        self._topics: dict[str, deque[tuple[int, int]]] = {}

    @property
    def commit_lsn(self) -> int:
        """The highest LSN committed reads may serve."""
        return self._commit_lsn

    @property
    def tracked(self) -> int:
        """How many uncommitted publishes are hidden."""
        return len(self._order)

    def appended(self, lsn: int, topic: str, first_offset: int) -> None:
        """A publish at lsn is about to be stored; hidden unless already committed."""
        if lsn <= self._commit_lsn:
            return
        self._order.append((lsn, topic))
        self._topics.setdefault(topic, deque()).append((lsn, first_offset))

    def advance(self, commit_lsn: int) -> bool:
        """The commit LSN moved to commit_lsn; True when it grew (wake subscribers)."""
        if commit_lsn <= self._commit_lsn:
            return False
        self._commit_lsn = commit_lsn
        order = self._order
        while order and order[0][0] <= commit_lsn:
            _, topic = order.popleft()
            entries = self._topics[topic]
            entries.popleft()
            if not entries:
                del self._topics[topic]
        return True

    def truncated(self, after_lsn: int) -> None:
        """Entries after after_lsn were removed (or never stored): forget them."""
        order = self._order
        while order and order[-1][0] > after_lsn:
            _, topic = order.pop()
            entries = self._topics[topic]
            entries.pop()
            if not entries:
                del self._topics[topic]
        self._commit_lsn = min(self._commit_lsn, after_lsn)

    def hidden_from(self, topic: str) -> int | None:
        """The first offset of topic not yet committed, or None when all are."""
        entries = self._topics.get(topic)
        return entries[0][1] if entries else None
