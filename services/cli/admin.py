"""`squall cluster ...`: operator controls sent to the nodes named in the config file.

    squall cluster shutdown [--timeout S]
    squall cluster quorum-override N [--node ID ...] [--reason WHY]
    squall cluster designated-primary ID [--off]
    squall cluster transfer --to ID [--reason WHY] [--wait-ms MS]
    squall cluster quarantine ID [--reason WHY]
    squall cluster unquarantine ID [--reason WHY]
    squall cluster ack-loss LOSS_ID [--reason WHY]
    squall cluster add-node | remove-node | replace-node | set-priority | config export
                               (runtime membership changes: services/cli/membership.py)

Every control is loud: the coordinator logs it as a warning, persists it with who, when and
why, and `squall status` shows it. A command against a node that is not configured or not
reachable fails with a message naming the node, and changes nothing. `shutdown` stops
every node at one point and marks the stores clean (services/cli/cluster_shutdown.py).
"""

from __future__ import annotations

import argparse
import getpass
import time
from contextvars import ContextVar
from typing import TextIO

import grpc

from squall import with_token
from squall.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from squall_server.cli import membership as cli_membership
from squall_server.cli.auth import add_token_argument, cli_token
from squall_server.cli.cluster_shutdown import TIMEOUT_MAX_S, ShutdownError, shutdown_cluster
from squall_server.common.config import ClusterConfig, ConfigError, NodeConfig, load_config
from squall_server.common.tls import Transport, cli_transport, plain_or

# Printed after setting the flag: what no protocol can prevent with two nodes.
_DESIGNATED_DANGER = (
    "WARNING: {node} will now run ALONE whenever it cannot reach the other node. Never set "
    "the flag on the other node as well: the nodes refuse it while they can see each "
    "other's flag, but on both sides of a partition both would run alone and accept writes "
    "the other never sees; when they meet again the lower-ranked one gives its flag up and "
    "one side's writes since the split are discarded (reported in `squall status` as a "
    "loss). Clear it with `squall cluster designated-primary {node} --off` once the other "
    "node is back."
)
# How often `transfer` polls the target while it takes over.
_TRANSFER_POLL_S = 0.01


