"""The slave side of replication: what a slave does with its master's hello, entry
batches, snapshot chunks and heartbeats (driven by the Replication servicer,
``replication_server.serve_replicate``).

The synchronous ``ReplicaDriver`` checks each message with the pure ``Follower`` and
applies its effects to the store and the commit gate; this shell holds the commit lock
while a message is applied, runs the store's writes on the store thread, and yields
each ack as it is due. A snapshot chunk is installed the same way for a new master's
reorganization fetch (``install_snapshot_chunk``, from ``taking_master``).

``SlaveSide`` is given what it uses: the driver, the commit lock, the store thread, the
writer's append and compaction, the truncation of a divergent suffix and the fail-stop
callback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Sequence
from typing import Protocol

from squall.v1 import replica_pb2
from squall.wire import stages as _stages
from squall_server.common.errors import ServiceError
from squall_server.replica.core import ReplicaCore
from squall_server.replica.core_view import CoreView
from squall_server.replica.driver import (
    AppendBatch,
    BatchStep,
    CompactLog,
    ReplicaDriver,
    TruncateLog,
)
from squall_server.replica.follower import Follower, FollowerError
from squall_server.replica.replication import batch_size_bytes
from squall_server.replica.store import StoreError

log = logging.getLogger("squall.replica")

# A slave's unflushed appends up to this size run on the event loop (``_appends_inline``).
INLINE_APPEND_BYTES_MAX = 64 * 1024

# What ``SlaveSide.batch_acks`` returns: the acks due on receipt, then the acks due once
# the batch is stored, or the task that stores it and returns them.
BatchAcks = tuple[
    list[replica_pb2.ReplicationAck],
    list[replica_pb2.ReplicationAck] | asyncio.Task[list[replica_pb2.ReplicationAck]],
]


class AppendEntries(Protocol):
    """Appends entries to the store, commit lock held (``Writer.append_entries``)."""

    def __call__(
        self, entries: Sequence[replica_pb2.LogEntry], *, sync: bool, commit_lsn: int
    ) -> Awaitable[None]: ...


class SlaveSide(CoreView):
    """Applies the master's replication stream to this node's store."""

    def __init__(
        self,
        node_id: str,
        core: ReplicaCore,
        driver: ReplicaDriver,
        *,
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        append: AppendEntries,
        compact: Callable[[int], Awaitable[None]],
        truncate_locked: Callable[[int, str], Awaitable[None]],
        fail_stop: Callable[[str], None],
    ) -> None:
        """``append(entries, *, sync, commit_lsn)`` and ``compact(keep_from_lsn)`` are the
        writer's (commit lock held); ``truncate_locked(keep_lsn, why)`` the truncation's."""
        self.node_id = node_id
        self.core = core
        self.driver = driver
        self._io = io
        self._commit_lock = commit_lock
        self._append = append
        self._compact = compact
        self._truncate_locked = truncate_locked
        self._fail_stop = fail_stop
        self._commit_recording: asyncio.Task[None] | None = None  # the core's record_commit

    async def hello(
        self, hello: replica_pb2.ReplicationHello
    ) -> tuple[int, replica_pb2.ReplicationPosition]:
        """Accepts a stream from this epoch's master; returns its number and our position."""
        async with self._commit_lock:
            return self.driver.hello(hello)

    async def batch_acks(self, stream: int, batch: replica_pb2.EntryBatch) -> BatchAcks:
        """Checks and stores one batch from the master: returns the acks due on receipt
        (send them first) and those due once it is stored, or the task storing it.

        A small unflushed append (and a batch with nothing to write) is stored here, on
        the loop, before this returns. Whatever must wait (a flush, a large batch, a
        truncation, a compaction, or any write after a NO_SYNC ack on receipt, which goes
        out before the write) runs in a task of its own that holds the commit lock until
        the batch is done: the batch finishes, and frees the lock, whether or not anyone
        still waits for it (a stream gRPC dropped while its handler waited; docs/chaos.md).
        Await that task under ``asyncio.shield``.
        """
        driver = self.driver
        if _stages.ENABLED:
            for entry in batch.entries:
                _stages.mark("s.in", f"lsn/{entry.lsn}")
        lock = self._commit_lock
        await lock.acquire()
        # From here to the return nothing awaits: no cancellation can land in between.
        try:
            accepted, follower, acks_now = driver.batch(stream, batch)
            steps = driver.write_batch(accepted, follower, batch.commit_lsn)
            if acks_now and accepted.batch is not None:
                step: BatchStep | list[replica_pb2.ReplicationAck] = steps.send(None)
            else:
                step = self._steps_inline(steps, follower)
        except StopIteration as done:
            lock.release()
            return acks_now, done.value
        except BaseException:
            lock.release()
            raise
        if isinstance(step, list):
            lock.release()
            return acks_now, step
        task = asyncio.get_running_loop().create_task(
            self._finish_steps(steps, step, follower), name=f"slave-batch-{self.node_id}"
        )
        # Held until done (the loop holds tasks only weakly, and whoever waited for it may
        # be gone long before the batch is); a failure nobody awaited is only logged.
        _BATCHES.add(task)
        task.add_done_callback(_batch_done)
        return acks_now, task

    async def batch(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> AsyncGenerator[replica_pb2.ReplicationAck, None]:
        """``batch_acks`` as a generator yielding each ack as it is due (the commit lock is
        never held at a yield)."""
        acks_now, stored = await self.batch_acks(stream, batch)
        for ack in acks_now:
            yield ack
        for ack in stored if isinstance(stored, list) else await asyncio.shield(stored):
            yield ack

    async def snapshot(
        self, stream: int, chunk: replica_pb2.SnapshotChunk
    ) -> list[replica_pb2.ReplicationAck]:
        """Installs one snapshot chunk from the master; after the last, returns the ack."""
        async with self._commit_lock:
            result, follower = self.driver.snapshot_chunk(stream, chunk)
            try:
                installed = await self.install_snapshot_chunk(
                    chunk,
                    last=result.install,
                    history=result.history,
                    source=f"master {follower.state().master_id}",
                )
            except (StoreError, FollowerError) as exc:
                error, fail_stop = self.driver.snapshot_failed(follower, chunk.index, exc)
                if fail_stop:
                    self._fail_stop(fail_stop)
                raise error from exc
            if installed is None:
                return []
            return [self.driver.snapshot_installed_ack(follower, installed)]

    async def install_snapshot_chunk(
        self,
        chunk: replica_pb2.SnapshotChunk,
        *,
        last: bool,
        history: Iterable[tuple[int, int]],
        source: str,
    ) -> int | None:
        """Installs one snapshot chunk (commit lock held) as ``ReplicaDriver.install_snapshot``
        says, its store operations on the store thread: chunk 0 begins the install, the
        last (`last`) finishes it with `history`. Returns the snapshot's LSN once
        installed, else None. A slave's stream and a new master's reorganization fetch
        share it; store errors are the caller's to map."""
        steps = self.driver.install_snapshot(chunk, last=last, history=history, source=source)
        loop = asyncio.get_running_loop()
        try:
            call = next(steps)
            # One store operation per step of the install: at most three.
            while True:
                try:
                    await loop.run_in_executor(self._io, call)
                except BaseException as exc:
                    # The install learns how its store operation ended (a failed swap puts
                    # the commit gate back; a cancelled one keeps it hiding), then raises it.
                    call = steps.throw(exc)
                    continue
                call = steps.send(None)
        except StopIteration as done:
            installed: int | None = done.value
            return installed

    def heartbeat(
        self, stream: int, heartbeat: replica_pb2.ReplicationHeartbeat
    ) -> replica_pb2.ReplicationAck:
        """A heartbeat from the master: learns its commit LSN; returns the ack."""
        record_commit, ack = self.driver.heartbeat(stream, heartbeat)
        # No store operation but the background record: applied without the commit lock.
        if record_commit:
            self._commit_recording = asyncio.get_running_loop().create_task(
                self._record_commit(record_commit), name=f"record-commit-{self.node_id}"
            )
        return ack

    def _steps_inline(
        self,
        steps: Generator[BatchStep, None, list[replica_pb2.ReplicationAck]],
        follower: Follower,
    ) -> BatchStep | list[replica_pb2.ReplicationAck]:
        """Carries out a batch's next store steps (commit lock held) on the loop while
        each is a small unflushed append (``_appends_inline``); returns the acks to send
        once the steps are done, or the first step that must wait (``_finish_steps``)."""
        try:
            step = steps.send(None)
            # At most three steps: truncate, append, compact.
            while isinstance(step, AppendBatch) and _appends_inline(step):
                try:
                    self.driver.store_append(step.entries, sync=False, commit_lsn=step.commit_lsn)
                except StoreError as exc:
                    raise self._batch_failed(follower, exc) from exc
                if _stages.ENABLED:
                    _mark_stored(step)
                step = steps.send(None)
        except StopIteration as done:
            acks: list[replica_pb2.ReplicationAck] = done.value
            return acks
        return step

    async def _finish_steps(
        self,
        steps: Generator[BatchStep, None, list[replica_pb2.ReplicationAck]],
        step: BatchStep,
        follower: Follower,
    ) -> list[replica_pb2.ReplicationAck]:
        """Carries out a batch's store steps from `step` on, in the driver's order
        (``ReplicaDriver.write_batch``), then releases the commit lock (held by
        ``batch_acks``); returns the acks to send. A failed truncation or append closes
        the stream with the driver's status (and may fail-stop)."""
        try:
            # At most three steps: truncate, append, compact.
            while True:
                if isinstance(step, CompactLog):
                    await self._compact(step.keep_from_lsn)
                else:
                    try:
                        if isinstance(step, TruncateLog):
                            await self._truncate_locked(
                                step.keep_lsn, f"master {follower.state().master_id}"
                            )
                        else:
                            await self._append(
                                step.entries, sync=step.sync, commit_lsn=step.commit_lsn
                            )
                    except (StoreError, ServiceError) as exc:
                        raise self._batch_failed(follower, exc) from exc
                    if _stages.ENABLED and isinstance(step, AppendBatch):
                        _mark_stored(step)
                following = self._steps_inline(steps, follower)
                if isinstance(following, list):
                    return following
                step = following
        finally:
            self._commit_lock.release()

    def _batch_failed(self, follower: Follower, exc: Exception) -> ServiceError:
        """A batch's store step failed: the stream's status (fail-stopping when due)."""
        error, fail_stop = self.driver.batch_failed(follower, exc)
        if fail_stop:
            self._fail_stop(fail_stop)
        return error

    async def _record_commit(self, commit_lsn: int) -> None:
        """Records a commit LSN learnt without a batch (a heartbeat: the stream is idle),
        so a restart does not hide the last batch (the core allows one at a time)."""
        recorded = 0
        try:
            async with self._commit_lock:  # ordered with appends, truncations and installs
                recorded = await asyncio.get_running_loop().run_in_executor(
                    self._io, self.driver.store_record_commit, commit_lsn
                )
        except StoreError as exc:
            # Only a hint for the next start-up: a failure hides more after a restart.
            log.warning(
                "replica %s: recording commit LSN %d failed: %s", self.node_id, commit_lsn, exc
            )
        finally:
            # Cancelled or failed: the next heartbeat records it.
            self.driver.commit_recorded(recorded)


_BATCHES: set[asyncio.Task[list[replica_pb2.ReplicationAck]]] = set()


def _batch_done(task: asyncio.Task[list[replica_pb2.ReplicationAck]]) -> None:
    _BATCHES.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("a slave batch failed after its stream ended: %s", task.exception())


def _appends_inline(step: AppendBatch) -> bool:
    """Whether a slave's append runs on the loop: unflushed and small, the writer's rule
    for its own appends (``writer._INLINE_APPEND_BYTES_MAX``): a one-entry commit without
    fsync costs less than the hand-off to the store thread and back."""
    return not step.sync and batch_size_bytes(step.entries) <= INLINE_APPEND_BYTES_MAX


def _mark_stored(step: AppendBatch) -> None:
    for entry in step.entries:
        _stages.mark("s.stored", f"lsn/{entry.lsn}")
