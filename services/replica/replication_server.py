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

import contextlib
import logging
from collections.abc import AsyncIterator

from services.common.errors import Code, ServiceError
from services.common.grpc_server import Context
from services.replica.node import ReplicaNode
from services.replica.server import abort
from services.replica.store import CorruptRecordError, StoreError
from squall.v1 import replica_pb2, replica_pb2_grpc

log = logging.getLogger("squall.replica")


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
                    # Closed at once if the stream is cancelled mid-batch: the batch
                    # holds the commit lock until it finishes.
                    async with contextlib.aclosing(
                        node.replication_batch(stream, request.entries)
                    ) as acks:
                        async for ack in acks:
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
