"""Seeded simulator of three shipped ``ReplicaNode``s: the whole async shell under faults.

Where ``replication_sim.py`` runs the replica's synchronous driver and cores and carries
their messages itself, this runs the shells as they ship: ``ReplicaNode`` (writer queue,
group commit, role taking with its reorganization fetch (``TakingMaster._sync_from``),
slave servicer path, lease watch, fail-stop), ``MasterDriver`` (streams, reconnection backoff, stall
detection, snapshots) and the servicers' logic (``replication_server``), over
``shell_network.py`` (the replica transport's simulated twin) on a deterministic virtual
event loop (``virtual_loop.py``): virtual time, the injected ``Clock`` reads it
(``LoopClock``), the store thread is a ``SimExecutor`` (``ReplicaNode(io=...)``), every
store a real ``Store`` over ``MemoryKV``. One seed decides everything (``random.Random``).

Role commands come from a small seeded role-assignment script (``RoleScript``), not the
shipped coordinator: it follows the coordinator's rules (one master per epoch, epochs
increase past every epoch a replica has seen, a group is a connected majority of healthy
replicas, stopped before their positions are read, the sync source is the member with
the highest ``(last_epoch, last_lsn)`` as ``election.pick_sync_source`` picks it,
leases renewed every ``RENEW_S`` only to members connected to the master, a new epoch
when the master stops serving or a healthy node is outside the group). The master is the
sync source or, in a quarter of elections, another member (so reorganization fetches
run). Coordinator faults are not modelled here: ``coordinated_sim.py`` runs this harness
with the shipped coordinator in place of the script (``_start_roles``, ``_heal_roles``,
``_inject`` and ``_truncator`` are its hooks).

Faults, during a safety phase of ``FAULT_PHASE_S``: links cut one way or both (held
messages, then a keepalive break), connection resets, replica process crashes (the
process and its store thread vanish mid-step; the store keeps what it committed, and in
seeds whose replicas flush every write, half the crashes are machine crashes,
``MemoryKV.lose_unsynced``) and restarts, pauses, a slow disk (store-thread jobs take up
to ``SLOW_DISK_S``) and a failing disk (every write transaction raises, so the replica
fail-stops or refuses as in production; the operator clears the fault at its restart).
Then everything heals, crashed nodes restart, and liveness is checked.

Snapshots: half the seeds keep a short log (``limits.log_retention_entries`` from
``SHORT_LOG_RETENTIONS``, the commit batch no larger, as the configuration requires), so
masters and slaves compact and a slave behind the retained log gets a snapshot; in every
seed a divergent slave gets one too (these stores cannot truncate). Chunks hold a seeded
number of records (``SNAPSHOT_CHUNK_RECORDS``), 2 or 16 in two seeds of three, so an
install spans many chunks and faults cut some short. ``Stats`` counts the installs begun
and finished (``CountingStore``); the others were cut short.

Clients publish through ``ReplicaNode.start_publish`` on whichever node they believe is
master, every third time a joined request of ``JOINED_PARTS`` parts
(``start_publish_parts``), and every third time as a write that rides with the master's
next commit batch (``ReplicaNode.write_with_next``, as a push subscriber's cursor goes:
with another client's publish, or alone after ``RIDE_S``), each payload unique; a receipt
is an acknowledgement (of a part, alone). A joined request is one ``PublishPartsOp``
entry while every node of the node set says it reads them; in ``OLDER_MEMBER_SHARE`` of
the seeds one node plays a release that predates them (its Position never says
``reads_joined_publishes``), so every master stores each part as an entry of its own:
that node reads every epoch's entries when it catches up, in the group or out of it.

Checks: at most one master per epoch (sampled and from the logs' epoch-start entries);
after healing a master serves and a publish is acknowledged within ``LIVENESS_S``; then
every live replica catches up and the logs are identical, every acknowledged event is
in every log and readable at its receipt's offset, and no joined entry was written while
a node of the older release was in the cluster. A failure raises ``ShellSimFailure``
whose message ends with the command that replays the seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import random
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, load_config
from squall_server.common.errors import ServiceError
from squall_server.replica import commands, slave_side, snapshot_pump
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.divergence import BoundaryLike
from squall_server.replica.faults import FAULT_FILE_NAME
from squall_server.replica.node import ReplicaNode
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.store import DATABASES, Store
from squall_server.replica.store.kv import KV, KVError, ReadTxn, WriteTxn
from squall_server.replica.store.kv_memory import MemoryKV
from tests.sim.shell_network import ShellNetwork
from tests.sim.virtual_loop import Every, LoopClock, SimExecutor, VirtualLoop

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
NODE_IDS = ("n1", "n2", "n3")
TOPIC = "orders"
CLUSTER_ID = "c-shell-sim"
FAULT_PHASE_S = 12.0  # simulated seconds of faults
# The share of "quiet" fault draws that flip a byte of a log record instead (one node).
ROT_SHARE = 0.3
ROT_NEWEST = 16  # the rot hits one of a log's newest records
LIVENESS_S = 20.0  # after healing: a master serves and a publish is acknowledged by then
CATCH_UP_S = 20.0  # then every replica holds the master's log by then
RENEW_S = 0.2  # the role script's tick (lease renewal, election)
LEASE_MS = 1200  # the lease each role command gives
TAKE_GRACE_S = 4.0  # a master not serving this long after its command: elect again
BREAK_AFTER_S = 1.0  # a cut held this long breaks the call (gRPC keepalive)
SLOW_DISK_S = 0.8  # the longest store-thread job of a slow disk
PUBLISH_WAIT_S = 3.0  # a client gives up on a publish after this long
JOINED_PARTS = 3  # parts of a client's joined publish (every third publish)
RIDE_S = 0.05  # a riding publish's longest wait for a batch to ride with (push.py's)
SAMPLE_S = 0.01  # how often the one-master-per-epoch check samples roles
NETWORK_TICK_S = 0.1  # how often the network fails calls a cut held too long
# A share of the seeds keep a short log (``limits.log_retention_entries`` drawn from
# SHORT_LOG_RETENTIONS): masters and slaves compact, and a slave behind the retained log
# or holding a divergent suffix above a compacted start gets a snapshot.
SHORT_LOG_SHARE = 0.5
OLDER_MEMBER_SHARE = 0.25  # seeds with a member of a release before PublishPartsOp
SHORT_LOG_RETENTIONS = (4, 16, 64)
# Records per snapshot chunk, drawn per seed (``snapshot_pump.SNAPSHOT_RECORDS_MAX``, never
# raised): a few records make an install span many chunks, store transactions and
# messages, for a crash, a cut or a newer master to come between.
SNAPSHOT_CHUNK_RECORDS = (2, 16, snapshot_pump.SNAPSHOT_RECORDS_MAX)

log = logging.getLogger("squall.sim.shell")


class ShellSimFailure(AssertionError):
    """A check failed; the message ends with the command that replays the seed."""


def replay_command(seed: int) -> str:
    """The command that replays one seed."""
    return f"SEED={seed} .venv/bin/pytest -q -p no:cacheprovider tests/sim/test_shell_sim.py"


class Disk:
    """One node's disk: the MemoryKV that outlives processes, and its injected faults."""

    def __init__(self) -> None:
        self.kv = MemoryKV(DATABASES, keep_unsynced=True)
        self.failing = False  # every write transaction raises (EIO)
        self.slow = False  # store-thread jobs take up to SLOW_DISK_S


