"""Deterministic simulator for the coordinator election (TigerBeetle's VOPR, in miniature).

One seed decides everything: cluster size (3, 5 or 7), priorities (some 0), timing, what the
stores hold at start, and the faults — message loss, duplication, delay and reordering,
symmetric and one-way partitions, crashes and restarts (only persisted state and the replica's
log survive), and pauses (a node stops handling anything for a while, like a long GC).
With per-process faults on (``run_seed``; ``make_scenario(processes=True)``) a node is two
processes, hit alone: its replica is killed (and restarted) or paused, its coordinator is
killed (and restarted) or paused, or the link between the two is cut, often on whoever is
master at the time. The whole-node crash and pause of before stay as they were.

Each coordinator is the shipped driver, ``services/coordinator/driver.py``'s
``CoordinatorDriver``, over a simulated peer transport (``SimPeers``: the lossy network
above, the checker sees every send), clock (``SimClock``: the simulation's time) and
state store (``SimStateStore``: survives crashes). The asyncio shell's three loops
(``node.py``), which only wait, are events here: the tick loop sleeps what ``tick()``
returns and wakes on the driver's ``wake`` hook; the role loop sends ``role_wanted()``
over the simulated replica link and waits as ``role_outcome()`` says, or until the
``role_changed`` hook; the watch loop calls ``watch()`` every ``watch_interval_ms`` and
probes the replica's health when told to. Everything the driver decides (persisting,
sending, reports after a deactivation, recovery on a refused role, ``replica_silent`` /
``replica_answered``) is its own code. The replica twin (``Replica`` and
``replica_set_role``) answers a role call when it reaches it: a dead replica refuses the
connection, a hung one or one behind a cut link lets the call time out
(``RPC_TIMEOUT_MS``; a call that reaches a paused replica is taken when it resumes, within
the timeout). Every role command renews its lease (``member_timeout_ms``): a replica
whose coordinator is gone, hung or cut off drops its role when the lease runs out, and a
replica that restarted or dropped a role refuses one in an epoch it held (the driver then
recovers with a fresh Election).
Operators act too: a leadership transfer from whoever leads to one of its members, and a
quarantine of a node that an operator may clear later (every quarantine is cleared when
the network heals). The drivers hand over too: a master's role answers report how far its
slaves lag (those holding its epoch's log), and a hand-over the election asks for
(``Ready.hand_over_to``, a higher-ranked node that rejoined to catch up) runs after a
simulated ``PrepareHandoff`` of up to ``HAND_OVER_PREPARE_MS_MAX``, in both phases.
The only randomness is ``random.Random(seed)`` here; the election itself is pure.

A run has two phases. The safety phase injects faults while the checker
(``election_checker.py``) runs after every step. Then the liveness phase heals the network,
restarts nodes (keeping a minority down when the stores allow it) and requires that within
``liveness_deadline_ms`` of simulated time every live node is NORMAL in one group led by the
highest-ranked live eligible node, and stays so for ``stable_ms``; a node that follows a
lower-ranked coordinator (after a transfer) is no candidate until it next recovers. A node
that joined a lower-ranked coordinator to catch up is still a candidate: the liveness
phase requires the hand-over to it.

Stores follow the lifecycle (empty, clean, dirty): a cluster that ran before starts from a
clean shutdown (the stores holding the newest log are clean, the others dirty), a replica
that takes a role makes its store dirty and has joined, a crash loses that. When the live
nodes at the heal would be refused a cold start (a total failure: nobody joined, no usable
clean store), the simulator does what docs/operations.md tells an operator: it stops them,
marks the best store clean and starts them again; liveness is then required as usual. Every
role command must name the same cluster id for the whole run (minted once, or inherited).

A failure raises ``SimFailure`` whose message ends with the command that replays the seed.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import random
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from squall_server.common.clock import MANUAL_CLOCK_WALL_START_MS
from squall_server.coordinator.driver import (
    CoordinatorDriver,
    DriverTimings,
    Failure,
    ReplicaAnswer,
    ReplicaFailure,
    RoleNext,
)
from squall_server.coordinator.election import Election, ElectionConfig, node_sort_key
from squall_server.coordinator.lifecycle import decide_start
from squall_server.coordinator.messages import (
    MemberReport,
    NodeState,
    PeerMessage,
    PersistedState,
    Ready,
    ReplicaReport,
    Role,
    RoleCommand,
    RoleCommandKind,
    StoreState,
    format_message,
    format_role_command,
)
from tests.sim.election_checker import Checker, InvariantViolation

# Event kinds, in the order they run when due at the same instant (then by scheduling order).
(
    _START,
    _CRASH,
    _RESTART,
    _PAUSE,
    _CUT,
    _UNCUT,
    _HEAL,
    _DELIVER,
    _TICK,
    _WRITE,
    _ROLE,
    _ROLE_REPLY,
    _TRANSFER,
    _QUARANTINE,
    _PROC_FAULT,
    _PROC_HEAL,
    _WATCH,
    _PROBE_REPLY,
    _LEASE,
    _REPLICA_CALL,
    _HAND_OVER,
) = range(21)
# The first kind free for a simulator built on this one (tests/sim/replication_sim.py).
KINDS_END = _HAND_OVER + 1
_KIND_NAMES = {
    _START: "start",
    _CRASH: "crash",
    _RESTART: "restart",
    _PAUSE: "pause",
    _CUT: "cut",
    _UNCUT: "uncut",
    _HEAL: "heal",
    _DELIVER: "deliver",
    _TICK: "tick",
    _WRITE: "write",
    _ROLE: "role call",
    _ROLE_REPLY: "role answer",
    _TRANSFER: "transfer",
    _QUARANTINE: "quarantine",
    _PROC_FAULT: "process fault",
    _PROC_HEAL: "process heal",
    _WATCH: "replica watch",
    _PROBE_REPLY: "probe answer",
    _LEASE: "lease",
    _REPLICA_CALL: "replica takes a call",
    _HAND_OVER: "hand-over",
}
# Per-process faults: (name, lasts for a while, healed by an event when it ends).
PROCESS_FAULTS = (
    "replica-kill",
    "replica-kill-restart",
    "replica-pause",
    "coordinator-kill",
    "coordinator-kill-restart",
    "coordinator-pause",
    "link-cut",
)
# Bounds: a run that needs more events than this is itself a bug (a message storm).
EVENTS_MAX = 400_000
TRACE_LINES = 80
WRITE_INTERVAL_MS = 25
# The driver's role-call timeout (timeouts.rpc_timeout_ms): a call to a hung replica or
# over a cut link fails after this long.
RPC_TIMEOUT_MS = 1000
# A hand-over's PrepareHandoff (the master fences writes until the target holds its log)
# takes up to this long before the driver calls transfer_leadership.
HAND_OVER_PREPARE_MS_MAX = 50


def reproduce_hint(seed: int) -> str:
    """The commands that replay one seed."""
    return (
        f"reproduce with: make sim SEEDS=1 SEED={seed}   "
        f"(or: .venv/bin/pytest -q tests/sim/test_election_sim.py --sim-seed={seed})"
    )


class SimFailure(AssertionError):
    """A seed broke an invariant or missed the liveness deadline."""


@dataclass
class Scenario:
    """Everything one seed decides, before the run starts."""

    seed: int
    priorities: dict[str, int]
    timing: dict[str, int]
    initial: dict[str, PersistedState]
    initial_logs: dict[str, tuple[int, int]]
    start_ms: dict[str, int]
    safety_ms: int
    loss: float
    dup: float
    delay_min_ms: int
    delay_max_ms: int
    long_delay_p: float
    long_delay_max_ms: int
    tick_jitter_ms: int
    faults: list[tuple[int, int, str, frozenset[tuple[str, str]] | int]] = field(
        default_factory=list
    )
    liveness_deadline_ms: int = 3000
    stable_ms: int = 300
    keep_minority_down: bool = True
    processes: bool = False
    rpc_timeout_ms: int = RPC_TIMEOUT_MS
    # Consistency at start: each node's agreed settings (none: nothing compared), and the
    # node whose settings differ from the others' (it must never share a group with them).
    agreed: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    odd_one_out: str = ""
    # A node whose replica refuses every master role (a store that cannot take the sync):
    # it must step aside so the others converge without it.
    refuses_master: str = ""


def _rank_key(priorities: dict[str, int], node: str) -> tuple[int, tuple[int, int, str]]:
    """Sort key: highest priority first, then the lower node id (as the election ranks)."""
    key = node_sort_key(node)
    return (-priorities[node], key)


def make_scenario(
    seed: int,
    faults: bool = True,
    sizes: tuple[int, ...] = (3, 5, 7),
    processes: bool = False,
) -> Scenario:
    """Draw one scenario from the seed (the cluster size cycles through ``sizes``).

    ``processes`` adds per-process faults, drawn from a generator of their own so the rest
    of the scenario is what the seed gave before.
    """
    rng = random.Random(seed)
    n = sizes[seed % len(sizes)]
    nodes = [str(i) for i in range(1, n + 1)]
    priorities = {node: rng.choice((1, 1, 2, 3, 5, 8)) for node in nodes}
    for node in nodes:
        if rng.random() < 0.15:
            priorities[node] = 0
    if sum(1 for p in priorities.values() if p > 0) < 2:
        priorities[nodes[0]] = 4
        priorities[nodes[-1]] = 6
    timing = {
        "heartbeat_interval_ms": 100,
        "member_timeout_ms": 400,
        "probe_interval_ms": 200,
        "merge_delay_ms_per_priority": 50,
        "replica_timeout_ms": 300,
    }
    if rng.random() < 0.2:
        heartbeat = rng.randint(20, 100)
        timing = {
            "heartbeat_interval_ms": heartbeat,
            "member_timeout_ms": heartbeat * rng.randint(2, 6),
            "probe_interval_ms": rng.randint(50, 300),
            "merge_delay_ms_per_priority": rng.randint(0, 60),
        }
        timing["replica_timeout_ms"] = max(2 * heartbeat, timing["member_timeout_ms"] * 3 // 4)
    majority = n // 2 + 1
    initial = {node: PersistedState() for node in nodes}
    logs = {node: (0, 0) for node in nodes}
    if rng.random() < 0.35:
        # The cluster ran before: epochs, max and logs on disk differ from node to node.
        ran_with = rng.choice((majority, n))
        for node in nodes:
            epoch = rng.randint(0, 12)
            seen = rng.choice((0, ran_with, ran_with))
            initial[node] = PersistedState(epoch=epoch, max_seen=seen, cluster_id=CLUSTER_ID)
            last_epoch = rng.randint(0, epoch)
            logs[node] = (last_epoch, rng.randint(1, 50) if last_epoch else 0)
    start_ms = {node: (0 if rng.random() < 0.5 else rng.randint(0, 400)) for node in nodes}
    scenario = Scenario(
        seed=seed,
        priorities=priorities,
        timing=timing,
        initial=initial,
        initial_logs=logs,
        start_ms=start_ms,
        safety_ms=rng.randint(400, 1500) if faults else 0,
        loss=rng.choice((0.0, 0.01, 0.05, 0.15, 0.3)) if faults else 0.0,
        dup=rng.choice((0.0, 0.02, 0.1)) if faults else 0.0,
        delay_min_ms=0,
        delay_max_ms=rng.choice((1, 5, 20, 60)) if faults else 2,
        long_delay_p=rng.choice((0.0, 0.01, 0.03)) if faults else 0.0,
        long_delay_max_ms=rng.randint(200, 1500),
        tick_jitter_ms=rng.choice((0, 1, 5)),
    )
    if not faults:
        return scenario
    horizon = scenario.safety_ms
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, horizon)
        until = at + rng.randint(50, 900)
        if rng.random() < 0.7:
            side = set(rng.sample(nodes, rng.randint(1, n - 1)))
            pairs = frozenset((a, b) for a in nodes for b in nodes if (a in side) != (b in side))
        else:
            pairs = frozenset((a, b) for a in nodes for b in nodes if a != b and rng.random() < 0.3)
        scenario.faults.append((at, _CUT, "", pairs))
        scenario.faults.append((until, _UNCUT, "", pairs))
    for _ in range(rng.randint(0, majority)):
        node = rng.choice(nodes)
        at = rng.randint(0, horizon)
        scenario.faults.append((at, _CRASH, node, 0))
        if rng.random() < 0.7:
            scenario.faults.append((at + rng.randint(1, 800), _RESTART, node, 0))
    for _ in range(rng.randint(0, 2)):
        node = rng.choice(nodes)
        at = rng.randint(0, horizon)
        scenario.faults.append((at, _PAUSE, node, rng.randint(50, 900)))
    # Operators: transfers of the leadership, quarantines cleared later.
    for _ in range(rng.randint(0, 2)):
        scenario.faults.append((rng.randint(0, horizon), _TRANSFER, "", rng.randint(0, 1 << 30)))
    if rng.random() < 0.3:
        node = rng.choice(nodes)
        at = rng.randint(0, horizon)
        scenario.faults.append((at, _QUARANTINE, node, 1))
        if rng.random() < 0.6:
            scenario.faults.append((at + rng.randint(1, 800), _QUARANTINE, node, 0))
    if processes:
        scenario.processes = True
        prng = random.Random(seed * 7 + 3)
        for _ in range(prng.randint(1, 3)):
            # Half of them hit whoever is master then (node ""): the case that matters.
            target = "" if prng.random() < 0.5 else prng.choice(nodes)
            at = prng.randint(0, horizon)
            fault = prng.choice(PROCESS_FAULTS)
            scenario.faults.append((at, _PROC_FAULT, target, (fault, prng.randint(50, 900))))
    return scenario


CLUSTER_ID = "c1"


@dataclass
class Replica:
    """The replica twin: a log position and store state that survive crashes, a role and
    the joined flag that do not."""

    cluster_id: str = ""
    last_epoch: int = 0
    last_lsn: int = 0
    role: Role = Role.INACTIVE
    epoch: int = 0
    master: str = ""
    applied_seq: int = 0
    state: StoreState = StoreState.EMPTY
    shutdown_id: str = ""
    joined: bool = False
    # The role command last taken (a repeat of it is a lease renewal).
    last_command: RoleCommand | None = None

    def report(self) -> ReplicaReport:
        """What the driver would read from the replica."""
        return ReplicaReport(
            cluster_id=self.cluster_id,
            last_epoch=self.last_epoch,
            last_lsn=self.last_lsn,
            store_state=self.state,
            active=self.role is not Role.INACTIVE,
            command_seq=self.applied_seq,
            shutdown_id=self.shutdown_id,
            joined=self.joined,
        )

    def take_role(self, cluster_id: str) -> None:
        """Taking a role records the group's cluster id; the store is in use (dirty)."""
        self.cluster_id = self.cluster_id or cluster_id
        self.state, self.shutdown_id, self.joined = StoreState.DIRTY, "", True


