"""Starts one node's coordinator: `python -m squall_server.coordinator --config FILE --node ID`."""

from __future__ import annotations

import asyncio
import logging
import sys

from squall.v1 import coordinator_pb2, coordinator_pb2_grpc
from squall_server.common.call_guard import guard_interceptors
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.file_checks import check_data_dir, check_own_key, make_private_dir
from squall_server.common.grpc_server import ServiceServer
from squall_server.common.logs import set_log_context
from squall_server.common.peer_guard import guards
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.service_main import FailStop, node_service_main
from squall_server.common.tls import transport
from squall_server.coordinator.node import CoordinatorNode
from squall_server.coordinator.persist import StateFileError
from squall_server.coordinator.server import Coordinator

log = logging.getLogger("squall.coordinator")

SERVICE_NAMES = [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]
# How long a fail-stopped coordinator lets its stopped server's handlers end.
_HANDLERS_END_S = 0.1


async def serve(config: ClusterConfig, node_config: NodeConfig, stop: asyncio.Event) -> None:
    """Serves until `stop` is set."""
    make_private_dir(node_config.data_dir)
    check_data_dir(node_config.data_dir, f"coordinator {node_config.id}")
    check_own_key(config.tls, node_config.id, f"coordinator {node_config.id}")
    # The node ids both guards accept, following the running node set (node.py).
    running = RunningNodes((n.id for n in config.nodes), (g.id for g in config.gateways))
    node = CoordinatorNode(config, node_config, on_shutdown=stop.set, running_nodes=running)
    set_log_context(
        lambda: {
            "state": node.election.status().state.value,
            "epoch": node.election.persisted.epoch,
        }
    )
    grpc_server = ServiceServer(
        node_config.coordinator_address,
        SERVICE_NAMES,
        config.limits.max_message_bytes,
        credentials=transport(config, node_config.id).server_credentials(require_client_cert=True),
        interceptors=[
            *guards(config, node_config.id, "coordinator", running),
            *guard_interceptors(config, running),
        ],
        metadata_bytes_max=config.limits.metadata_bytes_max,
    )
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Coordinator(node), grpc_server.server)
    try:
        await grpc_server.start()
        await node.start()
        await grpc_server.set_serving(True)
        log.info("coordinator %s serving on %s", node_config.id, node_config.coordinator_address)
        await stop.wait()
        log.info("coordinator %s stopping", node_config.id)
    finally:
        node.quiesce()
        await grpc_server.stop()
        await node.stop()
    if node.failed:
        # The server's cancelled handlers end over the next loop turns; raising at once
        # would leave them to asyncio.run's own cancelling, which gRPC logs as unhandled.
        await asyncio.sleep(_HANDLERS_END_S)
        raise FailStop(node.failed)


def main(argv: list[str] | None = None) -> int:
    """Entry point shared with `squall coordinator`."""
    return node_service_main("coordinator", __doc__, argv, serve, (StateFileError,))


if __name__ == "__main__":
    sys.exit(main())
