"""Watches the replica's event loop for stalls, so an operator can tell a busy replica
from a hung one.

The coordinator takes its node out of the group when its replica has not answered for
``timeouts.replica_timeout_ms`` (issue 14), and the replica answers on its event loop: any
synchronous work that holds the loop that long (a large batch planned or encoded, a flush
of the disk, a machine whose CPUs are oversubscribed) looks like a hung replica. A task
wakes every ``LOOP_WATCH_INTERVAL_MS`` (in a replica process, the lease watch:
``LoopWatch``); when it wakes at least ``LOOP_STALL_WARN_MS`` late it logs how long the
loop was held (at most one line per ``LOOP_STALL_LOG_INTERVAL_MS``,
counting the stalls in between), naming the replica timeout it is measured against.
"""

from __future__ import annotations

import asyncio
import logging

from squall_server.common.clock import Clock

log = logging.getLogger("squall.replica")

# How often the watch wakes: short enough to time a stall to tens of milliseconds, long
# enough to cost nothing measurable.
LOOP_WATCH_INTERVAL_MS = 50
# A wake-up this late is a stall worth a line: a third of the default replica_timeout_ms.
LOOP_STALL_WARN_MS = 100
# At most one line this often; the stalls in between are counted in it.
LOOP_STALL_LOG_INTERVAL_MS = 1000


class LoopWatch:
    """Logs the event loop's stalls from the wake-ups of a task that sleeps a fixed
    interval: a wake-up at least ``LOOP_STALL_WARN_MS`` late is a stall (at most one line
    per ``LOOP_STALL_LOG_INTERVAL_MS``, counting the stalls in between).

    A replica process feeds it from its lease watch (``RoleApplication.watch_lease``),
    which wakes every 50 ms anyway: one timer for both, not two (an idle replica's timer
    wake-ups are a third of its CPU; bench/README.md, *Idle CPU*)."""

    def __init__(self, node_id: str, replica_timeout_ms: int) -> None:
        self.node_id = node_id
        self.replica_timeout_ms = replica_timeout_ms
        self._logged_at: int | None = None
        self._unlogged = 0  # stalls since the last line
        self._worst_ms = 0  # the longest of them

    def woke(self, slept_at_ms: int, now_ms: int, interval_ms: int) -> None:
        """A sleep of ``interval_ms`` begun at ``slept_at_ms`` ended at ``now_ms``."""
        stalled_ms = now_ms - slept_at_ms - interval_ms
        if stalled_ms < LOOP_STALL_WARN_MS:
            return
        self._unlogged += 1
        self._worst_ms = max(self._worst_ms, stalled_ms)
        if self._logged_at is not None and now_ms - self._logged_at < LOOP_STALL_LOG_INTERVAL_MS:
            return
        log.warning(
            "replica %s: event loop held for %d ms (%d stall(s) of %d ms or more since the "
            "last report); its coordinator takes the node out of its group after "
            "replica_timeout_ms (%d) without an answer%s",
            self.node_id,
            self._worst_ms,
            self._unlogged,
            LOOP_STALL_WARN_MS,
            self.replica_timeout_ms,
            " [loop-stall-over-timeout]" if self._worst_ms >= self.replica_timeout_ms else "",
        )
        self._logged_at, self._unlogged, self._worst_ms = now_ms, 0, 0


async def watch_loop(clock: Clock, node_id: str, replica_timeout_ms: int) -> None:
    """Logs the event loop's stalls until cancelled, on a timer of its own (a replica
    process uses its lease watch's instead)."""
    watch = LoopWatch(node_id, replica_timeout_ms)
    interval_s = LOOP_WATCH_INTERVAL_MS / 1000
    # Bounded by cancellation: runs for the life of the replica.
    while True:
        before = clock.monotonic_ms()
        await asyncio.sleep(interval_s)
        watch.woke(before, clock.monotonic_ms(), LOOP_WATCH_INTERVAL_MS)
