"""Starts one node's coordinator: `python -m services.coordinator --config FILE --node ID`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.config import ClusterConfig, NodeConfig, load_config_or_exit
from services.common.grpc_server import ServiceServer, run_until_signalled
from services.common.logs import setup_logging
from services.coordinator.node import CoordinatorNode
from services.coordinator.persist import StateFileError
from services.coordinator.server import Coordinator
from squall.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("squall.coordinator")

SERVICE_NAMES = [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]


async def serve(config: ClusterConfig, node_config: NodeConfig, stop: asyncio.Event) -> None:
    """Serves until `stop` is set."""
    node = CoordinatorNode(config, node_config)
    grpc_server = ServiceServer(
        node_config.coordinator_address, SERVICE_NAMES, config.limits.max_message_bytes
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
        await grpc_server.stop()
        await node.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point shared with `squall coordinator`."""
    parser = argparse.ArgumentParser(prog="squall coordinator", description=__doc__)
    parser.add_argument("--config", required=True, help="cluster configuration file (TOML)")
    parser.add_argument("--node", required=True, help="this node's id in the configuration")
    args = parser.parse_args(argv)
    config = load_config_or_exit(args.config, node_id=args.node)
    node_config = config.node(args.node)
    setup_logging(config.logging, "coordinator", node_config.id)
    try:
        asyncio.run(run_until_signalled(lambda stop: serve(config, node_config, stop)))
    except StateFileError as exc:
        log.error("coordinator %s cannot read its state: %s", node_config.id, exc)
        return 1
    except OSError as exc:
        log.error("coordinator %s cannot start: %s", node_config.id, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