def mark_initial_stores(replicas: dict[str, Replica]) -> None:
    """A cluster that ran before was shut down cleanly: the stores with the newest log are
    clean (one shutdown id), the other used ones dirty (they were down at the shutdown)."""
    used = [r for r in replicas.values() if r.last_lsn]
    if not used:
        return
    newest = max((r.last_epoch, r.last_lsn) for r in used)
    for replica in used:
        replica.cluster_id = replica.cluster_id or CLUSTER_ID
        if (replica.last_epoch, replica.last_lsn) == newest:
            replica.state, replica.shutdown_id = StoreState.CLEAN, "s0"
        else:
            replica.state = StoreState.DIRTY


@dataclass
class SimResult:
    """What a passing run measured."""

    seed: int
    nodes: int
    events: int
    converge_ms: int
    leader: str
    final_epoch: int
    # Groups handed to a higher-ranked member that rejoined to catch up.
    hand_overs: int = 0


class SimClock:
    """The simulation's virtual time, as the driver's clock."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def monotonic_ms(self) -> int:
        """Simulated milliseconds since the run started."""
        return self.sim.now_ms

    def wall_ms(self) -> int:
        """A fixed wall-clock start plus simulated time."""
        return MANUAL_CLOCK_WALL_START_MS + self.sim.now_ms


class SimPeers:
    """The simulated network, as one driver's peer transport (the checker sees every send)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def send(self, message: PeerMessage) -> None:
        """Check the message, then hand it to the lossy network."""
        try:
            self.sim.checker.check_send(message)
        except InvariantViolation as exc:
            raise self.sim.fail(str(exc)) from None
        self.sim.send(message)


