"""The seeded fault schedule of a chaos run, and the code that injects and heals each fault.

``schedule(seed, ...)`` draws every choice from ``random.Random(seed)``: the same seed,
duration, nodes and kinds give the same list of faults (kind, targets, parameters,
durations, quiet gaps, overlaps). ``FaultRunner`` plays it against a ``ChaosCluster``
one fault at a time: quiet gap, start (history ``fault`` record, phase "start"), hold
for its duration, heal (phase "end"), then wait (bounded) until the cluster is normal
again before the next gap. A fault that would not end before the run's deadline is not
started; every started fault is healed, also when the run fails.

A fault's target is a node id fixed by the schedule, or a role resolved when the fault
starts (``role`` "master": the node whose replica is master then; "slave": another one,
the seeded ``pick`` choosing among them), so a single-process fault can be aimed at the
master whichever node holds the role by then.

Overlap: a fault may carry a second one (``overlap``), started ``overlap.gap_s`` into
its hold on a node the first does not hit, and healed no later than the first (e.g. a
paused slave while the master's replica is killed). The schedule draws it (seeded,
``OVERLAP_PROBABILITY``) and bounds it so that a majority of nodes stays able to
recover: at most a minority of nodes is ever wholly out (both processes killed, paused,
cut off or stopped), at least one node is not hit at all, and both faults are of kinds
that heal by themselves (restart, SIGCONT, routes deleted, controls cleared). Without an
overlap at most one node (a minority), or one gateway, is faulty at a time.

The kinds and what each one does:

``kill``        kill -9 a node's coordinator and replica (or one gateway), restart it.
``pause``       SIGSTOP a node's processes, SIGCONT them.
``kill_replica``       kill -9 the node's replica alone (its coordinator runs on),
                       restart it.
``kill_coordinator``   kill -9 the node's coordinator alone, restart it.
``pause_replica``      SIGSTOP the node's replica alone, SIGCONT it.
``pause_coordinator``  SIGSTOP the node's coordinator alone, SIGCONT it.
``stop``        SIGTERM a node's processes (an orderly stop, as a VM's restart or
                ``systemctl stop`` does: each drains its calls and exits), restart it.
``stop_replica``       SIGTERM the node's replica alone (``systemctl restart`` of one
                       unit), restart it.
``stop_coordinator``   SIGTERM the node's coordinator alone, restart it.
``partition``   blackhole routes between one node and the rest, or (5 nodes) between a
                2-node minority and the majority (chaos/netns.py); needs namespaces.
``partition_replica``      blackhole routes between the node's replica and the other
                           replicas; its coordinator keeps every link (namespaces).
``partition_coordinator``  the same for the node's coordinator and the other
                           coordinators; its replica keeps every link (namespaces).
``map_full``    the node's LMDB commits fail with ``lmdb.MapFullError``
                (services/replica/fault_hooks.py), then succeed again.
``corrupt``     stop the node, flip one byte inside one stored record of an event it
                serves (found through LMDB's own reader, then in the data file), restart
                it. At the end a reader asks that node for the damaged event: the
                record's checksum must fail (DATA_LOSS) and the node quarantine itself,
                unless the damage is gone from the store (a node that truncated its log
                on rejoining rebuilt the store from the log) and the event is served
                intact (``judge_undetected``); anything else is a finding. Heal: stop
                it, move the damaged store aside, restart it empty, ``squall cluster
                unquarantine``; it rejoins and is brought up to date by the master (log
                or snapshot).
``slow_disk``   every fsync of the node's store waits fsync_delay_ms first.
``clock_jump``  not applicable: no Squall timeout reads wall time (``NOT_APPLICABLE``).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from chaos.cluster import GATEWAY_IDS, NODE_PROCESSES, ChaosCluster, ClusterError
from chaos.history import HistoryWriter
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall_server.replica.committed import gate_from_store
from squall_server.replica.store import DATABASES, DB_EVENTS, Store
from squall_server.replica.store.kv_lmdb import LmdbKV

KINDS = (
    "kill",
    "pause",
    "kill_replica",
    "kill_coordinator",
    "pause_replica",
    "pause_coordinator",
    "stop",
    "stop_replica",
    "stop_coordinator",
    "partition",
    "partition_replica",
    "partition_coordinator",
    "map_full",
    "corrupt",
    "slow_disk",
    "clock_jump",
)
# The faults that hit one process of a node: (what is done, to which process).
PROCESS_FAULTS = {
    "kill_replica": ("kill", "replica"),
    "kill_coordinator": ("kill", "coordinator"),
    "pause_replica": ("pause", "replica"),
    "pause_coordinator": ("pause", "coordinator"),
    "stop_replica": ("stop", "replica"),
    "stop_coordinator": ("stop", "coordinator"),
    "partition_replica": ("partition", "replica"),
    "partition_coordinator": ("partition", "coordinator"),
}
NOT_APPLICABLE = {
    "clock_jump": (
        "no timeout depends on wall time: every timeout, lease and deadline in Squall reads "
        "the monotonic clock (services/common/clock.py; grpc and asyncio deadlines are "
        "monotonic too); wall time only stamps events, topics, faults and operator records"
    ),
}
NEEDS_NETNS = ("partition", "partition_replica", "partition_coordinator")

# Seconds of (lo, hi) for how long each kind is held.
_HOLD_S = {
    "kill": (1.0, 5.0),
    "pause": (1.0, 4.0),
    "kill_replica": (1.0, 5.0),
    "kill_coordinator": (1.0, 5.0),
    "pause_replica": (1.0, 4.0),
    "pause_coordinator": (1.0, 4.0),
    "stop": (1.0, 5.0),
    "stop_replica": (1.0, 5.0),
    "stop_coordinator": (1.0, 5.0),
    "partition": (2.0, 6.0),
    "partition_replica": (2.0, 6.0),
    "partition_coordinator": (2.0, 6.0),
    "map_full": (2.0, 5.0),
    "corrupt": (2.0, 5.0),
    "slow_disk": (3.0, 8.0),
}
_GAP_S = (1.0, 3.0)
_FSYNC_DELAYS_MS = (20, 100, 300, 1000)
# Time set aside per fault for the cluster to become normal again (not scheduled time).
_RECOVERY_ALLOWANCE_S = 5.0
# Quiet time at the start (workload warms up) and the end (everything heals) of a run.
WARMUP_S = 2.0
TAIL_S = 3.0
RECOVERY_TIMEOUT_S = 60.0
_QUARANTINE_WAIT_S = 10.0
# How often a fault carries an overlapping second one (when one fits the bounds).
OVERLAP_PROBABILITY = 0.3
# Kinds that may carry an overlap (first fault) and kinds that may be one (second):
# each heals by itself; corrupt (its repair restarts the node and unquarantines it) and a
# gateway kill stay alone. A partition is never the second: healing it deletes every
# blackhole route, the first's too.
OVERLAP_FIRST = (
    "kill",
    "pause",
    "stop",
    *PROCESS_FAULTS,
    "partition",
    "map_full",
    "slow_disk",
)
OVERLAP_SECOND = (
    "kill",
    "pause",
    "stop",
    *(kind for kind, (action, _) in PROCESS_FAULTS.items() if action != "partition"),
)
# Kinds that take a whole node out (both processes, or all its links).
WHOLE_NODE = ("kill", "pause", "stop", "partition", "corrupt")
# The second fault starts this share of the first's hold in, at most.
_OVERLAP_START_SHARE = 0.6
_OVERLAP_HOLD_S_MIN = 0.5
# The chance a single-process fault is aimed at the master (else at a seeded node).
_AT_MASTER_PROBABILITY = 0.5


@dataclass(frozen=True)
class FaultSpec:
    """One scheduled fault."""

    kind: str
    targets: tuple[str, ...]
    gap_s: float  # quiet time before it starts
    hold_s: float  # how long it lasts
    variant: str = ""  # kill: node | gateway; partition: isolate | split
    param: int = 0  # slow_disk: fsync delay ms; corrupt: the record choice
    # "" (targets fixed), "master" or "slave": the target resolved when the fault starts.
    role: str = ""
    pick: int = 0  # role "slave": which of the candidates (index modulo their number)
    # A second fault started overlap.gap_s into this one's hold, healed before this one.
    overlap: FaultSpec | None = None

    def describe(
        self,
        targets: tuple[str, ...] | list[str] | None = None,
        overlap_targets: list[str] | None = None,
    ) -> str:
        """What the fault is; targets (as resolved) replace a role's placeholder."""
        named = ",".join(targets) if targets else ",".join(self.targets) or f"<{self.role}>"
        if targets and self.role:
            named += f" (the {self.role})"
        text = f"{self.kind} {named} for {self.hold_s:.1f}s"
        if self.variant:
            text += f" ({self.variant})"
        if self.kind == "slow_disk":
            text += f" fsync +{self.param} ms"
        if self.overlap is not None:
            second = self.overlap.describe(overlap_targets)
            text += f", overlapped {self.overlap.gap_s:.1f}s in by {second}"
        return text

    @property
    def nodes_hit(self) -> int:
        """How many nodes the fault touches (0 for a gateway kill)."""
        if self.variant == "gateway":
            return 0
        return len(self.targets) if self.targets else 1

    @property
    def nodes_out(self) -> int:
        """How many nodes it takes wholly out (both processes or all links)."""
        return self.nodes_hit if self.kind in WHOLE_NODE else 0


