"""Why the master leads, and who would lead if a given node failed: the election's own rules
applied to a snapshot of the cluster (``squall status --explain``).

Pure, like the election: status facts in, verdicts and sentences out. The rules are the
election's functions (``rank_order``, ``quorum_rule``, ``pick_sync_source``), not a copy of
them, so an explanation cannot drift from what the coordinators do:

* A group's coordinator (its master) keeps leading while its group, less the failed node,
  still makes the quorum: members that fail only shrink the group; nobody re-elects.
* When the master fails (or its group falls below the quorum), the nodes that are left
  recover into groups of their own and the highest-ranked eligible one (priority above 0,
  not quarantined) invites the others: it leads if they make the quorum it computes (its
  own override and designated-primary flag count, the group's ``max`` decides between a
  majority and every node). The sync source is the survivor with the newest log.
* A node that is unreachable or quarantined now counts as failed already, and so does a
  node whose coordinator answers but whose replica does not (one fate per node: its
  coordinator keeps it out of every group), or a node that steps aside from leading for a
  while because its replica kept refusing the master role (out of every group until then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from squall_server.coordinator.election import (
    node_sort_key,
    pick_sync_source,
    quorum_rule,
    rank_order,
)


@dataclass(frozen=True)
class NodeFacts:
    """What the status view knows of one node."""

    node_id: str
    priority: int
    up: bool
    """Its coordinator and replica answered the status call."""
    quarantined: bool = False
    replica_unreachable: bool = False
    """Its coordinator holds it out of every group: its replica stopped answering."""
    held_off: str = ""
    """Why it steps aside from leading, out of every group, for now (its replica kept
    refusing the master role); empty when it does not (it then counts as not up)."""
    config_refused: bool = False
    """The master refuses it: settings every member must share differ from its own."""
    last_epoch: int = 0
    last_lsn: int = 0
    max_seen: int = 0
    quorum_override: int = 0
    designated_primary: bool = False
    state: str = ""
    coordinator_id: str = ""
    group_name: str = ""
    epoch: int = 0
    group: tuple[str, ...] = ()
    """On a coordinator: the other members of its group."""
    invited: tuple[str, ...] = ()
    sync_source_id: str = ""


@dataclass(frozen=True)
class Verdict:
    """Who would lead if ``failed`` failed, and why; ``leader`` is empty if nobody could."""

    failed: str
    leader: str
    sync_source: str
    why: str


def _by_id(facts: Sequence[NodeFacts]) -> dict[str, NodeFacts]:
    return {f.node_id: f for f in facts}


def _ranked(facts: dict[str, NodeFacts], nodes: set[str]) -> list[str]:
    return rank_order({x: facts[x].priority for x in nodes})


def _designated(facts: dict[str, NodeFacts], node: str, alive: set[str]) -> bool:
    """The designated-primary flag counts only in a two-node cluster, held by one node."""
    return (
        len(facts) == 2
        and facts[node].designated_primary
        and not any(facts[x].designated_primary for x in alive if x != node)
    )


def _ranking_text(facts: dict[str, NodeFacts], nodes: set[str]) -> str:
    return " > ".join(f"{x} ({facts[x].priority})" for x in _ranked(facts, nodes))


def _names(nodes: set[str] | Sequence[str]) -> str:
    return ",".join(sorted(nodes, key=node_sort_key)) or "none"


def if_failed(facts: Sequence[NodeFacts], master: str, failed: str) -> Verdict:
    """Who would lead if ``failed`` failed now (``master``: the current master, or "")."""
    by_id = _by_id(facts)
    n = len(by_id)
    gone = {x for x, f in by_id.items() if not f.up or f.quarantined or f.config_refused}
    alive = set(by_id) - gone - {failed}
    already = f" ({_names(gone - {failed})} already out)" if gone - {failed} else ""
    if master and master != failed and master in alive:
        m = by_id[master]
        members = ({master} | set(m.group)) & alive
        group_max = max(by_id[x].max_seen for x in members)
        required, why = quorum_rule(
            n,
            group_max,
            designated=_designated(by_id, master, alive),
            override=m.quorum_override,
        )
        if len(members) >= required:
            return Verdict(
                failed,
                master,
                m.sync_source_id,
                f"{master} keeps leading: its group {_names(members)} still has "
                f"{len(members)} of {n} nodes, {required} required ({why}); no election",
            )
        lost = (
            f"{master}'s group falls to {len(members)} of {n} ({_names(members)}), below "
            f"{required} ({why}), so it steps down; "
        )
    else:
        lost = f"{failed} leads now, so " if failed == master and master else ""
    verdict = _election(by_id, alive, lost + f"the survivors {_names(alive)}{already} re-elect: ")
    return Verdict(failed, verdict.leader, verdict.sync_source, verdict.why)


def _election(by_id: dict[str, NodeFacts], alive: set[str], prefix: str) -> Verdict:
    """The verdict of an election among ``alive``."""
    n = len(by_id)
    eligible = [x for x in _ranked(by_id, alive) if by_id[x].priority > 0]
    if not eligible:
        return Verdict("", "", "", prefix + "no survivor may lead (none has priority above 0)")
    leader = eligible[0]
    group_max = max(by_id[x].max_seen for x in alive)
    required, why = quorum_rule(
        n,
        group_max,
        designated=_designated(by_id, leader, alive),
        override=by_id[leader].quorum_override,
    )
    if len(alive) < required:
        return Verdict(
            "",
            "",
            "",
            prefix + f"{len(alive)} of {n} nodes left, {required} required ({why}); writes "
            "stop until nodes return or an operator overrides the quorum",
        )
    sync = pick_sync_source({x: (by_id[x].last_epoch, by_id[x].last_lsn) for x in alive}, leader)
    s = by_id[sync]
    return Verdict(
        "",
        leader,
        sync,
        prefix + f"{leader} ranks highest ({_ranking_text(by_id, alive)}) and leads "
        f"{len(alive)} of {n} nodes ({required} required: {why}); sync source {sync} "
        f"(log {s.last_epoch}/{s.last_lsn})",
    )


def succession(facts: Sequence[NodeFacts], master: str) -> list[Verdict]:
    """``if_failed`` for every node, in node id order."""
    return [if_failed(facts, master, node) for node in sorted(_by_id(facts), key=node_sort_key)]


def explain_master(facts: Sequence[NodeFacts], master: str) -> list[str]:
    """Sentences on why ``master`` leads (or why nobody does, if it is empty)."""
    by_id = _by_id(facts)
    n = len(by_id)
    if not master or master not in by_id:
        alive = {x for x, f in by_id.items() if f.up and not f.quarantined and not f.config_refused}
        verdict = _election(by_id, alive, "")
        return ["No master now.", f"If the reachable nodes formed a group: {verdict.why}"]
    m = by_id[master]
    members = {master, *m.group}
    lines = [
        f"{master} leads group {m.group_name or '-'} in epoch {m.epoch} with "
        f"{_names(members)} ({len(members)} of {n} nodes)."
    ]
    better = [x for x in _ranked(by_id, members) if by_id[x].priority > 0]
    ranking = _ranking_text(by_id, members)
    if better and better[0] != master:
        lines.append(
            f"Rank (priority, then the lower node id): {ranking}. {better[0]} ranks above "
            f"{master} but is a member: either it rejoined and is catching up, and {master} "
            "hands the group to it once its replica holds the log, or the leadership was "
            "handed over (squall cluster transfer), which lasts until the next election."
        )
    else:
        lines.append(
            f"Rank (priority, then the lower node id): {ranking}. The highest-ranked node "
            "that can reach the others invites them and leads; priority 0 never leads."
        )
    outside = [
        x
        for x in _ranked(by_id, set(by_id) - members)
        if by_id[x].priority > by_id[master].priority
    ]
    for x in outside:
        f = by_id[x]
        status = (
            "quarantined"
            if f.quarantined
            else f.held_off
            if f.held_off
            else "its replica is unreachable"
            if f.replica_unreachable
            else "refused: its configuration differs"
            if f.config_refused
            else "unreachable"
            if not f.up
            else f"{f.state}"
        )
        lines.append(f"{x} ranks higher but is not in the group ({status}).")
    if m.invited:
        lines.append(f"When the group formed, {master} invited {_names(m.invited)}.")
    if m.sync_source_id:
        s = by_id.get(m.sync_source_id)
        log = f" (log {s.last_epoch}/{s.last_lsn} now)" if s is not None else ""
        lines.append(
            f"Sync source: {m.sync_source_id}{log}, the member with the newest log when the "
            "group formed; priority decides who leads, the log decides what survives."
        )
    group_max = max(by_id[x].max_seen for x in members if x in by_id)
    required, why = quorum_rule(
        n,
        group_max,
        designated=_designated(by_id, master, members),
        override=m.quorum_override,
    )
    lines.append(f"Quorum: {required} of {n} nodes ({why}); the group has {len(members)}.")
    return lines