class SimStateStore:
    """One node's state file, in memory (``Simulation.durable``): survives crashes."""

    def __init__(self, sim: Simulation, node: str) -> None:
        self.sim = sim
        self.node = node

    def load(self) -> PersistedState:
        """The state last saved."""
        return self.sim.durable[self.node]

    def save(self, state: PersistedState) -> None:
        """Saved at once (a crash after this keeps it)."""
        self.sim.durable[self.node] = state


class ElectionsView(Mapping[str, "Election | None"]):
    """Each node's current Election (its driver's; None while the coordinator is down)."""

    def __init__(self, drivers: dict[str, CoordinatorDriver | None]) -> None:
        self.drivers = drivers

    def __getitem__(self, node: str) -> Election | None:
        driver = self.drivers[node]
        return None if driver is None else driver.election

    def __iter__(self) -> Iterator[str]:
        return iter(self.drivers)

    def __len__(self) -> int:
        return len(self.drivers)


@contextlib.contextmanager
def quiet_coordinator_log() -> Iterator[None]:
    """The drivers log as in production; thousands of simulated recoveries need not."""
    logger = logging.getLogger("squall.coordinator")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


class Simulation:
    """Runs one scenario; see the module docstring."""

    def __init__(self, scenario: Scenario) -> None:
        """Prepare nodes, stores and the event queue."""
        self.sc = scenario
        self.rng = random.Random(scenario.seed * 7919 + 1)
        self.priorities = scenario.priorities
        self.nodes = sorted(scenario.priorities, key=node_sort_key)
        self.majority = len(self.nodes) // 2 + 1
        self.now_ms = 0
        self.seq = 0
        self.queue: list[tuple[int, int, int, int, str, object]] = []
        # The shipped driver of each node's coordinator (None while it is down).
        self.drivers: dict[str, CoordinatorDriver | None] = {node: None for node in self.nodes}
        self.elections = ElectionsView(self.drivers)
        self.clock = SimClock(self)
        self.timings = DriverTimings(
            heartbeat_interval_ms=scenario.timing["heartbeat_interval_ms"],
            lease_ms=scenario.timing["member_timeout_ms"],
            rpc_timeout_ms=scenario.rpc_timeout_ms,
            replica_timeout_ms=scenario.timing["replica_timeout_ms"],
            # The simulated replicas' stores never stall (a stuck disk is covered by
            # tests/unit/test_coordinator_store_stall.py and a real-process test).
            store_stall_timeout_ms=2000,
        )
        self.durable: dict[str, PersistedState] = dict(scenario.initial)
        self.replicas: dict[str, Replica] = {}
        for node in self.nodes:
            last_epoch, last_lsn = scenario.initial_logs[node]
            self.replicas[node] = Replica(last_epoch=last_epoch, last_lsn=last_lsn)
        mark_initial_stores(self.replicas)
        self.group_ids: Counter[str] = Counter()
        self.incarnation: Counter[str] = Counter()
        self.paused_until: dict[str, int] = {node: 0 for node in self.nodes}
        # The driver's loops as the asyncio shell runs them (node.py): the tick loop's next
        # wake-up, whether its wake-up event is set; the role loop's state, its event, and
        # the generation of its pending wake-up; a health probe in flight.
        self.tick_at: dict[str, int | None] = {node: None for node in self.nodes}
        self.in_tick: dict[str, bool] = {node: False for node in self.nodes}
        self.role_state = {node: "idle" for node in self.nodes}
        self.role_flag = {node: False for node in self.nodes}
        self.role_gen: Counter[str] = Counter()
        self.probing = {node: False for node in self.nodes}
        self.cut: Counter[tuple[str, str]] = Counter()
        self.loss = scenario.loss
        self.delay_max_ms = scenario.delay_max_ms
        self.dup = scenario.dup
        self.long_delay_p = scenario.long_delay_p
        self.checker = Checker(scenario.priorities)
        self.trace: deque[tuple[int, str, str]] = deque(maxlen=TRACE_LINES)
        self.events = 0
        self.healed_at: int | None = None
        self.stable_since: int | None = None
        self.down_for_liveness: set[str] = set()
        self.cluster_ids: set[str] = set()
        self.cluster_id_counter = 0
        self.manual_recoveries = 0
        # Nodes following a lower-ranked coordinator (after a transfer), until they recover.
        self.demoted: set[str] = set()
        self.hand_overs = 0
        # Per-process model (scenario.processes): the replica process apart from its node.
        self.processes = scenario.processes
        self.replica_up = {node: True for node in self.nodes}
        self.replica_paused_until = {node: 0 for node in self.nodes}
        self.link_cut_until = {node: 0 for node in self.nodes}
        # The replica takes a new role only above this epoch (it restarted or dropped one).
        self.floor = {node: 0 for node in self.nodes}
        self.held_max = {node: 0 for node in self.nodes}
        # When the replica's role lease was last renewed (it runs out lease_ms later).
        self.renewed_at = {node: 0 for node in self.nodes}
        # The replica process's life: a call sent to a process that died since is lost.
        self.replica_life: Counter[str] = Counter()

    # ----------------------------------------------------------------- plumbing

    def push(self, at_ms: int, kind: int, node: str = "", payload: object = None) -> None:
        """Schedule an event."""
        self.seq += 1
        heapq.heappush(self.queue, (at_ms, kind, self.seq, 0, node, payload))

    def note(self, what: str, detail: str = "") -> None:
        """Remember a step for the failure report (formatted cheaply)."""
        self.trace.append((self.now_ms, what, detail))

    def fail(self, why: str) -> SimFailure:
        """A failure carrying the seed, the recent trace and the replay command."""
        lines = [f"seed {self.sc.seed} ({len(self.nodes)} nodes) failed at t={self.now_ms}: {why}"]
        lines.append(f"priorities: {self.priorities}; timing: {self.sc.timing}")
        lines.append(f"last {len(self.trace)} steps:")
        lines.extend(f"  t={t} {what} {detail}" for t, what, detail in self.trace)
        lines.append("nodes now:")
        for node in self.nodes:
            e = self.elections[node]
            if e is None:
                lines.append(f"  {node}: down, persisted {self.durable[node]}")
            else:
                s = e.status()
                lines.append(
                    f"  {node}: {s.state.value} coord={s.coordinator_id} group={s.group_name} "
                    f"epoch={s.epoch} max={s.max_seen} role={s.role.value} "
                    f"members={','.join(s.members)}"
                )
        lines.extend(self.extra_state_lines())
        lines.append(self.reproduce())
        return SimFailure("\n".join(lines))

    def reproduce(self) -> str:
        """The replay command a failure ends with (a subclass names its own test)."""
        return reproduce_hint(self.sc.seed)

    def extra_state_lines(self) -> list[str]:
        """More state for a failure report (a subclass adds its replicas)."""
        return []

    def new_group_id(self, node: str) -> str:
        """Unique per node across restarts, like a uuid."""
        self.group_ids[node] += 1
        return f"u{self.group_ids[node]}"

    def new_cluster_id(self, node: str) -> str:
        """Unique across the run, like a uuid: a second one minted would be a bug."""
        self.cluster_id_counter += 1
        return f"c-{node}-{self.cluster_id_counter}"

    def applied(self, node: str, ready: Ready) -> None:
        """The driver applied a Ready: note demotions, run the checker."""
        self.track_demotions(node, ready)
        self.check(node)

    # ----------------------------------------------------------------- the driver's loops
    # Each mirrors one asyncio loop of node.py, which only waits: the decisions are the
    # driver's. A paused coordinator runs none of them until its pause ends.

    def live_driver(self, node: str, incarnation: object) -> CoordinatorDriver | None:
        """The node's driver if ``incarnation`` is still the running one."""
        driver = self.drivers[node]
        if driver is None or incarnation != self.incarnation[node]:
            return None
        return driver

    def deferred(self, kind: int, node: str, payload: object) -> bool:
        """A paused coordinator handles the event when it resumes."""
        if self.paused_until[node] > self.now_ms:
            self.push(self.paused_until[node], kind, node, payload)
            return True
        return False

    def schedule_tick(self, node: str, at: int) -> None:
        """The tick loop sleeps until ``at`` (a later wake-up replaces an earlier one)."""
        if self.sc.tick_jitter_ms and at > self.now_ms:
            at += self.rng.randint(0, self.sc.tick_jitter_ms)
        self.tick_at[node] = at
        self.push(at, _TICK, node, (self.incarnation[node], at))

    def wake(self, node: str) -> None:
        """The driver's wake hook: the tick loop runs again now (unless it is running: its
        wake-up event is cleared after the tick, as in node.py)."""
        if self.in_tick[node]:
            return
        current = self.tick_at[node]
        if current is None or current > self.now_ms:
            self.schedule_tick(node, self.now_ms)

    def on_tick(self, node: str, payload: object) -> None:
        """One turn of the tick loop."""
        if not isinstance(payload, tuple):
            return
        incarnation, at = payload
        driver = self.live_driver(node, incarnation)
        if driver is None or self.tick_at[node] != at or self.deferred(_TICK, node, payload):
            return
        self.tick_at[node] = None
        self.in_tick[node] = True
        try:
            wait_ms = driver.tick()
        finally:
            self.in_tick[node] = False
        if self.drivers[node] is driver:
            self.schedule_tick(node, self.now_ms + wait_ms)

    def role_changed(self, node: str) -> None:
        """The driver's role hook: sets the role loop's event (wakes it if it waits)."""
        self.role_flag[node] = True
        if self.role_state[node] != "calling":
            self.role_gen[node] += 1
            self.role_state[node] = "woken"
            self.push(self.now_ms, _ROLE, node, (self.incarnation[node], self.role_gen[node], True))

    def on_role(self, node: str, payload: object) -> None:
        """One turn of the role loop: send the newest command to the replica."""
        if not isinstance(payload, tuple):
            return
        incarnation, gen, clear = payload
        driver = self.live_driver(node, incarnation)
        if driver is None or gen != self.role_gen[node] or self.deferred(_ROLE, node, payload):
            return
        if clear:
            self.role_flag[node] = False
        command = driver.role_wanted()
        if command is None:
            self.role_state[node] = "idle"
            return
        self.role_state[node] = "calling"
        self.call_set_role(node, incarnation, gen, command)

    def on_role_reply(self, node: str, payload: object) -> None:
        """The replica's answer (or the call's failure) reaches the role loop."""
        if not isinstance(payload, tuple):
            return
        incarnation, gen, command, outcome = payload
        driver = self.live_driver(node, incarnation)
        if driver is None or self.deferred(_ROLE_REPLY, node, payload):
            return
        following = driver.role_outcome(command, outcome)
        if self.drivers[node] is not driver:
            return
        self.role_gen[node] += 1
        gen = self.role_gen[node]
        if following is RoleNext.AGAIN:
            self.role_state[node] = "woken"
            self.push(self.now_ms, _ROLE, node, (incarnation, gen, False))
        elif self.role_flag[node]:
            self.role_state[node] = "woken"
            self.push(self.now_ms, _ROLE, node, (incarnation, gen, True))
        else:
            self.role_state[node] = "waiting"
            renew = self.timings.heartbeat_interval_ms
            self.push(self.now_ms + renew, _ROLE, node, (incarnation, gen, True))

    def on_watch(self, node: str, incarnation: object) -> None:
        """One turn of the replica watch: maybe tell the election, maybe probe."""
        driver = self.live_driver(node, incarnation)
        if driver is None or self.deferred(_WATCH, node, incarnation):
            return
        if driver.watch() and not self.probing[node]:
            self.probing[node] = True
            delay, answered = self.call_health(node)
            self.push(self.now_ms + delay, _PROBE_REPLY, node, (incarnation, answered))
        if self.drivers[node] is driver:
            self.push(self.now_ms + int(driver.watch_interval_ms), _WATCH, node, incarnation)

    def on_probe_reply(self, node: str, payload: object) -> None:
        """A health probe's result."""
        if not isinstance(payload, tuple):
            return
        incarnation, answered = payload
        driver = self.live_driver(node, incarnation)
        if driver is None or self.deferred(_PROBE_REPLY, node, payload):
            return
        self.probing[node] = False
        if answered:
            self.note(f"{node} replica answers a probe")
            driver.replica_answered()

    # ----------------------------------------------------------------- the replica link

    def call_delay(self, node: str, timeout_ms: int) -> int | None:
        """When a call to the replica sent now is answered (None: it times out, or the
        replica is dead and the connection is refused at once: -1)."""
        if not self.replica_up[node]:
            return -1
        if self.link_cut_until[node] > self.now_ms:
            return None
        answer_at = max(self.now_ms, self.replica_paused_until[node]) + self.rng.randint(0, 10)
        if answer_at - self.now_ms >= timeout_ms:
            return None  # a hung replica; gRPC drops a call whose deadline passed
        return answer_at - self.now_ms

    def call_set_role(self, node: str, incarnation: int, gen: int, command: RoleCommand) -> None:
        """SetRole over the simulated link: the replica takes it when the call reaches it
        (a paused replica when it resumes), or the call fails."""
        delay = self.call_delay(node, self.timings.rpc_timeout_ms)
        if delay is None:
            failure = ReplicaFailure(Failure.NO_ANSWER, "DEADLINE_EXCEEDED", "no answer")
            at = self.now_ms + self.timings.rpc_timeout_ms
            self.push(at, _ROLE_REPLY, node, (incarnation, gen, command, failure))
        elif delay < 0:
            failure = ReplicaFailure(Failure.NO_ANSWER, "UNAVAILABLE", "connection refused")
            at = self.now_ms + self.rng.randint(0, 5)
            self.push(at, _ROLE_REPLY, node, (incarnation, gen, command, failure))
        else:
            call = (incarnation, gen, command, self.replica_life[node])
            self.push(self.now_ms + delay, _REPLICA_CALL, node, call)

    def on_replica_call(self, node: str, payload: object) -> None:
        """A role command reaches the replica; the answer goes back at once."""
        if not isinstance(payload, tuple):
            return
        incarnation, gen, command, life = payload
        outcome: ReplicaAnswer | ReplicaFailure
        at = self.now_ms
        if not self.replica_up[node] or life != self.replica_life[node]:
            outcome = ReplicaFailure(Failure.NO_ANSWER, "UNAVAILABLE", "connection reset")
        elif (
            self.replica_paused_until[node] > self.now_ms or self.link_cut_until[node] > self.now_ms
        ):
            outcome = ReplicaFailure(Failure.NO_ANSWER, "DEADLINE_EXCEEDED", "no answer")
            at += self.timings.rpc_timeout_ms
        else:
            outcome = self.replica_set_role(node, command)
        self.push(at, _ROLE_REPLY, node, (incarnation, gen, command, outcome))

    def call_health(self, node: str) -> tuple[int, bool]:
        """A health check over the simulated link: the delay and whether it answered."""
        delay = self.call_delay(node, self.timings.replica_timeout_ms)
        if delay is None:
            return self.timings.replica_timeout_ms, False
        if delay < 0:
            return self.rng.randint(0, 5), False
        return delay, True

    def replica_set_role(self, node: str, cmd: RoleCommand) -> ReplicaAnswer | ReplicaFailure:
        """The replica twin takes (or refuses) a role command; it renews the lease."""
        replica = self.replicas[node]
        if self.refuses(node, cmd):
            self.note(f"{node} replica refuses", format_role_command(cmd))
            return ReplicaFailure(
                Failure.REFUSED, "FAILED_PRECONDITION", f"epoch {cmd.epoch} already held"
            )
        self.renew_lease(node)
        renewal = cmd == replica.last_command and (
            replica.role is not Role.INACTIVE or cmd.kind is RoleCommandKind.DEACTIVATE
        )
        replica.applied_seq = cmd.seq
        replica.last_command = cmd
        if renewal:
            return ReplicaAnswer(report=replica.report(), slave_lags=self.slave_lags(node))
        self.note(f"{node} role", format_role_command(cmd))
        if cmd.kind is not RoleCommandKind.DEACTIVATE:
            self.cluster_ids.add(cmd.cluster_id)
            if len(self.cluster_ids) > 1 or not cmd.cluster_id:
                raise self.fail(
                    f"role commands name cluster ids {sorted(self.cluster_ids)}: the "
                    "cluster id must be set once, at the first formation"
                )
        if cmd.kind is RoleCommandKind.DEACTIVATE:
            self.deactivate_replica(node)
        elif cmd.kind is RoleCommandKind.MASTER:
            self.become_master(node, cmd)
            self.held_max[node] = max(self.held_max[node], cmd.epoch)
        else:
            self.follow_master(node, cmd)
            self.held_max[node] = max(self.held_max[node], cmd.epoch)
        return ReplicaAnswer(report=replica.report(), slave_lags=self.slave_lags(node))

    def renew_lease(self, node: str) -> None:
        """A role command renews the replica's lease (per-process model only)."""
        if not self.processes:
            return
        self.renewed_at[node] = self.now_ms
        self.push(self.now_ms + self.timings.lease_ms, _LEASE, node, self.now_ms)

    def on_lease(self, node: str, renewed_at: object) -> None:
        """The replica's lease runs out if nothing renewed it since ``renewed_at``."""
        if self.renewed_at[node] != renewed_at or not self.replica_up[node]:
            return
        if self.replica_paused_until[node] > self.now_ms:
            return  # a paused replica notices when it resumes (see heal_process)
        self.drop_role(node, "role lease expired: no word from the coordinator")

    # ----------------------------------------------------------------- processes

    def refuses(self, node: str, cmd: RoleCommand) -> bool:
        """Would the replica refuse this role (one in an epoch it restarted out of or
        dropped, unless it is the renewal of the role it holds)?"""
        if cmd.kind is RoleCommandKind.MASTER and node == self.sc.refuses_master:
            return True
        if not self.processes or cmd.kind is RoleCommandKind.DEACTIVATE:
            return False
        replica = self.replicas[node]
        want = Role.MASTER if cmd.kind is RoleCommandKind.MASTER else Role.SLAVE
        renewal = replica.role is want and replica.epoch == cmd.epoch
        return not renewal and cmd.epoch <= self.floor[node]

    def drop_role(self, node: str, why: str) -> None:
        """The replica loses its role (a restart, a lease that ran out): it takes no role
        in an epoch it held any more."""
        replica = self.replicas[node]
        self.floor[node] = max(self.floor[node], self.held_max[node])
        if replica.role is not Role.INACTIVE:
            self.note(f"{node} replica drops its role", why)
        replica.role, replica.epoch, replica.master = Role.INACTIVE, 0, ""
        replica.last_command = None

    def driver_recovers(self, node: str, why: str) -> None:
        """The replica gave up a role it was given: the driver recovers (node.py's way)."""
        driver = self.drivers[node]
        if driver is not None:
            self.note(f"{node} driver recovers", why)
            driver.recover(why)

    def process_fault(self, node: str, payload: object) -> None:
        """Hit one process of ``node`` (or of the master now, when ``node`` is empty)."""
        if not isinstance(payload, tuple):
            return
        fault, duration = payload
        if not node:
            leaders = [
                (e.status().epoch, x)
                for x in self.nodes
                if (e := self.elections[x]) is not None
                and e.status().state is NodeState.NORMAL
                and e.status().coordinator_id == x
            ]
            if not leaders:
                return
            node = max(leaders)[1]
        self.note(f"{node} {fault}", f"for {duration} ms")
        end = self.now_ms + int(duration)
        if fault.startswith("replica-kill"):
            if not self.replica_up[node]:
                return
            self.replica_up[node] = False
            self.replica_life[node] += 1
            self.drop_role(node, "killed")
            replica = self.replicas[node]
            replica.applied_seq, replica.joined = 0, False
            if fault.endswith("restart"):
                self.push(end, _PROC_HEAL, node, "replica-restart")
        elif fault == "replica-pause":
            self.replica_paused_until[node] = max(self.replica_paused_until[node], end)
            self.push(end, _PROC_HEAL, node, "replica-resume")
        elif fault.startswith("coordinator-kill"):
            if self.drivers[node] is None:
                return
            self.stop_driver(node)
            if fault.endswith("restart"):
                self.push(end, _PROC_HEAL, node, "coordinator-restart")
        elif fault == "coordinator-pause":
            if self.drivers[node] is None:
                return
            self.paused_until[node] = max(self.paused_until[node], end)
        else:  # link-cut: coordinator and its own replica cannot reach each other
            self.link_cut_until[node] = max(self.link_cut_until[node], end)

    def heal_process(self, node: str, what: object) -> None:
        """The end of one process fault (also run for every node at the heal)."""
        if what == "replica-restart":
            if self.replica_up[node]:
                return
            self.replica_up[node] = True
            self.note(f"{node} replica restarted")
        elif what == "replica-resume":
            if self.replica_paused_until[node] > self.now_ms:
                return
            # The hung replica's lease ran out while it hung: it drops the role on resuming.
            if self.now_ms - self.renewed_at[node] >= self.timings.lease_ms:
                self.drop_role(node, "role lease expired while the replica hung")
            self.note(f"{node} replica resumed")
        elif what == "coordinator-restart":
            if self.healed_at is not None and node in self.down_for_liveness:
                return  # kept down for the liveness phase, like a whole-node restart
            self.start_node(node)

    def track_demotions(self, node: str, ready: Ready) -> None:
        """Note nodes that follow a coordinator ranked below them (after a transfer, and
        members of its later merges): they stay members until they next recover into a
        group of their own, so until then the top rank may legitimately lead nobody."""
        election = self.elections[node]
        if election is None:
            return
        for event in ready.events:
            if event.event == "invitation-accepted":
                coordinator = election.status().coordinator_id
                if _rank_key(self.priorities, coordinator) > _rank_key(self.priorities, node):
                    self.demoted.add(node)
            elif event.event in ("recovery", "start", "transfer-take-over"):
                self.demoted.discard(node)

    def deactivate_replica(self, node: str) -> None:
        """The replica stops serving; its log no longer grows once this returns. Like the
        shipped core's drop (``services/replica/core.py``, ``_drop``), it takes no role in
        an epoch it held any more: a master deactivated in its epoch and commanded master
        of that epoch again refuses (seed 38522: it took the role back, syncing from a
        member whose log was behind its own)."""
        replica = self.replicas[node]
        if replica.role is not Role.INACTIVE:
            self.floor[node] = max(self.floor[node], self.held_max[node])
        replica.role = Role.INACTIVE

    def follow_master(self, node: str, cmd: RoleCommand) -> None:
        """The replica follows ``cmd.master_id`` in ``cmd.epoch``."""
        replica = self.replicas[node]
        replica.take_role(cmd.cluster_id)
        replica.role, replica.epoch, replica.master = Role.SLAVE, cmd.epoch, cmd.master_id

    def check(self, node: str) -> None:
        """Run the checker for one node; a violation becomes a SimFailure with the trace."""
        try:
            self.checker.check_node(node, self.elections[node], self.durable)
        except InvariantViolation as exc:
            raise self.fail(str(exc)) from None
        odd = self.sc.odd_one_out
        election = self.elections[node]
        if odd and election is not None:
            s = election.status()
            together = set(s.members) | set(s.group) | {s.coordinator_id, node}
            if odd in together and len(together) > 1:
                raise self.fail(
                    f"node {odd}, whose settings differ, shares a group with "
                    f"{sorted(together - {odd}, key=node_sort_key)} (seen from {node}: "
                    f"{s.state.value}, group {s.group_name})"
                )

    def become_master(self, node: str, cmd: RoleCommand) -> None:
        """Sync from the sync source, write the epoch-start entry, keep writing."""
        replica = self.replicas[node]
        reissue = replica.role is Role.MASTER and replica.epoch == cmd.epoch
        logs = {x: (r.last_epoch, r.last_lsn) for x, r in self.replicas.items()}
        try:
            self.checker.check_master(node, cmd, logs, self.durable, reissue)
        except InvariantViolation as exc:
            raise self.fail(str(exc)) from None
        if reissue:
            return
        replica.take_role(cmd.cluster_id)
        source = self.replicas[cmd.sync_source_id]
        if (source.last_epoch, source.last_lsn) > (replica.last_epoch, replica.last_lsn):
            replica.last_epoch, replica.last_lsn = source.last_epoch, source.last_lsn
        replica.role, replica.epoch, replica.master = Role.MASTER, cmd.epoch, node
        self.write(node, cmd.epoch)

    def write(self, node: str, epoch: int) -> None:
        """The master appends an entry; reachable followers of its epoch copy the log."""
        replica = self.replicas[node]
        if self.elections[node] is None and not self.processes:
            return
        if not self.replica_up[node]:
            return
        if replica.role is not Role.MASTER or replica.epoch != epoch:
            return
        replica.last_epoch = epoch
        replica.last_lsn += 1
        for other in self.nodes:
            follower = self.replicas[other]
            if (
                follower.role is Role.SLAVE
                and follower.master == node
                and follower.epoch == epoch
                and (self.elections[other] is not None or self.processes)
                and self.replica_up[other]
                and self.replica_paused_until[other] <= self.now_ms
                and not self.cut[(node, other)]
                and self.copies(other)
                and self.rng.random() < 0.6
            ):
                # Followers lag at random, so logs differ and the sync source matters.
                follower.last_epoch, follower.last_lsn = replica.last_epoch, replica.last_lsn
                follower.cluster_id = replica.cluster_id
        self.push(self.now_ms + WRITE_INTERVAL_MS, _WRITE, node, epoch)

    def copies(self, node: str) -> bool:
        """Can ``node``'s replica copy its master's log at all? (A subclass models one
        that never catches up.)"""
        return True

    def send(self, msg: PeerMessage) -> None:
        """Hand a message to the network: maybe lost, maybe twice, each copy delayed."""
        rng = self.rng
        if self.loss and rng.random() < self.loss:
            return
        copies = 2 if self.dup and rng.random() < self.dup else 1
        for _ in range(copies):
            delay = rng.randint(self.sc.delay_min_ms, self.delay_max_ms)
            if self.long_delay_p and rng.random() < self.long_delay_p:
                delay += rng.randint(0, self.sc.long_delay_max_ms)
            self.push(self.now_ms + delay, _DELIVER, msg.to_node, msg)

    # ----------------------------------------------------------------- events

    def start_node(self, node: str) -> None:
        """Start or restart a node's coordinator (the shipped driver) from its persisted
        state, with its three loops."""
        if self.drivers[node] is not None:
            return
        self.incarnation[node] += 1
        config = ElectionConfig(
            node_id=node,
            priorities=self.config_priorities(node),
            agreed_settings=self.sc.agreed.get(node, ()),
            addresses={x: (f"c{x}:1", f"r{x}:1") for x in self.config_priorities(node)},
            **self.config_set_key(node),
            **self.sc.timing,
        )
        driver = CoordinatorDriver(
            config,
            self.timings,
            self.clock,
            SimPeers(self),
            SimStateStore(self, node),
            lambda: self.new_group_id(node),
            lambda: self.new_cluster_id(node),
            wake=lambda: self.wake(node),
            role_changed=lambda: self.role_changed(node),
            applied=lambda ready: self.applied(node, ready),
            hand_over=lambda target: self.prepare_hand_over(node, target),
        )
        self.drivers[node] = driver
        self.tick_at[node] = None
        self.role_state[node] = "idle"
        self.role_flag[node] = False
        self.probing[node] = False
        self.note(f"{node} start", f"persisted {self.durable[node]}")
        self.check(node)
        incarnation = self.incarnation[node]
        self.push(self.now_ms + int(driver.watch_interval_ms), _WATCH, node, incarnation)
        self.schedule_tick(node, self.now_ms)

    def config_priorities(self, node: str) -> dict[str, int]:
        """The node set of ``node``'s config file (every node; the membership simulator's
        spare nodes list the cluster and themselves)."""
        return self.priorities

    def config_set_key(self, node: str) -> dict[str, Any]:
        """The node set version and epoch ``node``'s config file records (none: 0), and
        the learners it marks."""
        return {}

    def stop_driver(self, node: str) -> None:
        """The coordinator process is gone: its loops and calls in flight with it."""
        self.drivers[node] = None
        self.tick_at[node] = None
        self.paused_until[node] = 0
        self.incarnation[node] += 1

    def crash(self, node: str) -> None:
        """Lose everything but the persisted state and the replica's log."""
        if self.drivers[node] is None:
            return
        self.stop_driver(node)
        self.replica_life[node] += 1
        replica = self.replicas[node]
        if self.processes:
            self.drop_role(node, "the whole node crashed")
        replica.role, replica.epoch, replica.master = Role.INACTIVE, 0, ""
        replica.applied_seq = 0
        replica.joined = False
        replica.last_command = None
        self.note(f"{node} crash")
        self.check(node)

    def handle(self, kind: int, node: str, payload: object) -> None:
        """Run one event."""
        if kind == _DELIVER:
            if not isinstance(payload, PeerMessage):
                raise TypeError("message expected")
            msg = payload
            driver = self.drivers[node]
            if driver is None or self.cut[(msg.from_node, msg.to_node)]:
                return
            if self.deferred(_DELIVER, node, msg):
                return
            self.note("deliver", format_message(msg))
            ready = driver.deliver(msg)
            if ready is not None and ready.rejection is not None:
                self.note(f"{node} rejected", ready.rejection.message)
        elif kind == _TICK:
            self.on_tick(node, payload)
        elif kind == _ROLE:
            self.on_role(node, payload)
        elif kind == _ROLE_REPLY:
            self.on_role_reply(node, payload)
        elif kind == _REPLICA_CALL:
            self.on_replica_call(node, payload)
        elif kind == _WATCH:
            self.on_watch(node, payload)
        elif kind == _PROBE_REPLY:
            self.on_probe_reply(node, payload)
        elif kind == _LEASE:
            self.on_lease(node, payload)
        elif kind == _WRITE:
            # The replica writes; in the per-process model its own pause stops it, not its
            # coordinator's.
            paused = self.replica_paused_until if self.processes else self.paused_until
            if isinstance(payload, int) and paused[node] <= self.now_ms:
                self.write(node, payload)
            elif isinstance(payload, int):
                self.push(paused[node], _WRITE, node, payload)
        elif kind in (_START, _RESTART):
            if self.healed_at is None or node not in self.down_for_liveness:
                if self.processes and self.drivers[node] is None:
                    # The whole node restarts: its replica process too.
                    self.replica_up[node] = True
                    self.replica_paused_until[node] = self.link_cut_until[node] = 0
                self.start_node(node)
        elif kind == _CRASH:
            if self.healed_at is None:
                self.crash(node)
        elif kind == _PAUSE and self.processes:
            # The coordinator hangs; its replica runs on until its lease runs out.
            if self.healed_at is None and isinstance(payload, int):
                self.process_fault(node, ("coordinator-pause", payload))
        elif kind == _PAUSE:
            if self.healed_at is None and isinstance(payload, int):
                self.paused_until[node] = self.now_ms + payload
                self.note(f"{node} paused", f"for {payload} ms")
        elif kind == _CUT:
            if self.healed_at is None and isinstance(payload, frozenset):
                self.cut.update(payload)
                self.note("partition", " ".join(f"{a}-x->{b}" for a, b in sorted(payload)))
        elif kind == _UNCUT:
            if self.healed_at is None and isinstance(payload, frozenset):
                self.cut.subtract(payload)
                self.cut = +self.cut
        elif kind == _HEAL:
            self.heal()
        elif kind == _TRANSFER:
            if self.healed_at is None and isinstance(payload, int):
                self.transfer(payload)
        elif kind == _QUARANTINE:
            if self.healed_at is None and isinstance(payload, int):
                self.quarantine(node, bool(payload))
        elif kind == _PROC_FAULT:
            if self.healed_at is None:
                self.process_fault(node, payload)
        elif kind == _PROC_HEAL:
            self.heal_process(node, payload)
        elif kind == _HAND_OVER:
            self.on_hand_over(node, payload)

    def leaders(self) -> list[str]:
        """The running, unpaused nodes that coordinate a normal group now."""
        return [
            x
            for x in self.nodes
            if (e := self.elections[x]) is not None
            and self.paused_until[x] <= self.now_ms
            and e.status().state is NodeState.NORMAL
            and e.status().coordinator_id == x
        ]

    def transfer(self, pick: int) -> None:
        """An operator hands the leadership of a normal group to one of its members."""
        leaders = self.leaders()
        if not leaders:
            return
        leader = leaders[pick % len(leaders)]
        election = self.elections[leader]
        if election is None:
            return
        members = [x for x in election.status().members if x != leader]
        if not members:
            return
        target = members[pick % len(members)]
        driver = self.drivers[leader]
        if driver is None:
            return
        self.note(f"{leader} transfer to {target}")
        ready = driver.transfer_leadership(target, "sim")
        if ready.rejection is not None:
            self.note(f"{leader} transfer refused", ready.rejection.message)

    def prepare_hand_over(self, node: str, target: str) -> None:
        """The driver's hand-over hook: the replica's PrepareHandoff takes a little while,
        then the driver calls transfer_leadership (node.py's background task)."""
        delay = self.rng.randint(0, HAND_OVER_PREPARE_MS_MAX)
        self.push(self.now_ms + delay, _HAND_OVER, node, (self.incarnation[node], target))

    def on_hand_over(self, node: str, payload: object) -> None:
        """The hand-over's replica is ready: the election hands the group over (or, if the
        group changed meanwhile, refuses and nothing happens)."""
        if not isinstance(payload, tuple):
            return
        incarnation, target = payload
        driver = self.live_driver(node, incarnation)
        if driver is None or self.deferred(_HAND_OVER, node, payload):
            return
        self.note(f"{node} hands over to {target}")
        ready = driver.transfer_leadership(str(target), "auto", "caught up")
        if ready.rejection is not None:
            self.note(f"{node} hand-over refused", ready.rejection.message)
        else:
            self.hand_overs += 1

    def slave_lags(self, node: str) -> tuple[tuple[str, int], ...]:
        """What a master replica's answer says of its streaming slaves: those that hold its
        epoch's log, and how far behind they are."""
        master = self.replicas[node]
        if master.role is not Role.MASTER:
            return ()
        return tuple(
            (other, master.last_lsn - follower.last_lsn)
            for other, follower in sorted(self.replicas.items())
            if other != node
            and follower.role is Role.SLAVE
            and follower.master == node
            and follower.epoch == master.epoch
            and follower.last_epoch == master.last_epoch
            and self.replica_up[other]
        )

    def quarantine(self, node: str, enabled: bool) -> None:
        """An operator quarantines a node, or clears it."""
        driver = self.drivers[node]
        if driver is None:
            return
        self.note(f"{node} quarantine", "on" if enabled else "off")
        driver.set_quarantine(enabled, "sim")

    def heal(self) -> None:
        """End of the safety phase: no more faults; restart nodes for the liveness check."""
        self.healed_at = self.now_ms
        self.cut.clear()
        self.loss = 0.0
        self.long_delay_p = 0.0
        # Liveness needs round trips well inside the timeouts; the safety phase need not.
        self.delay_max_ms = min(self.delay_max_ms, self.sc.timing["member_timeout_ms"] // 8)
        for node in self.nodes:
            self.paused_until[node] = 0
        if self.processes:
            for node in self.nodes:
                if not self.replica_up[node]:
                    self.heal_process(node, "replica-restart")
                if self.replica_paused_until[node] > self.now_ms:
                    # Resumed early: it has been paused for a lease at least.
                    self.replica_paused_until[node] = self.now_ms
                    self.renewed_at[node] = self.now_ms - self.timings.lease_ms
                    self.heal_process(node, "replica-resume")
                self.link_cut_until[node] = 0
        # Keep a minority down when some node could vouch that a majority ran before
        # (otherwise the first-startup rule rightly needs every node) and an eligible node
        # stays up.
        down: set[str] = set()
        if self.sc.keep_minority_down and self.rng.random() < 0.5:
            keep_down = self.rng.randint(0, len(self.nodes) - self.majority)
            down = set(self.rng.sample(self.nodes, keep_down))
            up = [x for x in self.nodes if x not in down]
            if max(self.durable[x].max_seen for x in up) < self.majority or not any(
                self.priorities[x] > 0 for x in up
            ):
                down = set()
            elif self.holds_newest_for_a_cold_start(down, up):
                down = set()
        self.down_for_liveness = down
        for node in down:
            self.crash(node)
        up = [x for x in self.nodes if x not in down]
        # A node whose settings differ never joins the others' group, so their stores alone
        # decide a cold start (and the operator's manual recovery leaves it out).
        agreeing = [x for x in up if x not in (self.sc.odd_one_out, self.sc.refuses_master)]
        refusal = self.cold_start_refusal(agreeing)
        if refusal:
            self.manual_recovery(agreeing, refusal)
        for node in up:
            self.start_node(node)
            self.quarantine(node, False)
        self.note("heal", f"down for liveness: {sorted(down, key=node_sort_key)}")

    def holds_newest_for_a_cold_start(self, down: set[str], up: list[str]) -> bool:
        """Would the up nodes' cold start rightly wait for a node kept down? It would when
        nobody up has joined and a down node's store is ahead of every up store: the
        coordinators that saw its report hold the group until a node restarts or a store
        changes (``lifecycle.decide_start``), as an operator would be told."""
        if any(self.replicas[x].joined and self.elections[x] is not None for x in up):
            return False

        def position(x: str) -> tuple[int, int]:
            return (self.replicas[x].last_epoch, self.replicas[x].last_lsn)

        best_up = max(position(x) for x in up)
        return any(position(x) > best_up for x in down)

    def cold_start_refusal(self, up: list[str]) -> str:
        """Why the live nodes' stores would be refused a start (empty: they would not)."""
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
            for x in up
            for r in (self.replicas[x],)
        }
        decision = decide_start(reports, len(self.nodes))
        return "" if decision.ok else decision.reason

    def manual_recovery(self, up: list[str], refusal: str) -> None:
        """docs/operations.md's procedure: stop every node, mark the store with the newest
        log clean (and any other clean store dirty), start them again."""
        self.manual_recoveries += 1
        for node in up:
            self.crash(node)
        # Equal positions hold equal logs, so any of the newest will do.
        best = max(up, key=lambda x: (self.replicas[x].last_epoch, self.replicas[x].last_lsn))
        for node in up:
            replica = self.replicas[node]
            if replica.state is StoreState.CLEAN:
                replica.state, replica.shutdown_id = StoreState.DIRTY, ""
        chosen = self.replicas[best]
        chosen.state, chosen.shutdown_id = StoreState.CLEAN, f"m{self.manual_recoveries}"
        self.note("manual recovery", f"{refusal[:120]}...; marked {best} clean")

    # ----------------------------------------------------------------- liveness

    def converged(self) -> str | None:
        """The leader if every live node is normal in one group under the right leader."""
        left_out = (self.sc.odd_one_out, self.sc.refuses_master)
        live = [x for x in self.nodes if self.elections[x] is not None and x not in left_out]
        eligible = [x for x in live if self.priorities[x] > 0 and x not in self.demoted]
        if not eligible:
            return None
        leader = min(eligible, key=lambda x: _rank_key(self.priorities, x))
        election = self.elections[leader]
        if election is None:
            return None
        head = election.status()
        if head.state is not NodeState.NORMAL or head.coordinator_id != leader:
            return None
        if list(head.members) != live:
            return None
        for node in live:
            e = self.elections[node]
            if e is None:
                return None
            s = e.status()
            if s.state is not NodeState.NORMAL or s.group_name != head.group_name:
                return None
        return leader

    # ----------------------------------------------------------------- run

    def schedule_scenario(self) -> None:
        """Queue the starts, the faults and the end of the safety phase."""
        for node in self.nodes:
            self.push(self.sc.start_ms[node], _START, node)
        for fault_at, fault_kind, fault_node, fault_payload in self.sc.faults:
            self.push(fault_at, fault_kind, fault_node, fault_payload)
        self.push(self.sc.safety_ms, _HEAL)

    def run(self) -> SimResult:
        """Run both phases; raise SimFailure on any violation or a missed deadline."""
        with quiet_coordinator_log():
            return self.run_phases()

    def run_phases(self) -> SimResult:
        """See run()."""
        self.schedule_scenario()
        deadline = self.sc.safety_ms + self.sc.liveness_deadline_ms
        leader: str | None = None
        while self.queue:
            at, kind, _, _, node, payload = heapq.heappop(self.queue)
            if at > deadline:
                break
            self.now_ms = at
            self.events += 1
            if self.events > EVENTS_MAX:
                raise self.fail(f"more than {EVENTS_MAX} events: a message storm")
            self.handle(kind, node, payload)
            if self.healed_at is not None and kind in (_DELIVER, _TICK, _START, _HEAL):
                leader = self.converged()
                if leader is None:
                    self.stable_since = None
                elif self.stable_since is None:
                    self.stable_since = self.now_ms
                elif self.now_ms - self.stable_since >= self.sc.stable_ms:
                    e = self.elections[leader]
                    return SimResult(
                        seed=self.sc.seed,
                        nodes=len(self.nodes),
                        events=self.events,
                        converge_ms=self.stable_since - self.sc.safety_ms,
                        leader=leader,
                        final_epoch=e.persisted.epoch if e is not None else 0,
                        hand_overs=self.hand_overs,
                    )
        raise self.fail(
            f"liveness: live nodes did not form one normal group under the highest-ranked "
            f"live eligible node within {self.sc.liveness_deadline_ms} ms of healing"
        )