def schedule(
    seed: int,
    duration_s: float,
    node_ids: list[str],
    gateway_ids: list[str],
    kinds: list[str],
    overlap_probability: float = OVERLAP_PROBABILITY,
) -> list[FaultSpec]:
    """The run's faults, in order; the same arguments always give the same list."""
    usable = [kind for kind in kinds if kind in _HOLD_S]
    if not usable:
        return []
    rng = random.Random(seed)
    specs: list[FaultSpec] = []
    elapsed = WARMUP_S
    # Bounded: every fault takes at least _GAP_S[0] + _RECOVERY_ALLOWANCE_S seconds.
    while True:
        kind = rng.choice(usable)
        gap = round(rng.uniform(*_GAP_S), 3)
        hold = round(rng.uniform(*_HOLD_S[kind]), 3)
        variant, param, role = "", 0, ""
        node = rng.choice(node_ids)
        targets: tuple[str, ...] = (node,)
        if kind in PROCESS_FAULTS and rng.random() < _AT_MASTER_PROBABILITY:
            role, targets = "master", ()
        if kind == "kill":
            variant = "gateway" if rng.random() < 0.25 else "node"
            if variant == "gateway":
                targets = (rng.choice(gateway_ids),)
        elif kind == "partition":
            variant = "split" if len(node_ids) >= 5 and rng.random() < 0.5 else "isolate"
            if variant == "split":
                targets = tuple(sorted(rng.sample(node_ids, (len(node_ids) - 1) // 2)))
        elif kind == "slow_disk":
            param = rng.choice(_FSYNC_DELAYS_MS)
        elif kind == "corrupt":
            param = rng.randrange(1 << 30)
        spec = FaultSpec(kind, targets, gap, hold, variant, param, role)
        if rng.random() < overlap_probability:
            spec = _with_overlap(rng, spec, len(node_ids), usable)
        elapsed += gap + hold + _RECOVERY_ALLOWANCE_S
        if elapsed > duration_s - TAIL_S:
            return specs
        specs.append(spec)


def _with_overlap(rng: random.Random, first: FaultSpec, nodes: int, usable: list[str]) -> FaultSpec:
    """first with a seeded second fault, if one fits the bounds (module docstring)."""
    if first.kind not in OVERLAP_FIRST or first.variant == "gateway":
        return first
    minority = (nodes - 1) // 2
    candidates = [
        kind
        for kind in usable
        if kind in OVERLAP_SECOND
        and first.nodes_hit + 1 <= nodes - 1
        and first.nodes_out + (1 if kind in WHOLE_NODE else 0) <= minority
    ]
    if not candidates:
        return first
    kind = rng.choice(candidates)
    delay = round(rng.uniform(0.1, _OVERLAP_START_SHARE * first.hold_s), 3)
    room = max(_OVERLAP_HOLD_S_MIN, first.hold_s - delay)
    hold = round(min(rng.uniform(*_HOLD_S[kind]), room), 3)
    role = rng.choice(("master", "slave"))
    second = FaultSpec(
        kind,
        (),
        delay,
        hold,
        "node" if kind == "kill" else "",
        role=role,
        pick=rng.randrange(1 << 16),
    )
    return replace(first, overlap=second)


def overlap_fits(first: FaultSpec, nodes: int) -> bool:
    """Whether a fault and its overlap keep within the bounds (module docstring)."""
    second = first.overlap
    if second is None:
        return True
    return (
        first.kind in OVERLAP_FIRST
        and second.kind in OVERLAP_SECOND
        and second.overlap is None
        and first.nodes_hit + second.nodes_hit <= nodes - 1
        and first.nodes_out + second.nodes_out <= (nodes - 1) // 2
        # (rounded to ms: a few ms over the first's hold is the rounding)
        and second.gap_s + second.hold_s
        <= max(first.hold_s, second.gap_s + _OVERLAP_HOLD_S_MIN) + 0.01
    )


@dataclass
class FaultOutcome:
    """What happened when one fault was played."""

    spec: FaultSpec
    detail: str = ""
    # The nodes (or gateway) it hit, a role resolved.
    targets: list[str] = field(default_factory=list)
    overlap_targets: list[str] = field(default_factory=list)
    recovered: bool = False
    recovery_s: float = 0.0
    problem: str = ""

    def describe(self) -> str:
        """What the fault was, a role's target resolved once it started."""
        return self.spec.describe(self.targets or None, self.overlap_targets or None)


@dataclass
class FaultRunner:
    """Plays a schedule against a cluster (see the module docstring)."""

    cluster: ChaosCluster
    history: HistoryWriter
    outcomes: list[FaultOutcome] = field(default_factory=list)
    # What a fault showed Squall doing wrong (the run fails on any).
    findings: list[str] = field(default_factory=list)
    _damaged: int = 0
    _damage: Damage | None = None

    async def run(self, specs: list[FaultSpec], deadline: float) -> None:
        """Plays specs until they are done or the next would not end before deadline
        (time.monotonic()); raises ClusterError if the cluster does not recover."""
        for spec in specs:
            if time.monotonic() + spec.gap_s + spec.hold_s + TAIL_S > deadline:
                return
            await asyncio.sleep(spec.gap_s)
            outcome = FaultOutcome(spec)
            self.outcomes.append(outcome)
            await self.play(spec, outcome)
            if outcome.problem:
                # A fault not cleanly ended may leave a second node faulty with the next.
                raise ClusterError(outcome.problem)
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.cluster.wait_normal, RECOVERY_TIMEOUT_S)
            except ClusterError as exc:
                outcome.problem = f"after {outcome.describe()}: {exc}"
                raise ClusterError(outcome.problem) from None
            outcome.recovered = True
            outcome.recovery_s = time.monotonic() - started

    async def play(
        self, spec: FaultSpec, outcome: FaultOutcome, exclude: tuple[str, ...] = ()
    ) -> None:
        """Starts the fault (and its overlap, in a task), holds it, heals it; the end
        record is written whatever happened (a failed injection or heal is in its
        detail). exclude: nodes a role must not resolve to (the first fault's)."""
        targets = await asyncio.to_thread(self.resolve, spec, exclude)
        outcome.targets = targets
        self.history.fault(spec.kind, "start", targets, spec.describe(targets))
        end_detail = ""
        second: asyncio.Task[FaultOutcome] | None = None
        try:
            start_note = await asyncio.to_thread(self._start, spec, targets)
            if start_note:
                outcome.detail = start_note
            if spec.overlap is not None:
                second = asyncio.create_task(self._overlap(spec.overlap, tuple(targets)))
            await asyncio.sleep(spec.hold_s)
        except Exception as exc:
            outcome.problem = f"{spec.describe(targets)}: injecting failed: {exc}"
            end_detail = outcome.problem + "; "
        finally:
            if second is not None:
                # Healed before this one: the second never outlives the first.
                overlapped = await second
                outcome.overlap_targets = overlapped.targets
                outcome.detail = "; ".join(
                    x for x in (outcome.detail, f"overlap: {overlapped.detail}") if x
                )
                outcome.problem = outcome.problem or overlapped.problem
            try:
                end_detail += await asyncio.to_thread(self._end, spec, targets)
            except Exception as exc:
                outcome.problem = f"{spec.describe(targets)}: healing failed: {exc}"
                end_detail += outcome.problem
                await asyncio.to_thread(self.heal_all)
            outcome.detail = "; ".join(x for x in (outcome.detail, end_detail) if x)
            self.history.fault(spec.kind, "end", targets, end_detail)

    async def _overlap(self, spec: FaultSpec, exclude: tuple[str, ...]) -> FaultOutcome:
        """Plays a fault's overlap: its gap into the first fault's hold, then the fault."""
        outcome = FaultOutcome(spec)
        await asyncio.sleep(spec.gap_s)
        await self.play(spec, outcome, exclude)
        return outcome

    def resolve(self, spec: FaultSpec, exclude: tuple[str, ...] = ()) -> list[str]:
        """The fault's targets: fixed by the schedule, or its role's node now (the master
        if it is not excluded, else a slave; a slave chosen by the spec's pick)."""
        if not spec.role:
            return list(spec.targets)
        free = [n for n in self.cluster.node_ids if n not in exclude]
        master = self.cluster.master()
        if spec.role == "master" and master in free:
            return [master]
        slaves = [n for n in free if n != master] or free
        return [slaves[spec.pick % len(slaves)]]

    # --- injection and healing (threads: they block on processes)

    def _start(self, spec: FaultSpec, targets: list[str]) -> str:
        cluster, target = self.cluster, targets[0]
        if spec.kind in PROCESS_FAULTS:
            action, process = PROCESS_FAULTS[spec.kind]
            if action == "kill":
                cluster.kill_process(process, target)
            elif action == "stop":
                cluster.stop_process(process, target)
            elif action == "pause":
                cluster.pause_process(process, target)
            elif cluster.topology is None:
                raise ClusterError(f"{spec.kind} needs network namespaces")
            else:
                cluster.topology.partition_process(target, process)
        elif spec.kind == "kill":
            if spec.variant == "gateway":
                cluster.kill_gateway(target)
            else:
                cluster.kill_node(target)
        elif spec.kind == "pause":
            cluster.pause_node(target)
        elif spec.kind == "stop":
            cluster.stop_node(target)
        elif spec.kind == "partition":
            if cluster.topology is None:
                raise ClusterError("partition needs network namespaces")
            minority = list(targets)
            majority = [n for n in cluster.node_ids if n not in minority]
            cluster.topology.partition([minority, majority])
        elif spec.kind == "map_full":
            cluster.set_fault_control(target, map_full=True)
        elif spec.kind == "slow_disk":
            cluster.set_fault_control(target, fsync_delay_ms=spec.param)
        elif spec.kind == "corrupt":
            cluster.stop_node(target)
            damage = flip_event_byte(cluster.data_dir(target), random.Random(spec.param))
            cluster.start_node(target)
            self._damage = damage
            return damage.note
        else:
            raise ValueError(f"no fault kind {spec.kind!r}")
        return ""

    def _end(self, spec: FaultSpec, targets: list[str]) -> str:
        cluster, target = self.cluster, targets[0]
        if spec.kind in PROCESS_FAULTS:
            action, process = PROCESS_FAULTS[spec.kind]
            if action in ("kill", "stop"):
                cluster.start_process(process, target)
                return f"{process} restarted"
            if action == "partition":
                if cluster.topology is not None:
                    cluster.topology.heal()
                return f"{process} links healed"
            cluster.resume_process(process, target)
            return f"{process} resumed"
        if spec.kind == "kill":
            if spec.variant == "gateway":
                cluster.start_gateway(target)
            else:
                cluster.start_node(target)
            return "restarted"
        if spec.kind == "stop":
            cluster.start_node(target)
            return "restarted"
        if spec.kind == "pause":
            cluster.resume_node(target)
            return "resumed"
        if spec.kind == "partition":
            if cluster.topology is not None:
                cluster.topology.heal()
            return "healed"
        if spec.kind in ("map_full", "slow_disk"):
            cluster.set_fault_control(target)
            return "cleared"
        if spec.kind == "corrupt":
            return self._repair(target)
        raise ValueError(f"no fault kind {spec.kind!r}")

    def _repair(self, node_id: str) -> str:
        """Moves a damaged store aside, restarts the node empty and clears its quarantine;
        says whether the node had noticed the damage (quarantined itself)."""
        cluster = self.cluster
        damage, self._damage = self._damage, None
        seen = "nothing damaged"
        if damage is not None and damage.topic:
            # A reader of the damaged record, served by this node: it must get DATA_LOSS,
            # and the node must quarantine itself.
            code, served = read_event(
                cluster.config.node(node_id).replica_address, damage.topic, damage.offset
            )
            seen = f"a read of {damage.topic}@{damage.offset} from {node_id} got {code}; "
            if code == "DATA_LOSS":
                quarantined = self._wait_quarantined(node_id)
                seen += (
                    "the node quarantined itself" if quarantined else "the node was NOT quarantined"
                )
                right = quarantined
            else:
                data = (cluster.data_dir(node_id) / "data.mdb").read_bytes()
                why, right = judge_undetected(code, served, damage, damage.damaged in data)
                seen += why
            if not right:
                self.findings.append(f"corrupt {node_id}: {seen}")
        cluster.stop_node(node_id)
        self._damaged += 1
        aside = cluster.run_dir / "damaged" / f"{node_id}-{self._damaged}"
        aside.mkdir(parents=True, exist_ok=True)
        data_dir = cluster.data_dir(node_id)
        for name in ("data.mdb", "lock.mdb", "replica-fault.json"):
            if (data_dir / name).exists():
                shutil.move(str(data_dir / name), str(aside / name))
        cluster.start_node(node_id)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "squall_server",
                "cluster",
                "unquarantine",
                node_id,
                "--config",
                str(cluster.config_path),
                "--reason",
                "chaos: store rebuilt",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise ClusterError(f"unquarantine {node_id} failed: {result.stdout}{result.stderr}")
        return f"{seen}; store moved to {aside}, node restarted empty, unquarantined"

    def _wait_quarantined(self, node_id: str) -> bool:
        """Whether the node's coordinator reports it quarantined within _QUARANTINE_WAIT_S."""
        deadline = time.monotonic() + _QUARANTINE_WAIT_S
        # Bounded by the deadline: one status call per pass.
        while time.monotonic() < deadline:
            status = self.cluster.coordinator_status(node_id)
            if status is not None and status.HasField("quarantine"):
                return True
            time.sleep(0.1)
        return False

    def heal_all(self) -> None:
        """Ends every fault whatever state it is in: resume paused nodes, delete blackhole
        routes, clear fault controls, start anything not running. Best effort."""
        cluster = self.cluster
        for kind, node_id in list(cluster.paused):
            cluster.resume_process(kind, node_id)
        if cluster.topology is not None and cluster.topology.partitioned:
            cluster.topology.heal()
        for node_id in cluster.node_ids:
            cluster.set_fault_control(node_id)
            for kind in NODE_PROCESSES:
                if not cluster.running(kind, node_id):
                    cluster.start_process(kind, node_id)
        for gateway_id in GATEWAY_IDS:
            if not cluster.running("gateway", gateway_id):
                cluster.start_gateway(gateway_id)


@dataclass(frozen=True)
class Damage:
    """What flip_event_byte did: the damaged event (topic "" if none) and a description;
    the event as it was stored, and the damaged record's bytes as they are now."""

    topic: str
    offset: int
    note: str
    original: common_pb2.Event | None = None
    damaged: bytes = b""


def judge_undetected(
    code: str, served: common_pb2.Event | None, damage: Damage, still_stored: bool
) -> tuple[str, bool]:
    """What a read of the damaged event that did not end in DATA_LOSS means, and whether
    Squall was right.

    Right only when the damage is gone: a node that truncates its log on rejoining (a
    deposed master's uncommitted suffix) rebuilds its store from its own log, which the
    flip did not touch, so the record is whole again and the event is served intact.
    """
    if code != "OK":
        return f"the read failed with {code}, not DATA_LOSS", False
    if served is None:
        return "the read got OK but did not serve the event", False
    if served != damage.original:
        return "the node served the event ALTERED", False
    if still_stored:
        return "the damaged record is still in the store and was NOT detected", False
    return (
        "the event intact: the damaged record is gone from the store (rebuilt from its "
        "log since the flip, by a truncation or a snapshot on rejoining)",
        True,
    )


def _served_end(hidden: int | None, next_offset: int) -> int:
    """A topic's end as committed reads serve it (hidden None: nothing hidden)."""
    return next_offset if hidden is None else hidden


def _served(key: tuple[int, int], served_end: dict[int, int]) -> bool:
    """Whether the event at (topic id, offset) is below its topic's served end."""
    topic_id, offset = key
    return offset < served_end.get(topic_id, 0)


def flip_event_byte(data_dir: Path, rng: random.Random) -> Damage:
    """Flips one byte inside the body of one stored event record (not its checksum) of a
    stopped node's store; returns what it did. The record is read with LMDB's own reader
    and then found by its bytes in the data file (every copy of it, as LMDB may keep an
    older page holding the same record)."""
    kv = LmdbKV(data_dir, DATABASES, map_size_bytes=0, readonly=True, lock=False)
    try:
        with kv.read() as txn:
            records = list(txn.scan(DB_EVENTS))
    finally:
        kv.close()
    store = Store.open_lmdb(data_dir, 0, readonly=True, lock=False)
    try:
        topics = store.list_topics()
        names = {info.topic_id: info.name for info in topics}
        # Only events the node serves: a reader must reach the damaged record.
        gate = gate_from_store(store)
        served_end = {
            info.topic_id: _served_end(gate.hidden_from(info.name), info.next_offset)
            for info in topics
        }
        records = [
            (key, value) for key, value in records if _served(struct.unpack(">QQ", key), served_end)
        ]
        if not records:
            return Damage("", 0, "no committed event stored yet: nothing to corrupt")
        key, value = rng.choice(records)
        topic_id, offset = struct.unpack(">QQ", key)
        topic = names.get(topic_id, "")
        [original] = store.read_events(topic, offset, 1)
    finally:
        store.close()
    # Past the 4-byte CRC: the checksum must be what no longer matches.
    position = 4 + rng.randrange(max(1, len(value) - 4))
    data_path = data_dir / "data.mdb"
    data = bytearray(data_path.read_bytes())
    copies = 0
    start = data.find(value)
    # Bounded by the file's length: each find starts past the last one.
    while start >= 0:
        data[start + position] ^= 0xFF
        copies += 1
        start = data.find(value, start + len(value))
    damaged = bytearray(value)
    damaged[position] ^= 0xFF
    if not copies:
        return Damage("", 0, f"event record {key.hex()} not found in {data_path}: nothing done")
    data_path.write_bytes(bytes(data))
    return Damage(
        topic,
        offset,
        f"flipped byte {position} of the record of event {topic}@{offset} ({copies} copies "
        "in the file)",
        original,
        bytes(damaged),
    )


def read_event(address: str, topic: str, offset: int) -> tuple[str, common_pb2.Event | None]:
    """Reads one event from a replica (a reader of the damaged record); returns the status
    code name it ended with ("OK" if the read succeeded) and the event it served, if any."""
    request = broker_pb2.SubscribeRequest(
        topic=topic,
        start=broker_pb2.START_POSITION_OFFSET,
        offset=offset,
        end_offset=offset + 1,
        follow=False,
    )
    served: common_pb2.Event | None = None
    with grpc.insecure_channel(address) as channel:
        try:
            for response in broker_pb2_grpc.SubscriberStub(channel).Subscribe(request, timeout=5):
                served = next((e for e in response.events if e.offset == offset), served)
        except grpc.RpcError as exc:
            return str(exc.code().name), None
    return "OK", served
