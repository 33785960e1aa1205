"""Starts a gateway: `python -m squall_server.gateway --config FILE [--gateway ID]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from squall.v1 import broker_pb2, gateway_pb2, gateway_pb2_grpc
from squall_server.common.call_guard import guard_interceptors
from squall_server.common.config import ClusterConfig, GatewayConfig, load_config_or_exit
from squall_server.common.file_checks import check_own_key
from squall_server.common.grpc_server import ServiceServer
from squall_server.common.logs import set_log_context, setup_logging
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.service_main import run_service
from squall_server.common.telemetry import current
from squall_server.console.hosted import HostedConsole, serves_console
from squall_server.gateway.forward import FORWARDED_SERVICES, Forwarder
from squall_server.gateway.master import MasterTracker
from squall_server.gateway.server import ClusterAdmin
from squall_server.gateway.shared_publish import SharedPublishStreams, joining_for
from squall_server.gateway.telemetry import instruments

log = logging.getLogger("squall.gateway")

SERVICE_NAMES = [
    *(broker_pb2.DESCRIPTOR.services_by_name[name].full_name for name in FORWARDED_SERVICES),
    gateway_pb2.DESCRIPTOR.services_by_name["ClusterAdmin"].full_name,
]


async def serve(config: ClusterConfig, gateway: GatewayConfig, stop: asyncio.Event) -> None:
    """Serves until `stop` is set."""
    check_own_key(config.tls, gateway.id, f"gateway {gateway.id}")
    timeout_s = config.timeouts.publish_timeout_ms / 1000
    rpc_timeout_s = config.timeouts.rpc_timeout_ms / 1000
    # The node ids the call guard takes for members, following the running node set.
    running = RunningNodes((n.id for n in config.nodes), (g.id for g in config.gateways))
    masters = MasterTracker(
        config, gateway.id, probe_timeout_s=rpc_timeout_s, running_nodes=running
    )
    admin = ClusterAdmin(config, masters, timeout_s=rpc_timeout_s)
    # Each shared publish stream is one client to a replica: it stays within that
    # client's limit of publishes awaiting receipts, and joins waiting publishes within
    # the masters' limits (the cluster's one config).
    shared = SharedPublishStreams(
        masters,
        config.limits.client_inflight_publishes_max,
        joining=joining_for(config.limits.max_batch_events, config.limits.max_message_bytes),
    )
    forwarder = Forwarder(
        masters,
        timeout_s,
        master_wait_s=rpc_timeout_s,
        policy=config.retry.policy(),
        gateway_id=gateway.id,
        read_from=gateway.read_from,
        shared=shared,
    )
    # Apps connect without a client certificate: TLS, not mutual TLS, on the gateway.
    grpc_server = ServiceServer(
        gateway.address,
        SERVICE_NAMES,
        config.limits.max_message_bytes,
        credentials=masters.transport.server_credentials(require_client_cert=False),
        interceptors=guard_interceptors(config, running),
        metadata_bytes_max=config.limits.metadata_bytes_max,
    )
    grpc_server.server.add_generic_rpc_handlers(forwarder.handlers())
    gateway_pb2_grpc.add_ClusterAdminServicer_to_server(admin, grpc_server.server)
    observed = current()
    gauges = instruments(observed) if observed.metering else None
    if gauges is not None:
        gauges.watch(gateway.id, shared.backlog)
    masters.start()
    set_log_context(lambda: {"master": masters.master_id or "-", "epoch": masters.epoch})
    console: HostedConsole | None = None
    try:
        await grpc_server.start()
        await grpc_server.set_serving(True)
        log.info("gateway %s serving on %s", gateway.id, gateway.address)
        if serves_console(config, gateway):
            # [console]: the page's threads call this gateway's own address. A console that
            # cannot start (its port taken, its token file unreadable) is logged; the
            # gateway, the apps' endpoint, keeps serving without it.
            try:
                console = await asyncio.to_thread(HostedConsole, config, gateway)
            except (OSError, ValueError) as err:
                log.error(
                    "gateway %s: the console cannot start on %s: %s; serving without it",
                    gateway.id, config.console.address, err,
                )  # fmt: skip
        await stop.wait()
        log.info("gateway %s stopping", gateway.id)
    finally:
        if gauges is not None:
            gauges.unwatch(gateway.id)
        if console is not None:
            await asyncio.to_thread(console.close)
        await grpc_server.stop()
        await shared.close()
        await admin.close()
        await masters.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point shared with `squall gateway`."""
    parser = argparse.ArgumentParser(prog="squall gateway", description=__doc__)
    parser.add_argument("--config", required=True, help="cluster configuration file (TOML)")
    parser.add_argument("--gateway", default=None, help="gateway id (default: the first)")
    args = parser.parse_args(argv)
    config = load_config_or_exit(args.config, gateway_id=args.gateway)
    gateway = config.gateway(args.gateway)
    if args.gateway is None and config.tls.enabled:
        load_config_or_exit(args.config, gateway_id=gateway.id)  # checks its certificate
    setup_logging(config.logging, "gateway", gateway.id)
    return run_service(
        "gateway", gateway.id, lambda stop: serve(config, gateway, stop), config=config
    )


if __name__ == "__main__":
    sys.exit(main())
