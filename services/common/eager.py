"""Starting a coroutine in the caller's turn: what Python 3.12's eager tasks do, for 3.11.

A task created the usual way runs its first step on the event loop's next turn. Where a
message should reach gRPC in the turn it was produced (a replication batch, issue 16),
``start_now`` runs the coroutine here until it first waits, and only then hands it to a
task that carries on from there: the task sees exactly what the coroutine's first step
yielded (the future it waits on), as if it had run that step itself. Unlike a task's
first step, the one run here runs in the caller's task and context (``current_task`` is
the caller's), and what it raises is raised to the caller.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
from typing import Any


def start_now(coroutine: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None] | None:
    """Runs coroutine until it first waits, here; None when it finished without waiting,
    else the task carrying it on (cancelling the task cancels the coroutine where it
    waits, as for any task)."""
    try:
        waiting = coroutine.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_carry_on(coroutine, waiting), name=name)


async def _carry_on(coroutine: Coroutine[Any, Any, None], waiting: Any) -> None:
    await _resumed(coroutine, waiting)


@types.coroutine
def _resumed(coroutine: Coroutine[Any, Any, None], waiting: Any) -> Generator[Any, None, None]:
    """Yields to the task what the coroutine waits on; the task's answer (the wait is
    over, or an exception such as its cancellation) goes to the coroutine. Each pass is
    one of the coroutine's own steps: it ends when the coroutine does."""
    while True:
        try:
            yield waiting
        except BaseException as exc:
            try:
                waiting = coroutine.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waiting = coroutine.send(None)
        except StopIteration:
            return
