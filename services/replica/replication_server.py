"""The slave side of replication as a gRPC servicer: a thin adapter over the node's
``ReplicationEndpoint`` (``endpoints``).

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

What each call does is in ``serve_replicate`` and ``serve_fetch_log``, which know no gRPC:
the servicer here runs them for the network and the simulated transport
(``tests/sim/replica_transport.py``) runs the same functions in process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from squall.v1 import replica_pb2, replica_pb2_grpc
from squall.wire import stages as _stages
from squall_server.common.errors import Code, ServiceError
from squall_server.common.grpc_server import Context
from squall_server.replica.endpoints import (
    ReplicationEndpoint,
    SlaveEndpoint,
    SyncSourceEndpoint,
)
from squall_server.replica.server import abort
from squall_server.replica.store import CorruptRecordError, StoreError

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


async def serve_replicate(
    node: SlaveEndpoint, requests: AsyncIterator[replica_pb2.ReplicateRequest]
) -> AsyncIterator[replica_pb2.ReplicateResponse]:
    """The slave side of one replication stream: answers each of the master's messages.

    A refusal or a store error ends it with a ServiceError (a store error as UNAVAILABLE
    naming this replica)."""
    stream = 0
    try:
        # One step per message; the master ends the stream (or is refused).
        async for request in requests:
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
    except StoreError as exc:
        raise ServiceError(Code.UNAVAILABLE, f"replica {node.node.id}: store error: {exc}") from exc


async def serve_fetch_log(
    node: SyncSourceEndpoint, request: replica_pb2.FetchLogRequest
) -> AsyncIterator[replica_pb2.FetchLogResponse]:
    """Serves a new master's reorganization fetch; a refusal or store error ends it with a
    ServiceError (a checksum error is reported as this node's fault first)."""
    try:
        async for response in node.fetch_log(request):
            yield response
    except StoreError as exc:
        if isinstance(exc, CorruptRecordError):
            node.report_fault(f"checksum error serving a fetch: {exc}")
        raise ServiceError(Code.UNAVAILABLE, f"replica {node.node.id}: store error: {exc}") from exc


class Replication(replica_pb2_grpc.ReplicationServicer):
    """Applies the master's replication stream; serves reorganization fetches."""

    def __init__(self, node: ReplicationEndpoint) -> None:
        self.node = node

    async def Replicate(
        self,
        request_iterator: AsyncIterator[replica_pb2.ReplicateRequest],
        context: Context,
    ) -> AsyncIterator[replica_pb2.ReplicateResponse]:
        try:
            async for response in serve_replicate(self.node, request_iterator):
                yield response
        except ServiceError as exc:
            await abort(context, exc)

    async def FetchLog(
        self, request: replica_pb2.FetchLogRequest, context: Context
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]:
        try:
            async for response in serve_fetch_log(self.node, request):
                yield response
        except ServiceError as exc:
            await abort(context, exc)
