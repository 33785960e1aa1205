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
from squall_server.replica.store import StoreError

log = logging.getLogger("squall.replica")


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

    async def batch(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> AsyncGenerator[replica_pb2.ReplicationAck, None]:
        """Checks and stores one batch from the master, yielding each ack as it is due.

        A NO_SYNC replica's ack on receipt is yielded before the write, so the master can
        count it without waiting for this store.
        """
        driver = self.driver
        if _stages.ENABLED:
            for entry in batch.entries:
                _stages.mark("s.in", f"lsn/{entry.lsn}")
        async with self._commit_lock:
            accepted, follower, acks_now = driver.batch(stream, batch)
            for ack_now in acks_now:
                yield ack_now
            steps = driver.write_batch(accepted, follower, batch.commit_lsn)
            for written in await self._batch_steps(steps, follower):
                yield written

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

    async def _batch_steps(
        self,
        steps: Generator[BatchStep, None, list[replica_pb2.ReplicationAck]],
        follower: Follower,
    ) -> list[replica_pb2.ReplicationAck]:
        """Carries out a batch's store steps (commit lock held) in the driver's order
        (``ReplicaDriver.write_batch``); returns the acks to send. A failed truncation
        or append closes the stream with the driver's status (and may fail-stop)."""
        try:
            step = next(steps)
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
                        error, fail_stop = self.driver.batch_failed(follower, exc)
                        if fail_stop:
                            self._fail_stop(fail_stop)
                        raise error from exc
                    if _stages.ENABLED and isinstance(step, AppendBatch):
                        for entry in step.entries:
                            _stages.mark("s.stored", f"lsn/{entry.lsn}")
                step = steps.send(None)
        except StopIteration as done:
            acks: list[replica_pb2.ReplicationAck] = done.value
            return acks

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
