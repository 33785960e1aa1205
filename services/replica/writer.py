"""The master's writer: the write queue, group commit and log compaction.

Every write goes through one writer, one commit batch at a time under the commit lock.
The writer task drains every command waiting (up to a bounded batch), plans them with a
`BatchBuilder` (the driver's ``plan_batch``), appends the whole batch to the store in one
transaction (small unflushed batches on the loop, the rest on the store thread, so fsync
never blocks the event loop), and only then hands the batch and its commands to the
master's replication (``MasterDriver.appended``, one record): a write is acknowledged only
once its entry is committed. A lone submitter's command (its caller has nothing else in
flight, nothing is queued, no write waits for its commit, the lock is free; on a master
whose commits wait for its slaves) is committed the same way at once, in the submitter's
turn, without waiting for the writer task's next turn; what must wait (a large append,
the flush, a compaction) then runs in a task of its own that holds the lock until done.
Bookkeeping that no caller waits on (a push subscriber's cursor) rides with the next
commit batch (``submit_with_next``), so it shares that batch's append, fsync and
replication round instead of paying a round of its own; it goes alone only when nothing
else is written within its wait.
A slave's batches are appended and its log compacted the same way (``append_entries``,
``compact``), from ``slave_side``.

The writer holds no reference to the node: what it needs (the core and driver, the
master's replication of this epoch, the commit lock, the store thread, the clock and the
fault callbacks) is handed to it by ``ReplicaNode``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall.wire import stages as _stages
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.telemetry import Telemetry
from squall_server.replica import commands, telemetry
from squall_server.replica.commands import Command, Planned
from squall_server.replica.core import ReplicaCore
from squall_server.replica.core_view import CoreView
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.master_driver import MasterDriver, Waiting
from squall_server.replica.replication import AckPolicy, MasterConfig, batch_size_bytes
from squall_server.replica.store import StoreError

log = logging.getLogger("squall.replica")

# Unflushed appends up to this size run on the event loop: an LMDB commit of a few
# entries without fsync takes tens of microseconds, less than the hand-off to the store
# thread and back (~0.3 ms per append measured on a busy 2-core machine), which one-at-a-
# time publishing pays twice per event (master and slave). Flushes and large batches go to
# the store thread so the loop never waits on the disk or on a long copy.
_INLINE_APPEND_BYTES_MAX = 64 * 1024


@dataclass
class _Pending:
    command: Command
    future: asyncio.Future[Planned]
    # Set once the command's entry is appended locally (before it commits).
    appended: asyncio.Future[None] | None = None
    # A traced publish: told when its entry is appended (squall_server.replica.telemetry).
    trace: telemetry.PublishWatch | None = None


class Writer(CoreView):
    """The write queue and its one writer task; appends and compactions of the log."""

    def __init__(
        self,
        node: NodeConfig,
        config: Callable[[], ClusterConfig],
        core: ReplicaCore,
        driver: ReplicaDriver,
        master: Callable[[], MasterDriver | None],
        *,
        clock: Clock,
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        observability: Telemetry,
        report_fault: Callable[[str], None],
        fail_stop: Callable[[str], None],
    ) -> None:
        """``config`` gives the configuration in force (a membership change replaces it);
        ``master`` the master's replication of this epoch (None unless master)."""
        self.node = node
        self._config = config
        self.core = core
        self.driver = driver
        self._master = master
        self.clock = clock
        self._io = io
        self._commit_lock = commit_lock
        self.telemetry = observability
        self.report_fault = report_fault
        self._fail_stop = fail_stop
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Commits begun at once whose rest runs in a task (held: the loop holds tasks
        # only weakly).
        self._rests: set[asyncio.Task[None]] = set()
        # Commands waiting to ride with the next commit batch (``submit_with_next``), and
        # the timer that queues them on their own if no batch begins first. Bounded by
        # their submitters: each push subscriber keeps at most one cursor write in flight.
        self._riders: list[_Pending] = []
        self._riders_due: asyncio.TimerHandle | None = None

    # --- what the moved methods read, by the names they had on the node

    @property
    def config(self) -> ClusterConfig:
        return self._config()

    @property
    def _driver(self) -> MasterDriver | None:
        return self._master()

    # --- the queue

    def start(self) -> None:
        """Starts the writer task."""
        self._task = asyncio.create_task(self._write_loop(), name=f"writer-{self.node.id}")

    async def stop(self) -> None:
        """Stops the writer task and fails anything still queued as indeterminate."""
        task = self._task
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for rest in list(self._rests):  # as the writer task's commit: stopped where it is
            rest.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rest
        self._queue_riders()
        while self._queue:
            pending = self._queue.popleft()
            if not pending.future.done():
                pending.future.set_exception(
                    ServiceError(Code.UNKNOWN, "replica stopped before the write committed")
                )

    def fail_queued(self, error: ServiceError) -> None:
        """Fails every write queued and not begun (definitely not stored)."""
        self._queue_riders()
        while self._queue:
            _fail_pending(self._queue.popleft(), error)

    def wake(self) -> None:
        """Wakes the writer (the master role ended: what is queued fails)."""
        self._wakeup.set()

    async def drain(self) -> None:
        """Waits until every write queued now has finished (committed or failed) and no
        batch is being written. Riders go now rather than at the end of their wait."""
        self.release_riders()
        queued = [pending.future for pending in self._queue]
        if queued:
            await asyncio.wait(queued)
        async with self._commit_lock:
            pass

    def idle(self) -> bool:
        """No write queued or being committed (a fenced master's log has stopped growing)."""
        return not self._queue and not self._riders and not self._commit_lock.locked()

    def submit(
        self,
        command: Command,
        *,
        appended: asyncio.Future[None] | None = None,
        trace: telemetry.PublishWatch | None = None,
        alone: bool = False,
    ) -> asyncio.Future[Planned]:
        """Queues a command for the writer; the future resolves once it committed.
        ``alone``: its submitter has nothing else in flight (a lone publisher's stream),
        so it may begin at once (``_may_begin_now``)."""
        future: asyncio.Future[Planned] = asyncio.get_running_loop().create_future()
        pending = _Pending(command, future, appended, trace)
        if alone and self._may_begin_now() and _try_acquire(self._commit_lock):
            # The writer is idle: begun here rather than on the writer task's next turn
            # (a loop turn less from a lone publish's read to its sends, issue 16).
            self._begin_now(pending)
            return future
        self._queue.append(pending)
        self._wakeup.set()
        return future

    def submit_with_next(self, command: Command, within_s: float) -> asyncio.Future[Planned]:
        """Queues a command to ride with the next commit batch, or to go on its own once
        within_s passed with no batch begun; the future resolves once it committed. For
        writes whose caller does not wait on them to answer anyone (a push subscriber's
        cursor): under traffic they cost no append, fsync or replication round of their
        own (issue 16: a lone delivery's cursor write was a round beside every publish)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Planned] = loop.create_future()
        self._riders.append(_Pending(command, future))
        if self._riders_due is None:
            self._riders_due = loop.call_later(within_s, self._riders_waited)
        return future

    def release_riders(self) -> None:
        """Queues the riders now, to go with the writer's next batch."""
        if self._queue_riders():
            self._wakeup.set()

    def _riders_waited(self) -> None:
        self._riders_due = None
        self.release_riders()

    def _queue_riders(self) -> bool:
        """Moves the riders to the end of the queue; whether there were any."""
        if self._riders_due is not None:
            self._riders_due.cancel()
            self._riders_due = None
        if not self._riders:
            return False
        self._queue.extend(self._riders)
        self._riders.clear()
        return True

    def _board_riders(self, batch: list[_Pending], driver: MasterDriver) -> None:
        """Adds the riders to batch as far as the batch bound and the master's write room
        leave space; those left keep waiting."""
        riders = self._riders
        if not riders:
            return
        room = min(self.config.limits.commit_batch_max_entries, driver.core.write_room)
        used = sum(_weight(pending.command) for pending in batch)
        boarding = 0
        for pending in riders:  # bounded by the riders
            if used + _weight(pending.command) > room:
                break
            used += _weight(pending.command)
            boarding += 1
        batch.extend(riders[:boarding])
        del riders[:boarding]
        if not riders and self._riders_due is not None:
            self._riders_due.cancel()
            self._riders_due = None

    async def _write_loop(self) -> None:
        max_commands = self.config.limits.commit_batch_max_entries
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                room = max_commands
                driver = self._driver
                if driver is not None and self.role == common_pb2.ROLE_MASTER:
                    # Publishers wait here while the replicas hold back commits (a full
                    # pending-write table), instead of the master growing memory.
                    room = min(room, await driver.wait_room()) or max_commands
                batch = _take(self._queue, room)
                async with self._commit_lock:
                    try:
                        rest = self._begin_commit(batch)
                        if rest is not None:
                            await rest
                    finally:
                        _finish_appended(batch)
                if self._queue:
                    # Nothing above need suspend (an unflushed append runs inline), so a
                    # long queue would hold the loop for all its batches: the replica's
                    # coordinator, acks and reads wait meanwhile, and under load that
                    # looked like a hung replica (replica_timeout_ms).
                    await asyncio.sleep(0)

    def _may_begin_now(self) -> bool:
        """Whether a lone submitter's command may be committed at once, in its turn:
        nothing queued, and no write waiting for its commit on a master whose commits
        wait for its slaves. While writes wait (other writers), new ones queue and group
        into one commit batch on the writer task as before; with none waiting, begun now
        its batch leaves a loop turn sooner. A master committing alone (one node,
        ``acks = "none"``) never has writes waiting, so that says nothing of its writers:
        there the writer task's turn is what groups them (and a lone write's answer waits
        for its handler's turn either way). A submitter that pipelines (a stream with
        other requests in flight) is not alone: its writes group as they did."""
        if self._queue or self.role != common_pb2.ROLE_MASTER:
            return False
        driver = self._driver
        if driver is None or driver.deposed:
            return False
        core = driver.core
        return core.pending_writes == 0 and _commits_wait_for_slaves(core.config)

    def _begin_now(self, pending: _Pending) -> None:
        """Commits one command in the submitter's turn (commit lock held, taken here): as
        far as it goes without waiting, the rest (an append on the store thread, the
        flush, a compaction) in a task of its own that frees the lock. The write has
        begun: a submitter that gives up later does not stop it (its own task)."""
        batch = [pending]
        lock = self._commit_lock
        try:
            rest = self._begin_commit(batch)
        except BaseException as exc:
            lock.release()
            _fail_pending(
                pending, ServiceError(Code.UNKNOWN, f"indeterminate: the write failed: {exc!r}")
            )
            raise
        if rest is None:
            lock.release()
            _finish_appended(batch)
            return
        task = asyncio.get_running_loop().create_task(rest, name=f"commit-{self.node.id}")
        self._rests.add(task)

        def finished(done: asyncio.Task[None]) -> None:
            # A done callback, so the lock is freed even if the task is cancelled
            # before its first step.
            self._rests.discard(done)
            lock.release()
            _finish_appended(batch)
            if not done.cancelled() and done.exception() is not None:
                log.error("replica %s: a commit failed: %r", self.node.id, done.exception())

        task.add_done_callback(finished)

    def _begin_commit(self, batch: list[_Pending]) -> Coroutine[None, None, None] | None:
        """Commits batch (commit lock held) as far as it goes without waiting; returns
        what is left to await (an append on the store thread, the flush, a compaction),
        or None once done."""
        driver = self._driver
        if self.role != common_pb2.ROLE_MASTER or driver is None or driver.deposed:
            _fail_all(
                [(p, Planned(None)) for p in batch],
                ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self.node.id} lost its role before the write began (not stored)",
                ),
            )
            return None
        self._board_riders(batch, driver)
        if _stages.ENABLED:
            _mark_publishes("m.plan", batch)
        # The caller may have given up (cancelled) before the write began.
        live = [pending for pending in batch if not pending.future.done()]
        planning = self.driver.plan_batch(
            [pending.command for pending in live],
            limits=self.config.limits,
            epoch=self.epoch,
            now_ms=self.clock.wall_ms(),
            # Every node of the node set reads joined entries, this one included.
            join_parts=self.driver.reads_joined_publishes and driver.steps.joins_publishes(),
        )
        for fault in planning.faults:
            self.report_fault(fault)
        for index, refusal in planning.refused:
            live[index].future.set_exception(refusal)
        planned: list[tuple[_Pending, Planned]] = []
        lsns: list[int] = []
        for index, plan, lsn in planning.planned:
            if plan.parts is not None and all(part.plan is None for part in plan.parts):
                # Every part of a joined request was refused: nothing to wait for.
                live[index].future.set_result(plan)
                continue
            planned.append((live[index], plan))
            lsns.append(lsn)
        entries = planning.entries
        if not entries:
            return self._stored(driver, planned, lsns, entries)
        commit_lsn = self.gate.commit_lsn
        # Written unflushed: under SYNC the flush runs below while the batch is already
        # on its way to the slaves (docs/replication.md, "Send before the flush"); the
        # commit still waits for it.
        if batch_size_bytes(entries) > _INLINE_APPEND_BYTES_MAX:
            return self._append_away(driver, planned, lsns, entries, commit_lsn)
        try:
            self.driver.store_append(entries, sync=False, commit_lsn=commit_lsn)
        except StoreError as exc:
            self._append_failed(exc, planned, entries)
            return None
        self.driver.batch_appended(entries[-1].lsn, commit_lsn)
        return self._stored(driver, planned, lsns, entries)

    async def _append_away(
        self,
        driver: MasterDriver,
        planned: list[tuple[_Pending, Planned]],
        lsns: list[int],
        entries: Sequence[replica_pb2.LogEntry],
        commit_lsn: int,
    ) -> None:
        """A large batch's append on the store thread, then the rest of its commit."""
        try:
            await self._append(entries, sync=False, commit_lsn=commit_lsn)
        except StoreError as exc:
            self._append_failed(exc, planned, entries)
            return
        self.driver.batch_appended(entries[-1].lsn, commit_lsn)
        rest = self._stored(driver, planned, lsns, entries)
        if rest is not None:
            await rest

    def _append_failed(
        self,
        exc: StoreError,
        planned: list[tuple[_Pending, Planned]],
        entries: Sequence[replica_pb2.LogEntry],
    ) -> None:
        error, fail_stop = self.driver.append_failed(
            exc,
            len(entries),
            epoch=self.epoch,
            map_size_bytes=self.config.limits.map_size_bytes,
        )
        if fail_stop:
            self._fail_stop(fail_stop)
        _fail_all(planned, error)

    def _stored(
        self,
        driver: MasterDriver,
        planned: list[tuple[_Pending, Planned]],
        lsns: list[int],
        entries: Sequence[replica_pb2.LogEntry],
    ) -> Coroutine[None, None, None] | None:
        """The batch is in the local store: hands it and its writes to replication; what
        is left to await (the flush, a compaction), or None."""
        if driver is not self._driver or driver.deposed:
            _fail_all(
                planned,
                ServiceError(
                    Code.UNKNOWN,
                    f"indeterminate: replica {self.node.id} lost the master role of epoch "
                    f"{self.epoch} after storing the write locally; it may or may not survive",
                ),
            )
            return None
        if _stages.ENABLED:
            _mark_stored(planned, lsns)
        if self.telemetry.tracing:
            # Before the append reaches the driver: its sends may leave at once.
            driver.traced(
                [
                    (lsn, pending.trace.appended(lsn, self.epoch, plan.receipt))
                    for (pending, plan), lsn in zip(planned, lsns, strict=True)
                    if pending.trace is not None
                ]
            )
        steps = driver.steps
        for _, plan in planned:
            for part in plan.parts or ():
                part.lsn = steps.wait_lsn(part.lsn)
        # The append and its writes in one record: the sends leave first, then whatever
        # commits completes.
        driver.appended(
            entries,
            synced=False,
            writes=[
                Waiting(pending.future, plan, steps.wait_lsn(lsn))
                for (pending, plan), lsn in zip(planned, lsns, strict=True)
            ],
        )
        if entries and steps.flush_after_send():
            return self._flush_then_compact(driver, entries[-1].lsn)
        return self._compaction(driver)

    async def _flush_then_compact(self, driver: MasterDriver, last_lsn: int) -> None:
        await self._flush(driver, last_lsn)
        rest = self._compaction(driver)
        if rest is not None:
            await rest

    def _compaction(self, driver: MasterDriver) -> Coroutine[None, None, None] | None:
        """The log's compaction after a commit batch, when due (None: not due)."""
        retention = self.config.limits.log_retention_entries
        # Never above the commit LSN: a restart hides what is above it by reading the log.
        keep = min(driver.compaction_target(retention), self.gate.commit_lsn + 1)
        if self.core.compaction(keep) and not driver.deposed:
            driver.set_log_start(keep)  # the core first: no batch is built below keep
            return self._compact(keep)
        return None

    async def _append(
        self, entries: Sequence[replica_pb2.LogEntry], *, sync: bool, commit_lsn: int
    ) -> None:
        """Appends entries to the store (commit lock held), on the loop when small and
        unflushed, recording the commit LSN known with them."""
        append = functools.partial(
            self.driver.store_append, entries, sync=sync, commit_lsn=commit_lsn
        )
        if not sync and batch_size_bytes(entries) <= _INLINE_APPEND_BYTES_MAX:
            append()
            return
        await asyncio.get_running_loop().run_in_executor(self._io, append)

    async def _flush(self, driver: MasterDriver, last_lsn: int) -> None:
        """Flushes the appended batch (commit lock held) while its sends are out; the
        core counts it locally once flushed. A failed flush after sending deposes the
        master (its writes fail as indeterminate) and fail-stops the store."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._io, self.driver.store_sync)
        except StoreError as exc:
            log.error(
                "replica %s: flushing the log to LSN %d failed after the batch was sent: "
                "epoch=%d: %s",
                self.node.id,
                last_lsn,
                self.epoch,
                exc,
            )
            driver.sync_failed(str(exc))
            self._fail_stop(f"store flush failed: {exc}")
            return
        if _stages.ENABLED:
            _stages.mark("m.synced", f"lsn/{last_lsn}")
        driver.synced(last_lsn)

    async def _compact(self, keep_from_lsn: int) -> None:
        """Deletes the log below keep_from_lsn on the store thread (commit lock held)."""
        try:
            deleted = await asyncio.get_running_loop().run_in_executor(
                self._io, self.driver.store_compact, keep_from_lsn
            )
        except StoreError as exc:
            # Compaction only deletes: a failure leaves more log than wanted, not less.
            log.warning(
                "replica %s: compacting the log below LSN %d failed: epoch=%d: %s",
                self.node.id,
                keep_from_lsn,
                self.epoch,
                exc,
            )
            return
        self.driver.compacted()
        log.debug(
            "replica %s compacted its log: %d entries deleted, now LSNs %d..%d",
            self.node.id,
            deleted,
            self._log_start_lsn,
            self._last_lsn,
        )

    # A slave stores the master's batches and compacts its log the same way.
    append_entries = _append
    compact = _compact


def pass_receipt(
    receipt: asyncio.Future[common_pb2.BatchReceipt], planned: asyncio.Future[Planned]
) -> None:
    """Settles a publish's receipt future as its planned write ended."""
    if receipt.done():
        return  # the caller gave up
    if planned.cancelled():
        receipt.cancel()
        return
    error = planned.exception()
    if error is not None:
        receipt.set_exception(error)
        return
    got = planned.result().receipt
    if got is None:
        receipt.set_exception(AssertionError("a planned publish always has a receipt"))
        return
    receipt.set_result(got)


