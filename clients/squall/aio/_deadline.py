"""Waiting for a future until a deadline without cancelling it, at little cost per wait.

`asyncio.wait_for(asyncio.shield(future), timeout_s)` makes an outer future, a waiter, a
timer and several callbacks for every wait. An asyncio app whose tasks publish one event
at a time waits once per event, and that machinery was a fifth of the library's CPU per
event at 64 tasks (issue 16; bench/README.md, *The asyncio library's wait per receipt*).
`within` is one future and one callback per wait; the waits whose deadlines fall in the
same `GRAIN_S` share one timer of the loop.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from typing import TypeVar

T = TypeVar("T")

# How late a wait may end past its deadline: its deadline is rounded up to this grain,
# and one timer serves every wait rounded to the same instant.
GRAIN_S = 0.01

# Per event loop: instant (in grains of its clock) -> the waiters that end then.
_Buckets = dict[int, set["asyncio.Future[None]"]]
_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Buckets] = (
    weakref.WeakKeyDictionary()
)


async def within(future: asyncio.Future[T], timeout_s: float) -> T:
    """The future's result (or its exception) once it is done; `TimeoutError` if it is not
    done `timeout_s` from now (up to `GRAIN_S` later; an infinite timeout waits for the
    outcome). The future itself is never cancelled: a caller cancelled while it waits
    leaves it to finish, as `shield` does."""
    if future.done():
        return future.result()
    # The future's loop is the running one; asking it is cheaper than Python 3.11's
    # `get_running_loop`, which makes a getpid system call each time.
    loop = future.get_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    bucket: set[asyncio.Future[None]] | None = None
    if math.isfinite(timeout_s):
        buckets = _by_loop.get(loop)
        if buckets is None:
            buckets = _by_loop[loop] = {}
        instant = math.ceil((loop.time() + timeout_s) / GRAIN_S)
        bucket = buckets.get(instant)
        if bucket is None:
            bucket = buckets[instant] = set()
            loop.call_at(instant * GRAIN_S, _expire, buckets, instant)
        bucket.add(waiter)
    try:
        await waiter
    except asyncio.CancelledError:
        # As `shield` does: the outcome its caller no longer waits for is taken when it
        # comes, so a failure nobody reads is not logged as never retrieved.
        future.add_done_callback(_retrieve)
        raise
    finally:
        if bucket is not None:
            bucket.discard(waiter)
        future.remove_done_callback(wake)
    if not future.done():
        raise TimeoutError
    return future.result()


def _retrieve(future: asyncio.Future[T]) -> None:
    if not future.cancelled():
        future.exception()


def _expire(buckets: _Buckets, instant: int) -> None:
    """Wakes the waits whose deadline is this instant (those not woken already)."""
    for waiter in buckets.pop(instant, ()):
        if not waiter.done():
            waiter.set_result(None)