def make_odd_one_out_scenario(seed: int) -> Scenario:
    """A seed's scenario (faults included) in which one node's agreed settings differ: the
    cluster ran before with every node (so the others are a majority without it), and the
    odd node must never share a group with them while the others converge without it."""
    scenario = make_scenario(seed)
    scenario.keep_minority_down = False
    nodes = sorted(scenario.priorities, key=node_sort_key)
    rng = random.Random(seed ^ 0x5E77)
    odd = rng.choice(nodes)
    if not any(scenario.priorities[x] > 0 for x in nodes if x != odd):
        scenario.priorities[nodes[0] if odd != nodes[0] else nodes[-1]] = 4
    for node in nodes:
        scenario.initial[node] = PersistedState(epoch=3, max_seen=len(nodes), cluster_id=CLUSTER_ID)
        scenario.initial_logs[node] = (3, rng.randint(1, 20))
    base = (("cluster.name", "sim"), ("durability.acks", "majority"))
    scenario.agreed = {node: base for node in nodes}
    scenario.agreed[odd] = (("cluster.name", "sim"), ("durability.acks", "all"))
    scenario.odd_one_out = odd
    return scenario


def run_seed(seed: int) -> SimResult:
    """Run one seed with faults, per-process faults included."""
    return Simulation(make_scenario(seed, processes=True)).run()