class ProcessKV:
    """One process's handle on its disk: fails writes while the disk fails, and every
    call once the process is gone (a dead process must not touch the store again)."""

    def __init__(self, disk: Disk) -> None:
        self._disk = disk
        self.dead = False

    def _check(self) -> None:
        if self.dead:
            raise KVError("the process is gone")

    def read(self) -> AbstractContextManager[ReadTxn]:
        self._check()
        return self._disk.kv.read()

    def snapshot(self) -> AbstractContextManager[ReadTxn]:
        self._check()
        return self._disk.kv.snapshot()

    @contextmanager
    def write(self, *, sync: bool) -> Iterator[WriteTxn]:
        self._check()
        if self._disk.failing:
            raise KVError("injected disk failure: EIO")
        with self._disk.kv.write(sync=sync) as txn:
            yield txn

    def sync(self) -> None:
        self._check()
        if self._disk.failing:
            raise KVError("injected disk failure: EIO on fsync")
        self._disk.kv.sync()

    def size_bytes(self) -> int:
        return self._disk.kv.size_bytes()

    def close(self) -> None:
        self.dead = True


@dataclass
class Member:
    """One node: its disk, and its running incarnation (None while down)."""

    node_id: str
    disk: Disk
    data_dir: Path
    incarnation: int = 0
    replica: ReplicaNode | None = None
    kv: ProcessKV | None = None
    io: SimExecutor | None = None
    paused: bool = False
    seq: int = 0
    # The config file its processes start from (None: the simulator's): a replacing
    # machine's is the running node set as `squall cluster config export` writes it.
    config: ClusterConfig | None = None

    @property
    def process(self) -> str:
        return f"{self.node_id}.{self.incarnation}"


@dataclass
class Acked:
    payload: bytes
    receipt: common_pb2.BatchReceipt


@dataclass
class Stats:
    acked: int = 0
    failed_publishes: int = 0
    elections: int = 0
    crashes: int = 0
    disk_failures: int = 0
    # Log records of one node's disk flipped (bit rot), and the faults it reported on
    # meeting one: its stream to a slave, a fetch it served, a read.
    rotten_records: int = 0
    rot_faults: int = 0
    fail_stops: int = 0
    replacements: int = 0  # coordinated_sim: machines gone for good and replaced
    removals: int = 0  # coordinated_sim: nodes removed, their machines wiped, added back
    shutdowns: int = 0  # coordinated_sim: cluster shutdowns run (finished or abandoned)
    # coordinated_sim: shutdowns interrupted before they stopped anything, which thawed
    # every replica they froze; and replicas whose freeze lapsed by itself by the heal
    # (its command died)
    shutdowns_interrupted: int = 0
    freezes_lapsed: int = 0
    hand_offs: int = 0  # coordinated_sim: hand-offs a master's replica got ready for
    # Snapshot installs (a slave's, or a new master's reorganization fetch): begun (marked
    # pending), finished (swapped in); the others were cut short (a crash, a broken
    # stream, a newer install or an append dropped what they staged).
    snapshots_begun: int = 0
    snapshots_finished: int = 0
    callbacks: int = 0
    sim_s: float = 0.0
    # What disrupted the cluster: every fault, heal and operator action noted (not what
    # the simulation only observed: a master seen, a publish acknowledged).
    disruptions: int = 0
    events: list[str] = field(default_factory=list)

    @property
    def snapshots_cut_short(self) -> int:
        return self.snapshots_begun - self.snapshots_finished


