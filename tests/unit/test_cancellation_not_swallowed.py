"""Waits with a timeout end when cancelled, also when the cancel lands as the wait ends.

On Python 3.11, ``asyncio.wait_for`` returns the result instead of raising a cancel that
lands in the loop turn its wait ends in (CPython gh-86296, fixed in 3.12 by rewriting it
on ``asyncio.timeout``). A loop cancelled at a stop then runs on: the simulator's two
publishing clients, cancelled after the heal, kept publishing through the whole
catch-up check (coordinated simulator, seed 11867 under acks "all"). The services and
the library wait under ``asyncio.timeout`` instead.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from squall.aio._stall_watch import _woken_or

ROOT = Path(__file__).resolve().parents[2]


def test_a_watchdog_cancelled_as_its_stream_wakes_it_ends() -> None:
    async def scenario() -> None:
        woken = asyncio.Event()
        waiting = asyncio.create_task(_woken_or(woken, 10.0))
        await asyncio.sleep(0)
        woken.set()  # the wait ends in the next turn...
        waiting.cancel()  # ...and the cancel lands in that same turn
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(scenario())


def _wait_for_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "wait_for"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "asyncio"
    ]


def test_no_service_or_library_code_waits_with_asyncio_wait_for() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for top in ("services", "clients/squall")
        for path in sorted((ROOT / top).rglob("*.py"))
        if (lines := _wait_for_calls(path))
    }
    assert not found, f"asyncio.wait_for may swallow a cancel on Python 3.11: {found}"