class AdminError(Exception):
    """An operator command failed; the message names the node and the reason."""


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `cluster designated-primary | quorum-override | transfer | (un)quarantine`."""
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
        help="lower the nodes a group needs (disaster recovery); 0 clears it; it also "
        "clears itself once a majority is back",
    )
    override.add_argument("count", type=int)
    override.add_argument(
        "--node", action="append", help="only on this node (repeatable; default: every node)"
    )
    transfer = sub.add_parser(
        "transfer",
        help="hand the master role to another node, losing no acknowledged write",
    )
    transfer.add_argument("--to", required=True, metavar="NODE", dest="target")
    transfer.add_argument(
        "--wait-ms",
        type=int,
        default=5000,
        help="longest wait for NODE to catch up before the transfer is abandoned (default 5000)",
    )
    quarantine = sub.add_parser(
        "quarantine", help="take NODE out of every group until it is unquarantined"
    )
    quarantine.add_argument("node")
    unquarantine = sub.add_parser(
        "unquarantine", help="let a quarantined NODE rejoin (repair its store first)"
    )
    unquarantine.add_argument("node")
    ack_loss = sub.add_parser(
        "ack-loss",
        help="acknowledge a loss report shown by `squall status` (it leaves the status; the "
        "audit trail keeps who acknowledged it)",
    )
    ack_loss.add_argument("loss_id", metavar="LOSS_ID")
    cli_membership.add_parsers(sub)
    for parser in (primary, override, transfer, quarantine, unquarantine, ack_loss):
        parser.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
        add_token_argument(parser)
        parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    shutdown = sub.add_parser(
        "shutdown",
        help="stop every node at one point and mark the stores clean (restart needs no operator)",
    )
    shutdown.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
    add_token_argument(shutdown)
    shutdown.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds for the members to reach the master's last entry (default 30)",
    )
    for parser in (override, transfer, quarantine, unquarantine, ack_loss):
        parser.add_argument("--reason", default="", help="why, for the audit trail")


def _config(path: str) -> ClusterConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise AdminError(f"config error: {path}: {exc}") from None


def _node(config: ClusterConfig, node_id: str) -> NodeConfig:
    try:
        return config.node(node_id)
    except ConfigError as exc:
        raise AdminError(str(exc)) from None


# The command's TLS identity (`admin` from [tls] cert_dir), set once by run().
_LINKS: ContextVar[Transport | None] = ContextVar("squall_admin_links", default=None)


def _call(
    address: str, node_id: str, method: str, request: object, timeout: float
) -> coordinator_pb2.OperatorControlResponse:
    with plain_or(_LINKS.get(), address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(with_token(channel, cli_token()))
        try:
            reply: coordinator_pb2.OperatorControlResponse = getattr(stub, method)(
                request, timeout=timeout
            )
            return reply
        except grpc.RpcError as exc:
            links = _LINKS.get()
            hint = ""
            if links is not None and links.enabled and links.identity is None:
                # Coordinators and replicas require a client certificate.
                hint = " (no admin.crt and admin.key in tls.cert_dir to present)"
            raise AdminError(f"node {node_id}: {exc.code().name}: {exc.details()}{hint}") from None


def _status(node: NodeConfig, timeout: float) -> coordinator_pb2.CoordinatorStatus | None:
    """A coordinator's status, or None if it does not answer."""
    with plain_or(_LINKS.get(), node.coordinator_address) as channel:
        try:
            status: coordinator_pb2.CoordinatorStatus = coordinator_pb2_grpc.CoordinatorStub(
                with_token(channel, cli_token())
            ).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=timeout)
            return status
        except grpc.RpcError:
            return None


