"""The replica transport's simulated twin on virtual time, with gRPC's failure modes.

Each node's ``ReplicaTransport`` (``ShellNetwork.transport_for``) opens its calls against
the peer's shipped servicer logic (``replication_server.serve_replicate`` and
``serve_fetch_log``), which runs as a task of the peer's simulated process
(``virtual_loop.PROCESS``). Each direction of a call is a FIFO link, as a gRPC stream over
TCP is: a message takes a seeded delay, never overtakes the one before it, and is never
lost or duplicated while the call lives. The faults are what gRPC shows of a bad network:

* **Cuts** (one way or both, ``cut``/``heal``): a new call across a cut in either
  direction fails at once (no handshake); in an open call the messages of a cut direction
  are held (TCP retransmits) and delivered in order when it heals, unless the cut lasts
  ``break_after_s``: then the call fails on both sides with UNAVAILABLE (keepalive). A
  one-way cut lets the other direction flow meanwhile (a slave keeps receiving batches
  whose acks never come back).
* **Breaks** (``break_calls``): the connection resets; every open call of a node fails.
* **Crashes** (``down``): the node's process is gone; its calls fail (its OS resets them)
  and new calls to it are refused until ``up`` registers its next incarnation.
* **Slow links**: ``delay_s()`` is drawn for every message (a seeded distribution).

Duplicates and loss reach the replicas as gRPC makes them: a broken stream loses what it
held, and the master's reconnection resends from what the slave acknowledged.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

from squall.v1 import replica_pb2
from squall_server.common.errors import ServiceError
from squall_server.replica.node import ReplicaNode
from squall_server.replica.replication_server import serve_fetch_log, serve_replicate
from squall_server.replica.transport import ReplicaCallError
from tests.sim.virtual_loop import VirtualLoop

R = TypeVar("R")
_CANCELLED = object()  # a pending read raises asyncio.CancelledError, as grpc.aio's does
_EOF = object()


class _Link:
    """One direction of one call: messages in flight, delivered in order at their time."""

    def __init__(self, call: _Call[Any], src: str, dst: str, deliver: Callable[[object], None]):
        self.call = call
        self.src = src
        self.dst = dst
        self._deliver = deliver
        self._flight: deque[tuple[float, object]] = deque()
        self._last_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def send(self, message: object) -> None:
        net = self.call.network
        at = max(self._last_at, net.loop.time() + net.delay_s())
        self._last_at = at
        self._flight.append((at, message))
        if self._timer is None:
            self._arm()

    def _arm(self) -> None:
        if not self._flight:
            self._timer = None
            return
        at = self._flight[0][0]
        # The network delivers: its callbacks belong to no process.
        self._timer = self.call.network.loop.call_at(at, self._step, context=_NET_CONTEXT)

    def _step(self) -> None:
        self._timer = None
        if self.call.ended:
            self._flight.clear()
            return
        if (self.src, self.dst) in self.call.network.cuts:
            # Held: try again shortly (the call breaks if the cut lasts).
            self._timer = self.call.network.loop.call_later(
                RETRANSMIT_S, self._step, context=_NET_CONTEXT
            )
            return
        now = self.call.network.loop.time()
        while self._flight and self._flight[0][0] <= now:
            _, message = self._flight.popleft()
            self._deliver(message)
        self._arm()

    def stop(self) -> None:
        self._flight.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_NET_CONTEXT = contextvars.copy_context()
# How often a held direction is retried (TCP retransmission, roughly).
RETRANSMIT_S = 0.02


class _Call(Generic[R]):
    """One call: the caller's side reads the peer's answers, or its end or failure."""

    def __init__(self, network: ShellNetwork, src: str, dst: str) -> None:
        self.network = network
        self.src = src
        self.dst = dst
        self.ended = False
        self.cut_since: float | None = None
        self._answers: asyncio.Queue[object] = asyncio.Queue()
        self._server: asyncio.Task[None] | None = None
        self.back = _Link(self, dst, src, self._answers.put_nowait)
        network.calls.append(self)

    def _serve_in_peer(self, answers: AsyncIterator[R]) -> None:
        process = self.network.processes[self.dst]
        self._server = self.network.loop.spawn(process, self._serve(answers))

    async def _serve(self, answers: AsyncIterator[R]) -> None:
        try:
            async for answer in answers:
                self.back.send(answer)
        except ServiceError as exc:
            self.back.send(ReplicaCallError(exc.code.value, exc.message, exc.metadata))
            return
        self.back.send(_EOF)

    def _finish(self, end: object) -> None:
        """The caller sees end next, and every read after it too."""
        if not self.ended:
            self.ended = True
            self.back.stop()
            self._stop_forward()
            if self._server is not None:
                self._server.cancel()
            self._answers.put_nowait(end)
            if self in self.network.calls:
                self.network.calls.remove(self)

    def _stop_forward(self) -> None:
        pass

    def fail(self, details: str) -> None:
        """The connection broke: the peer's side stops, the caller sees UNAVAILABLE."""
        self._finish(ReplicaCallError("UNAVAILABLE", details))

    async def _read(self) -> R | None:
        answer = await self._answers.get()
        if answer is _EOF or answer is None:
            self._answers.put_nowait(answer)
            self._finish(None)
            return None
        if answer is _CANCELLED:
            self._answers.put_nowait(answer)
            raise asyncio.CancelledError
        if isinstance(answer, ReplicaCallError):
            self._answers.put_nowait(answer)
            self._finish(answer)
            raise answer
        return answer  # type: ignore[return-value]

    def cancel(self) -> None:
        self._finish(_CANCELLED)