def measure_failover(seed: int, fault: str = "node-kill") -> int:
    """Milliseconds from ``fault`` hitting a settled master to a new normal majority group.

    ``fault`` is ``node-kill`` (both processes) or one of ``PROCESS_FAULTS`` hitting one
    process alone, lasting 5 s. No other faults; message delays of 0-2 ms as on a loopback
    network; the default timing.
    """
    scenario = make_scenario(seed, faults=False)
    scenario.keep_minority_down = False
    scenario.processes = fault != "node-kill"
    scenario.timing = {
        "heartbeat_interval_ms": 100,
        "member_timeout_ms": 400,
        "probe_interval_ms": 200,
        "merge_delay_ms_per_priority": 50,
        "replica_timeout_ms": 300,
    }
    sim = Simulation(scenario)
    result = sim.run()
    old_epoch = result.final_epoch
    killed_at = sim.now_ms
    sim.healed_at = None  # allow the fault below
    if fault == "node-kill":
        sim.crash(result.leader)
    else:
        sim.process_fault(result.leader, (fault, 5000))
    sim.healed_at = killed_at
    sim.down_for_liveness.add(result.leader)  # no restart: measure failover, not rejoin
    with quiet_coordinator_log():
        return _failover_ms(sim, killed_at, old_epoch, fault, result.leader)


