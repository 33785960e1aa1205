"""The virtual-time loop the shell simulator runs on: time jumps, processes pause and die,
the store thread's jobs run in order after their delay, and a run replays exactly."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.sim.shell_sim import run_seed
from tests.sim.virtual_loop import LoopClock, LoopIdleError, SimExecutor, VirtualLoop, run

pytestmark = pytest.mark.sim


def test_time_jumps_to_the_next_timer_without_sleeping() -> None:
    loop = VirtualLoop()
    clock = LoopClock(loop)

    async def main() -> tuple[float, int]:
        await asyncio.sleep(3600)
        await asyncio.wait_for(asyncio.sleep(0.25), 1.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 2.0)
        return loop.time(), clock.monotonic_ms()

    started = time.monotonic()
    assert run(main(), loop) == (3602.25, 3_602_250)
    assert time.monotonic() - started < 30  # an hour of loop time, no real sleeping


def test_a_paused_process_waits_and_a_killed_one_never_runs_again() -> None:
    loop = VirtualLoop()
    ticks: dict[str, list[float]] = {"a": [], "b": []}

    async def ticker(name: str) -> None:
        while True:
            ticks[name].append(loop.time())
            await asyncio.sleep(1)

    async def main() -> None:
        loop.spawn("a", ticker("a"))
        loop.spawn("b", ticker("b"))
        await asyncio.sleep(2.5)
        loop.pause("a")
        await asyncio.sleep(3)
        loop.resume("a")  # its held wakeup runs now, at 5.5
        await asyncio.sleep(0)
        loop.kill("b")
        await asyncio.sleep(2.9)

    run(main(), loop)
    assert ticks["a"] == [0, 1, 2, 5.5, 6.5, 7.5]
    assert ticks["b"] == [0, 1, 2, 3, 4, 5]


def test_a_timer_cancelled_while_its_paused_process_held_it_never_runs() -> None:
    """A paused process's timeout and the wakeup that ends its wait both come due; on
    resume the wait ends first and leaves its ``asyncio.timeout``, which cancels the
    timer: it must not run then (it failed ``Timeout``'s state assertion: seed 10062)."""
    loop = VirtualLoop()
    outcome: list[str] = []
    errors: list[str] = []
    loop.set_exception_handler(lambda _, context: errors.append(context["message"]))

    async def waiter(woken: asyncio.Event) -> None:
        try:
            async with asyncio.timeout(1.0):
                await woken.wait()
            outcome.append("woken")
        except TimeoutError:
            outcome.append("timed out")

    async def main() -> None:
        woken = asyncio.Event()
        task = loop.spawn("a", waiter(woken))
        await asyncio.sleep(0.5)
        loop.pause("a")
        woken.set()  # its wakeup is held...
        await asyncio.sleep(1.0)  # ...and so is its timer, which fires at 1.0
        loop.resume("a")
        await task

    run(main(), loop)
    assert outcome == ["woken"]
    assert errors == []


def test_store_thread_jobs_run_one_at_a_time_in_order_after_their_delay() -> None:
    loop = VirtualLoop()
    delays = iter([0.5, 0.1, 0.0])
    io = SimExecutor(loop, "n1", lambda: next(delays))
    done: list[tuple[str, float]] = []

    async def main() -> None:
        jobs = [
            loop.run_in_executor(io, lambda n=name: done.append((n, loop.time())))
            for name in ("x", "y", "z")
        ]
        await asyncio.gather(*jobs)

    run(main(), loop)
    assert done == [("x", 0.5), ("y", 0.6), ("z", 0.6)]


def test_waiting_for_what_can_never_happen_is_reported() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(LoopIdleError):
        run(main())


def test_a_seed_replays_identically() -> None:
    first, second = run_seed(3), run_seed(3)
    assert first.events == second.events
    assert (first.acked, first.callbacks, first.sim_s) == (
        second.acked,
        second.callbacks,
        second.sim_s,
    )
    assert first.acked > 0
