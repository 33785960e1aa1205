"""`squall cluster shutdown`: stop every node at one point and mark the stores clean.

Qpid's `qpid-cluster -k` for Squall (docs/operations.md, "Store lifecycle"):

1. find the master (a coordinator NORMAL as its group's coordinator, its replica master);
2. freeze every reachable replica for one new shutdown id, the master first: no replica
   takes a new role any more, the master admits no new write and answers once the writes
   it had queued are done;
3. wait until the master has committed its last entry and every member slave holds
   exactly that LSN (the shutdown point); on timeout, or if the master changes, every
   replica is thawed and nothing else happened;
4. stop every coordinator, so nothing renews or changes a role any more;
5. finish every frozen replica: it drops its role, records the shutdown id (CLEAN) if it
   holds the point, leaves its store DIRTY otherwise, and exits;
6. wait (bounded) until the stopped services no longer answer.

A node that is unreachable, or not a member of the master's group, keeps a DIRTY store:
the next start updates it from a clean one. Gateways keep running; they answer
UNAVAILABLE until the cluster is back.
"""

from __future__ import annotations

import getpass
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TextIO, TypeVar

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
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.tls import Transport, cli_transport, plain_or

# Per call when surveying and stopping; freezing waits for queued writes: the whole budget.
_CALL_TIMEOUT_S = 3.0
_POLL_S = 0.05

T = TypeVar("T")


class ShutdownError(Exception):
    """The shutdown could not be done; the message says what happened to the cluster."""


@dataclass
class _Node:
    config: NodeConfig
    replica: replica_pb2.ReplicaState | None = None
    coordinator: coordinator_pb2.CoordinatorStatus | None = None
    error: str = ""
    frozen: bool = False
    notes: list[str] = field(default_factory=list)


def _rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"


# The command line's TLS identity for this shutdown (set by shutdown_cluster; every helper
# below dials through it rather than taking it as one more argument).
_LINKS: ContextVar[Transport | None] = ContextVar("squall_shutdown_links", default=None)


def _call(address: str, make: Callable[[grpc.Channel], T]) -> T:
    with plain_or(_LINKS.get(), address) as channel:
        # Coordinator calls need the operator's token when [auth] is on (docs/auth.md).
        return make(with_token(channel, cli_token()))


def _replica_state(node: NodeConfig) -> replica_pb2.ReplicaState:
    return _call(
        node.replica_address,
        lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).GetReplicaState(
            replica_pb2.GetReplicaStateRequest(), timeout=_CALL_TIMEOUT_S
        ),
    )


def _survey(config: ClusterConfig) -> list[_Node]:
    nodes = [_Node(n) for n in config.nodes]
    for node in nodes:
        errors = []
        try:
            node.replica = _replica_state(node.config)
        except grpc.RpcError as exc:
            errors.append(f"replica {_rpc_error(exc)}")
        try:
            node.coordinator = _call(
                node.config.coordinator_address,
                lambda ch: coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(
                    coordinator_pb2.GetStatusRequest(), timeout=_CALL_TIMEOUT_S
                ),
            )
        except grpc.RpcError as exc:
            errors.append(f"coordinator {_rpc_error(exc)}")
        node.error = "; ".join(errors)
    return nodes


def _master(nodes: list[_Node]) -> tuple[_Node, replica_pb2.ReplicaState]:
    masters = [
        n
        for n in nodes
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
        for n in nodes
    )
    raise ShutdownError(
        f"{'no master is' if not masters else 'more than one master is'} serving ({seen}): "
        "a clean shutdown needs one running group; nothing was changed. A cluster that "
        "cannot form a group can only be stopped (its stores stay dirty; see "
        "docs/operations.md, 'Manual recovery')."
    )


def _freeze(node: _Node, shutdown_id: str, operator: str, timeout_s: float) -> None:
    node.replica = _call(
        node.config.replica_address,
        lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).FreezeForShutdown(
            replica_pb2.FreezeForShutdownRequest(shutdown_id=shutdown_id, operator=operator),
            timeout=timeout_s,
        ),
    )
    node.frozen = True


def _thaw(nodes: list[_Node], shutdown_id: str) -> list[str]:
    """Undo the freeze everywhere; returns the nodes that could not be thawed."""
    failed = []
    for node in nodes:
        if not node.frozen:
            continue
        try:
            _call(
                node.config.replica_address,
                lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).AbortShutdown(
                    replica_pb2.AbortShutdownRequest(shutdown_id=shutdown_id),
                    timeout=_CALL_TIMEOUT_S,
                ),
            )
            node.frozen = False
        except grpc.RpcError as exc:
            failed.append(f"{node.config.id} ({_rpc_error(exc)})")
    return failed


def _abort(nodes: list[_Node], shutdown_id: str, why: str) -> ShutdownError:
    failed = _thaw(nodes, shutdown_id)
    tail = (
        f"; could not thaw {', '.join(failed)}: restart those replicas"
        if failed
        else "; every replica serves again, nothing was changed"
    )
    return ShutdownError(f"cluster shutdown {shutdown_id} abandoned: {why}{tail}")