def _failover_ms(sim: Simulation, killed_at: int, old_epoch: int, fault: str, leader: str) -> int:
    """Run ``sim`` until a new normal majority group forms (see measure_failover)."""
    limit = killed_at + 5000
    while sim.queue:
        at, kind, _, _, node, payload = heapq.heappop(sim.queue)
        if at > limit:
            break
        sim.now_ms = at
        sim.handle(kind, node, payload)
        for x in sim.nodes:
            e = sim.elections[x]
            if e is None:
                continue
            s = e.status()
            if (
                s.state is NodeState.NORMAL
                and s.coordinator_id == x
                and s.epoch > old_epoch
                and len(s.members) >= sim.majority
            ):
                return sim.now_ms - killed_at
    raise sim.fail(f"no new master within 5000 ms of {fault} on {leader}")


def make_refusing_master_scenario(seed: int) -> Scenario:
    """A seed's scenario (faults included) in which the highest-ranked node's replica refuses
    every master role: the cluster ran before with every node (so the others are a majority
    without it); it must step aside, and the others converge under the next in rank."""
    scenario = make_scenario(seed)
    scenario.keep_minority_down = False
    nodes = sorted(scenario.priorities, key=lambda x: _rank_key(scenario.priorities, x))
    rng = random.Random(seed ^ 0x4EF5)
    if scenario.priorities[nodes[0]] == 0:
        scenario.priorities[nodes[0]] = 4
    if not any(scenario.priorities[x] > 0 for x in nodes[1:]):
        scenario.priorities[nodes[1]] = 1
    for node in nodes:
        scenario.initial[node] = PersistedState(epoch=3, max_seen=len(nodes), cluster_id=CLUSTER_ID)
        scenario.initial_logs[node] = (3, rng.randint(1, 20))
    scenario.refuses_master = nodes[0]
    return scenario
