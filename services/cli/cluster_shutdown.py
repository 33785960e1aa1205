"""`squall cluster shutdown`: stop every node at one point and mark the stores clean.

Qpid's `qpid-cluster -k` for Squall (docs/operations.md, "Store lifecycle"):

1. find the master (a coordinator NORMAL as its group's coordinator, its replica master);
2. freeze every reachable replica for one new shutdown id, the master first: no replica
   takes a new role any more, the master admits no new write and answers once the writes
   it had queued are done;
3. wait until the master has committed its last entry and every member slave holds
   exactly that LSN (the shutdown point); on timeout, if the master changes, or when the
   command is interrupted (Ctrl-C), every replica is thawed and nothing else happened. A
   freeze holds for the command's timeout and a margin for the steps after it; a command
   killed outright leaves it to lapse by itself then;
4. stop every coordinator, so nothing renews or changes a role any more;
5. finish every frozen replica: it drops its role, records the shutdown id (CLEAN) if it
   holds the point, leaves its store DIRTY otherwise, and exits;
6. wait (bounded) until the stopped services no longer answer.

A node that is unreachable, or not a member of the master's group, keeps a DIRTY store:
the next start updates it from a clean one. Gateways keep running; they answer
UNAVAILABLE until the cluster is back.

The steps (``run_shutdown``) reach the services only through ``ShutdownCalls``: over gRPC
for the command line (``GrpcCalls``), and through the shipped servicers in the
coordinated simulator (tests/sim/coordinated_sim.py), so the simulator runs the shutdown
an operator runs. Time is the injected clock's and the event loop's sleeps.
"""

from __future__ import annotations

import asyncio
import getpass
import signal
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TextIO, TypeVar

import grpc

from squall import with_token
from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server.cli.auth import cli_token
from squall_server.common.clock import Clock, SystemClock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.freeze import FREEZE_HOLD_MAX_MS
from squall_server.common.tls import Transport, cli_transport, plain_or

# Per call when surveying and stopping; freezing waits for queued writes: the whole budget.
_CALL_TIMEOUT_S = 3.0
_POLL_S = 0.05
# What a freeze holds beyond the command's timeout: stopping the coordinators and
# finishing each replica, a few calls of at most _CALL_TIMEOUT_S per node.
FINISH_HOLD_S = 60.0
# The longest --timeout: a replica holds a freeze for at most FREEZE_HOLD_MAX_MS.
TIMEOUT_MAX_S = FREEZE_HOLD_MAX_MS / 1000 - FINISH_HOLD_S

T = TypeVar("T")


class ShutdownError(Exception):
    """The shutdown could not be done; the message says what happened to the cluster."""


class CallFailed(Exception):
    """A call to a service failed; the message is its status and details."""


class ShutdownCalls(Protocol):
    """The calls the shutdown makes, each to one node's replica or coordinator; a failed
    call raises ``CallFailed``."""

    async def replica_state(self, node: NodeConfig) -> replica_pb2.ReplicaState: ...

    async def coordinator_status(self, node: NodeConfig) -> coordinator_pb2.CoordinatorStatus: ...

    async def freeze(
        self, node: NodeConfig, request: replica_pb2.FreezeForShutdownRequest, timeout_s: float
    ) -> replica_pb2.ReplicaState: ...

    async def thaw(self, node: NodeConfig, request: replica_pb2.AbortShutdownRequest) -> None: ...

    async def stop_coordinator(
        self, node: NodeConfig, request: coordinator_pb2.CoordinatorShutdownRequest
    ) -> None: ...

    async def finish(
        self, node: NodeConfig, request: replica_pb2.FinishShutdownRequest
    ) -> replica_pb2.FinishShutdownResponse: ...

    async def answering(self, kind: str, node: NodeConfig) -> bool:
        """Does the node's ``kind`` ("replica" or "coordinator") service still answer?"""
        ...


@dataclass
class _Node:
    config: NodeConfig
    replica: replica_pb2.ReplicaState | None = None
    coordinator: coordinator_pb2.CoordinatorStatus | None = None
    error: str = ""
    # Asked to freeze (it may be frozen even if the answer never came), and answered.
    asked: bool = False
    frozen: bool = False
    notes: list[str] = field(default_factory=list)


