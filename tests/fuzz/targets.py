"""The services the request fuzzers attack, each built as its process builds it.

* ``FullNode``: a one-node cluster (coordinator, replica, gateway: each service's own
  ``serve()``), elected and serving, with a topic ``keep.seed`` of known events committed
  before any fuzzing. What clients and the cluster-status view reach.
* ``PeerReplica``: node n2 of a three-node cluster, alone: a replica serving the internal
  ReplicaControl and Replication services, slave of n1 in epoch 2, over an LMDB store
  holding a committed log. What a hostile peer or coordinator reaches.
* ``LoneCoordinator``: node n1's coordinator of a three-node cluster whose peers are
  absent, serving the Coordinator service (peer messages and operator controls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server.common.grpc_server import ServiceServer
from squall_server.coordinator import __main__ as coordinator_main
from squall_server.coordinator.node import CoordinatorNode
from squall_server.coordinator.server import Coordinator
from squall_server.gateway import __main__ as gateway_main
from squall_server.replica import __main__ as replica_main
from squall_server.replica import replication_server, server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.backup import verify_copy
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store, make_entry
from tests.fuzz.harness import LoopThread, ServicerErrors, healthy, make_config, wait_until

SEED_TOPIC = "keep.seed"
SEED_PAYLOADS = [f"seed event {i}".encode() for i in range(20)]
PEER_EPOCH = 2
PEER_CLUSTER_ID = "fuzz-cluster"
# Longest wait for keep.seed to be readable again after a hostile call.
SEED_READ_BOUND_S = 15.0


class _Target:
    """A loop thread, the servicer-error collector, and clean-up."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.errors = ServicerErrors()
        logging.getLogger().addHandler(self.errors)
        self._channels: list[grpc.Channel] = []
        self.closed = False

    def channel(self, address: str) -> grpc.Channel:
        """A client channel to address, closed with the target."""
        channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self._channels.append(channel)
        return channel

    def _close_common(self) -> None:
        self.closed = True
        for channel in self._channels:
            channel.close()
        logging.getLogger().removeHandler(self.errors)
        self.loop.close()