class SimReplicate(_Call[replica_pb2.ReplicateResponse]):
    """A replication stream from src's master to dst's slave side."""

    def __init__(self, network: ShellNetwork, src: str, dst: str) -> None:
        super().__init__(network, src, dst)
        self._inbox: asyncio.Queue[replica_pb2.ReplicateRequest] = asyncio.Queue()
        self.forth = _Link(self, src, dst, self._inbox.put_nowait)
        problem = network.unreachable(src, dst)
        if problem:
            self.fail(problem)
        else:
            self._serve_in_peer(serve_replicate(network.nodes[dst], self._incoming()))

    def _stop_forward(self) -> None:
        self.forth.stop()

    def _incoming(self) -> _Inbox:
        return _Inbox(self._inbox)

    async def write(self, request: replica_pb2.ReplicateRequest) -> None:
        if self.ended:
            if not self._answers.empty():
                end = self._answers._queue[0]  # type: ignore[attr-defined]
                if isinstance(end, ReplicaCallError):
                    raise end
                if end is _CANCELLED:
                    raise asyncio.CancelledError
            raise ReplicaCallError("UNAVAILABLE", "the stream is closed")
        self.forth.send(request)

    async def read(self) -> replica_pb2.ReplicateResponse | None:
        return await self._read()


class _Inbox:
    """The master's messages as the servicer reads them (like grpc's request iterator,
    not an async generator: several tasks may read it and nobody closes it)."""

    def __init__(self, queue: asyncio.Queue[replica_pb2.ReplicateRequest]) -> None:
        self._queue = queue

    def __aiter__(self) -> _Inbox:
        return self

    async def __anext__(self) -> replica_pb2.ReplicateRequest:
        return await self._queue.get()  # ends when the call does (its server is cancelled)


class SimFetch(_Call[replica_pb2.FetchLogResponse]):
    """A reorganization fetch by src from its sync source dst (the request is delivered
    after one link delay)."""

    def __init__(
        self, network: ShellNetwork, src: str, dst: str, request: replica_pb2.FetchLogRequest
    ) -> None:
        super().__init__(network, src, dst)
        self.forth = _Link(self, src, dst, lambda _: self._start(request))
        problem = network.unreachable(src, dst)
        if problem:
            self.fail(problem)
        else:
            self.forth.send(request)

    def _stop_forward(self) -> None:
        self.forth.stop()

    def _start(self, request: replica_pb2.FetchLogRequest) -> None:
        if self.dst not in self.network.nodes:
            self.fail(f"node {self.dst}'s replica is down")
            return
        self._serve_in_peer(serve_fetch_log(self.network.nodes[self.dst], request))

    async def read(self) -> replica_pb2.FetchLogResponse | None:
        return await self._read()


class SimReplicaTransport:
    """One node's ``ReplicaTransport`` over the simulated network."""

    def __init__(self, network: ShellNetwork, node_id: str) -> None:
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


class ShellNetwork:
    """The replicas by node id, their processes, and the faults between them."""

    def __init__(
        self, loop: VirtualLoop, delay_s: Callable[[], float], break_after_s: float
    ) -> None:
        self.loop = loop
        self.delay_s = delay_s
        self.break_after_s = break_after_s
        self.nodes: dict[str, ReplicaNode] = {}
        self.processes: dict[str, str] = {}
        self.calls: list[_Call[Any]] = []
        self.cuts: set[tuple[str, str]] = set()

    def up(self, node: ReplicaNode, process: str) -> None:
        """node (an incarnation running as process) takes calls from now on."""
        self.nodes[node.node.id] = node
        self.processes[node.node.id] = process

    def down(self, node_id: str) -> None:
        """node_id's process is gone: its calls fail, new ones are refused."""
        self.nodes.pop(node_id, None)
        for call in list(self.calls):
            if node_id in (call.src, call.dst):
                call.fail(f"node {node_id}'s replica is down (connection reset)")

    def transport_for(self, node_id: str) -> Callable[[], SimReplicaTransport]:
        return lambda: SimReplicaTransport(self, node_id)

    def unreachable(self, src: str, dst: str) -> str:
        """Why a new call from src to dst fails now ("" when it can be made)."""
        if dst not in self.nodes or src not in self.nodes:
            return f"node {dst if dst not in self.nodes else src}'s replica is down"
        if (src, dst) in self.cuts or (dst, src) in self.cuts:
            return f"the link between {src} and {dst} is cut"
        return ""

    def cut(self, src: str, dst: str, *, both: bool = False) -> None:
        self.cuts.add((src, dst))
        if both:
            self.cuts.add((dst, src))

    def heal(self) -> None:
        self.cuts.clear()
        for call in self.calls:
            call.cut_since = None

    def break_calls(self, node_id: str) -> None:
        """node_id's connections reset (its calls fail; new ones can be made)."""
        for call in list(self.calls):
            if node_id in (call.src, call.dst):
                call.fail(f"connection of node {node_id} reset")

    def tick(self) -> None:
        """Fails the calls a cut has held for ``break_after_s`` (gRPC keepalive)."""
        now = self.loop.time()
        for call in list(self.calls):
            if (call.src, call.dst) in self.cuts or (call.dst, call.src) in self.cuts:
                if call.cut_since is None:
                    call.cut_since = now
                elif now - call.cut_since >= self.break_after_s:
                    call.fail(f"keepalive: the link between {call.src} and {call.dst} is cut")
            else:
                call.cut_since = None