class GrpcCalls:
    """``ShutdownCalls`` over gRPC with the command line's TLS identity and token. The
    calls block: the command runs nothing else meanwhile."""

    def __init__(self, links: Transport | None) -> None:
        self._links = links

    def _call(self, address: str, make: Callable[[grpc.Channel], T]) -> T:
        try:
            with plain_or(self._links, address) as channel:
                # Coordinator calls need the operator's token when [auth] is on (docs/auth.md).
                return make(with_token(channel, cli_token()))
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise CallFailed(f"{code.name if code else 'ERROR'}: {details}") from None

    async def replica_state(self, node: NodeConfig) -> replica_pb2.ReplicaState:
        return self._call(
            node.replica_address,
            lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).GetReplicaState(
                replica_pb2.GetReplicaStateRequest(), timeout=_CALL_TIMEOUT_S
            ),
        )

    async def coordinator_status(self, node: NodeConfig) -> coordinator_pb2.CoordinatorStatus:
        return self._call(
            node.coordinator_address,
            lambda ch: coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(
                coordinator_pb2.GetStatusRequest(), timeout=_CALL_TIMEOUT_S
            ),
        )

    async def freeze(
        self, node: NodeConfig, request: replica_pb2.FreezeForShutdownRequest, timeout_s: float
    ) -> replica_pb2.ReplicaState:
        return self._call(
            node.replica_address,
            lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).FreezeForShutdown(
                request, timeout=timeout_s
            ),
        )

    async def thaw(self, node: NodeConfig, request: replica_pb2.AbortShutdownRequest) -> None:
        self._call(
            node.replica_address,
            lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).AbortShutdown(
                request, timeout=_CALL_TIMEOUT_S
            ),
        )

    async def stop_coordinator(
        self, node: NodeConfig, request: coordinator_pb2.CoordinatorShutdownRequest
    ) -> None:
        self._call(
            node.coordinator_address,
            lambda ch: coordinator_pb2_grpc.CoordinatorStub(ch).Shutdown(
                request, timeout=_CALL_TIMEOUT_S
            ),
        )

    async def finish(
        self, node: NodeConfig, request: replica_pb2.FinishShutdownRequest
    ) -> replica_pb2.FinishShutdownResponse:
        return self._call(
            node.replica_address,
            lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).FinishShutdown(
                request, timeout=_CALL_TIMEOUT_S
            ),
        )

    async def answering(self, kind: str, node: NodeConfig) -> bool:
        address = node.replica_address if kind == "replica" else node.coordinator_address
        with plain_or(self._links, address) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.2)
            except grpc.FutureTimeoutError:
                return False
        return True


