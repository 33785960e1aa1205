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
from contextlib import AbstractContextManager

from squall_server.common.clock import Clock


class StallMeter:
    """The start times of the store writes in progress, and the oldest one's age."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._started_ms: dict[int, int] = {}

    def running(self) -> AbstractContextManager[None]:
        """Counts the with-block as a store write in progress, however it ends."""
        return _Running(self)

    def begin(self) -> int:
        """Counts a store write as begun; returns its token for ``end``."""
        with self._lock:
            token = next(self._ids)
            self._started_ms[token] = self._clock.monotonic_ms()
        return token

    def end(self, token: int) -> None:
        """The write of token (``begin``) ended, however it ended."""
        with self._lock:
            del self._started_ms[token]

    def stalled_ms(self) -> int:
        """How long the oldest write in progress has run (0: none is)."""
        with self._lock:
            if not self._started_ms:
                return 0
            oldest = min(self._started_ms.values())
        return max(0, self._clock.monotonic_ms() - oldest)


class _Running:
    """``StallMeter.running``'s context manager (a class, not a generator: every append
    opens one)."""

    __slots__ = ("_meter", "_token")

    def __init__(self, meter: StallMeter) -> None:
        self._meter = meter
        self._token = -1

    def __enter__(self) -> None:
        self._token = self._meter.begin()

    def __exit__(self, *exc: object) -> None:
        self._meter.end(self._token)
