"""The gateway's own servicer: the cluster status view assembled from every node."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

import grpc

from squall.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall.wire.auth import token_metadata
from squall_server.common.auth import bearer_token
from squall_server.common.config import ClusterConfig
from squall_server.common.grpc_server import Context
from squall_server.gateway.master import MasterTracker


class ClusterAdmin(gateway_pb2_grpc.ClusterAdminServicer):
    """Answers `squall status`: one row per known node (the file's, and those the running
    node set added)."""

    def __init__(self, config: ClusterConfig, masters: MasterTracker, timeout_s: float) -> None:
        self._config = config
        self._masters = masters
        self._timeout_s = timeout_s

    def _row(
        self, node_id: str, replica_address: str, metadata: tuple[tuple[str, str], ...]
    ) -> Coroutine[object, object, gateway_pb2.NodeStatus]:
        # The channels are taken now, not when the row's task first runs: a newer running
        # node set may drop the node meanwhile (the row then shows the call's error).
        replica = replica_pb2_grpc.ReplicaControlStub(self._masters.channel_to(replica_address))
        coordinator = coordinator_pb2_grpc.CoordinatorStub(
            self._masters.coordinator_channel(node_id)
        )
        return self._fill_row(node_id, replica_address, replica, coordinator, metadata)

    async def _fill_row(
        self,
        node_id: str,
        replica_address: str,
        replica: replica_pb2_grpc.ReplicaControlAsyncStub,
        coordinator: coordinator_pb2_grpc.CoordinatorAsyncStub,
        metadata: tuple[tuple[str, str], ...],
    ) -> gateway_pb2.NodeStatus:
        row = gateway_pb2.NodeStatus(node_id=node_id, replica_address=replica_address)
        errors = []
        state_call = replica.GetReplicaState(
            replica_pb2.GetReplicaStateRequest(), timeout=self._timeout_s
        )
        status_call = coordinator.GetStatus(
            coordinator_pb2.GetStatusRequest(), timeout=self._timeout_s, metadata=metadata or None
        )
        state, status = await asyncio.gather(state_call, status_call, return_exceptions=True)
        if isinstance(state, replica_pb2.ReplicaState):
            row.role = state.role
            row.epoch = state.epoch
            row.last_lsn = state.last_lsn
            row.commit_lsn = state.commit_lsn
            row.store_state = state.store_state
            row.slaves.extend(state.slaves)
            row.log_start_lsn = state.log_start_lsn
            row.last_epoch = state.last_epoch
            row.fault_reason = state.fault_reason
            row.frozen_for_shutdown_id = state.frozen_for_shutdown_id
            row.freeze_remaining_ms = state.freeze_remaining_ms
        else:
            errors.append(f"replica: {_reason(state)}")
        if isinstance(status, coordinator_pb2.CoordinatorStatus):
            row.coordinator_id = status.coordinator_id
            row.group_name = status.group_name
            row.state = status.state
            row.group.extend(status.group)
            row.max_seen = status.max_seen
            row.epoch = max(row.epoch, status.epoch)
            row.last_change_reason = status.last_change_reason
            row.priority = status.priority
            row.designated_primary = status.designated_primary
            row.quorum_override = status.quorum_override
            row.quorum_required = status.quorum_required
            if status.HasField("quorum_override_record"):
                row.quorum_override_record.CopyFrom(status.quorum_override_record)
            if status.HasField("quarantine"):
                row.quarantine.CopyFrom(status.quarantine)
            row.audit.extend(status.audit)
            row.invited.extend(status.invited)
            row.sync_source_id = status.sync_source_id
            row.transfer_target = status.transfer_target
            row.replica_unreachable_since_ms = status.replica_unreachable_since_ms
            row.lead_held_off_until_ms = status.lead_held_off_until_ms
            row.lead_held_off_reason = status.lead_held_off_reason
            row.config_mismatches.extend(status.config_mismatches)
            row.losses.extend(status.losses)
            if status.HasField("membership"):
                running = status.membership
                row.membership = f"v{running.version} (epoch {running.epoch}): " + ",".join(
                    f"{m.node_id}:{m.priority}{'L' if m.learner else ''}" for m in running.members
                )
            row.membership_change = status.membership_change
        else:
            errors.append(f"coordinator: {_reason(status)}")
        row.reachable = isinstance(state, replica_pb2.ReplicaState)
        row.error = "; ".join(errors)
        return row

    async def GetClusterStatus(
        self, request: gateway_pb2.GetClusterStatusRequest, context: Context
    ) -> gateway_pb2.ClusterStatus:
        # The file's nodes and those a membership change added, less those it removed (the
        # gateway follows the running node set).
        nodes = self._masters.nodes()
        # The caller's token (already checked: status is admin-only) goes on to the
        # coordinators, which check it again when they cannot see this gateway's certificate.
        token = bearer_token(context.invocation_metadata())
        metadata = token_metadata(token)
        rows, master = await asyncio.gather(
            asyncio.gather(*(self._row(n, replica, metadata) for n, _, replica in nodes)),
            self._masters.wait_master(0.0),
        )
        return gateway_pb2.ClusterStatus(
            nodes=rows,
            master_id=master.node_id if master else "",
            epoch=master.epoch if master else 0,
        )

    async def close(self) -> None:
        """Nothing of its own to close: the coordinator channels are the tracker's."""


def _reason(error: BaseException | object) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)
