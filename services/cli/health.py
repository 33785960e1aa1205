"""`squall health ADDRESS`: is the service at ADDRESS serving? For probes and scripts.

Asks the standard `grpc.health.v1.Health` service every Squall process runs (as
grpc_health_probe would, without installing it): exit status 0 when it answers SERVING,
1 otherwise, with one line saying what it answered. Container health checks, load
balancers and scripts that wait for a restarted service use it.
"""

from __future__ import annotations

import argparse
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from squall_server.common.tls import plain_or


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `health`."""
    health = commands.add_parser(
        "health", help="ask a service's gRPC health check (exit 0 when SERVING)"
    )
    health.add_argument("address", metavar="ADDRESS", help="host:port of any Squall service")
    health.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="a fully qualified gRPC service name (default: the whole server)",
    )
    health.add_argument(
        "--timeout", type=float, default=2.0, metavar="SECONDS", help="deadline of the check"
    )
    health.add_argument(
        "--config",
        metavar="FILE",
        help="cluster TOML: with [tls] on, check over TLS (as admin when cert_dir has it)",
    )
    health.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Checks one address; prints `ADDRESS: STATUS`; 0 only for SERVING."""
    links = None
    if args.config:
        from squall_server.common.config import ConfigError, load_config
        from squall_server.common.tls import cli_transport

        try:
            links = cli_transport(load_config(args.config))
        except ConfigError as err:
            print(f"squall: config error: {args.config}: {err}", file=out)
            return 2
    with plain_or(links, args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code()
            print(f"{args.address}: {code.name}: {exc.details()}", file=out)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}", file=out)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
