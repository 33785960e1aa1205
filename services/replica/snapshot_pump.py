"""The one snapshot pump: streams this store's snapshot in chunks, to a slave behind the
retained log (the master's catch-up, ``master_driver``) or to a new master that cannot
take the log alone (the reorganization fetch, ``ReplicaNode.fetch_log``).

``pump_snapshot`` opens ``Store.snapshot_chunks`` on the store thread with the commit
lock held (no batch is half-applied under the snapshot's LSN, and the caller's
``started`` hook sees the first chunk before any write moves the log on), then yields
the chunks one at a time: the next chunk is read, on the store thread, only once the
consumer took the last, so a stopped consumer holds at most one chunk of memory. The
export's read transaction is released on the store thread whatever happens (the consumer
stops early, is cancelled, or the store fails); a store error reaches the consumer as
``StoreError``. Consume it with ``contextlib.aclosing`` so an early stop closes it at
once.

Bounds: a chunk holds at most ``SNAPSHOT_RECORDS_MAX`` records and
``snapshot_chunk_bytes_max`` bytes (``SNAPSHOT_CHUNK_BYTES_MAX``, and at most half a gRPC
message); one snapshot has at most ``SNAPSHOT_CHUNKS_MAX`` chunks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Generator

from squall.v1 import replica_pb2
from squall_server.common.clock import Clock
from squall_server.replica.store import SNAPSHOT_BYTES_MAX_DEFAULT, Store, StoreError

log = logging.getLogger("squall.replica")

# Records per chunk (a few MB of 100-byte events).
SNAPSHOT_RECORDS_MAX = 8192
# Bytes per chunk, before the gRPC message bound (snapshot_chunk_bytes_max).
SNAPSHOT_CHUNK_BYTES_MAX = SNAPSHOT_BYTES_MAX_DEFAULT
# The most chunks one snapshot may have: a bound on the send loop far above any store
# (2**32 chunks of at least one record each).
SNAPSHOT_CHUNKS_MAX = 1 << 32


def snapshot_chunk_bytes_max(max_message_bytes: int) -> int:
    """The byte budget of one snapshot chunk: it must fit in one gRPC message."""
    return min(SNAPSHOT_CHUNK_BYTES_MAX, max_message_bytes // 2)


async def close_export(
    io: concurrent.futures.Executor, chunks: Generator[replica_pb2.SnapshotChunk, None, None]
) -> None:
    """Releases a snapshot export's read transaction on the store thread.

    ``contextlib.closing`` on the loop could run while the store thread is still
    inside ``next`` (a cancelled await does not stop the thread): queued behind it
    on the one store thread, the close waits its turn.
    """
    try:
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(io, chunks.close))
    except (RuntimeError, asyncio.CancelledError):
        # The store thread is shut down (nothing else runs the generator), or this
        # task was cancelled again while waiting: close it here.
        with contextlib.closing(chunks):
            pass


async def pump_snapshot(
    store: Callable[[], Store],
    *,
    io: concurrent.futures.Executor,
    commit_lock: asyncio.Lock,
    clock: Clock,
    max_message_bytes: int,
    sender: str,
    recipient: str,
    purpose: str = "",
    started: Callable[[replica_pb2.SnapshotChunk], bool] | None = None,
    stamp: Callable[[replica_pb2.SnapshotChunk], None] | None = None,
    chunk_delay_s: float = 0.0,
) -> AsyncGenerator[replica_pb2.SnapshotChunk, None]:
    """This store's snapshot, a chunk at a time (see the module docstring).

    started: called with the first chunk while the commit lock is still held; False
    ends the pump before anything is yielded (the stream it was for is gone). stamp:
    completes the last chunk before it is yielded (the sender's commit LSN and what the
    snapshot holds above it). chunk_delay_s: a wait before each chunk, test-only
    (``timeouts.snapshot_chunk_delay_ms``). sender, recipient and purpose name the
    transfer in the two log lines (its start, and its size and rate once the consumer
    took the last chunk).
    """
    loop = asyncio.get_running_loop()
    bytes_max = snapshot_chunk_bytes_max(max_message_bytes)
    chunks: Generator[replica_pb2.SnapshotChunk, None, None] | None = None
    started_ms = clock.monotonic_ms()
    sent_bytes = 0
    try:
        async with commit_lock:  # the writer held: the snapshot's LSN is the log's last
            chunks = store().snapshot_chunks(SNAPSHOT_RECORDS_MAX, bytes_max)
            chunk = await loop.run_in_executor(io, next, chunks, None)
            if chunk is None:
                raise StoreError("the snapshot export produced no chunk")
            if started is not None and not started(chunk):
                return
        log.info(
            "%s: sending %s a snapshot at LSN %d%s",
            sender,
            recipient,
            chunk.snapshot_lsn,
            purpose,
        )
        for count in range(1, SNAPSHOT_CHUNKS_MAX + 1):
            if chunk.last and stamp is not None:
                stamp(chunk)
            if chunk_delay_s:
                await asyncio.sleep(chunk_delay_s)
            sent_bytes += chunk.ByteSize()
            yield chunk  # resumed once the consumer took it: one chunk in memory at a time
            if chunk.last:
                elapsed_s = max(clock.monotonic_ms() - started_ms, 1) / 1000
                log.info(
                    "%s: snapshot at LSN %d sent to %s: %d chunks, %.1f MB in %.2f s (%.1f MB/s)",
                    sender,
                    chunk.snapshot_lsn,
                    recipient,
                    count,
                    sent_bytes / 1e6,
                    elapsed_s,
                    sent_bytes / 1e6 / elapsed_s,
                )
                return
            next_chunk = await loop.run_in_executor(io, next, chunks, None)
            if next_chunk is None:
                raise StoreError("the snapshot export ended without its last chunk")
            chunk = next_chunk
    finally:
        if chunks is not None:
            await close_export(io, chunks)