def cancel_with(
    planned: asyncio.Future[Planned], receipt: asyncio.Future[common_pb2.BatchReceipt]
) -> None:
    """A caller that gives up on its receipt cancels the write's wait (as awaiting did)."""
    if receipt.cancelled():
        planned.cancel()


def _commits_wait_for_slaves(config: MasterConfig) -> bool:
    """Whether a commit needs some slave's ack (else the master commits alone)."""
    if config.acks == AckPolicy.NONE:
        return False
    if config.acks == AckPolicy.ALL:
        return len(config.nodes) > 1
    return config.quorum > 1


def _try_acquire(lock: asyncio.Lock) -> bool:
    """Takes lock now if taking it would not wait (free, nobody queued for it): asyncio's
    lock has no such call, but an acquire that need not wait returns in its first step."""
    if lock.locked():
        return False
    step = lock.acquire()
    try:
        step.send(None)
    except StopIteration:
        return True
    # It would wait (a waiter is being handed the lock): leave the queue as it was.
    step.close()
    return False


def _take(queue: deque[_Pending], room: int) -> list[_Pending]:
    """The next commit batch: queued commands up to room, a joined request's parts
    counting one each (its first command is taken whatever its size)."""
    batch = [queue.popleft()]
    used = _weight(batch[0].command)
    while queue and used + _weight(queue[0].command) <= room:
        used += _weight(queue[0].command)
        batch.append(queue.popleft())
    return batch


