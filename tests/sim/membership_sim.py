"""The election simulator with runtime membership changes under faults (issue 20, item 1).

Each seed draws an election scenario (``election_sim.make_scenario``: 3, 4 or 5 nodes,
message loss, partitions, crashes, pauses, per-process faults on odd seeds) plus one or two
spare nodes that run from the start with a config file listing the cluster and themselves
(as ``squall cluster config export`` plus the new node gives an operator), and operator
membership changes at random times of the safety phase, each asked of whichever node leads
then: add a spare, remove a member (not the leader), replace a member that is down (a new
machine: its store and state are wiped and it starts again), or set a member's priority.
The changes the election refuses (unsafe, one in progress, not the leader) are counted.

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

from squall_server.coordinator.election import node_sort_key
from squall_server.coordinator.lifecycle import decide_start
from squall_server.coordinator.membership import ChangeKind, Membership, MembershipChange
from squall_server.coordinator.messages import (
    MemberReport,
    NodeState,
    PersistedState,
    Role,
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
# Spare nodes per seed (started from the beginning, added by a change or never).
SPARES_MAX = 2


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

    def config_set_key(self, node: str) -> dict[str, int]:
        """An exported file records its set's version and epoch."""
        exported = self.exported.get(node)
        if exported is None:
            return {}
        return {"membership_version": exported.version, "membership_epoch": exported.epoch}

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
        kind = rng.choice(list(ChangeKind))
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
            self.replace_machine(wiped, driver.election.status().membership or current)

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
        live = [x for x in ids if self.elections[x] is not None]
        eligible = [x for x in live if priorities[x] > 0 and x not in self.demoted]
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