class _Shutdown:
    """One shutdown's steps (the module docstring), with what it learned of each node."""

    def __init__(
        self,
        calls: ShutdownCalls,
        nodes: Sequence[NodeConfig],
        clock: Clock,
        shutdown_id: str,
        operator: str,
    ) -> None:
        self.calls = calls
        self.nodes = [_Node(n) for n in nodes]
        self.clock = clock
        self.shutdown_id = shutdown_id
        self.operator = operator
        self.hold_ms = 0

    def now_s(self) -> float:
        return self.clock.monotonic_ms() / 1000

    async def survey(self) -> None:
        for node in self.nodes:
            errors = []
            try:
                node.replica = await self.calls.replica_state(node.config)
            except CallFailed as exc:
                errors.append(f"replica {exc}")
            try:
                node.coordinator = await self.calls.coordinator_status(node.config)
            except CallFailed as exc:
                errors.append(f"coordinator {exc}")
            node.error = "; ".join(errors)

    def master(self) -> tuple[_Node, replica_pb2.ReplicaState]:
        masters = [
            n
            for n in self.nodes
            if n.replica is not None
            and n.replica.role == common_pb2.ROLE_MASTER
            and n.coordinator is not None
            and n.coordinator.state == common_pb2.NODE_STATE_NORMAL
            and n.coordinator.coordinator_id == n.config.id
        ]
        if len(masters) == 1 and masters[0].replica is not None:
            return masters[0], masters[0].replica
        seen = ", ".join(
            f"{n.config.id}: "
            + (
                common_pb2.Role.Name(n.replica.role).removeprefix("ROLE_").lower()
                if n.replica is not None
                else f"unreachable ({n.error})"
            )
            for n in self.nodes
        )
        raise ShutdownError(
            f"{'no master is' if not masters else 'more than one master is'} serving ({seen}): "
            "a clean shutdown needs one running group; nothing was changed. A cluster that "
            "cannot form a group can only be stopped (its stores stay dirty; see "
            "docs/operations.md, 'Manual recovery')."
        )

    async def freeze(self, node: _Node, timeout_s: float) -> None:
        request = replica_pb2.FreezeForShutdownRequest(
            shutdown_id=self.shutdown_id, operator=self.operator, hold_ms=self.hold_ms
        )
        node.asked = True
        node.replica = await self.calls.freeze(node.config, request, timeout_s)
        node.frozen = True

    async def thaw(self) -> list[str]:
        """Undo the freeze everywhere; returns the nodes that could not be thawed."""
        failed = []
        request = replica_pb2.AbortShutdownRequest(shutdown_id=self.shutdown_id)
        for node in self.nodes:
            if not node.asked:
                continue
            try:
                await self.calls.thaw(node.config, request)
                node.frozen = False
            except CallFailed as exc:
                failed.append(f"{node.config.id} ({exc})")
        return failed

    async def abort(self, why: str) -> ShutdownError:
        failed = await self.thaw()
        tail = (
            f"; could not thaw {', '.join(failed)}: each serves again once its freeze "
            f"lapses ({self.hold_ms / 1000:.0f} s after it was frozen), or restart it"
            if failed
            else "; every replica serves again, nothing was changed"
        )
        return ShutdownError(f"cluster shutdown {self.shutdown_id} abandoned: {why}{tail}")

    async def wait_for_point(
        self, master: _Node, epoch: int, members: list[_Node], deadline_s: float
    ) -> replica_pb2.ReplicaState:
        """Polls until the master committed its last entry and every member holds it."""
        # Bounded by the deadline: one poll per _POLL_S.
        while True:
            try:
                state = await self.calls.replica_state(master.config)
            except CallFailed as exc:
                raise await self.abort(f"master {master.config.id}: {exc}") from None
            if state.role != common_pb2.ROLE_MASTER or state.epoch != epoch:
                raise await self.abort(
                    f"master {master.config.id} lost its role of epoch {epoch} (now "
                    f"{common_pb2.Role.Name(state.role)}, epoch {state.epoch})",
                )
            behind = []
            if state.commit_lsn < state.last_lsn:
                behind.append(f"master commit LSN {state.commit_lsn} < last LSN {state.last_lsn}")
            for member in members:
                try:
                    held = await self.calls.replica_state(member.config)
                except CallFailed as exc:
                    member.notes.append(f"unreachable while reaching the point ({exc})")
                    continue
                member.replica = held
                if (held.last_epoch, held.last_lsn) != (state.last_epoch, state.last_lsn):
                    behind.append(f"{member.config.id} at {held.last_epoch}/{held.last_lsn}")
            if not behind:
                return state
            lagging = ", ".join(behind)
            if self.now_s() > deadline_s:
                raise await self.abort(
                    f"the members did not reach the master's log end "
                    f"{state.last_epoch}/{state.last_lsn} in time: {lagging}",
                )
            await asyncio.sleep(_POLL_S)

    async def stop_coordinators(self) -> None:
        request = coordinator_pb2.CoordinatorShutdownRequest(
            shutdown_id=self.shutdown_id, operator=self.operator
        )
        for node in self.nodes:
            if node.coordinator is None:
                continue
            try:
                await self.calls.stop_coordinator(node.config, request)
            except CallFailed as exc:
                node.notes.append(f"coordinator not stopped ({exc})")

    async def finish(self, node: _Node, point: replica_pb2.ReplicaState) -> bool:
        request = replica_pb2.FinishShutdownRequest(
            shutdown_id=self.shutdown_id,
            lsn=point.last_lsn,
            last_epoch=point.last_epoch,
            cluster_id=point.cluster_id,
            operator=self.operator,
        )
        try:
            done = await self.calls.finish(node.config, request)
        except CallFailed as exc:
            node.notes.append(f"dirty: finishing failed ({exc})")
            return False
        node.notes.append("clean" if done.clean else f"dirty: {done.reason}")
        return bool(done.clean)

    async def wait_stopped(self, deadline_s: float) -> list[str]:
        """Waits until no stopped service answers; returns those still answering."""
        remaining = [
            (kind, n)
            for n in self.nodes
            for kind, asked in (("replica", n.frozen), ("coordinator", n.coordinator is not None))
            if asked
        ]
        # Bounded by the deadline: one pass per _POLL_S.
        while remaining and self.now_s() < deadline_s:
            remaining = [
                (kind, n) for kind, n in remaining if await self.calls.answering(kind, n.config)
            ]
            if remaining:
                await asyncio.sleep(_POLL_S)
        return [f"{kind} {n.config.id}" for kind, n in remaining]


