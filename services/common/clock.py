"""The clock abstraction: every timeout and timestamp in Squall reads time through it.

Pure cores take a ``Clock`` (or plain millisecond values read from one) so tests and the
simulator drive time by hand with ``ManualClock``. ``SystemClock`` is the only code in the
services that reads the operating system's clocks.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

# A fixed wall-clock start for ManualClock (2026-01-01T00:00:00Z), so timestamps in test
# output are stable and plausible rather than 1970.
MANUAL_CLOCK_WALL_START_MS = 1_767_225_600_000


@runtime_checkable
class Clock(Protocol):
    """A source of monotonic time (for timeouts) and wall time (for timestamps)."""

    def monotonic_ms(self) -> int:
        """Milliseconds from an arbitrary start; never goes backwards."""
        ...

    def wall_ms(self) -> int:
        """Milliseconds since the Unix epoch; may jump, so never used for timeouts."""
        ...


@runtime_checkable
class PreciseClock(Protocol):
    """A monotonic clock fine enough for sub-millisecond latencies (metrics only)."""

    def monotonic_ns(self) -> int:
        """Nanoseconds from an arbitrary start; never goes backwards."""
        ...


class SystemClock:
    """The operating system's clocks."""

    def monotonic_ms(self) -> int:
        """Milliseconds of time.monotonic_ns()."""
        return time.monotonic_ns() // 1_000_000

    def wall_ms(self) -> int:
        """Milliseconds of time.time_ns()."""
        return time.time_ns() // 1_000_000

    def monotonic_ns(self) -> int:
        """time.perf_counter_ns(): the finest monotonic reading, for latencies."""
        return time.perf_counter_ns()


# The operating system's clocks, for code with no clock of its own to inject (a default).
SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when a test calls advance(); both readings move together."""

    def __init__(
        self, monotonic_start_ms: int = 0, wall_start_ms: int = MANUAL_CLOCK_WALL_START_MS
    ) -> None:
        if monotonic_start_ms < 0 or wall_start_ms < 0:
            raise ValueError(
                f"clock start must not be negative, got monotonic {monotonic_start_ms} ms, "
                f"wall {wall_start_ms} ms"
            )
        self._monotonic_ms = monotonic_start_ms
        self._wall_ms = wall_start_ms

    def monotonic_ms(self) -> int:
        """The current manual monotonic time."""
        return self._monotonic_ms

    def monotonic_ns(self) -> int:
        """The current manual monotonic time in nanoseconds."""
        return self._monotonic_ms * 1_000_000

    def wall_ms(self) -> int:
        """The current manual wall time."""
        return self._wall_ms

    def advance(self, ms: int) -> None:
        """Move both readings forward by ms milliseconds (ms >= 0)."""
        if ms < 0:
            raise ValueError(f"a monotonic clock cannot go back: advance({ms})")
        self._monotonic_ms += ms
        self._wall_ms += ms

    def set_wall_ms(self, wall_ms: int) -> None:
        """Jump the wall reading (as NTP might), leaving monotonic time alone."""
        self._wall_ms = wall_ms