class FullNode(_Target):
    """A one-node cluster serving, with keep.seed committed."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.config = make_config(root, 1)
        self.node = self.config.nodes[0]
        self.gateway = self.config.gateways[0]
        self.data_dir = self.node.data_dir
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.loop.run(self._start())
        self.gateway_channel = self.channel(self.gateway.address)
        self.replica_channel = self.channel(self.node.replica_address)
        self.coordinator_channel = self.channel(self.node.coordinator_address)
        wait_until(self._master, "the one-node cluster elects its master")
        wait_until(self._gateway_ready, "the gateway finds the master")
        self._seed()

    async def _start(self) -> None:
        self._stop = asyncio.Event()
        stop = self._stop
        self._tasks = [
            asyncio.ensure_future(coordinator_main.serve(self.config, self.node, stop)),
            asyncio.ensure_future(replica_main.serve(self.config, self.node, stop)),
            asyncio.ensure_future(gateway_main.serve(self.config, self.gateway, stop)),
        ]

    def _master(self) -> bool:
        stub = replica_pb2_grpc.ReplicaControlStub(self.replica_channel)
        try:
            state = stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return bool(state.role == common_pb2.ROLE_MASTER)

    def _gateway_ready(self) -> bool:
        stub = broker_pb2_grpc.TopicManagerStub(self.gateway_channel)
        try:
            stub.ListTopics(broker_pb2.ListTopicsRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return True

    def _seed(self) -> None:
        topics = broker_pb2_grpc.TopicManagerStub(self.gateway_channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name=SEED_TOPIC), timeout=10)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="fz"), timeout=10)
        publisher = broker_pb2_grpc.PublisherStub(self.gateway_channel)
        publisher.Publish(
            broker_pb2.PublishRequest(
                topic=SEED_TOPIC,
                events=[common_pb2.EventData(payload=p) for p in SEED_PAYLOADS],
            ),
            timeout=10,
        )

    def seed_payloads(self) -> list[bytes]:
        """keep.seed's events as a subscriber reads them from the start, through the gateway."""
        stub = broker_pb2_grpc.SubscriberStub(self.gateway_channel)
        request = broker_pb2.SubscribeRequest(
            topic=SEED_TOPIC, start=broker_pb2.START_POSITION_EARLIEST, follow=False
        )
        return [
            event.payload
            for response in stub.Subscribe(request, timeout=10)
            for event in response.events
        ]

    def addresses(self) -> list[str]:
        return [self.gateway.address, self.node.replica_address, self.node.coordinator_address]

    def check(self) -> list[str]:
        """What is wrong with the node now (empty: all serving, keep.seed intact).

        keep.seed is read until it answers, for a bounded time: the three services share
        one event loop here, so under a burst of hostile calls the master's role lease can
        lapse and the node re-elects itself; a read during that gap is refused as
        UNAVAILABLE, which is right, and not what this checks.
        """
        problems = [f"{a} is not serving" for a in self.addresses() if not healthy(a)]
        failure = ""
        deadline = time.monotonic() + SEED_READ_BOUND_S
        while True:
            try:
                payloads = self.seed_payloads()
            except grpc.RpcError as exc:
                failure = f"reading {SEED_TOPIC} failed: {exc.code().name} {exc.details()}"
                if exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                problems.append(failure)
            else:
                if payloads[: len(SEED_PAYLOADS)] != SEED_PAYLOADS:
                    problems.append(f"{SEED_TOPIC} no longer holds its committed events")
            break
        self._ensure_fz()
        return problems + self.errors.take()

    def _ensure_fz(self) -> None:
        """Recreates the topic "fz" if a fuzzed call destroyed it: the strategies name it
        often so that requests reach the code behind the topic lookup."""
        topics = broker_pb2_grpc.TopicManagerStub(self.gateway_channel)
        with contextlib.suppress(grpc.RpcError):  # exists already, or the topic limit
            topics.CreateTopic(broker_pb2.CreateTopicRequest(name="fz"), timeout=10)

    def close(self) -> None:
        """Stops the three services the way SIGTERM does, and the loop."""
        if self.closed:
            return

        async def stop() -> None:
            if self._stop is not None:
                self._stop.set()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.loop.run(stop())
        self._close_common()


