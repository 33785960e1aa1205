"""Watches the replica's event loop for stalls, so an operator can tell a busy replica
from a hung one.

The coordinator takes its node out of the group when its replica has not answered for
``timeouts.replica_timeout_ms`` (issue 14), and the replica answers on its event loop: any
synchronous work that holds the loop that long (a large batch planned or encoded, a flush
of the disk, a machine whose CPUs are oversubscribed) looks like a hung replica. A task
wakes every ``LOOP_WATCH_INTERVAL_MS``; when it wakes at least ``LOOP_STALL_WARN_MS`` late
it logs how long the loop was held (at most one line per ``LOOP_STALL_LOG_INTERVAL_MS``,
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


async def watch_loop(clock: Clock, node_id: str, replica_timeout_ms: int) -> None:
    """Logs the event loop's stalls until cancelled."""
    interval_s = LOOP_WATCH_INTERVAL_MS / 1000
    logged_at: int | None = None
    unlogged = 0  # stalls since the last line
    worst_ms = 0  # the longest of them
    # Bounded by cancellation: runs for the life of the replica.
    while True:
        before = clock.monotonic_ms()
        await asyncio.sleep(interval_s)
        now = clock.monotonic_ms()
        stalled_ms = now - before - LOOP_WATCH_INTERVAL_MS
        if stalled_ms < LOOP_STALL_WARN_MS:
            continue
        unlogged += 1
        worst_ms = max(worst_ms, stalled_ms)
        if logged_at is not None and now - logged_at < LOOP_STALL_LOG_INTERVAL_MS:
            continue
        log.warning(
            "replica %s: event loop held for %d ms (%d stall(s) of %d ms or more since the "
            "last report); its coordinator takes the node out of its group after "
            "replica_timeout_ms (%d) without an answer%s",
            node_id,
            worst_ms,
            unlogged,
            LOOP_STALL_WARN_MS,
            replica_timeout_ms,
            " [loop-stall-over-timeout]" if worst_ms >= replica_timeout_ms else "",
        )
        logged_at, unlogged, worst_ms = now, 0, 0
