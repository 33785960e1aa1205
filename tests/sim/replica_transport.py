"""The replica transport's simulated twin: replication calls between in-process replicas.

``SimReplicaNetwork`` holds the ``ReplicaNode`` of each node id; each node's ``transport``
(``build_replica_node(transport=network.transport_for(node_id))``) opens its calls
against the peer's shipped servicer logic (``replication_server.serve_replicate`` and
``serve_fetch_log``) in process, with no gRPC. Faults are injected by the test:

* ``cut(a, b)`` (one way, or both with ``both=True``) fails every open call from a to b
  with UNAVAILABLE and refuses new ones until ``heal``; ``down(node)`` does so for every
  call to a node (a replica killed while its coordinator lives).
* ``delay_s`` holds each message on the way back by that long (a slow link).

Calls keep gRPC's observable behaviour where the drivers depend on it: a refusal is a
``ReplicaCallError`` with the slave's status, message and trailing metadata (its epoch);
a call cancelled by its caller raises ``asyncio.CancelledError`` from a pending read, as
a cancelled grpc.aio call does; the end of a stream is ``None``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Generic, TypeVar

from squall.v1 import replica_pb2
from squall_server.common.config import ClusterConfig
from squall_server.common.errors import ServiceError
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.replication_server import serve_fetch_log, serve_replicate
from squall_server.replica.store import Store
from squall_server.replica.transport import ReplicaCallError

R = TypeVar("R")
_CANCELLED = object()  # a pending read raises asyncio.CancelledError, as grpc.aio's does


class _Call(Generic[R]):
    """One call's answer side: the peer's messages, its end, or its failure."""

    def __init__(self, network: SimReplicaNetwork, src: str, dst: str) -> None:
        self.network = network
        self.src = src
        self.dst = dst
        self._answers: asyncio.Queue[object] = asyncio.Queue()
        self._server: asyncio.Task[None] | None = None
        self._ended: object | None = None  # the end read returns or raises, once known
        network.calls.add(self)

    def _start(self, answers: AsyncIterator[R]) -> None:
        self._server = asyncio.get_running_loop().create_task(self._serve(answers))

    async def _serve(self, answers: AsyncIterator[R]) -> None:
        try:
            async for answer in answers:
                if self.network.delay_s:
                    await asyncio.sleep(self.network.delay_s)
                self._answers.put_nowait(answer)
        except ServiceError as exc:
            self._end(ReplicaCallError(exc.code.value, exc.message, exc.metadata))
            return
        self._end(None)

    def _end(self, end: object) -> None:
        if self._ended is None:
            self._ended = end if end is not None else "eof"
            self._answers.put_nowait(end)
            self.network.calls.discard(self)

    def fail(self, details: str) -> None:
        """The link broke: the peer's side stops, the caller sees UNAVAILABLE."""
        if self._server is not None:
            self._server.cancel()
        self._end(ReplicaCallError("UNAVAILABLE", details))

    async def _read(self) -> R | None:
        answer = await self._answers.get()
        if answer is None:
            self._answers.put_nowait(None)  # every later read sees the end too
            return None
        if answer is _CANCELLED:
            self._answers.put_nowait(answer)
            raise asyncio.CancelledError
        if isinstance(answer, ReplicaCallError):
            self._answers.put_nowait(answer)
            raise answer
        return answer  # type: ignore[return-value]

    def cancel(self) -> None:
        if self._server is not None:
            self._server.cancel()
        self._end(_CANCELLED)


class SimReplicate(_Call[replica_pb2.ReplicateResponse]):
    """A replication stream from src's master to dst's slave side."""

    def __init__(self, network: SimReplicaNetwork, src: str, dst: str) -> None:
        super().__init__(network, src, dst)
        self._requests: asyncio.Queue[replica_pb2.ReplicateRequest] = asyncio.Queue()
        problem = network.unreachable(src, dst)
        if problem:
            self._end(ReplicaCallError("UNAVAILABLE", problem))
        else:
            self._start(serve_replicate(network.nodes[dst], self._incoming()))

    async def _incoming(self) -> AsyncIterator[replica_pb2.ReplicateRequest]:
        while True:  # ends when the call does (its server task is cancelled)
            yield await self._requests.get()

    async def write(self, request: replica_pb2.ReplicateRequest) -> None:
        ended = self._ended
        if isinstance(ended, ReplicaCallError):
            raise ended
        if ended is _CANCELLED:
            raise asyncio.CancelledError
        self._requests.put_nowait(request)

    async def read(self) -> replica_pb2.ReplicateResponse | None:
        return await self._read()


