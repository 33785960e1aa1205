"""Work that runs only while this replica is the master of one epoch: one supervisor task
keeping one worker per item the store lists (push subscribers in `push.py`, topic links
in `links.py`).

The node starts it when its epoch's start entry commits and stops it when the role goes.
The supervisor rescans the store when told (`refresh`: an item was added or removed here)
and every `rescan_s()`; it starts a worker for each new item, cancels the workers of
items gone, and replaces a worker whose task ended unless the subclass says it ended for
good (`restart`). `active(epoch)` is what every worker checks before each step: a worker
of a deposed master stops at its next step, even before `stop` cancels it.

Each kind of work names what it uses of the node (`endpoints.MasterWorkEndpoint` and its
kin). `MasterWork` starts and stops all of them together, for the role shells that are
built before the node the tasks read (`assembly.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable
from typing import Any, Generic, Protocol, TypeVar

from squall.v1 import common_pb2
from squall_server.replica.endpoints import MasterWorkEndpoint
from squall_server.replica.store import StoreError


class Worker(Protocol):
    """One item's task."""

    task: asyncio.Task[None]

    def cancel(self) -> None:
        """Cancels the task and whatever it started."""


K = TypeVar("K", bound=Hashable)
W = TypeVar("W", bound=Worker)
I = TypeVar("I")  # noqa: E741  (the store's item: a subscriber, a link)
E = TypeVar("E", bound=MasterWorkEndpoint)  # what the work uses of the node


class MasterTasks(Generic[K, I, W, E]):
    """A supervisor and its workers while this replica is the master of one epoch."""

    def __init__(self, node: E, what: str, log: logging.Logger) -> None:
        self._node = node
        self._what = what  # "push delivery", "link forwarding": for the log lines
        self._log = log
        self._epoch = 0
        self._supervisor: asyncio.Task[None] | None = None
        self._workers: dict[K, W] = {}
        self._wake = asyncio.Event()

    # --- what a subclass says

    def rescan_s(self) -> float:
        """How often the supervisor rescans without being told."""
        raise NotImplementedError

    def wanted(self) -> dict[K, I]:
        """The items that should have a worker now, by key (StoreError: none for now)."""
        raise NotImplementedError

    def make(self, key: K, item: I, epoch: int) -> W | None:
        """A worker for a new item (None: not now; asked again at the next scan)."""
        raise NotImplementedError

    def restart(self, worker: W) -> bool:
        """Whether a worker whose task ended is replaced (default: yes)."""
        return True

    # --- lifecycle (called by the node on role changes)

    def start(self, epoch: int) -> None:
        """Starts as the master of `epoch` (its start entry has committed)."""
        self.stop()
        self._epoch = epoch
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(epoch), name=f"{self._what}-{self._node.node.id}-{epoch}"
        )
        self._log.info("replica %s: %s started (epoch=%d)", self._node.node.id, self._what, epoch)

    def stop(self) -> None:
        """Stops every worker now (the role is gone); calls and writes in flight are cancelled."""
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
            self._log.info(
                "replica %s: %s stopped (epoch=%d)", self._node.node.id, self._what, self._epoch
            )
        for worker in self._workers.values():
            worker.cancel()
        self._workers.clear()

    async def close(self) -> None:
        """Stops and waits for the tasks to end."""
        tasks = [w.task for w in self._workers.values()]
        if self._supervisor is not None:
            tasks.append(self._supervisor)
        self.stop()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def refresh(self) -> None:
        """An item was added or removed here: rescan now."""
        self._wake.set()

    def active(self, epoch: int) -> bool:
        """Whether this replica still works as the master of `epoch`."""
        node = self._node
        return (
            self._supervisor is not None
            and self._epoch == epoch
            and node.role == common_pb2.ROLE_MASTER
            and node.epoch == epoch
            and not node.failed_reason
        )

    @property
    def running(self) -> bool:
        """Whether the supervisor runs (this replica is a master whose epoch started)."""
        return self._supervisor is not None

    async def _supervise(self, epoch: int) -> None:
        # Bounded per pass by the store's items; ends with the role.
        while self.active(epoch):
            self._wake.clear()
            try:
                wanted = self.wanted()
            except StoreError as exc:
                self._log.warning(
                    "replica %s: %s: reading the store failed: %s",
                    self._node.node.id,
                    self._what,
                    exc,
                )
                wanted = {}
            for key in list(self._workers):
                worker = self._workers[key]
                if key not in wanted or (worker.task.done() and self.restart(worker)):
                    worker.cancel()
                    del self._workers[key]
            for key, item in wanted.items():
                if key not in self._workers:
                    made = self.make(key, item, epoch)
                    if made is not None:
                        self._workers[key] = made
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel
            # that lands as the wait ends, and the loop would run on past its stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.rescan_s()):
                    await self._wake.wait()


class MasterWork:
    """Every kind of work that runs while this replica is master (push delivery, topic
    links): started once the epoch's start entry commits, stopped with the role.

    The role shells that start and stop it are built before the node the tasks read, so
    the node attaches its tasks once it exists (``attach``)."""

    def __init__(self) -> None:
        self._tasks: list[MasterTasks[Any, Any, Any, Any]] = []

    def attach(self, *tasks: MasterTasks[Any, Any, Any, Any]) -> None:
        """Adds the node's tasks (once, when the node is made)."""
        self._tasks.extend(tasks)

    def start(self, epoch: int) -> None:
        """The epoch start committed and this node is still its master."""
        for tasks in self._tasks:
            tasks.start(epoch)

    def stop(self) -> None:
        """The role is gone: every task stops now."""
        for tasks in self._tasks:
            tasks.stop()

    async def close(self) -> None:
        """Stops and waits for every task to end (the node is stopping)."""
        for tasks in self._tasks:
            await tasks.close()
