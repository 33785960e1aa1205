"""`squall status` additions: operator notes (overrides, quarantines, transfers, with who,
when and why) and `--explain` (why the master leads, who would lead if a node failed).

The verdicts come from ``squall_server.coordinator.succession``, which applies the election's
own rules; this module only turns the status the gateway returned into its facts and the
verdicts into lines.
"""

from __future__ import annotations

import datetime
from typing import Any

import squall
from squall_server.coordinator.succession import NodeFacts, explain_master, succession


def when(at_ms: int) -> str:
    """Wall-clock milliseconds as UTC ISO 8601 (second precision)."""
    moment = datetime.datetime.fromtimestamp(at_ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _record(record: squall.OperatorRecord) -> str:
    reason = f": {record.reason}" if record.reason else ""
    return f"by {record.operator} at {when(record.at_ms)}{reason}"


def state_of(node: squall.NodeStatus) -> str:
    """The state column: loud when the node is out of its groups (quarantine, replica)."""
    if node.quarantine is not None:
        return "QUARANTINED"
    if node.replica_unreachable_since_ms:
        return "REPLICA UNREACHABLE"
    if node.lead_held_off_until_ms:
        return "STEPPED ASIDE"
    if not node.coordinator_id:
        return "COORDINATOR UNREACHABLE"
    return node.state


def reason_of(node: squall.NodeStatus) -> str:
    """The reason column: why the node's state last changed; what failed to answer."""
    parts = []
    if node.replica_unreachable_since_ms:
        parts.append(f"replica unreachable since {when(node.replica_unreachable_since_ms)}")
    if node.error:
        parts.append(node.error)
    parts.append(node.last_change_reason or "-")
    return "; ".join(parts)


def held_off(node: squall.NodeStatus) -> str:
    """Why a node steps aside from its groups (empty when it does not). Not "from
    leading": a node whose replica refuses the slave role, or whose coordinator dropped
    it while a slave, steps aside too; the reason names the role."""
    if not node.lead_held_off_until_ms:
        return ""
    return (
        f"steps aside until {when(node.lead_held_off_until_ms)}: "
        f"{node.lead_held_off_reason}; out of every group meanwhile (never master, never "
        "counted for acks or the quorum), then it rejoins"
    )


def loss_line(loss: squall.LossEvent) -> str:
    """One loss report: what was discarded, where, what allowed it, how to acknowledge."""
    parts = [f"{loss.loss_id} at {when(loss.at_ms)}: {loss.cause}"]
    if loss.operator_action:
        parts.append(f"allowed by {loss.operator_action}")
    if loss.first_lsn:
        epochs = f" (epochs {loss.first_epoch}..{loss.last_epoch})" if loss.first_epoch else ""
        upto = loss.last_lsn if loss.last_lsn else "(end unknown)"
        parts.append(f"LSN {loss.first_lsn}..{upto}{epochs}")
    if loss.topics:
        total = sum(count for _, count in loss.topics)
        listed = ", ".join(f"{topic}={count}" for topic, count in loss.topics)
        parts.append(f"{total} acknowledged events discarded ({listed})")
    parts.append(loss.detail)
    parts.append(f"acknowledge with `squall cluster ack-loss {loss.loss_id}`")
    return "; ".join(p for p in parts if p)


def notes(status: squall.ClusterStatus) -> list[str]:
    """One line per operator control in force, and per replica fault, for the table's foot."""
    lines: list[str] = []
    for node in status.nodes:
        if node.quorum_override_record is not None:
            lines.append(
                f"{node.node_id}: QUORUM OVERRIDE {node.quorum_override} set "
                f"{_record(node.quorum_override_record)} (clears itself once a majority is back)"
            )
        if node.quarantine is not None:
            lines.append(
                f"{node.node_id}: QUARANTINED {_record(node.quarantine)}; never master, never "
                f"counted for acks; clear with `squall cluster unquarantine {node.node_id}`"
            )
        elif node.replica_unreachable_since_ms:
            lines.append(
                f"{node.node_id}: replica unreachable since "
                f"{when(node.replica_unreachable_since_ms)}; its coordinator keeps the node "
                "out of every group (never master, never counted for acks or the quorum) "
                "until the replica answers again"
            )
        elif node.lead_held_off_until_ms:
            lines.append(f"{node.node_id}: {held_off(node)}")
        elif node.fault_reason:
            lines.append(f"{node.node_id}: its replica reports a fault: {node.fault_reason}")
        if node.frozen_for_shutdown_id:
            lines.append(
                f"{node.node_id}: FROZEN for cluster shutdown {node.frozen_for_shutdown_id}: "
                "takes no new role, and as master no new write; lapses by itself in "
                f"{node.freeze_remaining_ms / 1000:.0f} s unless the shutdown finishes or "
                "aborts first (restarting the replica also ends it)"
            )
        if node.transfer_target:
            lines.append(f"{node.node_id}: handing the leadership to {node.transfer_target}")
        for loss in node.losses:
            lines.append(f"{node.node_id}: LOSS {loss_line(loss)}")
        for mismatch in node.config_mismatches:
            lines.append(
                f"{node.node_id}: REFUSES {mismatch.node_id}: configuration differs: "
                f"{mismatch.key} is {mismatch.local_value!r} here, {mismatch.peer_value!r} on "
                f"{mismatch.node_id} (fix the file and restart the node that is wrong)"
            )
    return lines


def facts(status: squall.ClusterStatus) -> list[NodeFacts]:
    """The status rows as the succession rules want them."""
    # Nodes the master refuses for differing settings never join its group.
    refused = {
        m.node_id
        for n in status.nodes
        if n.node_id == status.master_id
        for m in n.config_mismatches
    }
    return [
        NodeFacts(
            node_id=n.node_id,
            priority=n.priority,
            up=n.reachable
            and not n.error
            and not n.replica_unreachable_since_ms
            and not n.lead_held_off_until_ms,
            held_off=held_off(n),
            quarantined=n.quarantine is not None,
            replica_unreachable=bool(n.replica_unreachable_since_ms),
            config_refused=n.node_id in refused,
            last_epoch=n.last_epoch,
            last_lsn=n.last_lsn,
            max_seen=n.max_seen,
            quorum_override=n.quorum_override,
            designated_primary=n.designated_primary,
            state=n.state,
            coordinator_id=n.coordinator_id,
            group_name=n.group_name,
            epoch=n.epoch,
            group=n.group,
            invited=n.invited,
            sync_source_id=n.sync_source_id,
        )
        for n in status.nodes
    ]


def explain(status: squall.ClusterStatus) -> dict[str, Any]:
    """The explanation as data (for --json)."""
    node_facts = facts(status)
    return {
        "master": explain_master(node_facts, status.master_id),
        "if_failed": [
            {"failed": v.failed, "leader": v.leader, "sync_source": v.sync_source, "why": v.why}
            for v in succession(node_facts, status.master_id)
        ],
        "audit": {
            n.node_id: [
                {
                    "at": when(r.at_ms),
                    "operator": r.operator,
                    "action": r.action,
                    "reason": r.reason,
                }
                for r in n.audit
            ]
            for n in status.nodes
            if n.audit
        },
    }


def explain_lines(status: squall.ClusterStatus, table: list[str]) -> list[str]:
    """The explanation as text: why, the members' facts, who would lead if each failed."""
    data = explain(status)
    lines = ["", "Why:"]
    lines.extend(f"  {line}" for line in data["master"])
    lines += ["", "Members:"]
    lines.extend(f"  {line}" for line in table)
    lines += ["", "If a node failed now:"]
    for verdict in data["if_failed"]:
        outcome = f"{verdict['leader']} would lead" if verdict["leader"] else "no master"
        lines.append(f"  {verdict['failed']} fails -> {outcome}: {verdict['why']}")
    if data["audit"]:
        lines += ["", "Operator actions (newest last):"]
        for node_id, records in data["audit"].items():
            for r in records:
                reason = f": {r['reason']}" if r["reason"] else ""
                lines.append(f"  {node_id} {r['at']} {r['operator']}: {r['action']}{reason}")
    return lines


def member_rows(status: squall.ClusterStatus) -> list[list[str]]:
    """The members' table for --explain: epoch, log position, priority, state."""
    rows = [["id", "prio", "state", "role", "epoch", "log (epoch/lsn)", "commit", "max", "coord"]]
    for n in status.nodes:
        if not n.reachable and not n.coordinator_id:
            rows.append([n.node_id, "-", "unreachable", "-", "-", "-", "-", "-", "-"])
            continue
        # The replica's columns only when it answered (its coordinator may answer alone).
        replica = n.reachable
        rows.append(
            [
                n.node_id,
                str(n.priority),
                state_of(n),
                n.role if replica else "-",
                str(n.epoch),
                f"{n.last_epoch}/{n.last_lsn}" if replica else "-",
                str(n.commit_lsn) if replica else "-",
                str(n.max_seen),
                n.coordinator_id or "-",
            ]
        )
    return rows
