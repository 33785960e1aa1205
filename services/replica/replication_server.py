"""The slave side of replication as a gRPC servicer: a thin adapter over the ReplicaNode.

``Replicate``: the first message must be a Hello from the master of this replica's
current epoch (``ReplicaNode.replication_hello`` asks the Follower); it is answered with
the replica's position, then every entry batch is checked by the Follower and stored in
one transaction, and acknowledged (received / written / synced); snapshot chunks are
installed one transaction each, and the last one acknowledged at the snapshot's LSN.
Any refusal closes the stream with the Follower's status, and carries the replica's
epoch in the trailing metadata (``squall-epoch``) so a stale master steps down.

``FetchLog``: serves a new master's reorganization catch-up (``ReplicaNode.fetch_log``):
log entries, or a snapshot and the log after it when the new master cannot truncate its
compacted log or lacks entries this replica compacted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from services.common.errors import Code, ServiceError
from services.common.grpc_server import Context
from services.replica.node import ReplicaNode
from services.replica.server import abort
from services.replica.store import CorruptRecordError, StoreError
from squall import _stages
from squall.v1 import replica_pb2, replica_pb2_grpc

log = logging.getLogger("squall.replica")

T = TypeVar("T")
_PUMPS: set[asyncio.Task[None]] = set()


async def detached(source: AsyncIterator[T]) -> AsyncIterator[T]:
    """Yields what source yields, while source runs to its end in a task of its own.

    Whoever iterates this may stop at any yield and never come back: source still
    finishes (and releases what it holds) without waiting for them. Its exception is
    raised here, after the items before it.
    """
    # (item,) per item, then None at the end or the exception source raised.
    queue: asyncio.Queue[tuple[T] | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait((item,))
        except BaseException as exc:  # handed to the reader, who raises it
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    # Kept in _PUMPS until done: the loop holds tasks only weakly, and the reader may
    # be gone long before the batch is.
    task = asyncio.get_running_loop().create_task(pump())
    _PUMPS.add(task)
    task.add_done_callback(_PUMPS.discard)
    # One step per item source yields; the end (None or an exception) always comes.
    while True:
        entry = await queue.get()
        if entry is None:
            break
        if isinstance(entry, BaseException):
            raise entry
        yield entry[0]
    await task


class Replication(replica_pb2_grpc.ReplicationServicer):
    """Applies the master's replication stream; serves reorganization fetches."""

    def __init__(self, node: ReplicaNode) -> None:
        self.node = node

    async def Replicate(
        self,
        request_iterator: AsyncIterator[replica_pb2.ReplicateRequest],
        context: Context,
    ) -> AsyncIterator[replica_pb2.ReplicateResponse]:
        node = self.node
        stream = 0
        try:
            # One step per message; the master ends the stream (or is refused).
            async for request in request_iterator:
                kind = request.WhichOneof("body")
                if not stream:
                    if kind != "hello":
                        raise ServiceError(
                            Code.INVALID_ARGUMENT,
                            f"replica {node.node.id}: a replication stream opens with a Hello, "
                            f"not {kind}",
                        )
                    stream, position = await node.replication_hello(request.hello)
                    yield replica_pb2.ReplicateResponse(position=position)
                elif kind == "entries":
                    # The batch holds the commit lock until it finishes, so it runs in its
                    # own task: a stream cancelled while this generator waits at a yield
                    # must not keep the lock (gRPC drops the generator without closing
                    # it, and only a garbage collection would; every later batch and
                    # stream of this replica waited for that).
                    async for ack in detached(node.replication_batch(stream, request.entries)):
                        if _stages.ENABLED:
                            for entry in request.entries.entries:
                                _stages.mark("s.ack", f"lsn/{entry.lsn}")
                        yield replica_pb2.ReplicateResponse(ack=ack)
                elif kind == "heartbeat":
                    ack = node.replication_heartbeat(stream, request.heartbeat)
                    yield replica_pb2.ReplicateResponse(ack=ack)
                elif kind == "snapshot":
                    for ack in await node.replication_snapshot(stream, request.snapshot):
                        yield replica_pb2.ReplicateResponse(ack=ack)
                else:
                    raise ServiceError(
                        Code.INVALID_ARGUMENT,
                        f"replica {node.node.id}: unexpected {kind or 'empty message'} on an "
                        "open replication stream",
                    )
        except ServiceError as exc:
            await abort(context, exc)
        except StoreError as exc:
            await abort(
                context,
                ServiceError(Code.UNAVAILABLE, f"replica {node.node.id}: store error: {exc}"),
            )

    async def FetchLog(
        self, request: replica_pb2.FetchLogRequest, context: Context
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]:
        try:
            async for response in self.node.fetch_log(request):
                yield response
        except ServiceError as exc:
            await abort(context, exc)
        except StoreError as exc:
            if isinstance(exc, CorruptRecordError):
                self.node.report_fault(f"checksum error serving a fetch: {exc}")
            await abort(
                context,
                ServiceError(Code.UNAVAILABLE, f"replica {self.node.node.id}: store error: {exc}"),
            )
