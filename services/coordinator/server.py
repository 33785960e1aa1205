"""The coordinator's gRPC servicer: a thin adapter from RPCs to the CoordinatorNode."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from squall.v1 import coordinator_pb2, coordinator_pb2_grpc
from squall_server.common.grpc_server import Context
from squall_server.coordinator import codec
from squall_server.coordinator.handoff import HandoffError
from squall_server.coordinator.messages import Rejection
from squall_server.coordinator.node import CoordinatorNode

log = logging.getLogger("squall.coordinator")


async def _refuse(context: Context, rejection: Rejection) -> None:
    await context.abort(grpc.StatusCode[rejection.code.status], rejection.message)


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Peer messages, status, the group-view watch and operator controls."""

    def __init__(self, node: CoordinatorNode) -> None:
        self.node = node

    async def Deliver(
        self, request: coordinator_pb2.PeerMessage, context: Context
    ) -> coordinator_pb2.DeliverResponse:
        try:
            rejection = self.node.deliver(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {exc}")
            raise
        if rejection is not None:
            await _refuse(context, rejection)
        return coordinator_pb2.DeliverResponse()

    def _status(self) -> coordinator_pb2.CoordinatorStatus:
        return codec.status_to_proto(self.node.status())

    async def GetStatus(
        self, request: coordinator_pb2.GetStatusRequest, context: Context
    ) -> coordinator_pb2.CoordinatorStatus:
        return self._status()

    async def WatchGroupView(
        self, request: coordinator_pb2.WatchGroupViewRequest, context: Context
    ) -> AsyncIterator[coordinator_pb2.GroupView]:
        async for view in self.node.watch():
            yield view

    async def SetDesignatedPrimary(
        self, request: coordinator_pb2.SetDesignatedPrimaryRequest, context: Context
    ) -> coordinator_pb2.OperatorControlResponse:
        ready = self.node.set_designated_primary(request.enabled, request.operator or "unknown")
        if ready.rejection is not None:
            await _refuse(context, ready.rejection)
        return coordinator_pb2.OperatorControlResponse(status=self._status())

    async def SetQuorumOverride(
        self, request: coordinator_pb2.SetQuorumOverrideRequest, context: Context
    ) -> coordinator_pb2.OperatorControlResponse:
        ready = self.node.set_quorum_override(
            request.required, request.operator or "unknown", request.reason
        )
        if ready.rejection is not None:
            await _refuse(context, ready.rejection)
        return coordinator_pb2.OperatorControlResponse(status=self._status())

    async def TransferLeadership(
        self, request: coordinator_pb2.TransferLeadershipRequest, context: Context
    ) -> coordinator_pb2.OperatorControlResponse:
        try:
            ready = await self.node.transfer_leadership(
                request.target, request.operator or "unknown", request.reason, request.timeout_ms
            )
        except HandoffError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
            raise
        if ready.rejection is not None:
            await _refuse(context, ready.rejection)
        return coordinator_pb2.OperatorControlResponse(status=self._status())

    async def SetQuarantine(
        self, request: coordinator_pb2.SetQuarantineRequest, context: Context
    ) -> coordinator_pb2.OperatorControlResponse:
        ready = self.node.set_quarantine(
            request.enabled, request.operator or "unknown", request.reason
        )
        if ready.rejection is not None:
            await _refuse(context, ready.rejection)
        return coordinator_pb2.OperatorControlResponse(status=self._status())

    async def AckLoss(
        self, request: coordinator_pb2.AckLossRequest, context: Context
    ) -> coordinator_pb2.OperatorControlResponse:
        ready = self.node.ack_loss(
            request.loss_id[:128], request.operator or "unknown", request.reason[:1024]
        )
        if ready.rejection is not None:
            await _refuse(context, ready.rejection)
        return coordinator_pb2.OperatorControlResponse(status=self._status())

    async def ChangeMembership(
        self, request: coordinator_pb2.ChangeMembershipRequest, context: Context
    ) -> coordinator_pb2.OperatorControlResponse:
        try:
            change = codec.change_from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"membership change: {exc}")
            raise
        ready = self.node.change_membership(change, request.operator or "unknown", request.reason)
        if ready.rejection is not None:
            await _refuse(context, ready.rejection)
        return coordinator_pb2.OperatorControlResponse(status=self._status())

    async def Shutdown(
        self, request: coordinator_pb2.CoordinatorShutdownRequest, context: Context
    ) -> coordinator_pb2.CoordinatorShutdownResponse:
        status = self._status()
        self.node.shutdown(request.shutdown_id[:64], request.operator[:64] or "unknown")
        return coordinator_pb2.CoordinatorShutdownResponse(status=status)
