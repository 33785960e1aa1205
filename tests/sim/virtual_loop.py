"""A deterministic asyncio event loop on virtual time, for simulating the shipped async code.

``VirtualLoop`` is the standard selector loop with three things replaced:

* **Time.** ``loop.time()`` is a simulated clock that only moves when nothing is ready to
  run: the loop then jumps to its next timer (no real sleeping). ``LoopClock`` is the
  ``Clock`` (``services/common/clock.py``) whose readings are that time, for the code that
  takes an injected clock.
* **Threads.** Nothing runs on a thread. ``SimExecutor`` is an executor for the shells'
  store thread (``ReplicaNode(io=...)``): its jobs run one at a time, in order, as loop
  callbacks after a delay the simulator chooses (a slow disk); ``run_in_executor(None, ...)``
  (``asyncio.to_thread``) runs its job as the next callback. With no threads and no real
  I/O, asyncio's own order (FIFO ready queue, timers by deadline then by scheduling
  order) makes a run a function of its inputs.
* **Processes.** Code runs on behalf of a simulated process, named by the context variable
  ``PROCESS`` (tasks inherit it from whoever creates them, callbacks from whoever
  schedules them). ``pause(p)`` holds every callback of p until ``resume(p)`` (a SIGSTOP:
  its timers still fire, the wakeups they cause wait); ``kill(p)`` parks them for good (a
  crashed process: its tasks never run again, whatever they were awaiting) until
  ``wind_down`` ends the run by letting every task unwind.

Others do this differently: ``looptime`` (PyPI) fast-forwards an asyncio loop's time but
keeps executor jobs on real threads (real time, not deterministic); trio's ``MockClock``
with ``autojump_threshold=0`` jumps like this loop but is trio's. Neither has processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import selectors
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from squall_server.common.clock import MANUAL_CLOCK_WALL_START_MS

T = TypeVar("T")

# The simulated process a piece of code runs for ("" is the simulator itself).
PROCESS: contextvars.ContextVar[str] = contextvars.ContextVar("sim_process", default="")


class LoopIdleError(RuntimeError):
    """Nothing is ready and no timer is set: the awaited thing can never happen."""


class _VirtualSelector(selectors.SelectSelector):
    """Registers the loop's self-pipe like the real one but never waits on it: a select
    with a timeout moves the loop's clock to its next timer instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        assert loop is not None
        if timeout is None:
            raise LoopIdleError(
                f"virtual loop idle at t={loop.time():.3f} s: no callback ready and no timer"
            )
        if timeout > 0:
            loop.jump_to_next_timer()
        return []


