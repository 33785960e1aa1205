"""`squall config check FILE`: validates a cluster file with the loader the services use.

Run it before a restart or a rollout: it reads the file exactly as `squall replica`,
`squall coordinator` and `squall gateway` do at start-up (squall_server.common.config's
load_config_or_exit), so a file it accepts is one they accept. A problem prints one line
naming the field (`squall: config error: FILE: timeouts.replica_timeout_ms: ...`) and
exits 2 — the same status the services exit with, which their systemd units never
restart. With --node or --gateway it also checks that id and, with [tls] on, that
cert_dir holds that host's certificate and key.
"""

from __future__ import annotations

import argparse
from typing import TextIO


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `config check`."""
    config = commands.add_parser("config", help="check a cluster configuration file")
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="validate FILE as the services would (exit 2 naming the field if it is wrong)",
    )
    check.add_argument("file", metavar="FILE", help="cluster TOML file")
    which = check.add_mutually_exclusive_group()
    which.add_argument("--node", metavar="ID", help="also check as node ID would start")
    which.add_argument("--gateway", metavar="ID", help="also check as gateway ID would start")
    check.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Loads the file as a service would; prints one OK line (exits 2 through the loader)."""
    from squall_server.common.config import load_config_or_exit

    config = load_config_or_exit(args.file, node_id=args.node, gateway_id=args.gateway)
    nodes = ", ".join(node.id for node in config.nodes)
    gateways = ", ".join(gateway.id for gateway in config.gateways) or "none"
    extras = [
        f"tls {'on' if config.tls.enabled else 'off'}",
        f"auth {'on' if config.auth.enabled else 'off'}",
    ]
    checked = f" as node {args.node}" if args.node else ""
    checked = f" as gateway {args.gateway}" if args.gateway else checked
    print(
        f"{args.file}: OK{checked}: cluster {config.name}, {len(config.nodes)} node(s) "
        f"({nodes}), gateway(s) {gateways}, {', '.join(extras)}",
        file=out,
    )
    return 0