class CountingStore(Store):
    """The shipped store, counting the snapshot installs that begin and finish on it."""

    def __init__(self, kv: KV, stats: Stats) -> None:
        super().__init__(kv)
        self._stats = stats

    def begin_snapshot(self, snapshot_lsn: int, snapshot_epoch: int, *, sync: bool = True) -> None:
        super().begin_snapshot(snapshot_lsn, snapshot_epoch, sync=sync)
        self._stats.snapshots_begun += 1

    def finish_snapshot(
        self,
        history: Iterable[tuple[int, int] | BoundaryLike],
        *,
        sync: bool = True,
        commit_lsn: int = 0,
        uncommitted: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        super().finish_snapshot(history, sync=sync, commit_lsn=commit_lsn, uncommitted=uncommitted)
        self._stats.snapshots_finished += 1


class ShellSim:
    """One seed's run (``run``)."""

    # Whether the seed may keep a short log (a scripted schedule keeps the shipped one).
    short_logs = True

    def __init__(
        self,
        seed: int,
        root: Path,
        *,
        acks: common_pb2.AckPolicy.ValueType = common_pb2.ACK_POLICY_MAJORITY,
    ) -> None:
        """acks: the ack policy (a test plants ACK_POLICY_NONE, which the checks must catch)."""
        self.seed = seed
        self.rng = random.Random(seed)
        self.loop = VirtualLoop()
        self.loop.set_exception_handler(self._loop_error)
        self.clock = LoopClock(self.loop)
        rng = self.rng
        self.replica_sync = rng.choice(
            [common_pb2.SYNC_POLICY_WRITE_NO_SYNC, common_pb2.SYNC_POLICY_SYNC]
        )
        base = load_config(CONFIG)
        # Its own stream: the seed's other draws stay as they were before it.
        log_rng = random.Random(seed * 15_485_863 + 7)
        retention = base.limits.log_retention_entries
        if log_rng.random() < SHORT_LOG_SHARE and self.short_logs:
            retention = log_rng.choice(SHORT_LOG_RETENTIONS)
        self.log_retention = retention
        self.snapshot_records = log_rng.choice(SNAPSHOT_CHUNK_RECORDS)
        older_rng = random.Random(seed * 7_919 + 11)
        self.older = older_rng.choice(NODE_IDS) if older_rng.random() < OLDER_MEMBER_SHARE else ""
        self.members = {node_id: Member(node_id, Disk(), root / node_id) for node_id in NODE_IDS}
        for member in self.members.values():
            member.data_dir.mkdir(parents=True, exist_ok=True)
        self.config: ClusterConfig = dataclasses.replace(
            base,
            nodes=tuple(
                dataclasses.replace(n, data_dir=self.members[n.id].data_dir) for n in base.nodes
            ),
            durability=dataclasses.replace(
                base.durability, replica_sync=self.replica_sync, acks=acks
            ),
            # The retained log must hold a commit batch (config validation).
            limits=dataclasses.replace(
                base.limits,
                log_retention_entries=retention,
                commit_batch_max_entries=min(base.limits.commit_batch_max_entries, retention),
            ),
        )
        self.config.validate()
        max_delay_s = rng.choice([0.001, 0.005, 0.03])
        self.net = ShellNetwork(
            self.loop, lambda: rng.random() * max_delay_s, break_after_s=BREAK_AFTER_S
        )
        self.epoch = 0
        self.group: list[str] = []
        self.master_id = ""
        self.commanded_at = 0.0
        self.healing = False
        # The publishing clients run until the heal's checks begin (``_client``).
        self.publishing = True
        self.rotten: set[str] = set()  # nodes whose disk holds a flipped log record
        self.quarantined: set[str] = set()  # by the operator (the script's nodes only)
        # A node whose machine is gone for good (coordinated_sim: until the operator's
        # replace-node brings a new one up): nothing restarts it.
        self.gone = ""
        self.acked: list[Acked] = []
        self.masters: dict[int, set[str]] = {}
        self.stats = Stats()
        self.loop_errors: list[str] = []
        self.payloads = 0
        self.script_error: Exception | None = None
        # A check that failed outside the main task (the sampler): ends the run with it.
        self.check_failure: ShellSimFailure | None = None
        self._main_task: asyncio.Task[None] | None = None

    # --- the harness

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "was destroyed but it is pending" in message:
            return  # a killed process's tasks
        exc = context.get("exception")
        if isinstance(exc, RuntimeError) and "generator is already running" in str(exc):
            return  # the finalizer of a generator whose process was killed mid-await
        self.loop_errors.append(f"{message}: {exc!r} in {context.get('future')!r}")

    def note(self, what: str, *, observed: bool = False) -> None:
        """Records an event for the failure report; ``observed``: only seen, not done to
        the cluster (not a disruption)."""
        self.stats.events.append(f"{self.loop.time():8.3f} {what}")
        if not observed:
            self.stats.disruptions += 1

    def fail(self, what: str) -> ShellSimFailure:
        tail = "\n".join(self.stats.events[-40:])
        return ShellSimFailure(
            f"seed {self.seed}: {what}\n{self.setup()}\nlast events:\n{tail}\n"
            f"replay: {replay_command(self.seed)}"
        )

    def setup(self) -> str:
        """The seed's drawn settings that a failure report names."""
        return (
            f"log retention {self.log_retention} entries, snapshot chunks of "
            f"{self.snapshot_records} records, {self.stats.snapshots_begun} installs begun, "
            f"{self.stats.snapshots_finished} finished"
            + (f", {self.older} of an older release" if self.older else "")
        )

    def run(self) -> Stats:
        self._main_task = self.loop.create_task(self._main())
        # The seed's chunk size for the run (a test that lowered it keeps its own).
        shipped_records = snapshot_pump.SNAPSHOT_RECORDS_MAX
        snapshot_pump.SNAPSHOT_RECORDS_MAX = min(shipped_records, self.snapshot_records)
        try:
            try:
                self.loop.run_until_complete(self._main_task)
            except asyncio.CancelledError:
                if self.check_failure is None:
                    raise
            if self.check_failure is not None:
                raise self.check_failure
        finally:
            snapshot_pump.SNAPSHOT_RECORDS_MAX = shipped_records
            self.stats.callbacks = self.loop.callbacks_run
            self.stats.sim_s = self.loop.time()
            self.loop.wind_down()
            self.loop.close()
            for batch in list(slave_side._BATCHES):
                if batch.get_loop() is self.loop:
                    slave_side._BATCHES.discard(batch)
        return self.stats

    async def _main(self) -> None:
        for member in self.members.values():
            await self._start(member)
        tasks = self._start_roles()
        observers = [
            Every(self.loop, NETWORK_TICK_S, self.net.tick),
            Every(self.loop, SAMPLE_S, self._sample_masters, first_s=0),
        ]
        clients = [self.loop.create_task(self._client(i)) for i in range(2)]
        await self._faults()
        # Heal everything: links, disks, pauses; crashed nodes restart.
        self.healing = True
        await self._before_heal()
        self.note("heal")
        self.net.heal()
        for member in self.members.values():
            member.disk.failing = False
            member.disk.slow = False
            if member.paused:
                self._resume(member)
            if member.node_id == self.gone:
                continue  # the operator replaces it (_heal_roles)
            if member.replica is None or member.replica.failed_reason:
                await self._restart(member)
        # A disk that rotted is replaced as the operator's procedure says
        # (docs/operations.md, *Quarantine*): its node is quarantined, the others run on
        # and hold every committed entry, then its store is moved aside and it rejoins.
        for node_id in sorted(self.rotten):
            self._quarantine(node_id)
        await self._heal_roles()
        healed_at = self.loop.time()
        await self._liveness(healed_at)
        self.publishing = False
        for task in clients:
            task.cancel()
        await self._catch_up(without=self.rotten)
        await self._replace_rotten_disks()
        await self._catch_up()
        for task in tasks:
            task.cancel()
        for observer in observers:
            observer.cancel()
        self._check_logs()
        await self._after_checks()
        self._check_churn()
        if self.loop_errors:
            raise self.fail(f"unexpected errors on the loop: {self.loop_errors[:3]}")

    async def _before_heal(self) -> None:
        """What a subclass waits for before the heal (coordinated_sim: an operator's
        command still running)."""

    async def _after_checks(self) -> None:
        """What a subclass runs on the healed, checked cluster (coordinated_sim: a cluster
        shutdown and restart)."""

    def _check_churn(self) -> None:
        """What a subclass checks of the run as a whole (coordinated_sim: master epochs
        grow with what disrupted the cluster, not with time)."""

    # --- processes

    async def _start(self, member: Member) -> None:
        member.incarnation += 1
        disk = member.disk
        member.kv = ProcessKV(disk)
        rng = self.rng
        member.io = SimExecutor(
            self.loop,
            member.process,
            lambda: rng.random() * (SLOW_DISK_S if disk.slow else 0.002),
        )
        store = self._store(member.kv)
        config = member.config or self.config
        replica = build_replica_node(
            config,
            config.node(member.node_id),
            store,
            self.clock,
            transport=self.net.transport_for(member.node_id),
            io=member.io,
            truncator=self._truncator(member),
        )
        member.replica = replica
        # A finished cluster shutdown stops the process (services/replica/__main__.py); after
        # the servicer's answer, as the gRPC server's graceful stop lets it out.
        replica.on_shutdown = functools.partial(
            self.loop.call_soon, self._exit_after_shutdown, member, member.process
        )
        if member.node_id == self.older:
            replica.driver.reads_joined_publishes = False
        # A store whose log fails its checksum rebuilding the commit gate starts
        # fail-stopped (reads and roles refused, the fault reported) until the disk is
        # replaced.
        await self.loop.spawn(member.process, replica.start())
        self.net.up(replica, member.process)
        self.note(f"start {member.process}")

    def _store(self, kv: KV) -> Store:
        """A process's store over its disk (counting snapshot installs in the stats)."""
        return CountingStore(kv, self.stats)

    def _truncator(self, member: Member) -> LmdbTruncator | None:
        """None: the replicas refuse a truncation (a slave's log is replaced by a snapshot)."""
        return None

    def _exit_after_shutdown(self, member: Member, process: str) -> None:
        if member.process == process and member.replica is not None:
            self._crash(member, machine=False, why="exit after cluster shutdown")

    def _crash(self, member: Member, *, machine: bool, why: str = "") -> None:
        assert member.replica is not None and member.kv is not None and member.io is not None
        if not why:
            self.stats.crashes += 1
        self.loop.kill(member.process)
        member.io.kill()
        member.kv.dead = True
        self.net.down(member.node_id)
        member.replica = None
        member.paused = False
        lost = member.disk.kv.lose_unsynced() if machine else 0
        if why:
            self.note(f"{why}: {member.process}")
            return
        self.note(f"crash {member.process} ({'machine' if machine else 'process'}, lost {lost})")

    async def _restart(self, member: Member) -> None:
        if member.replica is not None:
            self._crash(member, machine=False)
        # The operator replaced the failing disk's fault report (it was injected).
        (member.data_dir / FAULT_FILE_NAME).unlink(missing_ok=True)
        await self._start(member)

    def _pause(self, member: Member) -> None:
        member.paused = True
        self.loop.pause(member.process)
        self.note(f"pause {member.process}")

    def _resume(self, member: Member) -> None:
        member.paused = False
        self.loop.resume(member.process)
        self.note(f"resume {member.process}")

    # --- faults

    async def _faults(self) -> None:
        rng = self.rng
        end = self.loop.time() + FAULT_PHASE_S
        while self.loop.time() < end:
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            member = self.members[rng.choice(NODE_IDS)]
            if rng.random() < 0.5 and self.master_id:
                member = self.members[self.master_id]  # aim at the master half the time
            await self._inject(member, rng.randrange(self.fault_kinds))

    # Fault kinds _inject draws from (a subclass adds its own above these).
    fault_kinds = 10

    async def _inject(self, member: Member, kind: int) -> None:
        """One fault of kind ``kind`` aimed at ``member``'s replica or its links."""
        rng = self.rng
        others = [n for n in NODE_IDS if n != member.node_id]
        if kind == 0 and member.replica is not None:
            machine = self.replica_sync == common_pb2.SYNC_POLICY_SYNC and rng.random() < 0.5
            self._crash(member, machine=machine)
        elif kind == 1 and (member.replica is None or member.replica.failed_reason):
            await self._restart(member)
        elif kind == 2 and member.replica is not None and not member.paused:
            self._pause(member)
            self.loop.call_later(rng.uniform(0.1, 2.5), self._resume_if, member, member.process)
        elif kind == 3:
            peer = rng.choice(others)
            both = rng.random() < 0.5
            self.net.cut(member.node_id, peer, both=both)
            self.note(f"cut {member.node_id}->{peer}{' both ways' if both else ''}")
        elif kind == 4:
            self.net.heal()
            self.note("heal links")
        elif kind == 5:
            self.net.break_calls(member.node_id)
            self.note(f"reset connections of {member.node_id}")
        elif kind == 6:
            member.disk.slow = not member.disk.slow
            self.note(f"disk of {member.node_id} {'slow' if member.disk.slow else 'fast'}")
        elif kind == 7 and rng.random() < 0.3:
            member.disk.failing = True
            self.stats.disk_failures += 1
            self.note(f"disk of {member.node_id} fails")
            self.loop.call_later(rng.uniform(0.05, 1.0), self._disk_ok, member)
        elif kind == 8:
            for peer in others:  # isolate
                self.net.cut(member.node_id, peer, both=True)
            self.note(f"isolate {member.node_id}")
        elif (
            kind == 9
            and rng.random() < ROT_SHARE
            and self.rotten <= {member.node_id}
            # A lost machine and a rotted copy are two failures; so is a rotted voter while
            # a replacing (or added) machine may still be a learner (the heal's quarantine
            # would leave one voter).
            and not self.gone
            and not self.stats.replacements
            and not self.stats.removals
        ):
            self._rot(member)
        # (kind 9 otherwise: quiet)

    def _rot(self, member: Member) -> None:
        """Flips a byte of one log record on the member's disk, as bit rot would. One node
        per seed rots, so every committed entry keeps a sound copy (acks need a majority);
        the heal replaces its disk, as an operator does for a store that failed a checksum
        (docs/operations.md, *Quarantine*)."""
        records = self.members[member.node_id].disk.kv.dbs["log"].data
        if not records:
            return
        # Among the newest: those a lagging slave or a new master's fetch still needs.
        key = self.rng.choice(sorted(records)[-ROT_NEWEST:])
        value = records[key]
        records[key] = value[:-1] + bytes([value[-1] ^ 0x40])
        self.rotten.add(member.node_id)
        self.stats.rotten_records += 1
        self.note(f"rot: {member.node_id}'s log record LSN {int.from_bytes(key, 'big')}")

    async def _replace_rotten_disks(self) -> None:
        """The operator's repair of a store that failed a checksum: stop the replica, move
        the store aside, start it again empty; it is brought up to date by the master."""
        for node_id in sorted(self.rotten):
            member = self.members[node_id]
            replica = member.replica
            if replica is not None and replica.fault is not None:
                self.stats.rot_faults += 1
            if replica is not None:
                self._crash(member, machine=False)
            member.disk.kv = MemoryKV(DATABASES, keep_unsynced=True)
            self.note(f"{node_id}'s disk replaced (rot)")
            await self._restart(member)
            self._unquarantine(node_id)
        self.rotten.clear()

    def _quarantine(self, node_id: str) -> None:
        """Takes a node out of every group (the script leaves it out)."""
        self.quarantined.add(node_id)
        self.note(f"operator quarantines {node_id}")

    def _unquarantine(self, node_id: str) -> None:
        """Lets a node back in; the script elects anew to take it in."""
        self.quarantined.discard(node_id)
        self.note(f"operator clears {node_id}'s quarantine")

    def _resume_if(self, member: Member, process: str) -> None:
        if member.paused and member.process == process:
            self._resume(member)

    def _disk_ok(self, member: Member) -> None:
        member.disk.failing = False
        self.note(f"disk of {member.node_id} works again")

    # --- the role script (the coordinator's rules)

    def _start_roles(self) -> list[asyncio.Task[None] | Every]:
        """What commands the replicas' roles: here the role script (cancelled at the end)."""
        return [self.loop.create_task(self._role_script())]

    async def _heal_roles(self) -> None:
        """Heals what commands roles (the script has nothing to heal)."""

    def _healthy(self, node_id: str) -> bool:
        member = self.members[node_id]
        replica = member.replica
        return (
            replica is not None
            and not member.paused
            and not replica.failed_reason
            and replica.fault is None
            and node_id not in self.quarantined
        )

    def _connected(self, a: str, b: str) -> bool:
        return (a, b) not in self.net.cuts and (b, a) not in self.net.cuts

    def _position(self, node_id: str) -> tuple[int, int]:
        """(last_epoch, last_lsn) as the replica reports it to its coordinator."""
        replica = self.members[node_id].replica
        assert replica is not None
        meta = replica.store.meta()
        return (meta.last_epoch, meta.last_lsn)

    def _serving(self) -> bool:
        if not self.master_id:
            return False
        replica = self.members[self.master_id].replica
        return (
            replica is not None
            and replica.role == common_pb2.ROLE_MASTER
            and replica.epoch == self.epoch
        )

    def _holds_role(self, node_id: str) -> bool:
        replica = self.members[node_id].replica
        want = common_pb2.ROLE_MASTER if node_id == self.master_id else common_pb2.ROLE_SLAVE
        return replica is not None and replica.role == want and replica.epoch == self.epoch

    async def _role_script(self) -> None:
        while True:
            try:
                await self._role_tick()
            except Exception as exc:
                self.script_error = exc  # the harness's own bug: fail the seed with it
                raise
            await asyncio.sleep(RENEW_S)

    async def _role_tick(self) -> None:
        healthy = [n for n in NODE_IDS if self._healthy(n)]
        master = self.master_id
        if master and master in healthy:
            reach = [n for n in self.group if n in healthy and self._connected(master, n)]
            grow = [n for n in healthy if n not in self.group and self._connected(master, n)]
            taking = self.loop.time() - self.commanded_at < TAKE_GRACE_S
            # A member that lost its role (restarted, lease ran out) rejoins in a new epoch.
            lost = [n for n in reach if not self._holds_role(n)]
            # A quarantined member leaves its group, as the coordinator takes a quarantined
            # node out of every group: kept, it would hold every commit back under acks
            # "all" (seeds 32438, 32452: the rotten node quarantined at the heal).
            left = [n for n in self.group if n in self.quarantined]
            if (
                len(reach) * 2 > len(NODE_IDS)
                and not grow
                and not left
                and (taking or (self._serving() and not lost))
            ):
                for node_id in reach:
                    self._command(node_id, renew=True)
                return
        await self._elect(healthy)

    async def _elect(self, healthy: list[str]) -> None:
        rng = self.rng
        # The largest connected group of healthy replicas (three nodes: small search).
        best: list[str] = []
        for group in ([*healthy], *([a, b] for a in healthy for b in healthy if a < b)):
            if len(group) > len(best) and all(
                self._connected(a, b) for a in group for b in group if a < b
            ):
                best = group
        if len(best) * 2 <= len(NODE_IDS):
            return  # no majority: nothing can be elected
        if not await self._stop(best):
            return  # the next tick tries again
        epochs = [self.members[n].replica.epoch for n in best]  # type: ignore[union-attr]
        self.epoch = max(self.epoch, *epochs) + 1
        positions = {n: self._position(n) for n in best}
        source = max(best, key=lambda n: (positions[n], -NODE_IDS.index(n)))
        master = source if rng.random() < 0.75 else rng.choice(best)
        self.master_id = master
        self.sync_source = source
        self.group = [master, *[n for n in best if n != master]]
        self.commanded_at = self.loop.time()
        self.stats.elections += 1
        self.note(
            f"elect epoch {self.epoch}: master {master} group {self.group} source {source}",
            observed=True,
        )
        for node_id in self.group:
            self._command(node_id, renew=False)

    async def _stop(self, group: list[str]) -> bool:
        """Stops every replica of ``group`` before their positions are read, as a
        coordinator stops its replica before it reports a position for a new group
        (``Election._on_invitation``: ``_deactivate_if_active``, then the accept waits for
        the stopped replica's report): a position read from a replica still following the
        old master could grow afterwards by batches it acknowledges to that master.
        False when one did not stop within ``TAKE_GRACE_S`` or is no longer healthy."""
        stops = []
        for node_id in group:
            member = self.members[node_id]
            replica = member.replica
            if replica is None:
                return False
            member.seq += 1
            command = replica_pb2.RoleCommand(
                seq=member.seq, role=common_pb2.ROLE_INACTIVE, cluster_id=CLUSTER_ID
            )
            stops.append(self.loop.spawn(member.process, self._apply(replica, command, True)))
        _, pending = await asyncio.wait(stops, timeout=TAKE_GRACE_S)
        return not pending and all(self._healthy(n) for n in group)

    def _command(self, node_id: str, *, renew: bool) -> None:
        member = self.members[node_id]
        replica = member.replica
        if replica is None:
            return
        member.seq += 1
        master = node_id == self.master_id
        command = replica_pb2.RoleCommand(
            seq=member.seq,
            epoch=self.epoch,
            role=common_pb2.ROLE_MASTER if master else common_pb2.ROLE_SLAVE,
            master=common_pb2.NodeEndpoint(node_id=self.master_id),
            lease_ms=LEASE_MS,
            cluster_id=CLUSTER_ID,
        )
        if master:
            command.members.extend(common_pb2.NodeEndpoint(node_id=n) for n in self.group)
            command.sync_source_id = self.sync_source
        self.loop.spawn(member.process, self._apply(replica, command, renew))

    async def _apply(
        self, replica: ReplicaNode, command: replica_pb2.RoleCommand, renew: bool
    ) -> None:
        try:
            await replica.apply_role(command)
        except ServiceError as exc:
            if not renew:
                self.note(f"{replica.node.id} refused epoch {command.epoch}: {exc.message[:80]}")

    def _sample_masters(self) -> None:
        """Every SAMPLE_S: who is master in which epoch. Two in one epoch fail the seed at
        once (the main task is cancelled and ``run`` raises the failure)."""
        if self.check_failure is not None:
            return
        for member in self.members.values():
            replica = member.replica
            if replica is not None and replica.role == common_pb2.ROLE_MASTER:
                holders = self.masters.setdefault(replica.epoch, set())
                holders.add(member.node_id)
                if len(holders) > 1:
                    self.check_failure = self.fail(
                        f"two masters in epoch {replica.epoch}: {sorted(holders)}"
                    )
                    if self._main_task is not None:
                        self._main_task.cancel()
                    return

    # --- clients

    async def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 7919 + index)
        # Until the heal's checks stop it: cancelled alone, a client whose cancel landed as
        # a publish's asyncio.wait_for ended would publish on (Python 3.11 swallows such a
        # cancel, CPython gh-86296; seed 11867 of the coordinated simulator published
        # through the whole catch-up check, which then never saw the slaves level).
        while self.publishing:
            await asyncio.sleep(rng.uniform(0.005, 0.1))
            await self._publish_once(rng)

    async def _publish_once(self, rng: random.Random) -> bool:
        target = self.master_id or rng.choice(NODE_IDS)
        replica = self.members[target].replica
        if replica is None:
            return False
        self.payloads += 1
        # Every third publish is a joined request of JOINED_PARTS one-event parts (a
        # client's shared stream joins concurrent publishes: ``start_publish_parts``).
        joined = self.payloads % 3 == 0
        riding = self.payloads % 3 == 1
        payloads = [
            b"e%d-%d" % (self.seed, self.payloads) + (b"-%d" % part if joined else b"")
            for part in range(JOINED_PARTS if joined else 1)
        ]
        requests = [
            broker_pb2.PublishRequest(topic=TOPIC, events=[common_pb2.EventData(payload=p)])
            for p in payloads
        ]
        try:
            try:
                replica.topic(TOPIC)
            except ServiceError:
                await asyncio.wait_for(
                    replica.write(commands.CreateTopic(TOPIC, common_pb2.TOPIC_KIND_REPLICATED)),
                    PUBLISH_WAIT_S,
                )
            if joined:
                outcomes = await asyncio.wait_for(
                    replica.start_publish_parts(requests), PUBLISH_WAIT_S
                )
            elif riding:
                planned = await asyncio.wait_for(
                    replica.write_with_next(commands.Publish(requests[0]), RIDE_S),
                    PUBLISH_WAIT_S,
                )
                assert planned.receipt is not None, "a planned publish has a receipt"
                outcomes = [planned.receipt]
            else:
                outcomes = [
                    await asyncio.wait_for(replica.start_publish(requests[0]), PUBLISH_WAIT_S)
                ]
        except (ServiceError, TimeoutError):
            self.stats.failed_publishes += len(payloads)
            return False
        acked = False
        for payload, outcome in zip(payloads, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, ServiceError):
                    raise outcome  # a bug, not a fault's refusal
                self.stats.failed_publishes += 1
                continue
            self.acked.append(Acked(payload, outcome))
            self.stats.acked += 1
            acked = True
        return acked

    # --- checks

    async def _liveness(self, healed_at: float) -> None:
        rng = random.Random(self.seed)
        deadline = healed_at + LIVENESS_S
        while self.loop.time() < deadline:
            if self._serving() and await self._publish_once(rng):
                self.note("liveness: a publish was acknowledged after healing", observed=True)
                return
            await asyncio.sleep(0.05)
        states = {
            m.node_id: (m.replica.role, m.replica.epoch, m.replica.failed_reason)
            if m.replica
            else None
            for m in self.members.values()
        }
        if self.script_error is not None:
            raise self.script_error
        raise self.fail(
            f"no publish acknowledged within {LIVENESS_S} s of healing "
            f"(epoch {self.epoch}, master {self.master_id}, replicas {states})"
        )

    async def _catch_up(self, without: Iterable[str] = ()) -> None:
        """Waits until every replica (but those ``without``) holds and knows committed
        the master's whole log."""
        deadline = self.loop.time() + CATCH_UP_S
        left_out = set(without)
        while self.loop.time() < deadline:
            replicas = [
                m.replica
                for m in self.members.values()
                if m.replica is not None and m.node_id not in left_out
            ]
            master = self.members[self.master_id].replica if self.master_id else None
            if (
                master is not None
                and self.master_id not in left_out
                and len(replicas) == len(NODE_IDS) - len(left_out)
                and master.writes_idle()
                and all(r.last_lsn == master.last_lsn for r in replicas)
                and all(r.commit_lsn == master.last_lsn for r in replicas)
            ):
                return
            await asyncio.sleep(0.05)
        lsns = {
            m.node_id: (m.replica.last_lsn, m.replica.commit_lsn) if m.replica else None
            for m in self.members.values()
        }
        raise self.fail(f"replicas did not catch up within {CATCH_UP_S} s: {lsns}")

    def _check_logs(self) -> None:
        logs: dict[str, list[tuple[int, int, bytes]]] = {}
        for member in self.members.values():
            replica = member.replica
            assert replica is not None
            start = replica.log_start_lsn
            count = replica.last_lsn - start + 1  # 0: all in an installed snapshot
            entries = replica.store.read_log(start, count) if count > 0 else []
            logs[member.node_id] = [(e.lsn, e.epoch, e.operation) for e in entries]
        # Compaction may have taken different prefixes: compare what both still hold.
        first = {lsn: (epoch, op) for lsn, epoch, op in logs[NODE_IDS[0]]}
        for node_id, entries in logs.items():
            for lsn, epoch, operation in entries:
                theirs = first.get(lsn)
                if theirs is not None and theirs != (epoch, operation):
                    raise self.fail(
                        f"logs differ at LSN {lsn}: {NODE_IDS[0]} has epoch {theirs[0]} "
                        f"{theirs[1][:40]!r}, {node_id} epoch {epoch} {operation[:40]!r}"
                    )
        if self.older:
            for lsn, epoch, operation in (e for entries in logs.values() for e in entries):
                if replica_pb2.Operation.FromString(operation).WhichOneof("op") == "publish_parts":
                    raise self.fail(
                        f"joined entry at LSN {lsn} (epoch {epoch}) written while {self.older}, "
                        "a node of an older release, is in the cluster"
                    )
        for member in self.members.values():
            replica = member.replica
            assert replica is not None
            events = (
                {e.offset: e.payload for e in replica.store.read_events(TOPIC, 0, 1_000_000)}
                if self.acked
                else {}
            )
            for acked in self.acked:
                if events.get(acked.receipt.first_offset) != acked.payload:
                    raise self.fail(
                        f"acknowledged event {acked.payload!r} (offset "
                        f"{acked.receipt.first_offset}, lsn {acked.receipt.lsn}, epoch "
                        f"{acked.receipt.epoch}) is not readable on {member.node_id}"
                    )