async def run_shutdown(
    calls: ShutdownCalls,
    nodes: Sequence[NodeConfig],
    out: TextIO,
    *,
    clock: Clock,
    timeout_s: float,
    operator: str,
    shutdown_id: str,
) -> int:
    """Runs the shutdown in the module docstring; returns 0 if the master's store is clean
    (ShutdownError when it could not start or was abandoned: the message says what
    happened)."""
    run = _Shutdown(calls, nodes, clock, shutdown_id, operator)
    run.hold_ms = min(int((timeout_s + FINISH_HOLD_S) * 1000), FREEZE_HOLD_MAX_MS)
    deadline_s = run.now_s() + timeout_s
    await run.survey()
    master, master_state = run.master()
    epoch = master_state.epoch
    member_ids = {master.config.id, *(s.node_id for s in master_state.slaves)}
    members = [n for n in run.nodes if n.config.id in member_ids and n is not master]
    print(
        f"cluster shutdown {shutdown_id} (by {operator}): master {master.config.id}, epoch "
        f"{epoch}, members {','.join(sorted(member_ids))}",
        file=out,
    )
    try:
        point = await _freeze_to_point(run, master, epoch, members, deadline_s)
    except asyncio.CancelledError:
        # Interrupted (Ctrl-C) before anything was stopped: thaw now, rather than leave
        # every write refused until the freezes lapse.
        _take_interrupt()
        raise await run.abort("interrupted before any service was stopped") from None
    print(
        f"  shutdown point: epoch {point.last_epoch} LSN {point.last_lsn}, cluster "
        f"{point.cluster_id}",
        file=out,
    )
    try:
        master_clean = await _stop_and_finish(run, master, point)
    except asyncio.CancelledError:
        _take_interrupt()
        done = "; ".join(f"{n.config.id}: {', '.join(n.notes)}" for n in run.nodes if n.notes)
        raise ShutdownError(
            f"cluster shutdown {shutdown_id} interrupted while it stopped the services "
            f"({done or 'none answered yet'}): a replica not finished serves again once its "
            f"freeze lapses ({run.hold_ms / 1000:.0f} s after it was frozen); start the "
            "coordinators it stopped again, or stop the rest by PID"
        ) from None
    still = await run.wait_stopped(run.now_s() + max(deadline_s - run.now_s(), 5.0))
    for node in run.nodes:
        print(f"  {node.config.id}: {'; '.join(node.notes)}", file=out)
    if still:
        print(f"  still answering: {', '.join(still)} (stop them by PID)", file=out)
    print(
        "Dirty stores are updated from a clean one at the next start. Gateways keep "
        "running: stop them separately.",
        file=out,
    )
    return 0 if master_clean else 1


def _take_interrupt() -> None:
    """The command answers its interrupt with its own message: the task goes on as not
    cancelled (so ``asyncio.run`` raises that message, not KeyboardInterrupt)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def _freeze_to_point(
    run: _Shutdown, master: _Node, epoch: int, members: list[_Node], deadline_s: float
) -> replica_pb2.ReplicaState:
    """Steps 2 and 3: freezes every replica, the master first, and waits for the point.
    The calls block the loop, so an interrupt lands at the yields between them."""
    try:
        await run.freeze(master, max(deadline_s - run.now_s(), 1.0))
    except CallFailed as exc:
        raise await run.abort(f"master {master.config.id}: {exc}") from None
    for node in run.nodes:
        await asyncio.sleep(0)
        if node is master or node.replica is None:
            continue
        try:
            await run.freeze(node, _CALL_TIMEOUT_S)
        except CallFailed as exc:
            node.notes.append(f"not frozen ({exc})")
    point = await run.wait_for_point(master, epoch, members, deadline_s)
    await asyncio.sleep(0)
    return point


async def _stop_and_finish(run: _Shutdown, master: _Node, point: replica_pb2.ReplicaState) -> bool:
    """Steps 4 and 5: stops every coordinator, finishes every frozen replica; returns
    whether the master's store is clean."""
    await run.stop_coordinators()
    master_clean = False
    for node in run.nodes:
        if node.frozen:
            clean = await run.finish(node, point)
            master_clean = master_clean or (clean and node is master)
        elif node.replica is None:
            node.notes.append(f"unreachable ({node.error}): its store stays dirty")
        else:
            node.notes.append("its store stays dirty")
    return master_clean


def shutdown_cluster(
    config: ClusterConfig, out: TextIO, *, timeout_s: float = 30.0, operator: str = ""
) -> int:
    """`squall cluster shutdown`: ``run_shutdown`` over gRPC; returns 0 if the master's
    store is clean."""
    return asyncio.run(
        _terminable(
            run_shutdown(
                GrpcCalls(cli_transport(config)),
                config.nodes,
                out,
                clock=SystemClock(),
                timeout_s=timeout_s,
                operator=operator or getpass.getuser(),
                shutdown_id=uuid.uuid4().hex,
            )
        )
    )


async def _terminable(main: Coroutine[object, object, int]) -> int:
    """Runs main with SIGTERM (`kill`, `timeout`, a service manager) taken as Ctrl-C is
    by ``asyncio.run``: the command is interrupted and thaws what it froze, instead of
    dying with every replica frozen until its hold lapses."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None:
        return await main
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await main
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
