"""The master's part of a leadership transfer: stop new writes, let the taken ones commit,
and wait until the target slave holds the whole log (``ReplicaControl.PrepareHandoff``).

While the fence holds, a write is refused with UNAVAILABLE before anything is stored, so
the gateway and the client library retry it (at the new master, once the group view names
it). The fence lifts when the role changes (the transfer happened) or at its deadline (it
did not), so a coordinator that dies mid-transfer cannot leave the master refusing writes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.replication import Ack, SyncPolicy

if TYPE_CHECKING:
    from squall_server.replica.control_endpoints import HandoffEndpoint

# How often the wait rechecks the target's acks (it also wakes on every commit).
_POLL_S = 0.005
# The longest fence a request may ask for.
FENCE_MS_MAX = 60_000


def _held_lsn(node: HandoffEndpoint, target: str) -> int | None:
    """What ``target`` holds at the replica sync policy, or None if it is not our slave."""
    policy = SyncPolicy(int(node.config.durability.replica_sync))
    for slave in node.slave_status():
        p = slave.progress
        if p.node_id == target:
            return Ack(p.received_lsn, p.written_lsn, p.synced_lsn).durable_lsn(policy)
    return None


async def prepare(
    node: HandoffEndpoint, request: replica_pb2.PrepareHandoffRequest
) -> replica_pb2.PrepareHandoffResponse:
    """Fences writes and waits for the target (see the module docstring)."""
    clock = node.clock
    started = clock.monotonic_ms()
    if request.cancel:
        node.core.lift_fence(request.epoch)
        return _response(node, request.target_node_id, started)
    who = f"replica {node.node.id}"
    if node.role != common_pb2.ROLE_MASTER or node.epoch != request.epoch:
        raise ServiceError(
            Code.FAILED_PRECONDITION,
            f"{who} is not the master of epoch {request.epoch} (epoch {node.epoch}, role "
            f"{common_pb2.Role.Name(node.role)})",
        )
    target = request.target_node_id
    if _held_lsn(node, target) is None:
        slaves = ",".join(s.progress.node_id for s in node.slave_status()) or "none"
        raise ServiceError(
            Code.FAILED_PRECONDITION,
            f"{who}: {target[:64]!r} is not a slave of this master (slaves: {slaves})",
        )
    if not 0 < request.timeout_ms <= FENCE_MS_MAX:
        raise ServiceError(
            Code.INVALID_ARGUMENT, f"timeout_ms must be 1..{FENCE_MS_MAX}, got {request.timeout_ms}"
        )
    deadline = started + request.timeout_ms
    refusal = node.core.fence_writes(target, request.epoch, deadline)  # the rule: core.py
    if refusal is not None:
        raise refusal.error()
    # Writes riding with the next batch (a push cursor) go now: the log must stop growing
    # for the target to catch up, and no new write comes to carry them.
    node.send_riding_writes()
    # Bounded by the deadline: each pass waits at most _POLL_S (or until a commit).
    while True:
        if node.role != common_pb2.ROLE_MASTER or node.epoch != request.epoch:
            node.core.fence.clear()
            raise ServiceError(
                Code.FAILED_PRECONDITION, f"{who} lost the master role of epoch {request.epoch}"
            )
        held = _held_lsn(node, target) or 0
        if node.writes_idle() and held >= node.last_lsn and node.commit_lsn >= node.last_lsn:
            return _response(node, target, started)
        if clock.monotonic_ms() >= deadline:
            node.core.fence.clear()
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"{who}: {target} holds LSN {held} of {node.last_lsn} (commit LSN "
                f"{node.commit_lsn}) after {request.timeout_ms} ms; writes resumed",
            )
        signal = node.commit_signal()
        try:
            async with asyncio.timeout(_POLL_S):  # (wait_for may swallow a cancel on 3.11)
                await signal.wait()
        except TimeoutError:
            pass


def _response(
    node: HandoffEndpoint, target: str, started_ms: int
) -> replica_pb2.PrepareHandoffResponse:
    return replica_pb2.PrepareHandoffResponse(
        last_lsn=node.last_lsn,
        target_lsn=_held_lsn(node, target) or 0,
        commit_lsn=node.commit_lsn,
        waited_ms=max(0, node.clock.monotonic_ms() - started_ms),
    )