def _leads(status: coordinator_pb2.CoordinatorStatus | None, node_id: str) -> bool:
    return (
        status is not None
        and status.state == common_pb2.NODE_STATE_NORMAL
        and status.coordinator_id == node_id
        and status.role == common_pb2.ROLE_MASTER
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Runs one `squall cluster` command; returns the exit status."""
    config = _config(args.config)
    _LINKS.set(cli_transport(config))
    operator = getpass.getuser()
    command = args.cluster_command
    if command in ("add-node", "remove-node", "replace-node", "set-priority", "config"):
        return cli_membership.run(config, args, out)
    if command == "shutdown":
        if not 0 < args.timeout <= TIMEOUT_MAX_S:
            raise AdminError(
                f"--timeout must be > 0 and at most {TIMEOUT_MAX_S:.0f} s (a replica's "
                f"freeze holds at most an hour), not {args.timeout}"
            )
        try:
            return shutdown_cluster(config, out, timeout_s=args.timeout, operator=operator)
        except ShutdownError as exc:
            raise AdminError(str(exc)) from None
    if command == "designated-primary":
        node = _node(config, args.node)
        request = coordinator_pb2.SetDesignatedPrimaryRequest(
            enabled=not args.off, operator=operator
        )
        reply = _call(
            node.coordinator_address, node.id, "SetDesignatedPrimary", request, args.timeout
        )
        if reply.status.designated_primary:
            print(f"{node.id}: designated primary set", file=out)
            print(_DESIGNATED_DANGER.format(node=node.id), file=out)
        else:
            print(f"{node.id}: designated primary cleared", file=out)
        return 0
    if command == "ack-loss":
        return _ack_loss(config, args.loss_id, operator, args.reason, args.timeout, out)
    if command == "transfer":
        return _transfer(config, args, operator, out)
    if command in ("quarantine", "unquarantine"):
        node = _node(config, args.node)
        quarantine = coordinator_pb2.SetQuarantineRequest(
            enabled=command == "quarantine", operator=operator, reason=args.reason
        )
        reply = _call(node.coordinator_address, node.id, "SetQuarantine", quarantine, args.timeout)
        if reply.status.HasField("quarantine"):
            print(
                f"{node.id}: QUARANTINED ({reply.status.quarantine.reason}); it takes no part "
                f"until `squall cluster unquarantine {node.id}`",
                file=out,
            )
        else:
            print(f"{node.id}: not quarantined; it rejoins the group", file=out)
        return 0
    targets = config.nodes if not args.node else [_node(config, n) for n in args.node]
    failures = 0
    for node in targets:
        override = coordinator_pb2.SetQuorumOverrideRequest(
            required=args.count, operator=operator, reason=args.reason
        )
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


def _ack_loss(
    config: ClusterConfig, loss_id: str, operator: str, reason: str, timeout: float, out: TextIO
) -> int:
    """Finds the node holding the loss report and acknowledges it there."""
    held: list[str] = []
    unreachable: list[str] = []
    for node in config.nodes:
        status = _status(node, timeout)
        if status is None:
            unreachable.append(node.id)
            continue
        ids = [loss.loss_id for loss in status.losses]
        held.extend(f"{node.id}:{i}" for i in ids)
        if loss_id in ids:
            request = coordinator_pb2.AckLossRequest(
                loss_id=loss_id, operator=operator, reason=reason
            )
            _call(node.coordinator_address, node.id, "AckLoss", request, timeout)
            print(f"{node.id}: loss report {loss_id} acknowledged", file=out)
            return 0
    raise AdminError(
        f"no unacknowledged loss report {loss_id!r} on any reachable node (unacknowledged: "
        f"{', '.join(held) or 'none'}"
        + (f"; unreachable: {', '.join(unreachable)}" if unreachable else "")
        + "); nothing changed"
    )


def _transfer(config: ClusterConfig, args: argparse.Namespace, operator: str, out: TextIO) -> int:
    """Finds the master, asks it to hand over to --to, waits until the target leads."""
    target = _node(config, args.target)
    if not 0 < args.wait_ms <= 60_000:
        raise AdminError(f"--wait-ms must be 1..60000, not {args.wait_ms}")
    statuses = {n.id: _status(n, args.timeout) for n in config.nodes}
    masters = sorted(
        (s.epoch, node_id)
        for node_id, s in statuses.items()
        if s is not None and _leads(s, node_id)
    )
    if not masters:
        unreachable = [n for n, s in statuses.items() if s is None]
        raise AdminError(
            "no master to transfer from: no node is normal as its group's master"
            + (f" (unreachable: {', '.join(unreachable)})" if unreachable else "")
        )
    epoch, master_id = masters[-1]
    if master_id == target.id:
        print(f"{target.id} already leads (epoch {epoch}); nothing to do", file=out)
        return 0
    master = config.node(master_id)
    request = coordinator_pb2.TransferLeadershipRequest(
        target=target.id, operator=operator, reason=args.reason, timeout_ms=args.wait_ms
    )
    started = time.monotonic()
    _call(
        master.coordinator_address,
        master.id,
        "TransferLeadership",
        request,
        args.timeout + args.wait_ms / 1000,
    )
    deadline = started + args.timeout + args.wait_ms / 1000
    # Bounded by the deadline: one status call (at most --timeout) per pass.
    while time.monotonic() < deadline:
        status = _status(target, args.timeout)
        if _leads(status, target.id) and status is not None and status.epoch > epoch:
            print(
                f"{target.id} leads in epoch {status.epoch} (was {master.id} in epoch "
                f"{epoch}); hand-over took {(time.monotonic() - started) * 1000:.0f} ms",
                file=out,
            )
            return 0
        time.sleep(_TRANSFER_POLL_S)
    raise AdminError(
        f"{master.id} handed the leadership to {target.id}, but {target.id} does not lead "
        f"yet after {args.timeout + args.wait_ms / 1000:.1f} s; see `squall status` and the "
        "coordinators' logs (the old master resumed writes if the hand-over failed)"
    )
