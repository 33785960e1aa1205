"""The asyncio stall watchdog of a publish stream bound to a replica: a proxy's own stream
(`squall.aio._publisher`) and a client's shared stream to a replica
(`squall.aio._publish_mux`) run the same loop, as the threaded client's share
`squall._publish_rules.watch_stalls`.

A master that hangs after the group elected another cannot end its streams itself, so
the stream is watched, not a caller: every request on it is covered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from squall._proxy import Endpoint
from squall._publish_rules import (
    RECEIPT_STALL_AFTER_S,
    RECEIPT_STALL_CHECK_S,
    abandon_stream,
    stall_details,
    stall_move,
)

# Asks the gateway which replica is master ("" if it cannot say within the timeout given).
MasterCheck = Callable[[float], Awaitable[str]]


async def watch_stalls(stream: Any, endpoint: Endpoint, check: MasterCheck, who: str) -> None:
    """Once the stream's oldest unanswered request is RECEIPT_STALL_AFTER_S old, asks every
    RECEIPT_STALL_CHECK_S who the master is and abandons the stream as soon as the gateway
    names another replica, naming it (`moved_to`), so its callers' proxies move there.

    `stream` has `dead`, `woken` (set when a request goes out on an idle stream and when
    the stream ends), `pending` (unanswered requests with `sent_at` on the loop's clock),
    `abort_error`, `moved_to` and `call`; `who` names the publisher (or "shared") in the
    log line of a move."""
    loop = asyncio.get_running_loop()
    # Ends with the stream (its end sets dead and wakes this task).
    while not stream.dead:
        stream.woken.clear()
        if not stream.pending:
            await stream.woken.wait()
            continue
        oldest = stream.pending[0]
        late_in_s = oldest.sent_at + RECEIPT_STALL_AFTER_S - loop.time()
        if late_in_s > 0:
            await _woken_or(stream.woken, late_in_s)
            continue
        try:
            async with asyncio.timeout(2 * RECEIPT_STALL_CHECK_S):
                checked = await check(RECEIPT_STALL_CHECK_S)
        except Exception:
            checked = ""  # only a hint: a failed check leaves the stream to its timeout
        still_waiting = not stream.dead and stream.pending and stream.pending[0] is oldest
        if still_waiting and (master := stall_move(who, endpoint, checked)):
            if stream.abort_error is None:
                stream.moved_to = master
            abandon_stream(stream, grpc.StatusCode.UNAVAILABLE, stall_details(endpoint, master))
            return
        if still_waiting:
            await _woken_or(stream.woken, RECEIPT_STALL_CHECK_S)


async def _woken_or(woken: asyncio.Event, timeout_s: float) -> None:
    """Waits for `woken` or `timeout_s`, whichever comes first (a watchdog ends as soon as
    its stream does, not after its interval). asyncio.timeout, not wait_for: on Python
    3.11 wait_for swallows a cancel that lands as the wait ends, and a watchdog cancelled
    with its stream would watch on."""
    try:
        async with asyncio.timeout(timeout_s):
            await woken.wait()
    except TimeoutError:
        pass