def _weight(command: Command) -> int:
    return len(command.parts) if isinstance(command, commands.PublishParts) else 1


def _fail_all(planned: list[tuple[_Pending, Planned]], error: ServiceError) -> None:
    for pending, plan in planned:
        if plan.parts is not None and not pending.future.done():
            # A joined request's planned parts fail; its refused parts keep their refusal.
            commands.fail_parts(plan.parts, lambda _: error)
            pending.future.set_result(plan)
            continue
        _fail_pending(pending, error)


def _fail_pending(pending: _Pending, error: ServiceError) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)
    if pending.appended is not None and not pending.appended.done():
        pending.appended.set_exception(error)


def _finish_appended(batch: list[_Pending]) -> None:
    """Answers become_master's wait for the epoch start: appended, or why not."""
    for pending in batch:
        appended = pending.appended
        if appended is None or appended.done():
            continue
        future = pending.future
        if future.done() and not future.cancelled() and future.exception() is not None:
            error = future.exception()
            appended.set_exception(error if error is not None else RuntimeError("write failed"))
        else:
            appended.set_result(None)


def _mark_publishes(stage: str, batch: Sequence[_Pending]) -> None:
    """Marks each publish of a commit batch for the latency budget (squall.wire.stages)."""
    for pending in batch:
        command = pending.command
        requests = (
            command.parts
            if isinstance(command, commands.PublishParts)
            else (command.request,)
            if isinstance(command, commands.Publish)
            else ()
        )
        for request in requests:
            if request.events:
                first = request.events[0].sequence
                _stages.mark(stage, _stages.request_key(request.publisher_id, first))


def _mark_stored(planned: Sequence[tuple[_Pending, Planned]], lsns: Sequence[int]) -> None:
    """Marks the publishes just stored, linking each to its LSN and first offset."""
    stored: list[tuple[broker_pb2.PublishRequest, Planned, int]] = []
    for (pending, plan), lsn in zip(planned, lsns, strict=True):
        command = pending.command
        if isinstance(command, commands.Publish):
            stored.append((command.request, plan, lsn))
        elif isinstance(command, commands.PublishParts) and plan.parts is not None:
            stored.extend(
                (request, part.plan, part.lsn)
                for request, part in zip(command.parts, plan.parts, strict=True)
                if part.plan is not None
            )
    for request, plan, lsn in stored:
        if not request.events:
            continue
        key = _stages.request_key(request.publisher_id, request.events[0].sequence)
        _stages.mark("m.stored", key)
        _stages.link(key, f"lsn/{lsn}")
        if plan.receipt is not None:
            _stages.link(key, f"off/{request.topic}/{plan.receipt.first_offset}")
