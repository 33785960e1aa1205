"""Starts one node's replica: `python -m squall_server.replica --config FILE --node ID`."""

from __future__ import annotations

import asyncio
import logging
import sys

from squall.v1 import broker_pb2, broker_pb2_grpc, replica_pb2, replica_pb2_grpc
from squall_server.common.call_guard import guard_interceptors
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.file_checks import check_data_dir, check_own_key, make_private_dir
from squall_server.common.grpc_server import ServiceServer
from squall_server.common.logs import set_log_context
from squall_server.common.peer_guard import guards
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.service_main import node_service_main
from squall_server.common.tls import transport
from squall_server.replica import push_server, replication_server, server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.datadir import DataDirBusy, DataDirLock
from squall_server.replica.loop_watch import watch_loop
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.store import Store, StoreError
from squall_server.replica.telemetry import ROLE_NAMES

log = logging.getLogger("squall.replica")

SERVICE_NAMES = [
    broker_pb2.DESCRIPTOR.services_by_name["TopicManager"].full_name,
    broker_pb2.DESCRIPTOR.services_by_name["Publisher"].full_name,
    broker_pb2.DESCRIPTOR.services_by_name["Subscriber"].full_name,
    broker_pb2.DESCRIPTOR.services_by_name["PushSubscriptions"].full_name,
    replica_pb2.DESCRIPTOR.services_by_name["ReplicaControl"].full_name,
    replica_pb2.DESCRIPTOR.services_by_name["Replication"].full_name,
]


async def serve(config: ClusterConfig, node_config: NodeConfig, stop: asyncio.Event) -> None:
    """Opens the store, serves until `stop` is set, then closes everything in order."""
    make_private_dir(node_config.data_dir)
    check_data_dir(node_config.data_dir, f"replica {node_config.id}")
    check_own_key(config.tls, node_config.id, f"replica {node_config.id}")
    if config.tls.enabled and not config.tls.push_tls:
        log.warning(
            'replica %s: push deliveries to apps are plaintext (tls.push = "plaintext"): '
            "event payloads cross the network unencrypted to every push endpoint",
            node_config.id,
        )
    # Held until the process exits: the offline store tools and a second replica on the
    # same directory refuse while it is.
    lock = DataDirLock(node_config.data_dir)
    try:
        await _serve_locked(config, node_config, stop)
    finally:
        lock.release()


async def _serve_locked(
    config: ClusterConfig, node_config: NodeConfig, stop: asyncio.Event
) -> None:
    """serve() with the data directory locked."""
    store = Store.open_lmdb(
        node_config.data_dir,
        map_size_bytes=config.limits.map_size_bytes,
        dedupe_window=config.limits.dedupe_window,
    )
    truncator = LmdbTruncator(
        node_config.data_dir,
        map_size_bytes=config.limits.map_size_bytes,
        dedupe_window=config.limits.dedupe_window,
    )
    truncator.discard()  # a truncation interrupted by a crash is redone when needed
    # The node ids both guards accept, following the running node set (node.py).
    running = RunningNodes((n.id for n in config.nodes), (g.id for g in config.gateways))
    node = build_replica_node(
        config, node_config, store, truncator=truncator, running_nodes=running
    )
    node.on_shutdown = stop.set  # a finished cluster shutdown stops the process
    set_log_context(
        lambda: {
            "role": ROLE_NAMES.get(node.role, "unknown"),
            "epoch": node.epoch,
            "lsn": node.last_lsn,
        }
    )
    grpc_server = ServiceServer(
        node_config.replica_address,
        SERVICE_NAMES,
        config.limits.max_message_bytes,
        credentials=transport(config, node_config.id).server_credentials(require_client_cert=True),
        interceptors=[
            *guards(config, node_config.id, "replica", running),
            *guard_interceptors(config, running),
        ],
        metadata_bytes_max=config.limits.metadata_bytes_max,
    )
    broker_pb2_grpc.add_TopicManagerServicer_to_server(
        server.TopicManager(node), grpc_server.server
    )
    broker_pb2_grpc.add_PublisherServicer_to_server(server.Publisher(node), grpc_server.server)
    broker_pb2_grpc.add_SubscriberServicer_to_server(server.Subscriber(node), grpc_server.server)
    broker_pb2_grpc.add_PushSubscriptionsServicer_to_server(
        push_server.PushSubscriptions(node), grpc_server.server
    )
    replica_pb2_grpc.add_ReplicaControlServicer_to_server(
        server.ReplicaControl(node), grpc_server.server
    )
    replica_pb2_grpc.add_ReplicationServicer_to_server(
        replication_server.Replication(node), grpc_server.server
    )
    watch: asyncio.Task[None] | None = None
    try:
        await node.start()
        watch = asyncio.create_task(
            watch_loop(node.clock, node_config.id, config.timeouts.replica_timeout_ms),
            name=f"loop-watch-{node_config.id}",
        )
        await grpc_server.start()
        await grpc_server.set_serving(True)
        log.info("replica %s serving on %s", node_config.id, node_config.replica_address)
        await stop.wait()
        log.info("replica %s stopping", node_config.id)
    finally:
        if watch is not None:
            watch.cancel()
        await grpc_server.stop()
        await node.stop()
        node.store.close()  # the node may have reopened it (a truncation)


def main(argv: list[str] | None = None) -> int:
    """Entry point shared with `squall replica`."""
    return node_service_main("replica", __doc__, argv, serve, (StoreError, DataDirBusy))


if __name__ == "__main__":
    sys.exit(main())
