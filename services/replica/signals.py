"""The replica's commit signal: how readers (subscribers, push delivery, topic links, a
hand-off's wait) hear of the next commit without polling."""

from __future__ import annotations

import asyncio


class CommitSignal:
    """An event set at the next commit, then replaced: take it (``signal``) before
    reading, then wait on it, and no commit between the two is missed."""

    def __init__(self) -> None:
        self._committed = asyncio.Event()

    def signal(self) -> asyncio.Event:
        """The event the next commit sets."""
        return self._committed

    def notify(self) -> None:
        """Something committed: wakes every waiter."""
        committed, self._committed = self._committed, asyncio.Event()
        committed.set()
