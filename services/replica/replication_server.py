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
                # The commit lock is never held here: a stream cancelled while this
                # generator waits at a yield (gRPC drops it without closing it) keeps
                # nothing, and a batch that must wait for its write runs in a task of its
                # own, shielded, so it finishes and frees the lock whoever waits for it.
                acks_now, stored = await node.replication_batch_acks(stream, request.entries)
                for ack in acks_now:
                    if _stages.ENABLED:
                        _mark_acked(request.entries)
                    yield replica_pb2.ReplicateResponse(ack=ack)
                if not isinstance(stored, list):
                    stored = await asyncio.shield(stored)
                for ack in stored:
                    if _stages.ENABLED:
                        _mark_acked(request.entries)
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


def _mark_acked(batch: replica_pb2.EntryBatch) -> None:
    for entry in batch.entries:
        _stages.mark("s.ack", f"lsn/{entry.lsn}")


async def serve_fetch_log(
    node: SyncSourceEndpoint, request: replica_pb2.FetchLogRequest
) -> AsyncIterator[replica_pb2.FetchLogResponse]:
    """Serves a new master's reorganization fetch; a refusal or store error ends it with a
    ServiceError: ``DATA_LOSS`` for a checksum error (reported as this node's fault first;
    asking again meets the same record), ``UNAVAILABLE`` for another store error."""
    try:
        async for response in node.fetch_log(request):
            yield response
    except StoreError as exc:
        if isinstance(exc, CorruptRecordError):
            node.report_fault(f"checksum error serving a fetch: {exc}")
            raise ServiceError(
                Code.DATA_LOSS, f"replica {node.node.id}: its store failed a checksum: {exc}"
            ) from exc
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
