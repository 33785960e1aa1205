"""How long the replica's recent answers to role calls took, as the coordinator saw them.

A replica on oversubscribed CPUs answers late though it is well (each answer crosses
several turns of its event loop and two gRPC stacks, each waiting for a core), so its
coordinator allows a silence that follows slow answers more time before taking the node
out (``election``, "One fate per node"). What counts is the longest round trip within
about the last two seconds: long enough that the renewals of the next second remember a
slow one, short enough that a replica back on time soon gets no more than its timeout.
"""

from __future__ import annotations

# Round trips are remembered for one to two of these (two buckets).
ANSWER_TIMES_BUCKET_MS = 1000


class RecentAnswerTimes:
    """The longest round trip of a role call recorded in the current and previous bucket."""

    def __init__(self) -> None:
        self._bucket_start_ms: int | None = None
        self._current_ms = 0  # the longest in the bucket that began at _bucket_start_ms
        self._previous_ms = 0  # the longest in the bucket before it

    def record(self, took_ms: int, now_ms: int) -> None:
        """A role call answered took_ms after it was made."""
        self._roll(now_ms)
        self._current_ms = max(self._current_ms, took_ms)

    def longest_ms(self, now_ms: int) -> int:
        """The longest round trip recorded in about the last two buckets (0: none)."""
        self._roll(now_ms)
        return max(self._current_ms, self._previous_ms)

    def _roll(self, now_ms: int) -> None:
        start = self._bucket_start_ms
        if start is None or now_ms < start:
            self._bucket_start_ms = now_ms
            return
        if now_ms - start < ANSWER_TIMES_BUCKET_MS:
            return
        # Nothing recorded for two buckets or more leaves nothing to remember.
        one_on = now_ms - start < 2 * ANSWER_TIMES_BUCKET_MS
        self._previous_ms = self._current_ms if one_on else 0
        self._current_ms = 0
        self._bucket_start_ms = now_ms
