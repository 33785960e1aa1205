"""Committed reads: which stored events a subscriber may see (pure, no I/O).

A replica applies an entry to its store when it appends it, before the entry is
committed (held by enough replicas). Subscribers must only see committed events: an
uncommitted publish may still be truncated by the next master, and a subscriber that
saw it would have read an event that never happened. ``CommitGate`` remembers where
each publish above the commit LSN starts in its topic and hides every offset from
there on until the commit LSN passes it.

Across restarts: the replica records the commit LSN it knew in its store (with each
appended batch, and with the master's heartbeats on a slave). At start-up the gate
begins at that LSN and tracks every publish of the log above it (``appended`` in LSN
order), so a deposed master's suffix, or entries a slave held but never knew committed,
stay hidden until a new master's commit LSN passes them (or a truncation removes them).

Snapshots: an installed snapshot's state cannot be hidden entry by entry (its log is not
sent). The sender lists, per topic, the publishes the snapshot holds above its commit
LSN (``uncommitted``: the first hidden offset and the last such LSN); the receiver
tracks each as one publish at that last LSN (``restore``), which hides a little more
than needed (committed events after the first uncommitted one, until the last commits)
and never less.

A snapshot's swap (``Store.finish_snapshot``) runs on the store thread while the event
loop keeps serving reads, so a reader may meet the old state or the new one before the
driver knows which: ``swapping`` hides, until the swap's outcome is known, what either
may hold uncommitted (the old state's tracked publishes and the snapshot's list, at the
lower of the two commit LSNs); ``swap_failed`` puts the gate back when the old state is
known to be live, and ``truncated(0)`` (then ``advance`` and ``restore``) sets the new
one's.

Topics are tracked by name, and a topic destroyed and created again starts again at
offset 0: a publish of the new incarnation may be tracked after one of the old at a
higher offset. Offsets then no longer grow with LSNs within the name, and the gate hides
from the lowest offset tracked for it (more than needed until the old one commits, never
less).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class CommitGate:
    """Hides events of publishes above the commit LSN from committed reads."""

    def __init__(self, commit_lsn: int) -> None:
        """A gate over a store whose entries up to commit_lsn are all visible."""
        self._commit_lsn = commit_lsn
        # (lsn, topic) of every tracked publish, oldest first, and per topic the
        # (lsn, first offset) of its tracked publishes (offsets grow with LSNs).
        self._order: deque[tuple[int, str]] = deque()
        self._topics: dict[str, deque[tuple[int, int]]] = {}
        # Topics whose tracked offsets went down (a new incarnation of the name).
        self._mixed: set[str] = set()
        # Snapshot swaps' lists, per topic (first hidden offset, last LSN), hidden on top
        # of the tracked publishes; and what the gate had before the last swap began
        # (its commit LSN and swap lists; None: no swap's outcome pending).
        self._swap: dict[str, tuple[int, int]] = {}
        self._before_swap: tuple[int, dict[str, tuple[int, int]]] | None = None

    @property
    def commit_lsn(self) -> int:
        """The highest LSN committed reads may serve."""
        return self._commit_lsn

    @property
    def tracked(self) -> int:
        """How many uncommitted publishes are hidden (a swap's topics count one each)."""
        return len(self._order) + len(self._swap)

    def appended(self, lsn: int, topic: str, first_offset: int) -> None:
        """A publish at lsn is about to be stored; hidden unless already committed.

        LSNs must grow from call to call (a ValueError otherwise): advance and truncated
        rely on the order.
        """
        if lsn <= self._commit_lsn:
            return
        if self._order and lsn < self._order[-1][0]:
            raise ValueError(f"publish at LSN {lsn} tracked after LSN {self._order[-1][0]}")
        self._order.append((lsn, topic))
        entries = self._topics.setdefault(topic, deque())
        if entries and first_offset < entries[-1][1]:
            self._mixed.add(topic)
        entries.append((lsn, first_offset))

    def restore(self, uncommitted: Iterable[tuple[str, int, int]]) -> int:
        """Tracks a snapshot's uncommitted publishes, (topic, first offset, last LSN) per
        topic, each as one publish at its last LSN; returns how many it tracks.

        Call with nothing tracked above those LSNs (after the snapshot's install began).
        """
        count = 0
        for topic, first_offset, last_lsn in sorted(uncommitted, key=lambda item: item[2]):
            if last_lsn > self._commit_lsn:
                self.appended(last_lsn, topic, first_offset)
                count += 1
        return count

    def swapping(self, commit_lsn: int, uncommitted: Iterable[tuple[str, int, int]]) -> None:
        """A snapshot (sent at commit_lsn, with ``restore``'s uncommitted list) is about
        to replace the state: until ``swap_failed`` or ``truncated``, committed reads serve
        only what both the state now and the snapshot hold committed."""
        self._before_swap = (self._commit_lsn, dict(self._swap))
        self._commit_lsn = min(self._commit_lsn, commit_lsn)
        for topic, first_offset, last_lsn in uncommitted:
            if last_lsn > self._commit_lsn:
                # An earlier swap whose outcome was never learnt stays hidden too.
                had = self._swap.get(topic)
                if had is not None:
                    first_offset, last_lsn = min(had[0], first_offset), max(had[1], last_lsn)
                self._swap[topic] = (first_offset, last_lsn)

    def swap_failed(self) -> bool:
        """The last swap did not happen (the old state is live): the gate is back as it
        was, with any commit learnt since; True when reads may serve more."""
        if self._before_swap is None:
            return False
        commit_lsn, self._swap = self._before_swap
        self._before_swap = None
        self.advance(commit_lsn)
        self._swap = {t: v for t, v in self._swap.items() if v[1] > self._commit_lsn}
        return True

    def uncommitted(self, up_to_lsn: int) -> list[tuple[str, int, int]]:
        """Per topic with tracked publishes at or below up_to_lsn: (topic, first hidden
        offset, LSN of the last such publish), by that LSN. What a snapshot at up_to_lsn
        holds above the commit LSN (for ``restore`` on the receiver)."""
        out: list[tuple[str, int, int]] = []
        for topic, entries in self._topics.items():
            first_lsn, first_offset = entries[0]
            if first_lsn > up_to_lsn:
                continue
            last_lsn = first_lsn
            for lsn, offset in entries:
                if lsn > up_to_lsn:
                    break
                last_lsn = lsn
                first_offset = min(first_offset, offset)
            out.append((topic, first_offset, last_lsn))
        # A swap's topics too: which state is live may not be known yet (swapping).
        merged = {topic: (offset, lsn) for topic, offset, lsn in out}
        for topic, (offset, lsn) in self._swap.items():
            if lsn <= up_to_lsn:
                had = merged.get(topic, (offset, lsn))
                merged[topic] = (min(had[0], offset), max(had[1], lsn))
        out = [(topic, offset, lsn) for topic, (offset, lsn) in merged.items()]
        out.sort(key=lambda item: item[2])
        return out

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
                self._mixed.discard(topic)
        if self._swap:
            # Committed in the snapshot's state too (and never needed in the old one).
            self._swap = {t: v for t, v in self._swap.items() if v[1] > commit_lsn}
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
                self._mixed.discard(topic)
        self._commit_lsn = min(self._commit_lsn, after_lsn)
        self._before_swap = None
        if self._swap:
            # With a snapshot's state live, a truncation keeps at least the snapshot's LSN
            # (its log starts after it), so what goes was the old state's, which needed no
            # swap entry; the driver's truncated(0) ends a finished swap (then restore).
            self._swap = {t: v for t, v in self._swap.items() if v[1] <= after_lsn}

    def hidden_from(self, topic: str) -> int | None:
        """The first offset of topic not yet committed, or None when all are."""
        swapped = self._swap.get(topic)
        entries = self._topics.get(topic)
        if not entries:
            return None if swapped is None else swapped[0]
        if topic in self._mixed:
            first = min(offset for _, offset in entries)
        else:
            first = entries[0][1]
        return first if swapped is None else min(first, swapped[0])
