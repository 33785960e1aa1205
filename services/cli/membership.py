"""`squall cluster add-node | remove-node | replace-node | set-priority | config export`:
runtime membership changes, and the running node set written back out as a config file.

    squall cluster add-node ID --coordinator-address H:P --replica-address H:P [--priority N]
    squall cluster remove-node ID
    squall cluster replace-node ID --coordinator-address H:P --replica-address H:P
    squall cluster set-priority ID N
    squall cluster config export [--out FILE] [--data-dir ID=DIR ...]

Each change goes to the coordinator of the serving group (found by asking every node the
file names), which re-forms the group under the new node set; the command then waits for
the outcome (``--wait`` seconds) and prints it. An unsafe change is refused with the reason
and changes nothing (docs/operations.md, "Changing the membership"). `config export`
writes the running set over the file's [[nodes]], with its version and epoch, so the file
can be brought up to date and a new node started from it.
"""

from __future__ import annotations

import argparse
import getpass
import json
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from squall.v1 import common_pb2, coordinator_pb2
from squall_server.cli.auth import add_token_argument
from squall_server.common.config import ClusterConfig, NodeConfig

# How often a change's outcome is polled.
_POLL_S = 0.05
_CHANGES = {
    "add-node": coordinator_pb2.MEMBERSHIP_CHANGE_KIND_ADD_NODE,
    "remove-node": coordinator_pb2.MEMBERSHIP_CHANGE_KIND_REMOVE_NODE,
    "replace-node": coordinator_pb2.MEMBERSHIP_CHANGE_KIND_REPLACE_NODE,
    "set-priority": coordinator_pb2.MEMBERSHIP_CHANGE_KIND_SET_PRIORITY,
}


def add_parsers(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:  # type: ignore[type-arg]
    """Adds the four changes and `config export`; returns them (they share --config)."""
    add = sub.add_parser("add-node", help="add a node to the running cluster")
    replace = sub.add_parser(
        "replace-node",
        help="give a node that is gone for good new addresses (a new machine, empty store)",
    )
    for parser in (add, replace):
        parser.add_argument("node")
        parser.add_argument("--coordinator-address", required=True, metavar="HOST:PORT")
        parser.add_argument("--replica-address", required=True, metavar="HOST:PORT")
    add.add_argument("--priority", type=int, default=1, help="its priority (default 1)")
    remove = sub.add_parser("remove-node", help="take a node out of the running cluster")
    remove.add_argument("node")
    priority = sub.add_parser(
        "set-priority", help="change a node's priority (the highest caught-up node leads)"
    )
    priority.add_argument("node")
    priority.add_argument("priority", type=int)
    changes = [add, replace, remove, priority]
    for parser in changes:
        parser.add_argument("--reason", default="", help="why, for the audit trail")
        parser.add_argument(
            "--wait", type=float, default=10.0, help="seconds to wait for the outcome"
        )
    config = sub.add_parser("config", help="write the running node set out as a config file")
    actions = config.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="the config file with the running node set")
    export.add_argument("--out", metavar="FILE", help="write here (default: standard output)")
    export.add_argument(
        "--data-dir",
        action="append",
        default=[],
        metavar="ID=DIR",
        help="data directory of a node the file does not list (default: next to the "
        "first node's, named after the id)",
    )
    for parser in (*changes, export):
        parser.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
        add_token_argument(parser)
        parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    return changes


