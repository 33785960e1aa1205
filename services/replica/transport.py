"""What one replica sends to another, behind one interface: the master's replication
stream to each slave and a new master's reorganization fetch from its sync source.

``ReplicaTransport`` is all the replica's drivers (``master_driver.MasterDriver`` and
``TakingMaster._sync_from``) know of the network, as ``PeerTransport`` is all the
coordinator's driver knows (``services/coordinator/driver.py``). Two implementations:

* ``GrpcReplicaTransport`` (here): ``Replication.Replicate`` and ``Replication.FetchLog``
  over grpc.aio channels, one per peer, opened on first use and closed by ``close``.
* The simulated twin (``tests/sim/replica_transport.py``): the same calls run in process
  against the peer's shipped servicer logic (``replication_server.serve_replicate`` and
  ``serve_fetch_log``), with partitions and delays injected by the test.

A call's failure is a ``ReplicaCallError`` whatever the transport: the status name (as
gRPC names it), its message and trailing metadata (a slave's refusal carries its epoch,
``core.EPOCH_KEY``, so a stale master steps down).
"""

from __future__ import annotations

from typing import Protocol

import grpc

from squall.v1 import replica_pb2, replica_pb2_grpc
from squall_server.common.config import ClusterConfig
from squall_server.common.grpc_server import channel_options, reconnect_options
from squall_server.common.tls import transport

_ReplicateStub = grpc.aio.StreamStreamCall[
    replica_pb2.ReplicateRequest, replica_pb2.ReplicateResponse
]
_FetchStub = grpc.aio.UnaryStreamCall[replica_pb2.FetchLogRequest, replica_pb2.FetchLogResponse]


class ReplicaCallError(Exception):
    """A replication call failed or was refused: the status name (``UNAVAILABLE``,
    ``FAILED_PRECONDITION``, ... as ``grpc.StatusCode`` names them), the peer's message
    and its trailing metadata."""

    def __init__(self, status: str, details: str, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(f"{status}: {details}")
        self.status = status
        self.details = details
        self.metadata = metadata


class ReplicateCall(Protocol):
    """One open replication stream from the master to one slave."""

    async def write(self, request: replica_pb2.ReplicateRequest) -> None:
        """Sends one message; raises ReplicaCallError once the stream failed."""
        ...

    async def read(self) -> replica_pb2.ReplicateResponse | None:
        """The slave's next message, or None once it closed the stream normally; raises
        ReplicaCallError when it refused (its status, message and epoch) or failed."""
        ...

    def cancel(self) -> None:
        """Ends the stream from this side (a no-op once it ended)."""
        ...


class FetchCall(Protocol):
    """One reorganization fetch from a sync source."""

    async def read(self) -> replica_pb2.FetchLogResponse | None:
        """The source's next message, or None at the end; raises ReplicaCallError."""
        ...

    def cancel(self) -> None:
        """Ends the fetch from this side (a no-op once it ended)."""
        ...


class ReplicaTransport(Protocol):
    """Opens calls to other replicas by node id; owns whatever connections they need."""

    def replicate(self, node_id: str) -> ReplicateCall:
        """Opens a replication stream to node_id (nothing is sent until ``write``)."""
        ...

    def fetch_log(self, node_id: str, request: replica_pb2.FetchLogRequest) -> FetchCall:
        """Starts a reorganization fetch from node_id."""
        ...

    async def close(self) -> None:
        """Closes every connection; calls still open fail."""
        ...


def call_error(exc: grpc.aio.AioRpcError) -> ReplicaCallError:
    """A gRPC failure as the transport-neutral error."""
    metadata = tuple((k, v) for k, v in _pairs(exc.trailing_metadata()) if isinstance(v, str))
    return ReplicaCallError(exc.code().name, exc.details() or "", metadata)


def _pairs(metadata: object) -> list[tuple[str, str | bytes]]:
    """Metadata as (key, value) pairs (grpc-stubs types its items too narrowly)."""
    return [(str(k), v) for k, v in metadata or ()]  # type: ignore[attr-defined]


class _GrpcReplicate:
    def __init__(self, call: _ReplicateStub) -> None:
        self._call = call

    async def write(self, request: replica_pb2.ReplicateRequest) -> None:
        try:
            await self._call.write(request)
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc) from exc

    async def read(self) -> replica_pb2.ReplicateResponse | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc) from exc
        return message if isinstance(message, replica_pb2.ReplicateResponse) else None

    def cancel(self) -> None:
        self._call.cancel()


class _GrpcFetch:
    def __init__(self, call: _FetchStub) -> None:
        self._call = call

    async def read(self) -> replica_pb2.FetchLogResponse | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc) from exc
        if message is grpc.aio.EOF:  # type: ignore[attr-defined]
            return None
        if not isinstance(message, replica_pb2.FetchLogResponse):
            raise TypeError(f"a FetchLog stream sent a {type(message).__name__}")
        return message

    def cancel(self) -> None:
        self._call.cancel()


class GrpcReplicaTransport:
    """``Replication`` calls over grpc.aio, one channel per peer (TLS as configured)."""

    def __init__(self, config: ClusterConfig, node_id: str) -> None:
        self._config = config
        self._links = transport(config, node_id)
        self._options = [
            *channel_options(config.limits.max_message_bytes),
            *reconnect_options(config.timeouts.heartbeat_interval_ms),
        ]
        self._addresses = {n.id: n.replica_address for n in config.nodes}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, node_id: str) -> grpc.aio.Channel:
        channel = self._channels.get(node_id)
        if channel is None:
            channel = self._links.aio_channel(self._addresses[node_id], options=self._options)
            self._channels[node_id] = channel
        return channel

    def replicate(self, node_id: str) -> ReplicateCall:
        stub = replica_pb2_grpc.ReplicationStub(self._channel(node_id))
        return _GrpcReplicate(stub.Replicate(None))

    def fetch_log(self, node_id: str, request: replica_pb2.FetchLogRequest) -> FetchCall:
        stub = replica_pb2_grpc.ReplicationStub(self._channel(node_id))
        return _GrpcFetch(stub.FetchLog(request))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)
