"""When the master opens its next stream to a slave, decided without asyncio: the
reconnection backoff of ``MasterDriver`` (``master_driver.py``), which the replication
simulator (``tests/sim/replication_sim.py``) runs as well.

What the slave's messages on a stream mean to the master (its answer to the Hello, its
acks, a refusal carrying its epoch, the stream's end) is applied by ``MasterSteps``
(``master_steps.py``: ``hello_answered``, ``received``, ``refused``, ``stream_ended``).
"""

from __future__ import annotations

# Reconnect backoff to a slave: fast at first (failover time depends on it), bounded.
RECONNECT_BACKOFF_MIN_MS = 50
RECONNECT_BACKOFF_MAX_MS = 1000


class ReconnectBackoff:
    """One slave's reconnection delays for one master epoch: the first wait after a stream
    ends is ``RECONNECT_BACKOFF_MIN_MS``, each stream that ends unopened doubles the next
    wait, up to ``RECONNECT_BACKOFF_MAX_MS``, and an opened one starts over from the
    minimum (the slave is back, and failover time depends on reaching it again quickly).
    The shell says which streams opened: ``MasterDriver._run_link`` counts one whose Hello
    the slave answered, however it then ended (a slave's stream ends in an error: a
    break, a refusal, a cancel)."""

    __slots__ = ("_next_ms",)

    def __init__(self) -> None:
        self._next_ms = RECONNECT_BACKOFF_MIN_MS

    def after(self, *, opened: bool) -> int:
        """A stream ended (``opened``: as the class says): the milliseconds to wait
        before opening the next one."""
        if opened:
            self._next_ms = RECONNECT_BACKOFF_MIN_MS
        delay_ms = self._next_ms
        self._next_ms = min(delay_ms * 2, RECONNECT_BACKOFF_MAX_MS)
        return delay_ms
