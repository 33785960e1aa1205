"""``eager.start_now``: a coroutine's first step runs in the caller's turn, the rest in a
task that behaves as if it had run it all (results, failures, cancellation)."""

from __future__ import annotations

import asyncio

import pytest

from squall_server.common.eager import start_now


def test_a_coroutine_that_never_waits_runs_to_its_end_here() -> None:
    async def scenario() -> None:
        done: list[str] = []

        async def work() -> None:
            done.append("all")

        assert start_now(work(), name="w") is None
        assert done == ["all"]

    asyncio.run(scenario())


def test_a_coroutine_that_waits_ran_its_first_step_here_and_the_task_carries_on() -> None:
    async def scenario() -> None:
        steps: list[str] = []
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def work() -> None:
            steps.append("first")
            steps.append(f"got {await gate}")
            await asyncio.sleep(0)
            steps.append("last")

        task = start_now(work(), name="w")
        assert steps == ["first"] and task is not None
        gate.set_result(7)
        await asyncio.wait_for(task, 10)
        assert steps == ["first", "got 7", "last"]

    asyncio.run(scenario())


def test_failures_reach_the_caller_before_the_first_wait_and_the_task_after() -> None:
    async def scenario() -> None:
        async def fails_now() -> None:
            raise ValueError("now")

        with pytest.raises(ValueError, match="now"):
            start_now(fails_now(), name="w")

        async def fails_later() -> None:
            await asyncio.sleep(0)
            raise ValueError("later")

        task = start_now(fails_later(), name="w")
        assert task is not None
        with pytest.raises(ValueError, match="later"):
            await asyncio.wait_for(task, 10)

    asyncio.run(scenario())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    async def scenario() -> None:
        seen: list[str] = []
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def work() -> None:
            try:
                await never
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            finally:
                seen.append("finally")

        task = start_now(work(), name="w")
        assert task is not None
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled", "finally"] and never.cancelled()

    asyncio.run(scenario())
