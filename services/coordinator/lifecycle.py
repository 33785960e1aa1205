"""May a group start from these stores? The store-lifecycle rules of Qpid's persistent
cluster restart note, as one pure function over the members' reports.

A store is EMPTY (never used), CLEAN (stopped by ``squall cluster shutdown`` at the point
every member reached, carrying that shutdown's id) or DIRTY (in use, or stopped any other
way). A member is *joined* when its replica process has held a role since it started: its
store is part of the running cluster, not one restarted from disk.

* A group with a joined member is the running cluster (a failover, or a node rejoining):
  it starts, and the election's sync source (the newest log) updates everyone.
* A cluster of one node starts from its store whatever its state: it is the only copy.
* Otherwise it is a **cold start** (every member restarted from disk):

  - every store empty: the first formation; the coordinator mints the cluster id;
  - else at least one store must be CLEAN, every CLEAN store must carry the same shutdown
    id, and no store may hold a newer log than the best CLEAN one (a store ahead of it
    holds writes the clean stores never saw: they are not the cluster's last state).
    Dirty and empty members are then updated from the best clean store.

  Anything else is refused: after a total failure (every store dirty) an operator picks
  the store to recover from (``squall store inspect``, ``squall store mark-clean``;
  docs/operations.md, "Manual recovery").

Stores of another cluster never get here: the election leaves a member whose cluster id
differs from the group's out of the group (and never merges its node) before it asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from squall_server.coordinator.messages import MemberReport, StoreState

# Where the refusal message sends the operator.
RECOVERY_HINT = (
    "recover manually: see docs/operations.md, 'Manual recovery' "
    "(squall store inspect DIR; squall store mark-clean DIR)"
)


@dataclass(frozen=True, slots=True)
class StartDecision:
    """Whether a group may start, and a sentence saying why (or why not)."""

    ok: bool
    reason: str
    cold: bool = False
    """True for a cold start (no member joined): the stores' states were checked."""


def _position(report: MemberReport) -> tuple[int, int]:
    return (report.last_epoch, report.last_lsn)


def _describe(report: MemberReport) -> str:
    """``n1 (dirty, log 3/120)``."""
    state = report.store_state.value
    if report.store_state is StoreState.CLEAN:
        state += f" shutdown {report.shutdown_id}"
    return f"{report.node_id} ({state}, log {report.last_epoch}/{report.last_lsn})"


def _node_key(node_id: str) -> tuple[int, int, str]:
    # The election's order (numeric ids by value), without importing it.
    if node_id.isdigit():
        return (0, int(node_id), node_id)
    return (1, 0, node_id)


def decide_start(reports: Mapping[str, MemberReport], nodes_configured: int) -> StartDecision:
    """Apply the rules in the module docstring to the reports of a group's members."""
    if not reports:
        raise ValueError("decide_start needs at least one member report")
    ordered = [reports[x] for x in sorted(reports, key=_node_key)]
    joined = [r.node_id for r in ordered if r.joined]
    if joined:
        return StartDecision(True, f"running cluster: {','.join(joined)} served since starting")
    if nodes_configured == 1:
        return StartDecision(True, "one-node cluster: its store is the only copy", cold=True)
    used = [r for r in ordered if r.store_state is not StoreState.EMPTY]
    if not used:
        return StartDecision(True, "first formation: every store is empty", cold=True)
    clean = [r for r in used if r.store_state is StoreState.CLEAN]
    everyone = ", ".join(_describe(r) for r in ordered)
    if not clean:
        return StartDecision(
            False,
            f"refusing to start: no member has a clean store ({everyone}); every node "
            f"stopped without `squall cluster shutdown`, so which store is the cluster's "
            f"last state is for an operator to decide: {RECOVERY_HINT}",
            cold=True,
        )
    shutdown_ids = sorted({r.shutdown_id for r in clean})
    if len(shutdown_ids) > 1:
        return StartDecision(
            False,
            f"refusing to start: the clean stores come from different shutdowns "
            f"({', '.join(_describe(r) for r in clean)}); mark the stale ones dirty "
            f"(squall store mark-dirty DIR) or {RECOVERY_HINT}",
            cold=True,
        )
    best = max(clean, key=_position)
    ahead = [r for r in used if _position(r) > _position(best)]
    if ahead:
        verb = "holds" if len(ahead) == 1 else "hold"
        return StartDecision(
            False,
            f"refusing to start: {', '.join(_describe(r) for r in ahead)} {verb} a newer log "
            f"than every clean store (best {_describe(best)}), so the clean stores are not "
            f"the cluster's last state; {RECOVERY_HINT}",
            cold=True,
        )
    return StartDecision(
        True,
        f"restart after clean shutdown {shutdown_ids[0]} (newest clean log "
        f"{best.last_epoch}/{best.last_lsn} on {best.node_id}): every member is brought to it",
        cold=True,
    )