def _peer_store(data_dir: Path, config: Any) -> Store:
    """n2's store: epoch 1's log (a topic, its events) committed, as a slave holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store.open_lmdb(
        data_dir,
        map_size_bytes=config.limits.map_size_bytes,
        dedupe_window=config.limits.dedupe_window,
    )
    if store.meta().last_lsn == 0:
        op = replica_pb2.Operation
        entries = [
            make_entry(1, 1, op(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))),
            make_entry(2, 1, op(create_topic=replica_pb2.CreateTopicOp(name=SEED_TOPIC))),
            make_entry(
                3,
                1,
                op(
                    publish=replica_pb2.PublishOp(
                        topic=SEED_TOPIC,
                        first_offset=0,
                        events=[common_pb2.EventData(payload=p) for p in SEED_PAYLOADS],
                    )
                ),
            ),
        ]
        store.append(entries, sync=True, commit_lsn=3)
        store.set_cluster_id(PEER_CLUSTER_ID)
        store.set_epoch(1)
    return store


class PeerReplica(_Target):
    """n2's replica alone: slave of n1 in epoch 2, serving ReplicaControl and Replication."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.config = make_config(root, 3)
        self.node_config = self.config.node("n2")
        self.data_dir = self.node_config.data_dir
        self.address = self.node_config.replica_address
        self.node: ReplicaNode | None = None
        self.server: ServiceServer | None = None
        self.loop.run(self._start())
        self.channel_ = self.channel(self.address)

    async def _start(self) -> None:
        store = _peer_store(self.data_dir, self.config)
        node = build_replica_node(self.config, self.node_config, store)
        self.node = node
        await node.start()
        await node.apply_role(
            replica_pb2.RoleCommand(
                seq=1,
                epoch=PEER_EPOCH,
                role=common_pb2.ROLE_SLAVE,
                master=common_pb2.NodeEndpoint(node_id="n1"),
                lease_ms=600_000,
                reason="fuzz set-up",
            )
        )
        names = [
            replica_pb2.DESCRIPTOR.services_by_name["ReplicaControl"].full_name,
            replica_pb2.DESCRIPTOR.services_by_name["Replication"].full_name,
        ]
        grpc_server = ServiceServer(self.address, names, self.config.limits.max_message_bytes)
        replica_pb2_grpc.add_ReplicaControlServicer_to_server(
            server.ReplicaControl(node), grpc_server.server
        )
        replica_pb2_grpc.add_ReplicationServicer_to_server(
            replication_server.Replication(node), grpc_server.server
        )
        await grpc_server.start()
        await grpc_server.set_serving(True)
        self.server = grpc_server

    def check(self) -> list[str]:
        """What is wrong with the replica now (empty: serving and answering its state)."""
        problems = [] if healthy(self.address) else [f"{self.address} is not serving"]
        stub = replica_pb2_grpc.ReplicaControlStub(self.channel_)
        try:
            stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=5)
        except grpc.RpcError as exc:
            problems.append(f"GetReplicaState failed: {exc.code().name} {exc.details()}")
        return problems + self.errors.take()

    def close(self) -> None:
        """Stops the server and the node, and the loop."""
        if self.closed:
            return

        async def stop() -> None:
            if self.server is not None:
                await self.server.stop(0.2)
            if self.node is not None:
                await self.node.stop()
                self.node.store.close()

        with contextlib.suppress(Exception):
            self.loop.run(stop())
        self._close_common()


class LoneCoordinator(_Target):
    """n1's coordinator with its peers absent, serving the Coordinator service."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.config = make_config(root, 3)
        self.node_config = self.config.node("n1")
        self.node_config.data_dir.mkdir(parents=True, exist_ok=True)
        self.address = self.node_config.coordinator_address
        self.node: CoordinatorNode | None = None
        self.server: ServiceServer | None = None
        self.loop.run(self._start())
        self.channel_ = self.channel(self.address)

    async def _start(self) -> None:
        node = CoordinatorNode(self.config, self.node_config)
        self.node = node
        name = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
        grpc_server = ServiceServer(self.address, [name], self.config.limits.max_message_bytes)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            Coordinator(node), grpc_server.server
        )
        await grpc_server.start()
        await node.start()
        await grpc_server.set_serving(True)
        self.server = grpc_server

    def check(self) -> list[str]:
        """What is wrong with the coordinator now (empty: serving and answering its status)."""
        problems = [] if healthy(self.address) else [f"{self.address} is not serving"]
        stub = coordinator_pb2_grpc.CoordinatorStub(self.channel_)
        try:
            stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5)
        except grpc.RpcError as exc:
            problems.append(f"GetStatus failed: {exc.code().name} {exc.details()}")
        return problems + self.errors.take()

    def close(self) -> None:
        """Stops the server and the node, and the loop."""
        if self.closed:
            return

        async def stop() -> None:
            if self.server is not None:
                await self.server.stop(0.2)
            if self.node is not None:
                await self.node.stop()

        with contextlib.suppress(Exception):
            self.loop.run(stop())
        self._close_common()


def verify_store(data_dir: Path) -> tuple[int, int]:
    """The store's own consistency check over a closed store: every log entry and state
    record read back and checksummed. Returns (topics, records)."""
    meta, topics, records = verify_copy(data_dir)
    if meta.last_lsn < meta.log_start_lsn - 1:
        raise AssertionError(f"log tail {meta.last_lsn} below its start {meta.log_start_lsn}")
    return topics, records
