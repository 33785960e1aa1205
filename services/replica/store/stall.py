"""How long the store's oldest write in progress has run: a stuck disk, seen from inside.

A replica whose disk hangs (a write or fsync that never returns) keeps answering its
coordinator from the event loop while nothing commits; its coordinator learns of it from
``stalled_ms`` in the replica's answer to each role renewal and takes the node out of its
group after ``timeouts.store_stall_timeout_ms`` (docs/architecture.md, "One fate per
node"). The store wraps each write transaction (its commit and flush included) and each
flush in ``running()``; any thread may, and time comes from the injected clock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from squall_server.common.clock import Clock


class StallMeter:
    """The start times of the store writes in progress, and the oldest one's age."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._started_ms: dict[int, int] = {}

    @contextmanager
    def running(self) -> Iterator[None]:
        """Counts the with-block as a store write in progress, however it ends."""
        with self._lock:
            token = next(self._ids)
            self._started_ms[token] = self._clock.monotonic_ms()
        try:
            yield
        finally:
            with self._lock:
                del self._started_ms[token]

    def stalled_ms(self) -> int:
        """How long the oldest write in progress has run (0: none is)."""
        with self._lock:
            if not self._started_ms:
                return 0
            oldest = min(self._started_ms.values())
        return max(0, self._clock.monotonic_ms() - oldest)
