"""`squall cluster ...`: operator controls sent to the nodes named in the config file.

`quorum-override` and `designated-primary` change how many nodes a group needs, so they
are loud: the coordinator logs them as warnings, persists them, and `squall status` shows
them. `shutdown` stops every node at one point and marks the stores clean
(services/cluster_shutdown.py).
"""

from __future__ import annotations

import argparse
import getpass
from typing import TextIO

import grpc

from services.cluster_shutdown import ShutdownError, shutdown_cluster
from services.common.config import ClusterConfig, ConfigError, load_config
from squall.v1 import coordinator_pb2, coordinator_pb2_grpc


class AdminError(Exception):
    """An operator command failed; the message names the node and the reason."""


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `cluster designated-primary` and `cluster quorum-override`."""
    cluster = commands.add_parser("cluster", help="operator controls (see docs/operations.md)")
    sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    primary = sub.add_parser(
        "designated-primary",
        help="let NODE of a two-node cluster run alone (--off clears it)",
    )
    primary.add_argument("node")
    primary.add_argument("--off", action="store_true", help="clear the flag instead")
    override = sub.add_parser(
        "quorum-override",
        help="lower the nodes a group needs (disaster recovery); 0 clears it",
    )
    override.add_argument("count", type=int)
    override.add_argument(
        "--node", action="append", help="only on this node (repeatable; default: every node)"
    )
    for parser in (primary, override):
        parser.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
        parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    shutdown = sub.add_parser(
        "shutdown",
        help="stop every node at one point and mark the stores clean (restart needs no "
        "operator)",
    )
    shutdown.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
    shutdown.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds for the members to reach the master's last entry (default 30)",
    )


def _config(path: str) -> ClusterConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise AdminError(f"config error: {path}: {exc}") from None


def _call(
    address: str, node_id: str, method: str, request: object, timeout: float
) -> coordinator_pb2.OperatorControlResponse:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            reply: coordinator_pb2.OperatorControlResponse = getattr(stub, method)(
                request, timeout=timeout
            )
            return reply
        except grpc.RpcError as exc:
            raise AdminError(
                f"node {node_id}: {exc.code().name}: {exc.details()}"
            ) from None


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Runs one `squall cluster` command; returns the exit status."""
    config = _config(args.config)
    operator = getpass.getuser()
    if args.cluster_command == "shutdown":
        if args.timeout <= 0:
            raise AdminError(f"--timeout must be > 0, not {args.timeout}")
        try:
            return shutdown_cluster(config, out, timeout_s=args.timeout, operator=operator)
        except ShutdownError as exc:
            raise AdminError(str(exc)) from None
    if args.cluster_command == "designated-primary":
        try:
            node = config.node(args.node)
        except ConfigError as exc:
            raise AdminError(str(exc)) from None
        request = coordinator_pb2.SetDesignatedPrimaryRequest(
            enabled=not args.off, operator=operator
        )
        reply = _call(
            node.coordinator_address, node.id, "SetDesignatedPrimary", request, args.timeout
        )
        flag = "set" if reply.status.designated_primary else "cleared"
        print(f"{node.id}: designated primary {flag}", file=out)
        return 0
    targets = config.nodes if not args.node else [config.node(n) for n in args.node]
    failures = 0
    for node in targets:
        override = coordinator_pb2.SetQuorumOverrideRequest(required=args.count, operator=operator)
        try:
            reply = _call(
                node.coordinator_address, node.id, "SetQuorumOverride", override, args.timeout
            )
        except AdminError as exc:
            print(f"squall: {exc}", file=out)
            failures += 1
            continue
        print(
            f"{node.id}: quorum override {reply.status.quorum_override or 'cleared'}, "
            f"a group now needs {reply.status.quorum_required} node(s)",
            file=out,
        )
    return 1 if failures == len(targets) else 0