def _wait_for_point(
    master: _Node,
    epoch: int,
    members: list[_Node],
    nodes: list[_Node],
    shutdown_id: str,
    deadline: float,
) -> replica_pb2.ReplicaState:
    """Polls until the master committed its last entry and every member holds it."""
    while True:
        try:
            state = _replica_state(master.config)
        except grpc.RpcError as exc:
            why = f"master {master.config.id}: {_rpc_error(exc)}"
            raise _abort(nodes, shutdown_id, why) from None
        if state.role != common_pb2.ROLE_MASTER or state.epoch != epoch:
            raise _abort(
                nodes,
                shutdown_id,
                f"master {master.config.id} lost its role of epoch {epoch} (now "
                f"{common_pb2.Role.Name(state.role)}, epoch {state.epoch})",
            )
        behind = []
        if state.commit_lsn < state.last_lsn:
            behind.append(f"master commit LSN {state.commit_lsn} < last LSN {state.last_lsn}")
        for member in members:
            try:
                held = _replica_state(member.config)
            except grpc.RpcError as exc:
                member.notes.append(f"unreachable while reaching the point ({_rpc_error(exc)})")
                continue
            member.replica = held
            if (held.last_epoch, held.last_lsn) != (state.last_epoch, state.last_lsn):
                behind.append(f"{member.config.id} at {held.last_epoch}/{held.last_lsn}")
        if not behind:
            return state
        lagging = ", ".join(behind)
        if time.monotonic() > deadline:
            raise _abort(
                nodes,
                shutdown_id,
                f"the members did not reach the master's log end "
                f"{state.last_epoch}/{state.last_lsn} in time: {lagging}",
            )
        time.sleep(_POLL_S)


def _stop_coordinators(nodes: list[_Node], shutdown_id: str, operator: str) -> None:
    for node in nodes:
        if node.coordinator is None:
            continue
        try:
            _call(
                node.config.coordinator_address,
                lambda ch: coordinator_pb2_grpc.CoordinatorStub(ch).Shutdown(
                    coordinator_pb2.CoordinatorShutdownRequest(
                        shutdown_id=shutdown_id, operator=operator
                    ),
                    timeout=_CALL_TIMEOUT_S,
                ),
            )
        except grpc.RpcError as exc:
            node.notes.append(f"coordinator not stopped ({_rpc_error(exc)})")


def _finish(node: _Node, shutdown_id: str, point: replica_pb2.ReplicaState, operator: str) -> bool:
    try:
        done = _call(
            node.config.replica_address,
            lambda ch: replica_pb2_grpc.ReplicaControlStub(ch).FinishShutdown(
                replica_pb2.FinishShutdownRequest(
                    shutdown_id=shutdown_id,
                    lsn=point.last_lsn,
                    last_epoch=point.last_epoch,
                    cluster_id=point.cluster_id,
                    operator=operator,
                ),
                timeout=_CALL_TIMEOUT_S,
            ),
        )
    except grpc.RpcError as exc:
        node.notes.append(f"dirty: finishing failed ({_rpc_error(exc)})")
        return False
    node.notes.append("clean" if done.clean else f"dirty: {done.reason}")
    return bool(done.clean)


def _wait_stopped(nodes: list[_Node], deadline: float) -> list[str]:
    """Waits until no stopped service answers; returns those still answering."""
    addresses = [
        (f"{kind} {n.config.id}", address)
        for n in nodes
        for kind, address, asked in (
            ("replica", n.config.replica_address, n.frozen),
            ("coordinator", n.config.coordinator_address, n.coordinator is not None),
        )
        if asked
    ]
    remaining = list(addresses)
    while remaining and time.monotonic() < deadline:
        still = []
        for name, address in remaining:
            with plain_or(_LINKS.get(), address) as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=0.2)
                    still.append((name, address))
                except grpc.FutureTimeoutError:
                    pass
        remaining = still
        if remaining:
            time.sleep(_POLL_S)
    return [name for name, _ in remaining]


def shutdown_cluster(
    config: ClusterConfig, out: TextIO, *, timeout_s: float = 30.0, operator: str = ""
) -> int:
    """Runs the shutdown in the module docstring; returns 0 if the master's store is clean."""
    operator = operator or getpass.getuser()
    deadline = time.monotonic() + timeout_s
    _LINKS.set(cli_transport(config))
    nodes = _survey(config)
    master, master_state = _master(nodes)
    epoch = master_state.epoch
    member_ids = {master.config.id, *(s.node_id for s in master_state.slaves)}
    members = [n for n in nodes if n.config.id in member_ids and n is not master]
    shutdown_id = uuid.uuid4().hex
    print(
        f"cluster shutdown {shutdown_id} (by {operator}): master {master.config.id}, epoch "
        f"{epoch}, members {','.join(sorted(member_ids))}",
        file=out,
    )
    try:
        _freeze(master, shutdown_id, operator, max(deadline - time.monotonic(), 1.0))
    except grpc.RpcError as exc:
        raise _abort(nodes, shutdown_id, f"master {master.config.id}: {_rpc_error(exc)}") from None
    for node in nodes:
        if node is master or node.replica is None:
            continue
        try:
            _freeze(node, shutdown_id, operator, _CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            node.notes.append(f"not frozen ({_rpc_error(exc)})")
    point = _wait_for_point(master, epoch, members, nodes, shutdown_id, deadline)
    print(
        f"  shutdown point: epoch {point.last_epoch} LSN {point.last_lsn}, cluster "
        f"{point.cluster_id}",
        file=out,
    )
    _stop_coordinators(nodes, shutdown_id, operator)
    master_clean = False
    for node in nodes:
        if node.frozen:
            clean = _finish(node, shutdown_id, point, operator)
            master_clean = master_clean or (clean and node is master)
        elif node.replica is None:
            node.notes.append(f"unreachable ({node.error}): its store stays dirty")
        else:
            node.notes.append("its store stays dirty")
    still = _wait_stopped(nodes, time.monotonic() + max(deadline - time.monotonic(), 5.0))
    for node in nodes:
        print(f"  {node.config.id}: {'; '.join(node.notes)}", file=out)
    if still:
        print(f"  still answering: {', '.join(still)} (stop them by PID)", file=out)
    print(
        "Dirty stores are updated from a clean one at the next start. Gateways keep "
        "running: stop them separately.",
        file=out,
    )
    return 0 if master_clean else 1
