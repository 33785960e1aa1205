"""`squall.aio._deadline.within`: the asyncio library's wait for a receipt until its
deadline, as `wait_for(shield(future))` waited: the future's outcome as it is, a
`TimeoutError` not before the deadline, and the future never cancelled by its waiter."""

from __future__ import annotations

import asyncio
import gc
import math

import pytest

from squall.aio._deadline import GRAIN_S, within


def run(body: object) -> None:
    # Bounded: a wait that never ends fails the test instead of hanging it.
    asyncio.run(asyncio.wait_for(body, 30))  # type: ignore[arg-type]


def test_the_outcome_is_the_futures_own() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        done.set_result(7)
        assert await within(done, 1.0) == 7  # done already
        later: asyncio.Future[int] = loop.create_future()
        loop.call_soon(later.set_result, 8)
        assert await within(later, 1.0) == 8
        failing: asyncio.Future[int] = loop.create_future()
        loop.call_soon(failing.set_exception, ValueError("refused"))
        with pytest.raises(ValueError, match="refused"):
            await within(failing, 1.0)

    run(body())


def test_a_future_not_done_in_time_times_out_not_before_its_deadline_and_runs_on() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        slow: asyncio.Future[str] = loop.create_future()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await within(slow, 0.05)
        waited = loop.time() - started
        assert 0.05 <= waited < 5.0
        assert not slow.done()  # still the caller's to wait for again
        loop.call_later(0.01, slow.set_result, "late")
        assert await within(slow, 5.0) == "late"

    run(body())


def test_many_waits_with_one_deadline_each_end_by_their_own() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[int]] = [loop.create_future() for _ in range(200)]
        # Every other one answers; the rest time out together (their deadlines share
        # timers), none of them before its deadline.
        for index in range(0, 200, 2):
            loop.call_later(0.01, futures[index].set_result, index)
        started = loop.time()
        outcomes = await asyncio.gather(*(within(f, 0.1) for f in futures), return_exceptions=True)
        assert loop.time() - started >= 0.1
        for index, outcome in enumerate(outcomes):
            if index % 2:
                assert isinstance(outcome, TimeoutError)
            else:
                assert outcome == index

    run(body())


def test_a_cancelled_waiter_leaves_the_future_running() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        receipt: asyncio.Future[str] = loop.create_future()
        waiting = asyncio.create_task(within(receipt, 5.0))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not receipt.cancelled()
        receipt.set_result("stored")  # the write went on; another waiter hears it
        assert await within(receipt, 5.0) == "stored"

    run(body())


def test_a_failure_no_one_waits_for_any_more_is_not_reported_as_never_retrieved() -> None:
    # A cancelled caller's write may still fail; as with `shield`, that failure is taken
    # when it comes rather than logged by the loop as "exception was never retrieved".
    reported: list[str] = []

    async def body() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
        for timeout_s in (5.0, math.inf):
            receipt: asyncio.Future[str] = loop.create_future()
            waiting = asyncio.create_task(within(receipt, timeout_s))
            await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            receipt.set_exception(ConnectionError("the stream broke"))
            await asyncio.sleep(0)
            del receipt
            gc.collect()

    run(body())
    assert not reported, reported


def test_a_wait_without_a_deadline_waits_for_the_outcome() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        later: asyncio.Future[int] = loop.create_future()
        loop.call_later(2 * GRAIN_S, later.set_result, 3)
        assert await within(later, math.inf) == 3

    run(body())