class _ProcessTimer(asyncio.TimerHandle):
    """A timer of a process: when it fires while its process is paused or killed, it is
    held or parked itself instead of running (a subclass, not a wrapping callback:
    thousands of timers fire in a seed). Itself, not a new handle for its callback: a
    timer cancelled after it fired but before its process ran again must not run, as in
    a real loop, which skips a cancelled handle it had made ready. An ``asyncio.timeout``
    whose wait ended in the same turn as its deadline (a paused process resumed) cancels
    its timer on leaving; run anyway, the timer failed its state assertion (coordinated
    simulator, seed 10062 under acks "majority")."""

    __slots__ = ()

    def _run(self) -> None:
        loop = self._loop  # type: ignore[attr-defined]
        if loop._paused or loop._killed:
            process = self._context.get(PROCESS, "")  # type: ignore[attr-defined]
            if process in loop._killed:
                loop.callbacks_run += 1
                loop._parked.append(self)
                return
            held = loop._paused.get(process)
            if held is not None:
                loop.callbacks_run += 1
                held.append(self)
                return
        super()._run()  # type: ignore[misc]


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is simulated and whose callbacks belong to processes."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0
        self._paused: dict[str, deque[asyncio.Handle]] = {}
        self._killed: set[str] = set()
        self._parked: list[asyncio.Handle] = []  # killed processes' callbacks
        self._tasks: dict[str, weakref.WeakSet[asyncio.Task[Any]]] = {}
        self._inline = SimExecutor(self, "", lambda: 0.0)
        self.callbacks_run = 0
        self.set_task_factory(self._make_task)  # type: ignore[arg-type]

    # --- time

    def time(self) -> float:
        """The simulated time in seconds."""
        return self._now

    def jump_to_next_timer(self) -> None:
        """Nothing is ready: time moves to the earliest timer's deadline."""
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            self._now = max(self._now, scheduled[0].when())

    def _write_to_self(self) -> None:
        """Everything runs on this thread: there is no waiting select to wake."""

    # --- processes

    def _process_of(self, context: contextvars.Context | None) -> str:
        return PROCESS.get() if context is None else context.get(PROCESS, "")

    def _call_soon(
        self,
        callback: Callable[..., object],
        args: tuple[object, ...],
        context: contextvars.Context | None,
    ) -> asyncio.Handle:
        self.callbacks_run += 1
        if self._paused or self._killed:
            process = self._process_of(context)
            if process in self._killed:
                handle = asyncio.Handle(callback, args, self, context)
                self._parked.append(handle)  # never runs, unless at the end (wind_down)
                return handle
            held = self._paused.get(process)
            if held is not None:
                handle = asyncio.Handle(callback, args, self, context)
                held.append(handle)
                return handle
        ready: asyncio.Handle = super()._call_soon(callback, args, context)  # type: ignore[misc]
        return ready

    def call_at(
        self,
        when: float,
        callback: Callable[..., object],
        *args: object,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        """A timer whose callback, when it fires, waits while its process is paused and
        never runs once it was killed (``_ProcessTimer``; what the base ``call_at`` does
        otherwise, without its debug-mode traceback)."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = _ProcessTimer(when, callback, args, self, context)
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _make_task(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, T],
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.Task(coro, loop=loop, context=context)
        process = self._process_of(context)
        if process:
            tasks = self._tasks.get(process)
            if tasks is None:  # (not setdefault: that would build a WeakSet every call)
                tasks = self._tasks[process] = weakref.WeakSet()
            tasks.add(task)
        return task

    def spawn(self, process: str, coro: Coroutine[Any, Any, T], name: str = "") -> asyncio.Task[T]:
        """A task that runs for process (and so does everything it starts)."""
        context = contextvars.copy_context()
        context.run(PROCESS.set, process)
        return self.create_task(coro, name=name or None, context=context)

    def pause(self, process: str) -> None:
        """Holds every callback of process from now on."""
        self._paused.setdefault(process, deque())

    def resume(self, process: str) -> None:
        """Runs what process held, in the order it was scheduled."""
        for handle in self._paused.pop(process, deque()):
            if not handle.cancelled():
                self._ready.append(handle)  # type: ignore[attr-defined]

    def kill(self, process: str) -> None:
        """process never runs again: its callbacks, held or to come, are parked (its
        tasks stay suspended where they were, as a killed process's threads do)."""
        self._killed.add(process)
        self._parked.extend(self._paused.pop(process, deque()))

    def wind_down(self, timeout_s: float = 10.0) -> None:
        """Ends a run: every process runs again only to unwind (every task cancelled and
        run until it finished), so no coroutine is left suspended for the garbage
        collector to close. Call outside run_until_complete, before close."""
        self._killed.clear()
        self._ready.extend(self._parked)  # type: ignore[attr-defined]
        self._parked.clear()
        for process in list(self._paused):
            self.resume(process)
        for _ in range(3):  # a task may swallow one cancellation (and then end)
            tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
            if not tasks:
                return
            for task in tasks:
                task.cancel()
            self.run_until_complete(asyncio.wait(tasks, timeout=timeout_s))

    def tasks_of(self, process: str) -> list[asyncio.Task[Any]]:
        """The tasks process created (alive or not)."""
        return list(self._tasks.get(process, ()))

    # --- threads

    def run_in_executor(
        self, executor: concurrent.futures.Executor | None, func: Callable[..., T], *args: object
    ) -> asyncio.Future[T]:
        """``asyncio.to_thread`` and the default executor: the job runs as a callback."""
        return super().run_in_executor(executor or self._inline, func, *args)


class SimExecutor(concurrent.futures.Executor):
    """A one-worker executor (a store thread) whose jobs run as loop callbacks, one at a
    time in submission order, each after ``delay_s()`` of simulated time (the disk).

    Like a thread pool's, a job cancelled before it started never runs; a job cannot be
    stopped once it runs (here a job runs whole in one callback). ``kill`` drops the
    queue (the process died with its thread)."""

    def __init__(self, loop: VirtualLoop, process: str, delay_s: Callable[[], float]) -> None:
        self._loop = loop
        self._process = process
        self._delay_s = delay_s
        self._queue: deque[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = deque()
        self._busy = False
        self._dead = False
        self.jobs = 0

    def submit(
        self, fn: Callable[..., T], /, *args: object, **kwargs: object
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._dead:
            future.set_exception(RuntimeError("the store thread is gone (process killed)"))
            return future
        self._queue.append((future, lambda: fn(*args, **kwargs)))
        if not self._busy:
            self._next()
        return future

    def _next(self) -> None:
        if self._dead or not self._queue:
            self._busy = False
            return
        self._busy = True
        context = contextvars.copy_context()
        context.run(PROCESS.set, self._process)
        delay = self._delay_s()
        if delay > 0:
            self._loop.call_later(delay, self._run, context=context)
        else:
            self._loop.call_soon(self._run, context=context)

    def _run(self) -> None:
        future, job = self._queue.popleft()
        if future.set_running_or_notify_cancel():
            self.jobs += 1
            try:
                result = job()
            except BaseException as exc:  # handed to the awaiting side
                future.set_exception(exc)
            else:
                future.set_result(result)
        self._next()

    def kill(self) -> None:
        """The process died: queued jobs never run (their futures stay pending)."""
        self._dead = True
        self._queue.clear()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to join: jobs left run (as a thread pool's would) unless cancelled."""
        if cancel_futures:
            for future, _ in self._queue:
                future.cancel()


class Every:
    """Calls ``observe`` every ``interval_s`` of the loop's time (the first call after
    ``first_s``) as a plain timer callback, until ``cancel``: for the simulator's own
    observers (samplers, tickers), which run thousands of times a seed and as tasks
    cost a future, a timer and a task step each time."""

    def __init__(
        self,
        loop: VirtualLoop,
        interval_s: float,
        observe: Callable[[], object],
        *,
        first_s: float | None = None,
    ) -> None:
        self._loop = loop
        self._interval_s = interval_s
        self._observe = observe
        self._handle: asyncio.Handle = (
            loop.call_soon(self._fire)
            if first_s == 0
            else loop.call_later(interval_s if first_s is None else first_s, self._fire)
        )

    def _fire(self) -> None:
        self._handle = self._loop.call_later(self._interval_s, self._fire)
        self._observe()

    def cancel(self) -> None:
        self._handle.cancel()


class LoopClock:
    """The injected ``Clock`` whose time is the virtual loop's (monotonic and wall move
    together; the wall clock starts at ``MANUAL_CLOCK_WALL_START_MS``)."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop

    def monotonic_ms(self) -> int:
        """Milliseconds of the loop's time."""
        return int(self._loop.time() * 1000)

    def monotonic_ns(self) -> int:
        """Nanoseconds of the loop's time."""
        return int(self._loop.time() * 1_000_000_000)

    def wall_ms(self) -> int:
        """The wall clock: a fixed start plus the loop's time."""
        return MANUAL_CLOCK_WALL_START_MS + self.monotonic_ms()


def run(main: Coroutine[Any, Any, T], loop: VirtualLoop | None = None) -> T:
    """Runs main to completion on a (new) virtual loop and closes it."""
    loop = loop or VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.wind_down()
        loop.close()
