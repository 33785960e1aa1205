"""Knows which replica is the master, and keeps one channel per replica.

Until the coordinators' group-view watch is wired in, the gateway finds the master by
asking every replica for its role (highest epoch wins) when it has none, and follows a
replica's redirect (the `squall-master-address` trailing metadata) when it is wrong.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.config import ClusterConfig
from services.common.grpc_server import channel_options
from squall.v1 import common_pb2, replica_pb2, replica_pb2_grpc

log = logging.getLogger("squall.gateway")

MASTER_ADDRESS_KEY = "squall-master-address"


class NoMasterError(Exception):
    """No replica currently holds the master role."""


class MasterTracker:
    """The gateway's idea of the current master, and a channel to every replica."""

    def __init__(self, config: ClusterConfig, probe_timeout_s: float = 1.0) -> None:
        self._config = config
        self._probe_timeout_s = probe_timeout_s
        options = channel_options(config.limits.max_message_bytes)
        self._channels = {
            node.replica_address: grpc.aio.insecure_channel(node.replica_address, options=options)
            for node in config.nodes
        }
        self._master_address: str | None = None
        self.master_id = ""
        self.epoch = 0
        self._lock = asyncio.Lock()

    def channel_to(self, address: str) -> grpc.aio.Channel:
        """The channel to one replica."""
        return self._channels[address]

    async def channel(self) -> grpc.aio.Channel:
        """The master's channel, discovering the master first if it is not known."""
        if self._master_address is None:
            async with self._lock:
                if self._master_address is None:
                    await self._discover()
        if self._master_address is None:
            raise NoMasterError(
                "no master is elected (or reachable) right now; the call was not forwarded"
            )
        return self._channels[self._master_address]

    async def _probe(self, address: str) -> replica_pb2.ReplicaState | None:
        stub = replica_pb2_grpc.ReplicaControlStub(self._channels[address])
        try:
            state: replica_pb2.ReplicaState = await stub.GetReplicaState(
                replica_pb2.GetReplicaStateRequest(), timeout=self._probe_timeout_s
            )
            return state
        except grpc.aio.AioRpcError:
            return None

    async def _discover(self) -> None:
        addresses = list(self._channels)
        states = await asyncio.gather(*(self._probe(a) for a in addresses))
        masters = [
            (state.epoch, address, state.node_id)
            for address, state in zip(addresses, states, strict=True)
            if state is not None and state.role == common_pb2.ROLE_MASTER
        ]
        if masters:
            epoch, address, node_id = max(masters)
            if address != self._master_address:
                log.info("gateway: master is %s at %s (epoch=%d)", node_id, address, epoch)
            self._master_address, self.master_id, self.epoch = address, node_id, epoch

    def observe_error(self, error: grpc.aio.AioRpcError) -> None:
        """Learns from a failed forward: follow a redirect, or forget a lost master."""
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            return
        for key, value in pairs(error.trailing_metadata()):
            if key == MASTER_ADDRESS_KEY and str(value) in self._channels:
                self._master_address = str(value)
                return
        self._master_address = None

    async def close(self) -> None:
        """Closes every channel."""
        await asyncio.gather(*(c.close(None) for c in self._channels.values()))


def pairs(metadata: object) -> list[tuple[str, str | bytes]]:
    """Metadata as (key, value) pairs (grpc-stubs types its items too narrowly)."""
    return [(str(k), v) for k, v in metadata or ()]  # type: ignore[attr-defined]
