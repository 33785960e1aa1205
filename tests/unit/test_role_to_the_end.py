"""A role command's application is not cut short by its caller's cancellation (a SetRole
call past its deadline): it runs to its end, then the cancellation comes through
(services/replica/roles.py, ``_to_the_end``; coordinated simulator seed 526)."""

from __future__ import annotations

import asyncio

import pytest

from squall_server.replica.roles import _to_the_end


def test_a_cancelled_caller_waits_for_the_application_then_is_cancelled() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        steps: list[str] = []

        async def apply() -> None:
            steps.append("drop begun")
            await release.wait()  # the commit lock, behind a slow disk
            steps.append("drop done")

        applying = asyncio.ensure_future(apply())
        caller = asyncio.ensure_future(_to_the_end(applying))
        await asyncio.sleep(0)
        caller.cancel()  # the SetRole deadline
        await asyncio.sleep(0)
        caller.cancel()  # twice: still not cut short
        await asyncio.sleep(0)
        assert not caller.done() and steps == ["drop begun"]
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert steps == ["drop begun", "drop done"] and applying.done()

    asyncio.run(scenario())


def test_an_uncancelled_caller_gets_the_result_or_the_error() -> None:
    async def scenario() -> None:
        async def ok() -> None:
            return None

        async def refused() -> None:
            raise RuntimeError("refused")

        assert await _to_the_end(asyncio.ensure_future(ok())) is None
        with pytest.raises(RuntimeError, match="refused"):
            await _to_the_end(asyncio.ensure_future(refused()))

    asyncio.run(scenario())