class SimFetch(_Call[replica_pb2.FetchLogResponse]):
    """A reorganization fetch by src from its sync source dst."""

    def __init__(
        self, network: SimReplicaNetwork, src: str, dst: str, request: replica_pb2.FetchLogRequest
    ) -> None:
        super().__init__(network, src, dst)
        problem = network.unreachable(src, dst)
        if problem:
            self._end(ReplicaCallError("UNAVAILABLE", problem))
        else:
            self._start(serve_fetch_log(network.nodes[dst], request))

    async def read(self) -> replica_pb2.FetchLogResponse | None:
        return await self._read()


class SimReplicaTransport:
    """One node's ``ReplicaTransport`` over the simulated network."""

    def __init__(self, network: SimReplicaNetwork, node_id: str) -> None:
        self.network = network
        self.node_id = node_id
        self._open: list[_Call[Any]] = []

    def replicate(self, node_id: str) -> SimReplicate:
        call = SimReplicate(self.network, self.node_id, node_id)
        self._open.append(call)
        return call

    def fetch_log(self, node_id: str, request: replica_pb2.FetchLogRequest) -> SimFetch:
        call = SimFetch(self.network, self.node_id, node_id, request)
        self._open.append(call)
        return call

    async def close(self) -> None:
        calls, self._open = self._open, []
        for call in calls:
            call.fail(f"node {self.node_id} closed its connections")
        self.network.closed += 1


class SimReplicaNetwork:
    """The replicas by node id and the faults between them."""

    def __init__(self) -> None:
        self.nodes: dict[str, ReplicaNode] = {}
        self.calls: set[_Call[Any]] = set()
        self.cuts: set[tuple[str, str]] = set()
        self.delay_s = 0.0
        self.closed = 0  # transports closed (each master epoch and sync closes its own)

    def add(self, node: ReplicaNode) -> None:
        self.nodes[node.node.id] = node

    async def start_replicas(
        self, config: ClusterConfig, node_ids: Sequence[str]
    ) -> dict[str, ReplicaNode]:
        """The shipped replicas of node_ids over this network, each with an in-memory
        store, started (no role yet)."""
        nodes = {
            node_id: build_replica_node(
                config,
                config.node(node_id),
                Store.open_memory(),
                transport=self.transport_for(node_id),
            )
            for node_id in node_ids
        }
        for node in nodes.values():
            self.add(node)
            await node.start()
        return nodes

    def transport_for(self, node_id: str) -> Callable[[], SimReplicaTransport]:
        return lambda: SimReplicaTransport(self, node_id)

    def unreachable(self, src: str, dst: str) -> str:
        """Why src cannot reach dst now ("" when it can)."""
        if dst not in self.nodes:
            return f"node {dst}'s replica is down"
        if (src, dst) in self.cuts:
            return f"the link from {src} to {dst} is cut"
        return ""

    def _fail_calls(self) -> None:
        for call in list(self.calls):
            problem = self.unreachable(call.src, call.dst) or self.unreachable(call.dst, call.src)
            if problem:
                call.fail(problem)

    def cut(self, src: str, dst: str, *, both: bool = False) -> None:
        self.cuts.add((src, dst))
        if both:
            self.cuts.add((dst, src))
        self._fail_calls()

    def down(self, node_id: str) -> ReplicaNode:
        """The node's replica is gone (killed); returns it so the test can stop it."""
        node = self.nodes.pop(node_id)
        self._fail_calls()
        return node

    def heal(self) -> None:
        self.cuts.clear()


def flip_a_byte(store: Store, db: str, key: bytes | None = None) -> None:
    """Damages one record of an in-memory store (its last byte; the first record of ``db``
    when no key is given), as bit rot would a disk page: reading it fails its checksum."""
    records = store._kv.dbs[db].data  # type: ignore[attr-defined]
    key = min(records) if key is None else key
    records[key] = records[key][:-1] + bytes([records[key][-1] ^ 0x40])
