"""The sync source's side of a reorganization: answering a new master's ``FetchLog``
with the log after where the two logs part, or with a snapshot and the log after it when
the new master cannot take the log alone (its log is compacted, shares no entry with
ours, or lacks entries ours compacted).

The synchronous ``ReplicaDriver`` decides the answer (``fetch_answer``) and
``FetchServing`` which messages carry it (the replication simulator sends the same);
``SyncSource`` reads the log on a worker thread and pumps the snapshot (``snapshot_pump``) under the
commit lock, so no batch is half-applied under the snapshot's LSN.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable

from squall.v1 import replica_pb2
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.fetch_serving import FetchServing
from squall_server.replica.snapshot_pump import pump_snapshot
from squall_server.replica.store import Store
from squall_server.replica.visibility import CommitGate


class SyncSource:
    """Serves reorganization fetches from this node's store."""

    def __init__(
        self,
        node_id: str,
        driver: ReplicaDriver,
        config: Callable[[], ClusterConfig],
        *,
        is_master: Callable[[], bool],
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        clock: Clock,
    ) -> None:
        """``config`` gives the configuration in force; ``is_master`` whether this node
        holds the master role now."""
        self.node_id = node_id
        self.driver = driver
        self._config = config
        self._is_master = is_master
        self._io = io
        self._commit_lock = commit_lock
        self.clock = clock

    @property
    def config(self) -> ClusterConfig:
        return self._config()

    @property
    def store(self) -> Store:
        return self.driver.store

    @property
    def gate(self) -> CommitGate:
        return self.driver.gate

    async def fetch_log(
        self, request: replica_pb2.FetchLogRequest
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]:
        """Serves a new master's reorganization fetch: the log after where ours part, or a
        snapshot and the log after it when the requester cannot take the log alone."""
        answer = self.driver.fetch_answer(
            request,
            is_master=self._is_master(),
            step_max=self.config.limits.commit_batch_max_entries,
        )
        serving = FetchServing(answer, lambda: self.gate.commit_lsn)
        if serving.snapshot:
            async for chunk in self._export_snapshot(request.node_id[:64]):
                yield serving.snapshot_chunk(chunk)
            serving.snapshot_sent(self.store.meta().last_lsn)
        else:
            yield serving.opening()
        # One read per batch of the answer: bounded by where the log ended.
        while (read := serving.next_read()) is not None:
            entries = await asyncio.to_thread(self.store.read_log, *read)
            response = serving.entries_read(entries)
            if response is None:
                break
            yield response

    def stamp_snapshot(self, chunk: replica_pb2.SnapshotChunk) -> None:
        """On a snapshot's last chunk: what the receiver must hide (the driver's)."""
        self.driver.stamp_snapshot(chunk)

    async def _export_snapshot(self, requester: str) -> AsyncIterator[replica_pb2.SnapshotChunk]:
        """This store's snapshot for a fetch (``snapshot_pump``: one read transaction on
        the store thread, the next chunk read only once the caller took the last one)."""
        pump = pump_snapshot(
            lambda: self.store,
            io=self._io,
            commit_lock=self._commit_lock,  # no batch half-applied under the snapshot's LSN
            clock=self.clock,
            max_message_bytes=self.config.limits.max_message_bytes,
            sender=f"replica {self.node_id}",
            recipient=requester,
            purpose=" for its reorganization",
            stamp=self.stamp_snapshot,
            chunk_delay_s=self.config.timeouts.snapshot_chunk_delay_ms / 1000,  # test-only
        )
        async with contextlib.aclosing(pump) as chunks:
            async for chunk in chunks:
                yield chunk