def run(config: ClusterConfig, args: argparse.Namespace, out: TextIO) -> int:
    """Runs one membership command; AdminError (from admin) names what failed."""
    from squall_server.cli import admin

    if args.cluster_command == "config":
        text = export_text(config, _running_set(config, args.timeout), _data_dirs(args))
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}", file=out)
        else:
            out.write(text)
        return 0
    statuses = {n.id: admin._status(n, args.timeout) for n in config.nodes}
    leaders = sorted(
        (s.epoch, node_id)
        for node_id, s in statuses.items()
        if s is not None and admin._leads(s, node_id)
    )
    if not leaders:
        raise admin.AdminError(
            "no serving group to change: no node the file names is normal as its group's "
            "master (see squall status)"
        )
    epoch, leader_id = leaders[-1]
    leader = config.node(leader_id)
    kind = args.cluster_command
    request = coordinator_pb2.ChangeMembershipRequest(
        kind=_CHANGES[kind],
        node_id=args.node,
        priority=max(0, getattr(args, "priority", 0)),
        coordinator_address=getattr(args, "coordinator_address", ""),
        replica_address=getattr(args, "replica_address", ""),
        operator=getpass.getuser(),
        reason=args.reason,
    )
    if getattr(args, "priority", 0) < 0:
        raise admin.AdminError(f"priority {args.priority} is negative; use 0 to never lead")
    reply = admin._call(
        leader.coordinator_address, leader.id, "ChangeMembership", request, args.timeout
    )
    note = reply.status.membership_change
    deadline = time.monotonic() + max(0.0, args.wait)
    # Bounded by the deadline: one status call (at most --timeout) per pass.
    while "in progress" in note and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        status = admin._status(leader, args.timeout)
        if status is not None and status.membership_change:
            note = status.membership_change
    print(f"{leader.id} (master, epoch {epoch}): {note}", file=out)
    if "FAILED" in note:
        return 1
    if "in progress" in note:
        print(f"still in progress after {args.wait:.1f} s; see squall status", file=out)
        return 1
    return 0


def _running_set(config: ClusterConfig, timeout: float) -> coordinator_pb2.NodeSet:
    """The node set of the newest normal group any node the file names reports."""
    from squall_server.cli import admin

    best: coordinator_pb2.NodeSet | None = None
    for node in config.nodes:
        status = admin._status(node, timeout)
        if status is None or not status.HasField("membership"):
            continue
        if status.state != common_pb2.NODE_STATE_NORMAL:
            continue
        found = status.membership
        if best is None or (found.epoch, found.version) > (best.epoch, best.version):
            best = found
    if best is None:
        raise admin.AdminError(
            "no node the file names is normal in a group: nothing to export (see squall status)"
        )
    return best


def _data_dirs(args: argparse.Namespace) -> dict[str, str]:
    from squall_server.cli import admin

    dirs: dict[str, str] = {}
    for item in args.data_dir:
        node, sep, path = item.partition("=")
        if not sep or not node or not path:
            raise admin.AdminError(f"--data-dir {item!r}: use ID=DIR")
        dirs[node] = path
    return dirs


def export_text(
    config: ClusterConfig, running: coordinator_pb2.NodeSet, data_dirs: Mapping[str, str]
) -> str:
    """The config file with ``running`` in place of its [[nodes]] and its version recorded;
    every other section as the file has it."""
    document: dict[str, Any] = tomllib.loads(config.path.read_text())
    known: dict[str, NodeConfig] = {n.id: n for n in config.nodes}
    parent = config.nodes[0].data_dir.parent if config.nodes else Path(".")
    cluster = dict(document.get("cluster", {}))
    cluster["membership_version"] = running.version
    cluster["membership_epoch"] = running.epoch
    document["cluster"] = cluster
    document["nodes"] = [
        {
            "id": m.node_id,
            "priority": m.priority,
            "coordinator_address": m.coordinator_address,
            "replica_address": m.replica_address,
            "data_dir": data_dirs.get(m.node_id)
            or str(known[m.node_id].data_dir if m.node_id in known else parent / m.node_id),
            **({"learner": True} if m.learner else {}),
        }
        for m in running.members
    ]
    header = (
        f"# Written by `squall cluster config export`: node set v{running.version} "
        f"(epoch {running.epoch}).\n"
    )
    return header + _toml(document)


def _toml(document: Mapping[str, Any]) -> str:
    """TOML for a config document: tables of scalars and lists, arrays of tables."""
    lines: list[str] = []
    for key, value in document.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_value(v)}" for k, v in value.items())
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for table in value:
                lines.append(f"\n[[{key}]]")
                lines.extend(f"{k} = {_value(v)}" for k, v in table.items())
        else:
            lines.insert(0, f"{key} = {_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")
