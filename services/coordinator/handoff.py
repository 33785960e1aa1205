"""Leadership transfer, the driver's part: make the master's replica ready, then let the
election hand the group over.

The order is what makes the transfer lose nothing and stall little:

1. ``Election.transfer_refusal`` checks the request against the election's state (this node
   leads, the target is an eligible member) before anything changes.
2. The replica (``ReplicaControl.PrepareHandoff``) stops taking new writes, lets the writes
   it took commit, and waits until the target holds its whole log. Writes that arrive
   meanwhile are refused as not stored (the gateway and the library retry them), so every
   acknowledged write is on the target, and the target is the new group's sync source
   with nothing to fetch.
3. ``Election.transfer_leadership`` sends the target the hand-over; the target invites the
   group into a group of its own, which forms in a new epoch like any other.

If step 3 is refused (the group changed while the replica waited), the replica's writes
resume at once, and so they do when the target leaves the group or goes silent before it
takes over (``Ready.transfer_dropped``); if it stays and never takes over, they resume
when the replica's wait times out, and the election gives up after
``2 * member_timeout_ms``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from squall.v1 import replica_pb2
from squall_server.coordinator.messages import Ready

if TYPE_CHECKING:
    from squall_server.coordinator.node import CoordinatorNode

log = logging.getLogger("squall.coordinator")


class HandoffError(Exception):
    """The replica could not get ready for the transfer; ``code`` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class HandoffLink(Protocol):
    """The call a transfer makes to its own replica (``GrpcReplicaLink`` over gRPC; the
    simulator's link serves it with the replica's servicer)."""

    async def prepare_handoff(
        self, request: replica_pb2.PrepareHandoffRequest, timeout_s: float
    ) -> replica_pb2.PrepareHandoffResponse:
        """``ReplicaControl.PrepareHandoff``; a failed call raises HandoffError (the status)."""
        ...


async def transfer(
    node: CoordinatorNode,
    replica: HandoffLink,
    target: str,
    operator: str,
    reason: str,
    timeout_ms: int,
) -> Ready:
    """Runs one transfer; a refusal comes back in ``Ready.rejection``, a replica that could
    not get ready raises HandoffError. Either way nothing changed."""
    refusal = node.election.transfer_refusal(target)
    if refusal is not None:
        return Ready(rejection=refusal)
    epoch = node.election.status().epoch
    rpc_timeout_ms = node.config.timeouts.rpc_timeout_ms
    wait_ms = timeout_ms or rpc_timeout_ms
    request = replica_pb2.PrepareHandoffRequest(
        epoch=epoch, target_node_id=target, timeout_ms=wait_ms
    )
    try:
        prepared = await replica.prepare_handoff(request, (wait_ms + rpc_timeout_ms) / 1000)
    except HandoffError as exc:
        raise HandoffError(
            exc.code,
            f"node {node.node.id}: transfer to {target} abandoned, writes resumed: {exc.message}",
        ) from None
    ready = node.driver.transfer_leadership(target, operator, reason)
    if ready.rejection is not None:
        await resume(replica, epoch, target, rpc_timeout_ms)
        return ready
    log.warning(
        "coordinator %s: handing epoch %d to %s: its log holds LSN %d of %d (commit LSN %d) "
        "after %d ms without new writes",
        node.node.id,
        epoch,
        target,
        prepared.target_lsn,
        prepared.last_lsn,
        prepared.commit_lsn,
        prepared.waited_ms,
    )
    return ready


async def resume(replica: HandoffLink, epoch: int, target: str, rpc_timeout_ms: int) -> None:
    """The transfer was refused, or given up, after the replica stopped its writes: start
    them again."""
    request = replica_pb2.PrepareHandoffRequest(epoch=epoch, target_node_id=target, cancel=True)
    try:
        await replica.prepare_handoff(request, rpc_timeout_ms / 1000)
    except HandoffError as exc:
        # The replica's own timeout resumes its writes in any case.
        log.warning("coordinator: could not resume the replica's writes: %s", exc.message)