def _quiet_dropped_coroutines(
    hook: Callable[[sys.UnraisableHookArgs], object],
) -> Callable[[sys.UnraisableHookArgs], object]:
    def quiet(args: sys.UnraisableHookArgs) -> object:
        if isinstance(args.exc_value, RuntimeError) and "ignored GeneratorExit" in str(
            args.exc_value
        ):
            return None
        return hook(args)

    return quiet


def run_seed(
    seed: int, *, acks: common_pb2.AckPolicy.ValueType = common_pb2.ACK_POLICY_MAJORITY
) -> Stats:
    """Runs one seed in a temporary directory (the replicas' fault and loss files)."""
    return run_sim(ShellSim, "shell-sim", seed, acks)


def run_sim(
    kind: type[ShellSim], prefix: str, seed: int, acks: common_pb2.AckPolicy.ValueType
) -> Stats:
    """One seed of a ShellSim (or a subclass) in a temporary directory, then collected."""
    # What lived before the seed (the test runner, modules, earlier tests) is not the
    # seed's garbage: frozen, the collections during and after the run skip it (a full
    # collection of the whole test process took ~10% of a seed's CPU).
    gc.freeze()
    try:
        with tempfile.TemporaryDirectory(prefix=f"{prefix}-{seed}-") as root:
            sim = kind(seed, Path(root), acks=acks)
            try:
                return sim.run()
            except ShellSimFailure as exc:
                # A fresh exception: the caught one's frames would keep the run alive.
                raise ShellSimFailure(str(exc)) from None
            finally:
                # The coroutines of killed processes were dropped mid-await: collected
                # now, Python reports that they ignored their GeneratorExit (they never
                # finished).
                del sim
                collect_dropped()
    finally:
        gc.unfreeze()


def collect_dropped() -> None:
    """Collects a finished run: the coroutines of killed processes were dropped
    mid-await, and Python reports that they ignored their GeneratorExit."""
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_dropped_coroutines(hook)
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
