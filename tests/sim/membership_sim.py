"""The election simulator with runtime membership changes under faults (issue 20, item 1).

Each seed draws an election scenario (``election_sim.make_scenario``: 3, 4 or 5 nodes,
message loss, partitions, crashes, pauses, per-process faults on odd seeds) plus one or two
spare nodes that run from the start with a config file listing the cluster and themselves
(as ``squall cluster config export`` plus the new node gives an operator), and operator
membership changes at random times of the safety phase, each asked of whichever node leads
then: add a spare, remove a member (not the leader), replace a member that is down (a new
machine: its store and state are wiped and it starts again), or set a member's priority.
The changes the election refuses (unsafe, one in progress, not the leader) are counted.
Added and replaced nodes are learners until their replica is within the catch-up bound;
on some seeds one spare's replica never copies anything (a learner that never catches
up), and the scenario's faults (crashes, replica kills and pauses, partitions) hit
learners while they catch up like any node.

Acknowledged writes: an entry the master appended counts as acknowledged once a majority
of the voters its role command names (learners excluded) hold it; every later master,
after its sync, must hold every acknowledged entry (no acknowledged loss), and a node
whose replica never copies must never become a voter.

The checker (``election_checker.py``) holds every step to its invariants with the node set
each group uses: one coordinator NORMAL and one master per epoch, a NORMAL group holds a
majority of its own node set and a majority of that set persisted its epoch, two sets in
force one after the other differ by at most one node, and a later epoch never goes back to
an older set. After healing, every live node of the newest set must be NORMAL in one group
under the highest-ranked live eligible node of that set; nodes outside it (spares never
added, removed nodes still running) must stay out of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from squall_server.coordinator.election import node_sort_key
from squall_server.coordinator.lifecycle import decide_start
from squall_server.coordinator.membership import (
    OPERATOR_CHANGES,
    ChangeKind,
    Membership,
    MembershipChange,
)
from squall_server.coordinator.messages import (
    MemberReport,
    NodeState,
    PersistedState,
    Role,
    RoleCommand,
    StoreState,
)
from tests.sim.election_sim import (
    KINDS_END,
    Scenario,
    SimResult,
    Simulation,
    _rank_key,
    make_scenario,
)

_MEMBERSHIP = KINDS_END
# A replacement machine starts once its replace-node change is done (the CLI waits).
_REPLACED = KINDS_END + 1
# How long after a replace-node the operator looks whether it is done.
REPLACE_CHECK_MS = 1500
# Spare nodes per seed (started from the beginning, added by a change or never).
SPARES_MAX = 2
# The chance a follower copies at a write (times the election simulator's own 0.6).
LAG_COPY_P = 0.5


def membership_reproduce_hint(seed: int) -> str:
    """The command that replays one seed."""
    return (
        ".venv/bin/pytest -q tests/sim/test_membership_sim.py "
        f"-k test_membership_changes_under_faults --sim-seed={seed}"
    )


@dataclass
class MembershipResult:
    """What a passing seed did."""

    result: SimResult
    changes_done: int
    changes_refused: int


class MembershipSimulation(Simulation):
    """A seed of the election with spare nodes and operator membership changes."""

    def __init__(self, seed: int) -> None:
        """Draw the scenario, add the spares and schedule the changes."""
        scenario = make_scenario(seed, sizes=(3, 4, 5), processes=seed % 2 == 1)
        rng = random.Random(seed * 4099 + 17)
        # Changes need a serving group to ask: a longer safety phase gives them time.
        scenario.safety_ms += rng.randint(500, 1500)
        bootstrap = dict(scenario.priorities)
        n = len(bootstrap)
        spares = [str(n + i) for i in range(1, rng.randint(1, SPARES_MAX) + 1)]
        for spare in spares:
            scenario.priorities[spare] = rng.choice((0, 1, 2, 5, 9))
            scenario.initial[spare] = PersistedState()
            scenario.initial_logs[spare] = (0, 0)
            scenario.start_ms[spare] = rng.randint(0, scenario.safety_ms)
        scenario.keep_minority_down = False
        self.bootstrap = bootstrap
        self.spares = spares
        self.changes: list[tuple[int, int]] = [
            (rng.randint(scenario.safety_ms // 4, scenario.safety_ms), rng.randint(0, 1 << 30))
            for _ in range(rng.randint(2, 6))
        ]
        self.changes_done = 0
        self.changes_refused = 0
        # One spare in three seeds whose replica never copies: a learner never caught up.
        self.stuck = spares[0] if rng.random() < 1 / 3 else ""
        # The newest acknowledged LSN of each epoch, and the voters each master counts.
        self.acked: dict[int, int] = {}
        self.master_voters: dict[str, tuple[str, ...]] = {}
        self.starting: tuple[str, RoleCommand] | None = None
        # Replaced nodes: the running set exported for the new machine's config file.
        self.exported: dict[str, Membership] = {}
        super().__init__(scenario)

    def reproduce(self) -> str:
        """This module's replay command."""
        return membership_reproduce_hint(self.sc.seed)

    def config_priorities(self, node: str) -> dict[str, int]:
        """A bootstrap node's file lists the cluster; a spare's adds itself; a replaced
        node's is the running set exported when it was replaced."""
        exported = self.exported.get(node)
        if exported is not None:
            return exported.priorities
        if node in self.bootstrap:
            return self.bootstrap
        return {**self.bootstrap, node: self.priorities[node]}

    def config_set_key(self, node: str) -> dict[str, Any]:
        """An exported file records its set's version and epoch, and marks its learners."""
        exported = self.exported.get(node)
        if exported is None:
            return {}
        return {
            "membership_version": exported.version,
            "membership_epoch": exported.epoch,
            "learners": frozenset(exported.learners),
        }

    def copies(self, node: str) -> bool:
        """The stuck spare's replica copies nothing; the others lag more than in the
        election's seeds (half the copies skipped), so entries acknowledged by a bare
        majority, and new masters that must fetch them, are common."""
        return node != self.stuck and self.rng.random() < LAG_COPY_P

    def become_master(self, node: str, cmd: RoleCommand) -> None:
        """The master syncs and writes its epoch-start entry (base class); its voters are
        the role command's (learners excluded), and its synced log must hold every
        acknowledged entry (checked in ``write``, before the epoch-start entry)."""
        self.master_voters[node] = cmd.nodes or tuple(
            x for x in self.config_priorities(node) if x not in cmd.learners
        )
        if set(cmd.learners) & set(self.master_voters[node]):
            raise self.fail(f"master {node} counts learners {cmd.learners} as voters")
        self.starting = (node, cmd)
        try:
            super().become_master(node, cmd)
        finally:
            self.starting = None

    def override_seen(self) -> bool:
        """An operator override may give acknowledged entries up (the sim sets none)."""
        return any(p.quorum_override or p.designated_primary for p in self.durable.values())

    def write(self, node: str, epoch: int) -> None:
        """The master appends (base class); an entry a majority of its voters hold is
        acknowledged."""
        replica = self.replicas[node]
        if self.starting is not None and self.starting[0] == node:
            cmd = self.starting[1]
            self.starting = None
            synced = (replica.last_epoch, replica.last_lsn)
            # Only entries of older epochs bind a master (a late command of an older epoch
            # owes nothing to a newer one; the checker's one-master-per-epoch stands).
            needed = max(
                ((e, lsn) for e, lsn in self.acked.items() if e < cmd.epoch), default=(0, 0)
            )
            if synced < needed and not self.override_seen():
                raise self.fail(
                    f"acknowledged entry {needed[0]}/{needed[1]} lost: master {node} "
                    f"of epoch {cmd.epoch} synced from {cmd.sync_source_id} holds only "
                    f"{synced[0]}/{synced[1]}"
                )
        super().write(node, epoch)
        voters = self.master_voters.get(node, ())
        if replica.role is not Role.MASTER or replica.epoch != epoch or not voters:
            return
        entry = (replica.last_epoch, replica.last_lsn)
        holders = [
            x
            for x in voters
            if x == node
            or (
                self.replicas[x].role is Role.SLAVE
                and self.replicas[x].master == node
                and self.replicas[x].epoch == epoch
                and (self.replicas[x].last_epoch, self.replicas[x].last_lsn) >= entry
            )
        ]
        if len(holders) >= len(voters) // 2 + 1 and entry[1] > self.acked.get(entry[0], 0):
            self.acked[entry[0]] = entry[1]
        if self.stuck:
            for membership in (p.membership for p in self.durable.values()):
                if membership is not None and self.stuck in membership.voters:
                    raise self.fail(
                        f"node {self.stuck}, whose replica never copied, became a voter "
                        f"({membership.describe()})"
                    )

    def schedule_scenario(self) -> None:
        """The election's events, and the operator's changes."""
        super().schedule_scenario()
        for at, pick in self.changes:
            self.push(at, _MEMBERSHIP, "", pick)

    def handle(self, kind: int, node: str, payload: object) -> None:
        """A membership change here; the election's events in the base class."""
        if kind == _MEMBERSHIP:
            if self.healed_at is None and isinstance(payload, int):
                self.change(payload)
            return
        if kind == _REPLACED:
            self.start_replacement(node)
            return
        super().handle(kind, node, payload)

    def newest_set(self) -> Membership:
        """The newest node set any node persisted (the bootstrap set if none)."""
        sets = [p.membership for p in self.durable.values() if p.membership is not None]
        if not sets:
            return Membership.bootstrap([])
        return max(sets, key=lambda m: (m.epoch, m.version))

    def set_ids(self) -> tuple[str, ...]:
        """The ids of the newest node set."""
        newest = self.newest_set()
        return newest.ids if newest.members else tuple(sorted(self.bootstrap, key=node_sort_key))

    def set_priorities(self) -> dict[str, int]:
        """The priorities of the newest node set."""
        newest = self.newest_set()
        return newest.priorities if newest.members else dict(self.bootstrap)

    def change(self, pick: int) -> None:
        """An operator asks whichever node leads now for one membership change."""
        leaders = self.leaders()
        if not leaders:
            return
        leader = leaders[pick % len(leaders)]
        driver = self.drivers[leader]
        if driver is None:
            return
        status = driver.election.status()
        current = status.membership
        if current is None:
            return
        rng = random.Random(pick)
        kind = rng.choice(OPERATOR_CHANGES)
        others = [x for x in current.ids if x != leader]
        outside = [x for x in self.spares if x not in current.ids]
        wiped = ""
        if kind is ChangeKind.ADD and outside:
            target = rng.choice(outside)
            change = MembershipChange(
                kind, target, self.priorities[target], f"c{target}:1", f"r{target}:1"
            )
        elif kind is ChangeKind.REPLACE and others:
            down = [x for x in others if x not in status.members]
            target = rng.choice(down or others)
            change = MembershipChange(kind, target, 0, f"c{target}:2", f"r{target}:2")
            wiped = target if target not in status.members else ""
        elif kind is ChangeKind.SET_PRIORITY and others:
            target = rng.choice(others)
            change = MembershipChange(kind, target, rng.choice((0, 1, 3, 7, 11)))
        elif others:
            change = MembershipChange(ChangeKind.REMOVE, rng.choice(others))
        else:
            return
        self.note(f"{leader} membership", change.describe())
        ready = driver.change_membership(change, "sim")
        if ready.rejection is not None:
            self.changes_refused += 1
            self.note(f"{leader} membership refused", ready.rejection.message)
            return
        self.changes_done += 1
        if wiped:
            self.push(self.now_ms + REPLACE_CHECK_MS, _REPLACED, wiped, None)

    def start_replacement(self, node: str) -> None:
        """The operator starts the new machine from the exported running set once the
        replace-node is done (a node set some group went normal with names the node's new
        addresses); a change that failed leaves the old machine's place empty."""
        newest = self.newest_set()
        member = newest.member(node)
        if member is None or member.coordinator_address != f"c{node}:2" or not newest.epoch:
            self.note(f"{node} not replaced", f"the change did not complete: {newest.describe()}")
            return
        self.replace_machine(node, newest)

    def replace_machine(self, node: str, exported: Membership) -> None:
        """The replaced node is a new machine: an empty store and no state, started now."""
        self.crash(node)
        self.durable[node] = PersistedState()
        self.checker.epoch_seen[node] = 0
        replica = self.replicas[node]
        replica.last_epoch, replica.last_lsn = 0, 0
        replica.cluster_id, replica.shutdown_id = "", ""
        replica.state = StoreState.EMPTY
        replica.role = Role.INACTIVE
        self.floor[node] = 0
        self.held_max[node] = 0
        self.exported[node] = exported
        self.note(f"{node} replaced", f"a new machine with an empty store, {exported.describe()}")
        self.start_node(node)

    def cold_start_refusal(self, up: list[str]) -> str:
        """As the election would judge the live nodes of the newest set."""
        ids = self.set_ids()
        members = [x for x in up if x in ids]
        reports = {
            x: MemberReport(
                node_id=x,
                cluster_id=r.cluster_id,
                last_epoch=r.last_epoch,
                last_lsn=r.last_lsn,
                store_state=r.state,
                max_seen=self.durable[x].max_seen,
                epoch=self.durable[x].epoch,
                shutdown_id=r.shutdown_id,
                joined=r.joined and self.elections[x] is not None,
            )
            for x in members
            for r in (self.replicas[x],)
        }
        decision = decide_start(reports, len(ids))
        return "" if decision.ok else decision.reason

    def converged(self) -> str | None:
        """Every live node of the newest set NORMAL in one group under its best node, and
        no node outside the set in that group."""
        ids = self.set_ids()
        priorities = self.set_priorities()
        learners = set(self.newest_set().learners)
        live = [x for x in ids if self.elections[x] is not None]
        eligible = [
            x for x in live if priorities[x] > 0 and x not in self.demoted and x not in learners
        ]
        if not eligible:
            return None
        leader = min(eligible, key=lambda x: _rank_key(priorities, x))
        election = self.elections[leader]
        if election is None:
            return None
        head = election.status()
        if head.state is not NodeState.NORMAL or head.coordinator_id != leader:
            return None
        if list(head.members) != sorted(live, key=node_sort_key):
            return None
        for node in live:
            e = self.elections[node]
            if e is None:
                return None
            s = e.status()
            if s.state is not NodeState.NORMAL or s.group_name != head.group_name:
                return None
        return leader


def run_membership_seed(seed: int) -> MembershipResult:
    """Run one seed; SimFailure names the seed and the replay command."""
    sim = MembershipSimulation(seed)
    result = sim.run()
    return MembershipResult(result, sim.changes_done, sim.changes_refused)


__all__ = ["MembershipSimulation", "Scenario", "run_membership_seed"]
