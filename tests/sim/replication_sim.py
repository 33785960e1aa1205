"""Deterministic simulator for the election and replication together (a small VOPR).

Every node runs the real ``Election`` (through the election simulator's driver, network and
faults, which this module extends) and the shipped replica code: a ``ReplicaDriver``
(``services/replica/driver.py``) with its ``ReplicaCore`` over a real ``Store`` on
``MemoryKV``, and, while the election makes it master, a ``ReplicationMaster`` made by that
driver whose ``Actions`` the shipped ``MasterSteps`` apply. The replica's decisions are
shipped code: role commands go to the core and are carried out through the driver's role
steps; a sync source's answer is the driver's (``fetch_answer``), sent message by message
as ``FetchServing`` says; a new master's fetch is stepped by the driver (``fetch_step``,
``store_fetched``, ``fetch_finished``); snapshot chunks are installed and slaves' batches
written by the driver's store steps (``install_snapshot``, ``write_batch``); the master
role is held by ``hold_master`` and its epoch start planned by the writer's planning;
what a slave's stream says to its master is read by ``MasterSteps`` (``hello_answered``,
``received``, ``refused``, ``stream_ended``), the reconnection delay is the shipped
``ReconnectBackoff`` (``services/replica/master_streams.py``) and the writer's hand-off
asks ``MasterSteps`` (``flush_after_send``, ``wait_lsn``). What this module carries
itself is the mechanics the asyncio shells and gRPC provide around those calls, over its
own network and clock: messages and their faults, the streams themselves (their identity,
which message is a stream's first, sending and closing), timers, keepalive and stall
detection (what gRPC's keepalive does for the service), the store's delays, the
catch-up's retry and timeout (the shell bounds each message of the fetch instead), when
masters compact (a fault: lagging slaves get snapshots), and the checker's view of every
log. Clients write to whichever node they
believe is master. One seed decides everything; the only randomness is
``random.Random`` seeded from it.

What is modelled
----------------
* **Store.** Each node's real store (``Store.open_memory``): every entry is a real
  ``replica_pb2.LogEntry`` whose operation the store applies (a plain write creates a topic
  named after it, so the store's state says which writes it holds); snapshots are the
  store's own export and install (``snapshot_chunks``, ``begin_snapshot``,
  ``install_chunk``, ``finish_snapshot``); compaction is the store's. Next to it the
  simulator keeps the checker's view of each log (``NodeStore.log``: the entries the state
  was built from, also those a snapshot or compaction took out of the store's log), checked
  against the store after each install and fetch, and in full at the end. Crashes are
  process crashes: what the store wrote survives, under every policy. A slave's store
  write completes after a store delay (0-3 ms), and the slave takes its next message only
  then (``ReplicaNode`` holds its commit lock across a batch); a crash discards the batch
  being written. Only ``NO_SYNC`` acknowledges received entries, so only it can lose an
  acknowledged entry in a crash: the checker is told (``degrade``) and stops the checks
  that rely on durability for that seed (reported as "degraded" seeds). A snapshot install
  cut short leaves the store as it was (the shipped store stages the install and swaps it
  in at its end), so the checker's view changes only when an install finishes.
* **Roles.** Every role command goes to the node's ``ReplicaCore`` (``role_command``) and
  its effects are carried out by ``ReplicaDriver.role_steps`` in the order ``core.Effects``
  documents, each step the driver leaves to the shell done as ``RoleApplication`` does it
  (``CancelTaking``: the catch-up stops and ``taking_stopped`` re-reads the gate;
  ``DropRole``: the master is deposed, the slave's stream ends once the batch being
  written is written; ``RecordClusterId`` and ``PersistRole``: ``write_role``;
  ``StartTaking``: the master role is taken after the command; ``FollowMaster``:
  ``follow``; ``RenewMembers``: the master's group shrinks); a command the core refuses
  is answered as refused and the coordinator recovers.
* **Master.** Taking the master role runs ``TakingMaster.become_master``'s sequence: the
  epoch persisted (``take_master_persist``), then, unless the node is its own sync
  source, the store brought to the sync source's state (the reorganization rule) by a
  **transfer over the simulated network**: a request (``ReplicaDriver.fetch_request``) to
  the source, retried until an answer arrives; the source answers as ``SyncSource``
  does (``fetch_answer`` decides: the entries after the fork, or a snapshot of its store
  when the master's own log diverges and cannot be truncated or the source no longer
  retains them; ``FetchServing`` builds the messages). The new master steps each message
  through the driver as ``TakingMaster._sync_from`` does; any refusal, a failed check or
  store write, or no answer within the catch-up timeout fails the attempt and its
  coordinator recovers, as ``services/coordinator/node.py`` does when its replica refuses
  a role. Then the driver holds the role (``hold_master``: the ``ReplicationMaster`` over
  the store, ``truncate_by_snapshot=True``), the streams open and the writer's planning
  (``plan_batch``) builds the epoch-start entry. The shipped ``MasterSteps``
  (``services/replica/master_steps.py``) applies every ``Actions`` record in its
  documented order and builds each granted batch (from its tail cache, or the store's
  log); this module gives its outputs (the part ``MasterDriver`` does with streams and
  tasks). A slave's messages reach the master as ``MasterDriver._stream`` reads them: the
  stream's first through ``MasterSteps.hello_answered`` (a Position opens it; anything
  else ends it unopened), later ones through ``received`` (acks), a slave's Close through
  ``refused`` (the epoch its metadata names may depose the master) and every end through
  ``stream_ended``; a new stream follows after ``ReconnectBackoff``'s delay. The
  simulator's shell closes streams silent for four heartbeat intervals (gRPC's keepalive
  does this for the service, so it is no decision of ``MasterDriver``) or whose in-flight
  entries stop being received for as long (only this network loses them, see Network),
  and sometimes compacts the master's log (so lagging slaves get snapshots). A reissued
  MASTER command of the same epoch renews the group (the core's ``RenewMembers``) or
  joins the attempt under way. Deposed masters
  are kept, as the real driver's late stream input would reach them, so late acks still
  arrive and must not move their commit LSN.
* **Slave.** Hello, batches, heartbeats and snapshot chunks go to the node's
  ``ReplicaDriver`` (``hello``, ``batch`` then its ``write_batch`` store steps,
  ``heartbeat``, ``snapshot_chunk`` then its ``install_snapshot`` steps) in the order
  ``SlaveSide`` applies them (a Hello to a replica that is not a slave is refused by
  ``hello`` too); a refusal closes the stream (a ``Close`` to the master carrying the
  refusal's status and trailing metadata, the slave's epoch, as gRPC carries them). Slaves
  compact their logs beyond a per-seed retention in seeds where masters compact.
* **Network.** Replication messages share the election's faulty network: partitions,
  pauses, delay, loss, duplication (of catch-up and client messages: a stream's message
  is never delivered twice, as gRPC guarantees and the drivers rely on) and, when the
  seed says so, reordering (otherwise each link is FIFO). That is harsher than gRPC,
  whose stream never drops or reorders a message and carries on: here a gap reaches the
  Follower's checks (which refuse it and close the stream), and a lost tail is noticed
  by the simulator's stall check (see Master). Nothing can overtake a stream's first
  batch when it truncates: ``ReplicationMaster`` sends nothing more on the stream until
  the slave acknowledges it (seeds 5027 and 5493 found what a message that overtook it
  did against the deposed master's suffix). A gRPC stream is
  identified by (master, epoch, stream id); a slave drops input of a stream other than
  its current one (as gRPC would after the stream closed) and answers it with a
  ``Close``. After healing the links are FIFO without loss or duplication, as TCP gives.
* **Faults.** The election simulator's (crashes, restarts, pauses, partitions), over a
  safety phase up to 1.5 s longer, plus up to four faults aimed at whichever node is
  serving as master when they fire: crash (with or without restart), pause, isolation,
  one-way cuts either way, or a crash of its busiest slave; and, with a per-seed chance,
  the sync source crashes or is cut off just as a new master asks it for its log (the
  reorganization's worst moment). Clients outside the network
  keep writing to an isolated master, so deposed masters hold uncommitted suffixes that
  later rejoin as divergent logs.
* **Clients.** One to three clients write unique payloads to the node they believe is
  master, follow redirects, time out and try another node. Every write is planned by the
  shipped writer planning (``ReplicaDriver.plan_batch``: a plain write creates a topic
  named after it, a topic command is the workload's below), one command per batch, and
  stored before the steps hear of it. A write is acknowledged when
  the master's ``ReplicationMaster`` completes its token; every acknowledged write
  (LSN, epoch, payload) goes to the checker.
* **Topics.** In about half the seeds the clients also create, destroy and re-create one
  topic and publish to it under one fixed publisher id with sequences drawn from a small
  range, so retries, duplicates and a re-created topic reusing the old incarnation's
  sequences are frequent. These commands are planned like every write, by the production
  ``BatchBuilder`` over the master's store (``topic_state.py``); a duplicate's token
  waits for the master's last entry. The checker
  holds every duplicate receipt to the incarnation invariant when it is planned (it points
  at the publisher's event, stored in the topic as the master holds it now), every
  acknowledged receipt to the event at its offset, and at the end every live replica to
  every acknowledged event of the topic's final incarnation.

Faults on the store: in seeds where the master flushes every write, half the crashes of
master faults are machine crashes (``MemoryKV.lose_unsynced``: the store goes back to its
last flush and is reopened); a loss of unflushed entries degrades the seed unless the
replicas flush every write too, where it is a failure. Half the seeds' stores truncate a
divergent log by rebuilding it from their own log (``rebuild.rebuild_into``), the others
cannot (``truncate_by_snapshot``: a divergent slave gets a snapshot). Such a master
sends each batch before its flush, as ``Writer._commit`` does
(``MasterSteps.flush_after_send`` says a flush follows), and the flush ends up
to a store delay later (``master_flush``), so slaves' acks can come back before it and a
crash (with the machine's loss of what was not flushed) can fall in between; in three
seeds of four (its own generator) a flush fails after sending with a per-flush chance of
2 %, 10 % or 30 % during the safety phase (``flush_failed``): the steps depose the
master, its machine loses the unflushed write and the process restarts later, so the
slaves hold entries their old master never made durable.

Simplifications: no deduplication of the plain writes (each payload is written once,
never retried; the topic workload above is deduplicated); one command per writer batch;
no operator controls (quorum override, designated primary); no slow disk, and no failing
one beyond the master's flush above and a slave's store that is full for a while (every
batch refused with RESOURCE_EXHAUSTED, nothing written).
What this module still carries of the shells, beside the network (issue 15): the
streams' mechanics (``open_stream``, ``stream_broken``, ``master_receive``: which stream a
message belongs to and whether it is its first, the reconnect timer; each decision in
them is the shipped steps' or backoff's); keepalive and stall detection in
``master_tick`` (gRPC's keepalive in the service; no shipped code decides it); the loops
that carry the driver's steps out (``serve_catchup``, ``on_catchup_reply``,
``batch_steps``, ``apply_role``), each a few lines of plumbing around shipped decisions;
the writer's queue around its hand-off (``master_store``, ``master_flush``: one write per
entry, the flush's delay and failure as faults; the calls are ``Writer._commit``'s);
and the truncation of a divergent log (``truncate``: the shipped ``Truncation`` rebuilds
an LMDB store through ``LmdbTruncator`` and refuses on the memory twin, so this module
rebuilds the memory store with the shipped ``rebuild_into`` and hands it to the driver's
``truncated``). The asyncio shells themselves run as shipped in ``shell_sim.py``: three
whole ``ReplicaNode``s (``MasterDriver``, the writer queue, ``TakingMaster``/``SyncSource``,
the slave servicer path, the lease watch) on a virtual-time event loop
(``virtual_loop.py``) over the transport's twin (``shell_network.py``), with crashes,
pauses, cuts, resets and slow and failing disks; its roles come from a seeded script
following the coordinator's rules, where this module runs the shipped election.

Phases: the safety phase injects the election simulator's faults while the checker
(``replication_checker.py``) runs after every step; then the network heals and within
``liveness_deadline_ms`` every live node must be NORMAL in one group led by the
highest-ranked live eligible node, that master must acknowledge ``LIVENESS_WRITES`` writes
after healing, and once the clients then stop, every live replica must hold the master's log
with everything committed and known committed: within that deadline too, or, when the
configured window needs longer to bring the replicas up (one window per round trip: a
one-entry window is stop-and-wait), by ``drain_deadline``, reckoned when the clients
stop. A failure raises ``SimFailure`` ending with the replay command.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import random
import zlib
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.errors import Code, ServiceError
from squall_server.coordinator.election import node_sort_key
from squall_server.coordinator.messages import (
    NodeState,
    PersistedState,
    Role,
    RoleCommand,
    RoleCommandKind,
)
from squall_server.replica import commands
from squall_server.replica.committed import gate_from_store
from squall_server.replica.core import (
    EPOCH_KEY,
    CoreConfig,
    Effects,
    LogPosition,
    PersistRole,
    ReplicaCore,
    RoleOrder,
    StoreFacts,
    TakeMaster,
)
from squall_server.replica.core import Role as CoreRole
from squall_server.replica.divergence import History
from squall_server.replica.driver import (
    AppendBatch,
    BatchStep,
    CancelTaking,
    DropRole,
    FollowMaster,
    InstallFetched,
    RecordClusterId,
    RenewMembers,
    ReplicaDriver,
    StartTaking,
    StoreFetched,
    TruncateFetched,
    TruncateLog,
    run_store_steps,
)
from squall_server.replica.fetch_serving import FetchServing
from squall_server.replica.follower import (
    BatchAccepted,
    Follower,
    FollowerConfig,
)
from squall_server.replica.master_steps import MasterOutputs, MasterSteps
from squall_server.replica.master_streams import ReconnectBackoff
from squall_server.replica.rebuild import rebuild_into
from squall_server.replica.replication import (
    AckPolicy,
    Actions,
    MasterConfig,
    ReplicationError,
    ReplicationMaster,
    SlaveProgress,
    SlaveState,
    SyncPolicy,
    entry_size_bytes,
)
from squall_server.replica.store import Store, StoreError, StoreFullError
from squall_server.replica.store.errors import InvalidEntryError
from squall_server.replica.store.kv_memory import MemoryKV
from tests.sim import topic_state
from tests.sim.election_checker import InvariantViolation
from tests.sim.election_sim import (
    _CRASH,
    _CUT,
    _RESTART,
    _UNCUT,
    KINDS_END,
    Replica,
    SimFailure,
    Simulation,
    make_scenario,
    mark_initial_stores,
    quiet_coordinator_log,
)
from tests.sim.replication_checker import Entry, ReplicationChecker, short

__all__ = ["ReplResult", "ReplicationSimulation", "SimFailure", "repl_reproduce_hint", "run_seed"]

# Event kinds of this module; they run after the election simulator's kinds at one instant.
# Numbered after them: a kind the election adds must not take one of these numbers.
_NET, _RTICK, _STORE, _CLIENT, _MASTER_FAULT, _FLUSH_FAILED, _FLUSH = range(
    KINDS_END, KINDS_END + 7
)
MASTER_FAULTS = ("crash", "crash-restart", "crash-slave", "pause", "isolate", "mute", "deaf")
CLUSTER_ID = "c1"
EVENTS_MAX = 300_000
RTICK_MS = 10
CLIENT_TIMEOUT_MS = 200
LIVENESS_DEADLINE_MS = 5000
# After the clients stop: what follows a replica's last entry (the commit LSN's heartbeat,
# a reconnection's backoff, a write still on its way to the master); see drain_deadline.
DRAIN_SLACK_MS = 1000
# Writes the converged master must acknowledge after healing before the clients stop.
LIVENESS_WRITES = 8
CONVERGE_CHECK_MS = 5
# Entries per batch of a reorganization fetch (the service: commit_batch_max_entries).
FETCH_STEP_ENTRIES = 64


def repl_reproduce_hint(seed: int) -> str:
    """The commands that replay one seed of this simulator."""
    return (
        f"reproduce with: make sim SEEDS=1 SEED={seed}   "
        f"(or: .venv/bin/pytest -q tests/sim/test_replication_sim.py --sim-seed={seed})"
    )


def make_entry(lsn: int, epoch: int, operation: bytes) -> Entry:
    """An entry with its checksum."""
    return Entry(lsn=lsn, epoch=epoch, checksum=zlib.crc32(operation), operation=operation)


def write_operation(name: str) -> bytes:
    """A plain write's operation: it creates a topic of that (unique) name, so the real
    store holds one record per write whatever snapshots and compactions do to the log."""
    return replica_pb2.Operation(
        create_topic=replica_pb2.CreateTopicOp(name=name, kind=common_pb2.TOPIC_KIND_REPLICATED)
    ).SerializeToString()


def history_of(log: Sequence[Entry]) -> History:
    """The epoch history of a log: where each epoch's entries start."""
    out: list[tuple[int, int]] = []
    last = 0
    for entry in log:
        if entry.epoch != last:
            out.append((entry.epoch, entry.lsn))
            last = entry.epoch
    return tuple(out)


# ----------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Hello:
    """Master -> slave: a new stream of ``epoch``."""

    epoch: int
    stream: int
    cluster_id: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Slave -> master: one message of the stream as ``serve_replicate`` yields it (the
    Position answering the Hello, then acks)."""

    epoch: int
    stream: int
    response: replica_pb2.ReplicateResponse


@dataclass(frozen=True, slots=True)
class Batch:
    """Master -> slave: entries, the commit LSN, maybe a truncation."""

    epoch: int
    stream: int
    entries: tuple[Entry, ...]
    commit_lsn: int
    truncate_after_lsn: int | None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Master -> slave: the commit LSN on an idle stream."""

    epoch: int
    stream: int
    commit_lsn: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """Master -> slave: one snapshot chunk; the last carries the history."""

    epoch: int
    stream: int
    chunk: replica_pb2.SnapshotChunk
    ghost: tuple[Entry, ...]
    """On the last chunk: the log the snapshot's state was built from (the checker's view;
    the real store receives only the chunk's records)."""


@dataclass(frozen=True, slots=True)
class Close:
    """Either way: the stream is closed (why; from a slave, its refusal's status name and
    trailing metadata, which carries its epoch)."""

    epoch: int
    stream: int
    reason: str
    to_master: bool
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class CatchUpRequest:
    """New master -> its sync source: where my log ends (``ReplicaDriver.fetch_request``)."""

    epoch: int
    request: replica_pb2.FetchLogRequest


@dataclass(frozen=True, slots=True)
class CatchUpReply:
    """Sync source -> new master: the ``FetchLog`` stream's messages as the source's driver
    decided them (``fetch_answer``), or its refusal; ``ghost``: the source's log as the
    checker sees it (what a snapshot's state was built from); ``request_last_lsn``: where
    the requester's log ended when it asked."""

    epoch: int
    request_last_lsn: int
    responses: tuple[replica_pb2.FetchLogResponse, ...]
    ghost: tuple[Entry, ...]
    error_code: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class ClientWrite:
    """Client -> node: append this payload, or (kind set) run this topic command."""

    client: str
    pid: int
    kind: str = ""  # "", or a topic command: "create", "destroy", "publish"
    sequence: int = 0  # a publish's sequence


@dataclass(frozen=True, slots=True)
class ClientReply:
    """Node -> client: ok, fail (indeterminate), busy, or redirect to ``hint``."""

    pid: int
    outcome: str
    hint: str


Body = (
    Hello
    | Answer
    | Batch
    | Heartbeat
    | Chunk
    | Close
    | CatchUpRequest
    | CatchUpReply
    | ClientWrite
    | ClientReply
)


# The messages of a replication stream (``Replicate``): lost or reordered here, never
# duplicated.
STREAM_MESSAGES = (Hello, Answer, Batch, Heartbeat, Chunk, Close)


@dataclass(frozen=True, slots=True)
class Packet:
    """One message in flight."""

    src: str
    dst: str
    body: Body


def describe(body: Body) -> str:
    """A message in one short line for the failure trace."""
    name = type(body).__name__
    if isinstance(body, Batch):
        span = f"{body.entries[0].lsn}..{body.entries[-1].lsn}" if body.entries else "-"
        cut = f" truncate>{body.truncate_after_lsn}" if body.truncate_after_lsn is not None else ""
        return f"Batch e{body.epoch} s{body.stream} {span} commit={body.commit_lsn}{cut}"
    if isinstance(body, Answer) and body.response.WhichOneof("body") == "ack":
        a = body.response.ack
        return f"Ack e{body.epoch} s{body.stream} {a.received_lsn}/{a.written_lsn}/{a.synced_lsn}"
    if isinstance(body, Answer):
        p = body.response.position
        return (
            f"Position e{body.epoch} s{body.stream} log={p.last_epoch}/{p.last_lsn} "
            f"start={p.log_start_lsn}"
        )
    if isinstance(body, Chunk):
        c = body.chunk
        return f"Chunk e{body.epoch} s{body.stream} #{c.index} at={c.snapshot_lsn}"
    if isinstance(body, Close):
        said = " ".join(f"{k}={v}" for k, v in body.metadata)
        return f"Close e{body.epoch} s{body.stream} {body.reason} {said}".rstrip()
    if isinstance(body, Hello | Heartbeat):
        return f"{name} e{body.epoch} s{body.stream}"
    if isinstance(body, CatchUpReply):
        kinds = Counter(r.WhichOneof("body") for r in body.responses)
        return f"CatchUpReply e{body.epoch} {dict(kinds)} {body.error_code}"
    if isinstance(body, CatchUpRequest):
        return f"CatchUpRequest e{body.epoch} have={body.request.last_lsn}"
    if isinstance(body, ClientWrite):
        topic = f" {body.kind} {body.sequence}" if body.kind else ""
        return f"ClientWrite p{body.pid}{topic}"
    return f"ClientReply p{body.pid} {body.outcome} {body.hint}"


# ----------------------------------------------------------------- scenario and state


@dataclass
class ReplParams:
    """The replication half of a scenario."""

    acks: AckPolicy
    master_sync: SyncPolicy
    replica_sync: SyncPolicy
    window_entries: int
    window_bytes: int
    pending_max: int
    compaction_p: float
    store_delay_max_ms: int
    reorder: bool
    clients: int
    client_interval_ms: int
    client_inflight_max: int
    logs: dict[str, list[Entry]]
    master_faults: list[tuple[int, str, int]]
    source_fault_p: float
    """Chance that a sync source is crashed or cut off just as a new master asks it."""
    """(when, which of MASTER_FAULTS, for how long): aimed at whoever is master then (or
    its busiest slave)."""


@dataclass
class NodeStore(Replica):
    """The replica twin's store: survives crashes (the election sim reads its report)."""

    log: list[Entry] = field(default_factory=list)
    snapshot_lsn: int = 0
    log_start: int = 1
    synced_lsn: int = 0
    db: Store = field(default_factory=lambda: Store.open_memory(keep_unsynced=True))
    """The real store (``MemoryKV``): what the drivers read and write. ``log`` is the
    checker's view of it: the entries its state was built from, also those a snapshot
    or a compaction took out of the store's log."""

    def refresh(self) -> None:
        """Keep the position the coordinator reads in step with the log."""
        self.last_lsn = len(self.log)
        self.last_epoch = self.log[-1].epoch if self.log else 0
        if self.log and not self.cluster_id:
            self.cluster_id = CLUSTER_ID


@dataclass
class CatchUp:
    """A new master fetching the sync source's log."""

    source: str
    deadline_ms: int
    next_try_ms: int


StreamKey = tuple[str, int, int]
"""(master, epoch, stream id): one gRPC replication stream."""


@dataclass
class PendingWrite:
    """A batch the slave's core accepted, being written (the store's delay): what the
    driver said to store, the stream's follower, the batch and its stream."""

    accepted: BatchAccepted[Entry]
    effects: Effects
    """The core's effects that accepted it (``ReplicaDriver.write_batch`` writes them)."""
    follower: Follower
    batch: Batch
    key: StreamKey


@dataclass
class Runtime:
    """One node's volatile replica state: gone when the process crashes."""

    gen: int = 0
    core: ReplicationMaster[int] | None = None
    zombie: ReplicationMaster[int] | None = None
    epoch: int = 0
    members: tuple[str, ...] = ()
    catchup: CatchUp | None = None
    last_heard: dict[str, int] = field(default_factory=dict)
    reconnect_at: dict[str, int] = field(default_factory=dict)
    backoff: dict[str, ReconnectBackoff] = field(default_factory=dict)
    """Each slave's reconnection backoff (the shipped ``ReconnectBackoff``) for ``core``."""
    answered: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    """Slave -> (epoch, stream, answered) of the last stream whose first message the
    master read, and whether it answered the Hello (``MasterSteps.hello_answered``)."""
    stalled: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Slave -> (stream, received LSN, since when) while entries are in flight unreceived."""
    steps: dict[int, MasterSteps[int]] = field(default_factory=dict)
    """The ``MasterSteps`` of each master core this process made (by the core's id)."""
    tokens: dict[int, tuple[int, str, int]] = field(default_factory=dict)
    """Write token -> (LSN, client, payload id); a duplicated request gets its own token."""
    driver: ReplicaDriver | None = None
    """The shipped replica driver over this node's store (made when the process starts)."""
    taking: int = 0
    """The epoch whose master role the driver's core is taking (0: none)."""
    master_id: str = ""
    stream: StreamKey | None = None
    core_stream: int = 0
    """The driver's number for ``stream`` (its later messages name it)."""
    last_hello: StreamKey | None = None
    writes: deque[PendingWrite] = field(default_factory=deque)
    deferred: deque[Packet] = field(default_factory=deque)
    known_commit: int = 0


@dataclass
class Client:
    """A client: where it sends writes and which are in flight (payload id -> deadline)."""

    name: str
    target: str
    inflight: dict[int, int] = field(default_factory=dict)


@dataclass
class ReplResult:
    """What a passing run measured."""

    seed: int
    nodes: int
    events: int
    acked: int
    commit_lsn: int
    converge_ms: int
    degraded: str
    snapshots: int
    refusals: int
    policies: str
    flush_failures: int = 0
    """The master's flushes that failed after its batch went out (the seed's fault)."""


def _prehistory(
    rng: random.Random, nodes: list[str]
) -> tuple[dict[str, list[Entry]], dict[str, int]]:
    """Logs and persisted epochs of a cluster that ran before, built as the protocol would.

    Each earlier epoch was voted by a majority (which persisted it) and has one leader that
    appends entries; some voters copy a prefix of its log (after dropping a divergent
    suffix), so logs differ, diverge and lag as in life.
    """
    logs: dict[str, list[Entry]] = {node: [] for node in nodes}
    epochs = dict.fromkeys(nodes, 0)
    epoch = 0
    majority = len(nodes) // 2 + 1
    for _ in range(rng.randint(1, 4)):
        epoch += rng.randint(1, 3)
        leader = rng.choice(nodes)
        others = [x for x in nodes if x != leader]
        group = [leader, *rng.sample(others, rng.randint(majority - 1, len(others)))]
        mine = logs[leader]
        start = len(mine) + 1
        mine = mine + [
            make_entry(lsn, epoch, write_operation(f"h{epoch}-{lsn}"))
            for lsn in range(start, start + rng.randint(1, 8))
        ]
        logs[leader] = mine
        for node in group:
            epochs[node] = epoch
            if node == leader or rng.random() < 0.3:
                continue
            theirs = logs[node]
            common = 0
            while common < min(len(theirs), len(mine)) and theirs[common] == mine[common]:
                common += 1
            # A follower keeps what agrees with the leader and copies some more of its log.
            logs[node] = mine[: rng.randint(common, len(mine))]
    return logs, epochs


class ReplicationSimulation(Simulation):
    """Runs one seed of the election and replication cores; see the module docstring."""

    def __init__(self, seed: int) -> None:
        """Draw the scenario from the seed and prepare every node's store."""
        scenario = make_scenario(seed, sizes=(3, 5))
        rng = random.Random(seed * 31337 + 5)
        nodes = sorted(scenario.priorities, key=node_sort_key)
        n = len(nodes)
        majority = n // 2 + 1
        logs: dict[str, list[Entry]] = {node: [] for node in nodes}
        if rng.random() < 0.4:
            logs, epochs = _prehistory(rng, nodes)
            ran_with = rng.choice((majority, n))
            for node in nodes:
                seen = rng.choice((0, ran_with, ran_with))
                scenario.initial[node] = PersistedState(
                    epoch=epochs[node], max_seen=seen, cluster_id=CLUSTER_ID
                )
        else:
            for node in nodes:
                scenario.initial[node] = PersistedState()
        for node in nodes:
            log = logs[node]
            scenario.initial_logs[node] = (log[-1].epoch if log else 0, len(log))
        scenario.liveness_deadline_ms = LIVENESS_DEADLINE_MS
        # More time under faults, so groups form and clients write while the faults hit.
        scenario.safety_ms += rng.randint(0, 1500)
        master_faults = [
            (
                rng.randint(100, scenario.safety_ms),
                rng.choice(MASTER_FAULTS),
                rng.randint(30, 900),
            )
            for _ in range(rng.randint(0, 4))
        ]
        replica_sync = rng.choice(
            (
                SyncPolicy.SYNC,
                SyncPolicy.WRITE_NO_SYNC,
                SyncPolicy.WRITE_NO_SYNC,
                SyncPolicy.NO_SYNC,
            )
        )
        self.params = ReplParams(
            acks=AckPolicy.ALL if rng.random() < 0.2 else AckPolicy.MAJORITY,
            master_sync=rng.choice((SyncPolicy.SYNC, SyncPolicy.WRITE_NO_SYNC)),
            replica_sync=replica_sync,
            window_entries=rng.choice((1, 2, 4, 16, 64)),
            window_bytes=rng.choice((64, 256, 1 << 20)),
            pending_max=rng.choice((2, 8, 1024)),
            compaction_p=rng.choice((0.0, 0.0, 0.05, 0.3)),
            store_delay_max_ms=rng.choice((0, 1, 3)),
            reorder=rng.random() < 0.5,
            clients=rng.randint(1, 3),
            client_interval_ms=rng.randint(8, 30),
            client_inflight_max=rng.randint(1, 3),
            logs=logs,
            master_faults=master_faults,
            source_fault_p=rng.choice((0.0, 0.0, 0.3, 0.6)),
        )
        super().__init__(scenario)
        self.rrng = random.Random(seed * 104729 + 7)
        self.stores: dict[str, NodeStore] = {}
        self.rchecker = ReplicationChecker(self.nodes, self.majority)
        for node in self.nodes:
            store = NodeStore(log=list(logs[node]))
            store.synced_lsn = len(store.log)
            store.refresh()
            if store.log:
                # What the earlier cluster committed is not known: nothing counts as
                # committed (a store with no record would count its whole log).
                store.db.append(store.log, sync=True, commit_lsn=0)
                store.db.set_commit_lsn(0)
                store.db.set_cluster_id(CLUSTER_ID)
            self.stores[node] = store
            self.replicas[node] = store
            for entry in store.log:
                self.rchecker.created.setdefault((entry.lsn, entry.epoch), entry.operation)
                self.rchecker.writer.setdefault(entry.epoch, f"prehistory-{entry.epoch}")
        mark_initial_stores(self.replicas)
        self.rt: dict[str, Runtime] = {node: Runtime() for node in self.nodes}
        # Half the seeds: the stores cannot truncate (a divergent slave gets a snapshot);
        # the others truncate by rebuilding from their own log, as LMDB stores do.
        self.truncate_by_snapshot = random.Random(seed * 613 + 3).random() < 0.5
        # Machine crashes (unflushed writes lost): half the crashes of master faults where
        # the master flushes every write. Only where the replicas do too must no
        # acknowledged entry be lost; otherwise a loss degrades the seed (the policy
        # promises nothing then).
        self.power_loss = self.params.master_sync == SyncPolicy.SYNC
        self.power_safe = self.power_loss and self.params.replica_sync == SyncPolicy.SYNC
        self.frng = random.Random(seed * 31 + 17)
        # A master that flushes every write sends each batch before its flush; in some
        # seeds the flush then fails (its own generator: the other draws stay as they were).
        self.flush_rng = random.Random(seed * 7907 + 5)
        self.flush_fail_p = self.flush_rng.choice((0.0, 0.02, 0.1, 0.3)) if self.power_loss else 0.0
        self.flush_failures = 0
        # In some seeds a node's store is full for a while (its own generator too): a
        # slave refuses every batch with RESOURCE_EXHAUSTED, nothing written, which under
        # acks ALL makes it catching up (``ReplicationMaster.cannot_store``).
        full_rng = random.Random(seed * 7919 + 11)
        self.full_windows: dict[str, list[tuple[int, int]]] = {node: [] for node in self.nodes}
        # Not under a replica NO_SYNC: a slave acknowledges a batch there before writing
        # it, so one its full store then refuses was counted held where it is not (the
        # policy promises no more than receipt; a crash loses it alike).
        if self.params.replica_sync != SyncPolicy.NO_SYNC and full_rng.random() < 0.5:
            for _ in range(full_rng.randint(2, 4)):
                start = full_rng.randint(100, scenario.safety_ms)
                self.full_windows[full_rng.choice(self.nodes)].append(
                    (start, start + full_rng.randint(200, 2000))
                )
        self.full_refusals = 0
        self.master_cfg = {
            node: MasterConfig(
                node_id=node,
                nodes=tuple(self.nodes),
                acks=self.params.acks,
                master_sync=self.params.master_sync,
                replica_sync=self.params.replica_sync,
                inflight_entries_max=self.params.window_entries,
                inflight_bytes_max=self.params.window_bytes,
                pending_writes_max=self.params.pending_max,
                heartbeat_interval_ms=scenario.timing["heartbeat_interval_ms"],
                truncate_by_snapshot=self.truncate_by_snapshot,
            )
            for node in self.nodes
        }
        self.follower_cfg = {
            node: FollowerConfig(
                node_id=node,
                sync_policy=self.params.replica_sync,
                inflight_entries_max=self.params.window_entries,
                inflight_bytes_max=self.params.window_bytes,
            )
            for node in self.nodes
        }
        self.keepalive_ms = 4 * scenario.timing["heartbeat_interval_ms"]
        self.catchup_timeout_ms = 2 * scenario.timing["member_timeout_ms"]
        self.repl_loss = scenario.loss
        self.repl_dup = scenario.dup
        self.fifo = not self.params.reorder
        self.link_at: dict[tuple[str, str], int] = {}
        self.clients = [
            Client(f"c{i}", self.rrng.choice(self.nodes)) for i in range(self.params.clients)
        ]
        self.client_by_name = {c.name: c for c in self.clients}
        self.next_pid = 0
        self.next_token = 0
        self.quiesced = False
        # When the clients stopped: by then the live replicas must have caught up (0: not
        # yet; see drain_deadline).
        self.drain_deadline_ms = 0
        self.acked_after_heal: Counter[tuple[str, int]] = Counter()
        self.next_converge_check = 0
        self.snapshots = 0
        self.refusals = 0
        # The topic workload draws from its own generator, so it leaves the other draws
        # (and the seeds found before it existed) as they were.
        self.trng = random.Random(seed * 7919 + 11)
        self.topic_p = self.trng.choice((0.0, 0.6, 0.9))
        # Snapshot chunks hold at most this many records (several chunks per snapshot).
        self.snapshot_records = self.rrng.choice((4, 32, 8192))
        # The slaves' own log retention (their cores compact beyond it).
        self.slave_retention = self.rrng.choice((8, 64)) if self.params.compaction_p else 10**9
        self.topic_tokens: dict[int, topic_state.Receipt] = {}

    # ----------------------------------------------------------------- plumbing

    def reproduce(self) -> str:
        """This simulator's replay command."""
        return repl_reproduce_hint(self.sc.seed)

    def extra_state_lines(self) -> list[str]:
        """Every replica's log, role and progress, for a failure report."""
        p = self.params
        lines = [
            f"replication: acks={p.acks.name} master_sync={p.master_sync.name} "
            f"replica_sync={p.replica_sync.name} window={p.window_entries}/{p.window_bytes}B "
            f"pending_max={p.pending_max} reorder={p.reorder} store_delay<={p.store_delay_max_ms}"
            f" degraded={self.rchecker.degraded or '-'}"
        ]
        for node in self.nodes:
            store, rt = self.stores[node], self.rt[node]
            tail = ",".join(short(e) for e in store.log[-4:])
            role = "-"
            if rt.core is not None:
                core = rt.core
                slaves = " ".join(
                    f"{s.node_id}:{s.state.value}@{s.written_lsn}" for s in core.status()
                )
                role = (
                    f"master e{core.epoch} commit={core.commit_lsn} deposed={core.deposed!r} "
                    f"[{slaves}]"
                )
            elif rt.catchup is not None:
                role = f"master e{rt.epoch} catching up from {rt.catchup.source}"
            elif rt.driver is not None and (follower := rt.driver.core.follower) is not None:
                fs = follower.state()
                role = (
                    f"slave of {fs.master_id} e{fs.epoch} stream={rt.stream} "
                    f"commit={follower.commit_lsn} pending_writes={len(rt.writes)}"
                )
            lines.append(
                f"  {node}: log len={len(store.log)} start={store.log_start} "
                f"snap={store.snapshot_lsn} tail=[{tail}] {role}"
            )
        return lines

    def violation(self, exc: InvariantViolation) -> SimFailure:
        """A replication invariant failed."""
        return self.fail(f"invariant: {exc}")

    def alive(self, node: str) -> bool:
        """Is the node's process up?"""
        return self.elections[node] is not None

    def net_send(self, src: str, dst: str, body: Body) -> None:
        """Hand a replication or client message to the network (faults as for elections)."""
        rng = self.rrng
        if self.repl_loss and rng.random() < self.repl_loss:
            return
        copies = 2 if self.repl_dup and rng.random() < self.repl_dup else 1
        if isinstance(body, STREAM_MESSAGES):
            # A gRPC stream delivers each message once, which the drivers rely on (a
            # truncating batch delivered twice would cut what the slave acknowledged).
            copies = 1
        for _ in range(copies):
            at = self.now_ms + rng.randint(0, self.delay_max_ms)
            if self.long_delay_p and rng.random() < self.long_delay_p:
                at += rng.randint(0, self.sc.long_delay_max_ms)
            if self.fifo:
                key = (src, dst)
                at = max(at, self.link_at.get(key, 0))
                self.link_at[key] = at
            self.push(at, _NET, dst, Packet(src, dst, body))

    def holders(self, lsn: int, entry: Entry) -> int:
        """Nodes holding ``entry`` at ``lsn``: in the store, or (NO_SYNC) received."""
        if self.params.replica_sync == SyncPolicy.NO_SYNC:
            return sum(1 for node in self.nodes if self.holds_received(node, lsn, entry))
        count = 0
        for node in self.nodes:
            store = self.stores[node]
            log = store.log
            if len(log) >= lsn and log[lsn - 1] == entry:
                count += 1
        return count

    def holds_received(self, node: str, lsn: int, entry: Entry) -> bool:
        """Does the node hold ``entry`` in its store or among its received, unwritten batches?"""
        store = self.stores[node]
        log = store.log
        held: Entry | None = log[lsn - 1] if lsn <= len(log) else None
        for write in self.rt[node].writes:
            batch = write.accepted
            cut = batch.truncate_after_lsn
            if cut is not None and cut < lsn:
                held = None
            entries = batch.entries
            if entries and entries[0].lsn <= lsn <= entries[-1].lsn:
                held = entries[lsn - entries[0].lsn]
        return held == entry

    def set_log(self, node: str, new_log: list[Entry], first: int) -> None:
        """Replace ``node``'s log (``new_log[:first]`` is unchanged) and check it."""
        store = self.stores[node]
        removed = store.log[first:]
        store.log = new_log
        store.refresh()
        try:
            self.rchecker.log_changed(node, new_log, first, removed, self.durable[node].epoch)
        except InvariantViolation as exc:
            raise self.violation(exc) from None

    def append_log(self, node: str, entries: Sequence[Entry]) -> None:
        """Append to ``node``'s log and check it."""
        store = self.stores[node]
        first = len(store.log)
        store.log.extend(entries)
        store.refresh()
        try:
            self.rchecker.log_changed(node, store.log, first, (), self.durable[node].epoch)
        except InvariantViolation as exc:
            raise self.violation(exc) from None

    def claim_commit(self, node: str, commit_lsn: int) -> None:
        """A replica's commit LSN, checked against the committed sequence."""
        rt = self.rt[node]
        if commit_lsn > rt.known_commit:
            rt.known_commit = commit_lsn
        try:
            self.rchecker.commit_reported(node, self.stores[node].log, commit_lsn)
        except InvariantViolation as exc:
            raise self.violation(exc) from None

    # ----------------------------------------------------------------- election hooks

    def driver_of(self, node: str) -> ReplicaDriver:
        """The node's ``ReplicaDriver`` and ``ReplicaCore``, made over its store as a
        starting replica process makes them (the core's floor is the stored epoch)."""
        rt = self.rt[node]
        if rt.driver is None:
            store = self.stores[node]
            self.reconcile(node)
            db = store.db
            meta = db.meta()
            core = ReplicaCore(
                CoreConfig(node, {x: x for x in self.nodes}, self.slave_retention),
                stored_epoch=meta.epoch,
                log=LogPosition(meta.last_lsn, db.log_start_lsn()),
            )
            rt.driver = ReplicaDriver(
                node,
                core,
                db,
                gate_from_store(db),
                follower_config=self.follower_cfg[node],
                on_committed=lambda: None,
                on_fault=lambda why: self.note(f"{node} fault", why),
            )
        return rt.driver

    def reconcile(self, node: str) -> None:
        """The checker's view follows a store a machine crash took back to its last flush
        (an unfinished snapshot install leaves the store as it was)."""
        store = self.stores[node]
        meta = store.db.meta()
        if meta.last_lsn < len(store.log):
            self.note(f"{node} store lost", f"LSNs {meta.last_lsn + 1}..{len(store.log)}")
            if not self.power_safe:
                self.rchecker.degrade(
                    f"t={self.now_ms}: node {node}'s machine crashed and lost LSNs "
                    f"{meta.last_lsn + 1}..{len(store.log)} it had written without a flush "
                    f"({self.params.replica_sync.name})"
                )
            self.set_log(node, store.log[: meta.last_lsn], meta.last_lsn)
        store.log_start = store.db.log_start_lsn()
        self.check_store(node)

    def order(self, node: str, cmd: RoleCommand | None, reason: str = "") -> Effects:
        """A role command (None: DEACTIVATE) put to the node's ``ReplicaCore``."""
        driver = self.driver_of(node)
        meta = driver.store.meta()
        if cmd is None or cmd.kind is RoleCommandKind.DEACTIVATE:
            order = RoleOrder(int(CoreRole.INACTIVE), reason=reason or "coordinator")
        else:
            role = CoreRole.MASTER if cmd.kind is RoleCommandKind.MASTER else CoreRole.SLAVE
            order = RoleOrder(
                int(role),
                epoch=cmd.epoch,
                master_id=cmd.master_id,
                members=tuple(cmd.members),
                sync_source_id=cmd.sync_source_id,
                seq=cmd.seq,
                cluster_id=cmd.cluster_id,
            )
        return driver.core.role_command(order, self.now_ms, StoreFacts(meta.epoch, meta.cluster_id))

    def apply_role(self, node: str, cmd: RoleCommand | None) -> tuple[str, StartTaking | None]:
        """A role command (None: DEACTIVATE) put to the node's ``ReplicaCore``, its effects
        carried out by ``ReplicaDriver.role_steps`` in the order ``core.Effects``
        documents, each step the driver leaves to the shell done as
        ``RoleApplication.apply_effects`` does it, over this simulator's streams and
        catch-up; returns the core's refusal ("" when none) and the master role to take
        (the shell's background task, which the caller starts once the command is
        applied)."""
        driver = self.driver_of(node)
        start: StartTaking | None = None
        try:
            for step in driver.role_steps(self.order(node, cmd)):
                if isinstance(step, CancelTaking):
                    self.cancel_taking(node, step.why)
                elif isinstance(step, DropRole):
                    self.teardown(node, step.reason)
                elif isinstance(step, RecordClusterId | PersistRole):
                    driver.write_role(step)
                elif isinstance(step, StartTaking):
                    # What the role before left in this shell goes (a deposed master's
                    # streams, a slave's stream and the batch being written).
                    self.teardown(node, f"now master of epoch {step.take.epoch}")
                    start = step
                elif isinstance(step, FollowMaster):
                    # The commit lock: the batch being written finishes, the stream ends.
                    self.teardown(node, f"now following {step.follow.master_id}")
                    driver.follow(step.follow, self.now_ms)
                elif isinstance(step, RenewMembers):
                    self.renew_members(node, step.members)
                # JoinTaking: the catch-up under way answers the command.
        except ServiceError as exc:
            return exc.message, None
        return "", start

    def cancel_taking(self, node: str, why: str) -> None:
        """The core abandoned the master role being taken (``TakingMaster.cancel``): the
        catch-up stops, and the driver re-reads committed reads from what was stored."""
        rt = self.rt[node]
        if rt.catchup is None and not rt.taking:
            return  # the attempt ended already
        self.note(f"{node} abandons taking the master role", why)
        rt.catchup = None
        rt.taking = 0
        driver = self.driver_of(node)
        driver.taking_stopped(gate_from_store(driver.store))

    def deactivate_replica(self, node: str) -> None:
        """Stop serving: depose a master, wait for a slave's pending writes, drop the role."""
        self.apply_role(node, None)
        super().deactivate_replica(node)

    def follow_master(self, node: str, cmd: RoleCommand) -> None:
        """The replica's core takes the slave role (the driver makes its Follower)."""
        refusal, _ = self.apply_role(node, cmd)
        if refusal:
            self.note(f"{node} refuses slave role", refusal)
            self.stores[node].role = Role.INACTIVE
            self.driver_recovers(node, refusal)
            return
        super().follow_master(node, cmd)
        self.role_taken(node, cmd.epoch)
        rt = self.rt[node]
        rt.master_id, rt.epoch = cmd.master_id, cmd.epoch
        rt.stream = rt.last_hello = None
        rt.core_stream = 0

    def become_master(self, node: str, cmd: RoleCommand) -> None:
        """Take the master role as the core says: catch up from the sync source, then
        serve as master of ``cmd.epoch``; a reissued command of the epoch renews the
        members or joins the catch-up under way."""
        replica = self.stores[node]
        reissue = replica.role is Role.MASTER and replica.epoch == cmd.epoch
        logs = {x: (r.last_epoch, r.last_lsn) for x, r in self.replicas.items()}
        try:
            self.checker.check_master(node, cmd, logs, self.durable, reissue)
        except InvariantViolation as exc:
            raise self.fail(str(exc)) from None
        refusal, start = self.apply_role(node, cmd)
        if refusal:
            self.give_up(node, refusal)
            return
        if start is None:
            return  # members renewed, or the catch-up under way continues
        take = start.take
        self.role_taken(node, take.epoch)
        replica.take_role(cmd.cluster_id)
        replica.role, replica.epoch, replica.master = Role.MASTER, take.epoch, node
        self.start_taking(node, take, start.persist)

    def start_taking(self, node: str, take: TakeMaster, persist: PersistRole) -> None:
        """The task taking the master role (``TakingMaster.become_master``): persist the
        epoch as the core says, catch up from the sync source unless this node is it, then
        serve."""
        rt = self.rt[node]
        rt.taking = take.epoch
        # A machine crash may have taken the store back: the fetch starts from what it
        # holds, and so does the checker's view.
        self.reconcile(node)
        try:
            self.driver_of(node).take_master_persist(persist, take.members)
        except ServiceError as exc:
            self.give_up(node, exc.message)
            return
        rt.epoch, rt.members = take.epoch, take.members
        source = take.sync_source_id
        if not source or source == node or not self.catch_up_needed(node, take):
            self.start_serving(node)
            return
        rt.catchup = CatchUp(source, self.now_ms + self.catchup_timeout_ms, 0)
        self.note(f"{node} catch-up", f"from {source} for epoch {take.epoch}")
        if self.healed_at is None and self.rrng.random() < self.params.source_fault_p:
            self.source_fault(source)
        self.request_catchup(node)

    def catch_up_needed(self, node: str, take: TakeMaster) -> bool:
        """A new master brings its store to its sync source's state first (a planted bug
        skips it)."""
        return True

    def role_taken(self, node: str, epoch: int) -> None:
        """Role epochs never decrease."""
        try:
            self.rchecker.role_taken(node, epoch)
        except InvariantViolation as exc:
            raise self.violation(exc) from None

    def renew_members(self, node: str, members: tuple[str, ...]) -> None:
        """A master renewal naming another group (the core's ``RenewMembers``), as
        ``RoleApplication._renew_members`` tells the epoch's replication: the group
        shrank within the epoch. (A command repeating the master role being taken joins
        it instead: that attempt keeps the members it was given.)"""
        rt = self.rt[node]
        core = rt.core
        if core is None or core.deposed or set(members) == set(core.members):
            return
        rt.members = members
        for gone in set(core.members) - set(members):
            rt.last_heard.pop(gone, None)
            rt.reconnect_at.pop(gone, None)
            rt.backoff.pop(gone, None)
        try:
            actions = core.set_members(list(members))
        except ReplicationError as exc:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {node} (master, epoch {core.epoch}) cannot take members "
                f"{','.join(members)}: {exc}",
            ) from exc
        self.apply_master(node, core, actions)

    def teardown(self, node: str, reason: str) -> None:
        """Drop whatever role the replica had (in-process: deposes, flushes pending writes)."""
        rt = self.rt[node]
        core = rt.core
        if core is not None:
            rt.core = None
            rt.zombie = core
            if not core.deposed:
                self.apply_master(node, core, core.depose(reason))
        rt.catchup = None
        rt.members = ()
        rt.gen += 1  # store completions already scheduled belong to the old role
        rt.last_heard.clear()
        rt.reconnect_at.clear()
        rt.backoff.clear()
        rt.stalled.clear()
        while rt.writes:  # the node waits for the batch being written
            self.finish_write(node, send_ack=False)
        rt.stream = rt.last_hello = None
        rt.core_stream = 0
        rt.deferred.clear()

    def crash(self, node: str) -> None:
        """A process crash: the store stays, the replica's volatile state goes."""
        if self.elections[node] is None:
            return
        super().crash(node)
        rt = self.rt[node]
        lost = sum(len(w.accepted.entries) for w in rt.writes)
        if lost and self.params.replica_sync == SyncPolicy.NO_SYNC:
            self.rchecker.degrade(
                f"t={self.now_ms}: node {node} crashed holding {lost} received, unwritten "
                "entries it had acknowledged (NO_SYNC)"
            )
            self.note(f"{node} degraded", self.rchecker.degraded)
        store = self.stores[node]
        store.synced_lsn = len(store.log)  # the OS writes back what a dead process wrote
        self.rt[node] = Runtime(gen=rt.gen + 1, zombie=None)

    def new_cluster_id(self, node: str) -> str:
        """The stores' cluster id: minted once, at the first formation (the base checks)."""
        return CLUSTER_ID

    def give_up(self, node: str, reason: str) -> None:
        """The replica refuses the master role; its coordinator recovers (node.py's way)."""
        self.note(f"{node} refuses master role", reason)
        self.teardown(node, reason)
        rt = self.rt[node]
        if rt.taking:
            epoch, rt.taking = rt.taking, 0
            error = ServiceError(Code.FAILED_PRECONDITION, reason)
            self.driver_of(node).taking_finished(epoch, error, self.now_ms)
        self.stores[node].role = Role.INACTIVE
        self.driver_recovers(node, reason)

    def heal(self) -> None:
        """End of the safety phase; replication links behave like TCP from now on."""
        super().heal()
        self.repl_loss = 0.0
        self.repl_dup = 0.0
        self.fifo = True

    # ----------------------------------------------------------------- master side

    def request_catchup(self, node: str) -> None:
        """Ask the sync source for its log after ours (``ReplicaDriver.fetch_request``)."""
        rt = self.rt[node]
        if rt.catchup is None:
            return
        request = self.driver_of(node).fetch_request(rt.epoch, FETCH_STEP_ENTRIES)
        rt.catchup.next_try_ms = self.now_ms + 4 * RTICK_MS
        self.net_send(node, rt.catchup.source, CatchUpRequest(rt.epoch, request))

    def serve_catchup(self, node: str, src: str, body: CatchUpRequest) -> None:
        """The sync source answers from its store as ``SyncSource.fetch_log`` does: its
        driver decides (``fetch_answer``) and ``FetchServing`` builds the messages; the
        answer is read at once (nothing changes the store meanwhile in this simulator)
        and travels as one network message."""
        store = self.stores[node]
        driver = self.driver_of(node)
        request = body.request
        try:
            answer = driver.fetch_answer(
                request,
                is_master=driver.core.role == CoreRole.MASTER,
                step_max=FETCH_STEP_ENTRIES,
            )
        except ServiceError as exc:
            reply = CatchUpReply(body.epoch, request.last_lsn, (), (), exc.code.name, exc.message)
            self.net_send(node, src, reply)
            return
        # The messages of the answer, as ``SyncSource.fetch_log`` sends them.
        serving = FetchServing(answer, lambda: driver.gate.commit_lsn)
        responses: list[replica_pb2.FetchLogResponse] = []
        if serving.snapshot:
            responses.extend(serving.snapshot_chunk(c) for c in self.export_snapshot(node))
            serving.snapshot_sent(store.db.meta().last_lsn)
        else:
            responses.append(serving.opening())
        while (read := serving.next_read()) is not None:
            response = serving.entries_read(driver.store.read_log(*read))
            if response is None:
                break
            responses.append(response)
        reply = CatchUpReply(body.epoch, request.last_lsn, tuple(responses), tuple(store.log))
        self.net_send(node, src, reply)

    def export_snapshot(self, node: str) -> list[replica_pb2.SnapshotChunk]:
        """The store's snapshot as the snapshot pump reads it (one read transaction), its
        last chunk stamped with this node's commit LSN as ``ReplicaNode`` does."""
        db = self.stores[node].db
        chunks = list(db.snapshot_chunks(records_max=self.snapshot_records))
        self.driver_of(node).stamp_snapshot(chunks[-1])
        return chunks

    def install_chunk(
        self,
        node: str,
        chunk: replica_pb2.SnapshotChunk,
        *,
        last: bool,
        history: Sequence[tuple[int, int]],
        ghost: Sequence[Entry],
        source: str,
    ) -> int | None:
        """One snapshot chunk into the store by ``ReplicaDriver.install_snapshot``, as
        ``SlaveSide.install_snapshot_chunk`` installs it (a slave's stream and a new
        master's fetch share it), its store operations run at once; after the last, the
        checker's view becomes the log the snapshot was built from. Returns the
        snapshot's LSN once installed."""
        store = self.stores[node]
        driver = self.driver_of(node)
        lsn = run_store_steps(
            driver.install_snapshot(chunk, last=last, history=history, source=source)
        )
        if lsn is None:
            return None
        staged = list(ghost)
        if len(staged) != lsn or any(e.lsn != i + 1 for i, e in enumerate(staged)):
            raise self.fail(f"node {node}: snapshot at {lsn} built from {len(staged)} entries")
        first = 0
        limit = min(len(staged), len(store.log))
        while first < limit and staged[first] == store.log[first]:
            first += 1
        self.set_log(node, staged, first)
        store.snapshot_lsn = lsn
        store.log_start = lsn + 1
        store.synced_lsn = lsn
        self.check_store(node)
        return lsn

    def check_store(self, node: str) -> None:
        """The real store's log ends where the checker's view of it does."""
        store = self.stores[node]
        meta = store.db.meta()
        last_epoch = store.log[-1].epoch if store.log else 0
        if (meta.last_lsn, meta.last_epoch) != (len(store.log), last_epoch):
            raise self.fail(
                f"invariant: node {node}'s store's log ends at {meta.last_epoch}/{meta.last_lsn}, "
                f"the simulator's view at {last_epoch}/{len(store.log)}"
            )

    def on_catchup_reply(self, node: str, src: str, reply: CatchUpReply) -> None:
        """The sync source's answer, stepped by the driver (``fetch_step``) in the order
        ``TakingMaster._sync_from`` applies it; then serve."""
        rt = self.rt[node]
        if rt.catchup is None or rt.catchup.source != src or reply.epoch != rt.epoch:
            return
        store = self.stores[node]
        if reply.error_code:
            # As ``TakingMaster._sync_from``: a refused fetch fails the attempt.
            self.give_up(node, f"sync source {src} refused the fetch: {reply.error}")
            return
        driver = self.driver_of(node)
        tail = driver.fetch_begin()
        if tail.last_lsn != reply.request_last_lsn:
            return  # an answer to a request from another log state: wait for the retry
        sync = self.params.master_sync == SyncPolicy.SYNC
        try:
            for response in reply.responses:
                step = driver.fetch_step(tail, response, rt.epoch, src)
                if isinstance(step, InstallFetched):
                    chunk = step.chunk
                    driver.check_fetched_snapshot(
                        chunk, rt.epoch, src, after_entries=tail.entries > 0
                    )
                    lsn = self.install_chunk(
                        node,
                        chunk,
                        last=chunk.last,
                        history=[(b.epoch, b.start_lsn) for b in chunk.history],
                        ghost=reply.ghost,
                        source=f"sync source {src}",
                    )
                    driver.fetched_chunk_installed(tail, chunk, lsn)
                elif isinstance(step, TruncateFetched):
                    self.truncate(node, step.keep_lsn)
                    self.request_catchup(node)  # and fetch again, from the truncated log
                    return
                elif isinstance(step, StoreFetched):
                    run_store_steps(driver.store_fetched(tail, step, sync=sync))
                    self.append_log(node, step.entries)
        except ServiceError as exc:
            self.give_up(node, exc.message)
            return
        except StoreError as exc:
            self.give_up(node, f"storing the log fetched from {src} failed: {exc}")
            return
        driver.fetch_finished()
        self.check_store(node)
        store.synced_lsn = len(store.log)
        self.note(f"{node} caught up", f"from {src}: log now ends at {len(store.log)}")
        rt.catchup = None
        self.start_serving(node)

    def truncate(self, node: str, keep_lsn: int) -> None:
        """Truncates the node's log after keep_lsn as ``Truncation.truncate_locked`` does:
        the driver's check (a log that no longer starts at LSN 1 cannot be replayed:
        FAILED_PRECONDITION, it needs a snapshot), then the store is rebuilt from its
        own log (``rebuild.rebuild_into``, here into a fresh in-memory store, where the
        shipped code stages and swaps an LMDB store) and the driver follows."""
        store = self.stores[node]
        driver = self.driver_of(node)
        # This store can truncate: it is rebuilt here as the LMDB truncator rebuilds.
        driver.check_truncation(keep_lsn, "simulated", can_truncate=True)
        fresh = Store.open_memory(keep_unsynced=True)
        rebuild_into(store.db, fresh, keep_lsn)
        fresh.sync()  # as the LMDB truncator flushes the staged store before the swap
        store.db = fresh
        driver.truncated(keep_lsn, fresh)
        self.note(f"{node} truncated", f"after LSN {keep_lsn}")
        self.set_log(node, store.log[:keep_lsn], keep_lsn)
        store.synced_lsn = min(store.synced_lsn, keep_lsn)
        self.check_store(node)

    def start_serving(self, node: str) -> None:
        """The end of ``TakingMaster.become_master``: the driver makes the epoch's
        ReplicationMaster over the store and holds the role (``hold_master``); the
        streams open and the writer plans and appends the epoch start (``StartEpoch``);
        once appended the attempt has ended (``taking_finished``)."""
        store, rt = self.stores[node], self.rt[node]
        driver = self.driver_of(node)
        try:
            core: ReplicationMaster[int] = driver.hold_master(
                self.master_cfg[node], rt.epoch, rt.members
            )
        except ServiceError as exc:
            self.give_up(node, exc.message)
            return
        rt.core = core
        rt.zombie = None
        rt.backoff.clear()
        self.rchecker.master_started(node, rt.epoch, core.commit_lsn)
        self.note(f"{node} serving", f"master of epoch {rt.epoch}, log ends at {len(store.log)}")
        for slave in core.members:
            if slave != node:
                self.open_stream(node, core, slave)
        planned = driver.plan_batch(
            [commands.StartEpoch(epoch=rt.epoch, master_id=node)],
            limits=topic_state.LIMITS,
            epoch=core.epoch,
            now_ms=0,
        )
        if planned.refused or planned.faults:
            raise self.fail(f"node {node}: the epoch start was refused: {planned}")
        for entry in planned.entries:
            self.master_store(node, core, entry)
        if core.deposed:
            return  # the epoch start's flush failed (flush_failed): the process goes down
        if rt.taking:
            epoch, rt.taking = rt.taking, 0
            driver.taking_finished(epoch, None, self.now_ms)

    def master_store(
        self, node: str, core: ReplicationMaster[int], entry: replica_pb2.LogEntry
    ) -> None:
        """The writer stores one entry of this master's epoch and hands it to the steps."""
        try:
            self.rchecker.entry_created(node, entry)
        except InvariantViolation as exc:
            raise self.violation(exc) from None
        driver = self.driver_of(node)
        # As ``Writer._commit``: written unflushed and handed to the steps (the batch
        # leaves for the slaves), then, under SYNC, flushed and reported flushed.
        driver.store_append((entry,), sync=False, commit_lsn=core.commit_lsn)
        driver.batch_appended(entry.lsn, core.commit_lsn)
        self.append_log(node, (entry,))
        self.master_report(node, core)
        steps = self.steps_of(node, core)
        steps.appended((entry,), synced=False)
        if not steps.flush_after_send() or core.deposed:
            return
        # The flush runs on the store thread while the batch is out, and ends a store
        # delay later: acks may come back before it, a crash may fall in between.
        delay = self.flush_rng.randint(0, self.params.store_delay_max_ms)
        self.push(self.now_ms + delay, _FLUSH, node, (self.rt[node].gen, core.epoch))

    def master_flush(self, node: str, epoch: int) -> None:
        """The master's flush ends: it succeeded (the core counts what it covers) or
        failed after the batch went out (``flush_failed``). A deposed master's flush
        still runs, as ``Writer._flush`` does, and tells the core nothing new."""
        store = self.stores[node]
        core = self.core_for(node, epoch)
        if core is None or store.synced_lsn >= len(store.log):
            return
        if self.healed_at is None and self.flush_rng.random() < self.flush_fail_p:
            self.flush_failed(node, core, core.last_lsn)
            return
        self.driver_of(node).store_sync()
        store.synced_lsn = len(store.log)
        self.steps_of(node, core).synced(core.last_lsn)

    def flush_failed(self, node: str, core: ReplicationMaster[int], lsn: int) -> None:
        """The master's flush failed after the batch went out: the writer deposes the
        master (``MasterSteps.sync_failed``: its writes fail as indeterminate) and fails
        the store; the disk never got the write (its machine loses what was not flushed)
        and the process is restarted later, as an operator clears the fault."""
        self.flush_failures += 1
        self.note(f"{node} flush failed", f"after sending LSN {lsn} (epoch {core.epoch})")
        self.steps_of(node, core).sync_failed("simulated EIO")
        self.push(self.now_ms, _FLUSH_FAILED, node, self.rt[node].gen)

    def open_stream(self, node: str, core: ReplicationMaster[int], slave: str) -> None:
        """Connect to a member slave: a new stream and its Hello."""
        rt = self.rt[node]
        stream = core.connect(slave)
        rt.last_heard[slave] = self.now_ms
        rt.reconnect_at.pop(slave, None)
        self.net_send(node, slave, Hello(core.epoch, stream, self.stores[node].cluster_id))

    def stream_broken(
        self, node: str, core: ReplicationMaster[int], slave: str, stream: int
    ) -> None:
        """A stream is gone (``MasterSteps.stream_ended``); when a new one is due, it opens
        after the shipped backoff, which starts over once the stream was opened (its
        slave answered the Hello), as ``MasterDriver._run_link`` counts it."""
        if not self.steps_of(node, core).stream_ended(slave, stream):
            return
        rt = self.rt[node]
        opened = rt.answered.get(slave) == (core.epoch, stream, True)
        backoff = rt.backoff.setdefault(slave, ReconnectBackoff())
        rt.reconnect_at[slave] = self.now_ms + backoff.after(opened=opened)

    def core_for(self, node: str, epoch: int) -> ReplicationMaster[int] | None:
        """The master core (live or deposed) of ``epoch`` on this node, if any."""
        rt = self.rt[node]
        for core in (rt.core, rt.zombie):
            if core is not None and core.epoch == epoch:
                return core
        return None

    def steps_of(self, node: str, core: ReplicationMaster[int]) -> MasterSteps[int]:
        """The shipped ``MasterSteps`` that apply this master core's Actions, made once per
        core with this simulator's outputs (the part ``MasterDriver`` does with streams)."""
        rt = self.rt[node]
        steps = rt.steps.get(id(core))
        if steps is not None and steps.core is core:
            return steps
        store = self.stores[node]

        def completed(tokens: Sequence[int]) -> None:
            self.master_report(node, core)
            self.writes_completed(node, core, tokens)

        def failed(tokens: Sequence[int]) -> None:
            for token in tokens:
                _, client, pid = rt.tokens.pop(token)
                self.topic_tokens.pop(token, None)
                self.net_send(node, client, ClientReply(pid, "fail", ""))

        def close_stream(slave: str, stream: int, reason: str) -> None:
            self.net_send(node, slave, Close(core.epoch, stream, reason, to_master=False))
            self.stream_broken(node, core, slave, stream)

        steps = MasterSteps(
            node,
            core,
            lambda: store.db,
            MasterOutputs(
                send=lambda slave, request: self.send_request(node, core, slave, request),
                heartbeat=lambda slave, request: self.send_request(node, core, slave, request),
                snapshot=lambda slave: self.send_snapshot(node, core, slave),
                close_stream=close_stream,
                completed=completed,
                failed=failed,
                committed=lambda _lsn: self.master_report(node, core),
                room=lambda: None,
                deposed=lambda why: self.master_deposed(node, core, why),
                fault=lambda why: self.note(f"{node} fault", why),
            ),
            tail_bytes_max=2 * self.params.window_bytes,
            log_start_lsn=store.log_start,
        )
        rt.steps[id(core)] = steps
        return steps

    def master_deposed(self, node: str, core: ReplicationMaster[int], why: str) -> None:
        """The replication core deposed itself (a slave of a newer epoch, a lost group):
        the replica's core drops the role as ``ReplicaNode`` has it do, and the report
        the coordinator reads says so. (A role change deposes the core on its own.)"""
        self.note(f"{node} deposed", why)
        if self.rt[node].core is core:
            self.driver_of(node).deposed(why)
            self.stores[node].role = Role.INACTIVE

    def apply_master(self, node: str, core: ReplicationMaster[int], actions: Actions[int]) -> None:
        """One Actions record, applied by the shipped ``MasterSteps`` in its documented
        order; the checker first hears the commit LSN the core reports with it."""
        self.master_report(node, core, actions.commit_lsn)
        self.steps_of(node, core).apply(actions)

    def master_report(self, node: str, core: ReplicationMaster[int], commit_lsn: int = -1) -> None:
        """The checker hears a master core's commit LSN (by default its current one): it
        never goes back, never moves once deposed, and whoever it counts holds the entries."""
        if commit_lsn < 0:
            commit_lsn = core.commit_lsn
        log = self.stores[node].log
        before = self.rchecker.core_commit.get((node, core.epoch), 0)
        try:
            self.rchecker.master_reported(
                node, core.epoch, commit_lsn, bool(core.deposed), log, self.holders
            )
        except InvariantViolation as exc:
            raise self.violation(exc) from None
        if commit_lsn > before and not self.rchecker.degraded:
            self.check_vouched(node, core, before, commit_lsn)
        if not core.deposed:
            self.claim_commit(node, commit_lsn)

    def send_request(
        self,
        node: str,
        core: ReplicationMaster[int],
        slave: str,
        request: replica_pb2.ReplicateRequest,
    ) -> None:
        """A batch or heartbeat ``MasterSteps`` built, sent on the slave's current stream."""
        stream = core.progress(slave).stream_id
        if not stream:
            return  # no stream open: the real driver's heartbeat is dropped as well
        if request.WhichOneof("body") == "heartbeat":
            hb = request.heartbeat
            self.net_send(node, slave, Heartbeat(hb.epoch, stream, hb.commit_lsn))
            return
        batch = request.entries
        self.net_send(
            node,
            slave,
            Batch(
                batch.epoch,
                stream,
                tuple(batch.entries),
                batch.commit_lsn,
                batch.truncate_after_lsn or None,
            ),
        )

    def writes_completed(
        self, node: str, core: ReplicationMaster[int], tokens: Sequence[int]
    ) -> None:
        """Committed writes: checked, then answered."""
        rt = self.rt[node]
        log = self.stores[node].log
        for token in tokens:
            lsn, client, pid = rt.tokens.pop(token)
            entry = log[lsn - 1]
            receipt = self.topic_tokens.pop(token, None)
            if receipt is not None:
                state = self.topic_state(node)
                info = state.get_topic(topic_state.TOPIC)
                self.check_topic(
                    self.rchecker.receipt_acked,
                    node,
                    receipt,
                    info.topic_id if info is not None else 0,
                    topic_state.event_at(state, receipt.offset),
                )
            if receipt is None or not receipt.duplicate:
                try:
                    self.rchecker.write_acked(node, entry, core.commit_lsn, self.holders)
                except InvariantViolation as exc:
                    raise self.violation(exc) from None
            if self.healed_at is not None:
                self.acked_after_heal[(node, core.epoch)] += 1
            self.net_send(node, client, ClientReply(pid, "ok", node))

    def check_vouched(
        self, node: str, core: ReplicationMaster[int], low: int, commit_lsn: int
    ) -> None:
        """Whoever the core says holds a newly committed entry really holds it.

        Claims of a received-only copy are checked only under NO_SYNC: with the other
        policies a crash may discard such a copy without the core (or a promise) relying on it.
        """
        log = self.stores[node].log
        received_counts = self.params.replica_sync == SyncPolicy.NO_SYNC
        for lsn in range(low + 1, commit_lsn + 1):
            entry = log[lsn - 1]
            for holder, level in core.holders(lsn):
                if level == SyncPolicy.NO_SYNC and not received_counts:
                    continue
                theirs = self.stores[holder].log
                if len(theirs) >= lsn and theirs[lsn - 1] == entry:
                    continue
                if level == SyncPolicy.NO_SYNC and self.holds_received(holder, lsn, entry):
                    continue
                raise self.fail(
                    f"invariant: master {node} epoch {core.epoch} commits LSN {lsn} "
                    f"({short(entry)}) counting node {holder} as holding it ({level.name}), "
                    "but that node does not hold it"
                )

    def send_snapshot(self, node: str, core: ReplicationMaster[int], slave: str) -> None:
        """Export the master's store (one read) and send its chunks on the slave's stream."""
        progress = core.progress(slave)
        if progress.state is not SlaveState.SNAPSHOTTING or progress.snapshot_lsn:
            return
        chunks = self.export_snapshot(node)
        lsn = chunks[0].snapshot_lsn
        self.snapshots += 1
        self.apply_master(node, core, core.on_snapshot_started(slave, progress.stream_id, lsn))
        ghost = tuple(self.stores[node].log[:lsn])
        for chunk in chunks:
            self.net_send(
                node,
                slave,
                Chunk(core.epoch, progress.stream_id, chunk, ghost if chunk.last else ()),
            )

    def master_receive(self, node: str, src: str, body: Answer | Close) -> None:
        """Input from a slave's stream, for the master core of its epoch, through the
        shipped steps as ``MasterDriver._stream`` reads it: the stream's first message
        must answer the Hello (``hello_answered``), later ones go to ``received``; a
        slave's Close is its refusal (``refused``: the epoch it names may depose us)."""
        core = self.core_for(node, body.epoch)
        if core is None:
            return
        rt = self.rt[node]
        if core is rt.core and src in rt.last_heard:
            rt.last_heard[src] = self.now_ms
        steps = self.steps_of(node, core)
        if isinstance(body, Answer):
            if core is not rt.core:
                # A deposed master's late input: the core refuses it (its commit stays).
                steps.received(src, body.stream, body.response)
                return
            answered = rt.answered.get(src)
            if answered is not None and answered[:2] == (body.epoch, body.stream):
                if answered[2]:
                    steps.received(src, body.stream, body.response)
                return  # the rest of a stream ended unopened: gRPC delivers none of it
            opened = steps.hello_answered(src, body.stream, body.response)
            rt.answered[src] = (body.epoch, body.stream, opened)
            if not opened:
                # The stream ends unopened: the master cancels it.
                self.net_send(node, src, Close(core.epoch, body.stream, "no-position", False))
                self.stream_broken(node, core, src, body.stream)
            return
        if steps.refused(src, body.reason, body.reason, body.metadata):
            self.stream_broken(node, core, src, body.stream)

    def client_write(self, node: str, src: str, body: ClientWrite) -> None:
        """A client's write reaches a node: append it if this node serves as master."""
        rt = self.rt[node]
        core = rt.core
        if core is None or core.deposed:
            outcome, hint = "redirect", ""
            if rt.catchup is not None:
                outcome, hint = "busy", node
            election = self.elections[node]
            if election is not None and not hint:
                status = election.status()
                if status.state is NodeState.NORMAL and status.coordinator_id != node:
                    hint = status.coordinator_id
            self.net_send(node, src, ClientReply(body.pid, outcome, hint))
            return
        if core.write_room <= 0:
            self.net_send(node, src, ClientReply(body.pid, "busy", node))
            return
        receipt = None
        db = self.stores[node].db
        if body.kind:
            command = topic_state.command(body.kind, body.sequence)
        else:
            # A duplicated request is written again: the name is unique per entry.
            name = f"p{body.pid}-{len(self.stores[node].log) + 1}"
            command = commands.CreateTopic(name, common_pb2.TOPIC_KIND_REPLICATED)
        # The writer's planning (one command per batch here): the production planner over
        # the master's store, publishes hidden from committed reads until they commit.
        planned = self.driver_of(node).plan_batch(
            [command], limits=topic_state.LIMITS, epoch=core.epoch, now_ms=0
        )
        if planned.faults:
            raise self.fail(f"node {node}: {planned.faults}")
        if planned.refused:
            code = planned.refused[0][1].code.name
            self.net_send(node, src, ClientReply(body.pid, f"refused {code}", ""))
            return
        _, plan, lsn = planned.planned[0]
        if body.kind and plan.receipt is not None:
            (ack,) = commands.expand_receipt(plan.receipt)
            info = db.get_topic(topic_state.TOPIC)
            topic_id = info.topic_id if info is not None else 0
            receipt = topic_state.Receipt(topic_id, ack.offset, body.sequence, ack.duplicate)
            if receipt.duplicate:
                self.check_topic(
                    self.rchecker.duplicate_planned,
                    node,
                    receipt,
                    topic_state.event_at(db, receipt.offset),
                )
        for entry in planned.entries:
            self.master_store(node, core, entry)
        if core.deposed:
            self.net_send(node, src, ClientReply(body.pid, "fail", ""))
            return
        self.next_token += 1
        rt.tokens[self.next_token] = (lsn, src, body.pid)
        if receipt is not None:
            self.topic_tokens[self.next_token] = receipt
        # As ``Writer._commit``: the write waits for its entry, or the epoch start.
        wait_lsn = self.steps_of(node, core).wait_lsn(lsn)
        self.apply_master(node, core, core.register_write(wait_lsn, self.next_token))

    def topic_state(self, node: str) -> Store:
        """The node's real store, which its log built (see topic_state.py)."""
        return self.stores[node].db

    def check_topic(self, check: Callable[..., None], *args: object) -> None:
        """Runs one of the checker's topic checks, turning a breach into a failure."""
        try:
            check(*args)
        except InvariantViolation as exc:
            raise self.violation(exc) from None

    def master_tick(self, node: str) -> None:
        """Heartbeats, keepalive, reconnects, flushes and compaction of a serving master."""
        rt = self.rt[node]
        core = rt.core
        if rt.catchup is not None and self.now_ms >= rt.catchup.next_try_ms:
            if self.now_ms >= rt.catchup.deadline_ms:
                self.give_up(
                    node,
                    f"no catch-up from sync source {rt.catchup.source} within "
                    f"{self.catchup_timeout_ms} ms",
                )
                return
            self.request_catchup(node)
        if core is None or core.deposed:
            return
        self.apply_master(node, core, core.tick(self.now_ms))
        for progress in core.status():
            if core.deposed:
                return
            slave = progress.node_id
            if progress.state is SlaveState.DISCONNECTED:
                if rt.reconnect_at.get(slave, 0) <= self.now_ms:
                    self.open_stream(node, core, slave)
            elif self.now_ms - rt.last_heard.get(slave, self.now_ms) > self.keepalive_ms:
                self.note(f"{node} keepalive", f"stream {progress.stream_id} to {slave} silent")
                self.net_send(
                    node, slave, Close(core.epoch, progress.stream_id, "keepalive", False)
                )
                self.stream_broken(node, core, slave, progress.stream_id)
            elif self.stream_stalled(node, progress):
                # A gRPC stream never loses a message and goes on; this network can, so the
                # driver breaks a stream whose in-flight entries stop being received.
                self.note(f"{node} stalled", f"stream {progress.stream_id} to {slave}")
                self.net_send(node, slave, Close(core.epoch, progress.stream_id, "stalled", False))
                self.stream_broken(node, core, slave, progress.stream_id)
        store = self.stores[node]
        if self.params.master_sync != SyncPolicy.SYNC:
            # The OS writes back what the writer left unflushed; the writer tells the core
            # of no flush under these policies (``MasterSteps.flush_after_send``).
            store.synced_lsn = len(store.log)
        if self.params.compaction_p and self.rrng.random() < self.params.compaction_p:
            start = min(core.commit_lsn + 1, len(store.log) + 1)
            if self.rrng.random() < 0.5:
                start = min(start, core.retain_from_lsn())  # no slave needs a snapshot
            if start > store.log_start and not core.deposed:
                # The steps hear of the new log start before the store deletes below it.
                self.master_report(node, core)
                self.steps_of(node, core).set_log_start(start)
                driver = self.driver_of(node)
                driver.store_compact(start)
                driver.compacted()
                store.log_start = start

    # ----------------------------------------------------------------- slave side

    def stream_stalled(self, node: str, progress: SlaveProgress) -> bool:
        """Have entries in flight on this stream gone unreceived for the keepalive period?"""
        stalled = self.rt[node].stalled
        slave = progress.node_id
        in_flight = progress.next_lsn - 1 > progress.received_lsn
        if progress.state not in (SlaveState.STREAMING, SlaveState.PAUSED) or not in_flight:
            stalled.pop(slave, None)
            return False
        mark = (progress.stream_id, progress.received_lsn)
        seen = stalled.get(slave)
        if seen is None or seen[:2] != mark:
            stalled[slave] = (*mark, self.now_ms)
            return False
        if self.now_ms - seen[2] <= self.keepalive_ms:
            return False
        del stalled[slave]
        return True

    def slave_receive(self, node: str, pkt: Packet) -> None:
        """Stream input for the node's ``ReplicaDriver`` (its core's Follower judges it),
        one message at a time, as ``serve_replicate`` and ``ReplicaNode`` take them."""
        rt = self.rt[node]
        body = pkt.body
        src = pkt.src
        if not isinstance(body, Hello | Batch | Heartbeat | Chunk | Close):
            return
        driver = self.driver_of(node)
        key = (src, body.epoch, body.stream)
        if isinstance(body, Close):
            if rt.stream == key:
                rt.stream = None
            return
        if rt.writes:
            # The node holds its commit lock while a batch is written: the next message
            # (of this stream or another) waits.
            rt.deferred.append(pkt)
            return
        if isinstance(body, Hello):
            last = rt.last_hello
            if last is not None and last[:2] == key[:2] and body.stream <= last[2]:
                return  # an old or repeated stream: gRPC would not deliver it
            hello = replica_pb2.ReplicationHello(
                master_id=src, epoch=body.epoch, cluster_id=body.cluster_id
            )
            try:
                stream, position = driver.hello(hello)
            except ServiceError as exc:
                self.reconcile(node)
                self.slave_refused(node, src, body, exc)
                return
            self.reconcile(node)
            rt.stream = rt.last_hello = key
            rt.core_stream = stream
            answer = replica_pb2.ReplicateResponse(position=position)
            self.net_send(node, src, Answer(body.epoch, body.stream, answer))
            return
        if key != rt.stream:
            # A message of a stream that is not this replica's current one: gRPC would
            # have ended that stream; the master hears this replica's epoch.
            said = ((EPOCH_KEY, str(driver.core.epoch)),)
            self.net_send(node, src, Close(body.epoch, body.stream, "no-stream", True, said))
            return
        try:
            if isinstance(body, Batch):
                self.slave_batch(node, body, key)
            elif isinstance(body, Heartbeat):
                heartbeat = replica_pb2.ReplicationHeartbeat(
                    epoch=body.epoch, commit_lsn=body.commit_lsn
                )
                record, ack = driver.heartbeat(rt.core_stream, heartbeat)
                if record:
                    driver.commit_recorded(driver.store_record_commit(record))
                self.send_ack(node, src, body.epoch, body.stream, ack)
                self.claim_slave_commit(node)
            else:
                result, follower = driver.snapshot_chunk(rt.core_stream, body.chunk)
                installed = self.install_chunk(
                    node,
                    body.chunk,
                    last=result.install,
                    history=result.history,
                    ghost=body.ghost,
                    source=f"master {follower.state().master_id}",
                )
                if installed is not None:
                    ack = driver.snapshot_installed_ack(follower, installed)
                    self.send_ack(node, src, body.epoch, body.stream, ack)
                    self.claim_slave_commit(node)
        except ServiceError as exc:
            self.slave_refused(node, src, body, exc)

    def slave_batch(self, node: str, body: Batch, key: StreamKey) -> None:
        """A batch for the driver: the acks due on receipt go out, the write is queued
        (the store's delay), or with nothing to write the commit LSN moves."""
        rt = self.rt[node]
        driver = self.driver_of(node)
        batch = replica_pb2.EntryBatch(
            entries=body.entries,
            epoch=body.epoch,
            commit_lsn=body.commit_lsn,
            truncate_after_lsn=body.truncate_after_lsn or 0,
        )
        accepted, follower, acks_now = driver.batch(rt.core_stream, batch)
        for ack in acks_now:
            self.send_ack(node, key[0], body.epoch, body.stream, ack)
        if accepted.batch is not None:
            rt.writes.append(PendingWrite(accepted.batch, accepted, follower, body, key))
            self.schedule_write(node)
            return
        # Nothing to write: only the log effects (the acks went out on receipt).
        self.batch_steps(node, driver.write_batch(accepted, follower, body.commit_lsn))
        self.claim_slave_commit(node)

    def compact_slave(self, node: str, compact_from: int) -> None:
        """The slave's core asked for its log to be compacted below compact_from (as
        ``Writer.compact``)."""
        driver = self.driver_of(node)
        driver.store_compact(compact_from)
        driver.compacted()
        self.stores[node].log_start = driver.store.log_start_lsn()

    def claim_slave_commit(self, node: str) -> None:
        """The slave's follower knows this much committed (and written)."""
        follower = self.driver_of(node).core.follower
        if follower is not None:
            self.claim_commit(node, follower.commit_lsn)

    def slave_refused(
        self, node: str, src: str, body: Hello | Batch | Heartbeat | Chunk, exc: ServiceError
    ) -> None:
        """Close the stream with the refusal; the master learns the slave's epoch."""
        self.refusals += 1
        rt = self.rt[node]
        if "superseded" not in exc.message:
            self.note(f"{node} refused", exc.message)
        if rt.stream == (src, body.epoch, body.stream):
            rt.stream = None
        close = Close(body.epoch, body.stream, exc.code.name, True, exc.metadata)
        self.net_send(node, src, close)

    def send_ack(
        self, node: str, master: str, epoch: int, stream: int, ack: replica_pb2.ReplicationAck
    ) -> None:
        """An ack on the stream, as ``serve_replicate`` yields it."""
        answer = replica_pb2.ReplicateResponse(ack=ack)
        self.net_send(node, master, Answer(epoch, stream, answer))

    def schedule_write(self, node: str) -> None:
        """The store finishes the pending write after a store delay."""
        rt = self.rt[node]
        delay = self.rrng.randint(0, self.params.store_delay_max_ms)
        if delay == 0:
            self.finish_write(node, send_ack=True)
            return
        self.push(self.now_ms + delay, _STORE, node, rt.gen)

    def finish_write(self, node: str, *, send_ack: bool) -> None:
        """The store's transaction (``SlaveSide.batch``): the driver's ``write_batch``
        steps (truncate, append, compact), then the acks go out on the stream."""
        rt = self.rt[node]
        if not rt.writes:
            return
        write = rt.writes.popleft()
        driver = self.driver_of(node)
        steps = driver.write_batch(write.effects, write.follower, write.batch.commit_lsn)
        try:
            if self.healed_at is None and any(
                start <= self.now_ms < end for start, end in self.full_windows[node]
            ):
                self.full_refusals += 1
                raise StoreFullError("simulated: the store is full")
            acks = self.batch_steps(node, steps)
        except (ServiceError, StoreError) as exc:
            # The truncation failed, or the store is full: the stream closes with the
            # driver's status.
            error, fail_stop = driver.batch_failed(write.follower, exc)
            if fail_stop:
                raise self.fail(f"node {node} fail-stopped: {fail_stop}") from None
            if send_ack and rt.stream == write.key:
                master, epoch, stream = write.key
                rt.stream = None
                close = Close(epoch, stream, error.code.name, True, error.metadata)
                self.net_send(node, master, close)
            if send_ack:
                while rt.deferred and not rt.writes:
                    self.slave_receive(node, rt.deferred.popleft())
            return
        if not send_ack:
            return
        if rt.stream == write.key:
            master, epoch, stream = write.key
            for ack in acks:
                self.send_ack(node, master, epoch, stream, ack)
        self.claim_commit(node, write.follower.commit_lsn)
        while rt.deferred and not rt.writes:
            self.slave_receive(node, rt.deferred.popleft())

    def batch_steps(
        self, node: str, steps: Generator[BatchStep, None, list[replica_pb2.ReplicationAck]]
    ) -> list[replica_pb2.ReplicationAck]:
        """Carries out a batch's store steps in the driver's order
        (``ReplicaDriver.write_batch``), as ``SlaveSide`` does, over this simulator's
        store (a truncation by rebuild, the store's delay already taken); returns the
        acks to send."""
        store = self.stores[node]
        driver = self.driver_of(node)
        try:
            step = next(steps)
            while True:
                if isinstance(step, TruncateLog):
                    self.truncate(node, step.keep_lsn)
                elif isinstance(step, AppendBatch):
                    try:
                        driver.store_append(
                            step.entries, sync=step.sync, commit_lsn=step.commit_lsn
                        )
                    except InvalidEntryError as exc:
                        # A replicated entry the store cannot apply (a topic created twice,
                        # say) means this log and the master's diverged: the replica would
                        # fail-stop on it.
                        raise self.fail(
                            f"invariant: node {node}'s store refused a replicated entry: {exc}"
                        ) from None
                    self.append_log(node, step.entries)
                    if step.sync:
                        store.synced_lsn = len(store.log)
                else:
                    self.compact_slave(node, step.keep_from_lsn)
                step = steps.send(None)
        except StopIteration as done:
            acks: list[replica_pb2.ReplicationAck] = done.value
            return acks

    # ----------------------------------------------------------------- clients

    def client_tick(self, client: Client) -> None:
        """Expire requests, maybe send a new write, and come back later."""
        for pid, deadline in list(client.inflight.items()):
            if deadline <= self.now_ms:
                del client.inflight[pid]
                client.target = self.rrng.choice(self.nodes)
        if not self.quiesced and len(client.inflight) < self.params.client_inflight_max:
            self.next_pid += 1
            client.inflight[self.next_pid] = self.now_ms + CLIENT_TIMEOUT_MS
            kind, sequence = "", 0
            if self.topic_p and self.trng.random() < self.topic_p:
                kind = self.trng.choice(("create", "destroy", "publish", "publish", "publish"))
                sequence = self.trng.randint(1, topic_state.SEQUENCES_MAX)
            self.net_send(
                client.name, client.target, ClientWrite(client.name, self.next_pid, kind, sequence)
            )
        jitter = self.rrng.randint(0, self.params.client_interval_ms // 2)
        self.push(self.now_ms + self.params.client_interval_ms + jitter, _CLIENT, client.name)

    def client_receive(self, client: Client, reply: ClientReply) -> None:
        """A node's answer: redirects move the client to the named node."""
        if client.inflight.pop(reply.pid, None) is None:
            return
        if reply.outcome == "redirect":
            client.target = reply.hint or self.rrng.choice(self.nodes)

    # ----------------------------------------------------------------- events

    def handle(self, kind: int, node: str, payload: object) -> None:
        """Run one event: this module's kinds here, the election's in the base class."""
        if kind == _NET:
            if not isinstance(payload, Packet):
                raise TypeError("packet expected")
            self.deliver(payload)
        elif kind == _RTICK:
            if self.alive(node):
                if self.paused_until[node] > self.now_ms:
                    self.push(self.paused_until[node], _RTICK, node)
                    return
                self.master_tick(node)
            self.push(self.now_ms + RTICK_MS, _RTICK, node)
        elif kind == _STORE:
            if not self.alive(node) or payload != self.rt[node].gen:
                return
            if self.paused_until[node] > self.now_ms:
                self.push(self.paused_until[node], _STORE, node, payload)
                return
            self.finish_write(node, send_ack=True)
        elif kind == _CLIENT:
            self.client_tick(self.client_by_name[node])
        elif kind == _FLUSH:
            if not isinstance(payload, tuple) or not self.alive(node):
                return
            gen, epoch = payload
            if gen != self.rt[node].gen:
                return  # the process restarted: that flush never ran
            if self.paused_until[node] > self.now_ms:
                self.push(self.paused_until[node], _FLUSH, node, payload)
                return
            self.master_flush(node, epoch)
        elif kind == _FLUSH_FAILED:
            if self.alive(node) and payload == self.rt[node].gen:
                self.crash(node)
                self.lose_unsynced(node)
                self.push(self.now_ms + self.flush_rng.randint(30, 900), _RESTART, node)
        elif kind == _MASTER_FAULT:
            if self.healed_at is None and isinstance(payload, tuple):
                self.master_fault(*payload)
        else:
            super().handle(kind, node, payload)

    def master_fault(self, fault: str, duration_ms: int) -> None:
        """Hit the node serving as master (the newest epoch's) with ``fault``."""
        serving = [
            (core.epoch, node)
            for node in self.nodes
            if (core := self.rt[node].core) is not None and not core.deposed
        ]
        if not serving:
            return
        master = max(serving)[1]
        others = [x for x in self.nodes if x != master]
        self.note(f"{master} master fault", f"{fault} for {duration_ms} ms")
        if fault == "crash-slave":
            # Whichever slave is busiest writing: under NO_SYNC it loses acknowledged entries.
            slave = max(others, key=lambda x: (len(self.rt[x].writes), x))
            self.crash(slave)
            if self.power_loss and self.frng.random() < 0.5:
                self.lose_unsynced(slave)
            self.push(self.now_ms + duration_ms, _RESTART, slave)
            return
        if fault.startswith("crash"):
            self.crash(master)
            if self.power_loss and self.frng.random() < 0.5:
                self.lose_unsynced(master)
            if fault == "crash-restart":
                self.push(self.now_ms + duration_ms, _RESTART, master)
            return
        if fault == "pause":
            self.paused_until[master] = self.now_ms + duration_ms
            return
        pairs: set[tuple[str, str]] = set()
        if fault in ("isolate", "mute"):
            pairs |= {(master, x) for x in others}
        if fault in ("isolate", "deaf"):
            pairs |= {(x, master) for x in others}
        self.push(self.now_ms, _CUT, "", frozenset(pairs))
        self.push(self.now_ms + duration_ms, _UNCUT, "", frozenset(pairs))

    def lose_unsynced(self, node: str) -> None:
        """The crashed node's machine lost power: its store goes back to its last flush
        (``MemoryKV.lose_unsynced``) and the restarted process reopens it."""
        store = self.stores[node]
        kv = store.db._kv  # the MemoryKV under the store (a test may reach it)
        if not isinstance(kv, MemoryKV):
            raise TypeError("the simulator's stores are in memory")
        lost = kv.lose_unsynced()
        store.db = Store(kv)
        self.note(f"{node} power loss", f"{lost} unflushed transactions lost")
        self.reconcile(node)

    def source_fault(self, source: str) -> None:
        """The sync source fails as the new master asks it: crashed, or cut off, a while."""
        duration_ms = self.rrng.randint(100, 900)
        self.note(f"{source} sync source fault", f"for {duration_ms} ms")
        if self.rrng.random() < 0.5:
            self.push(self.now_ms, _CRASH, source)
            self.push(self.now_ms + duration_ms, _RESTART, source)
            return
        pairs = frozenset(
            pair for x in self.nodes if x != source for pair in ((x, source), (source, x))
        )
        self.push(self.now_ms, _CUT, "", pairs)
        self.push(self.now_ms + duration_ms, _UNCUT, "", pairs)

    def deliver(self, pkt: Packet) -> None:
        """A message arrives, unless its node is down or cut off (a paused node waits)."""
        dst = pkt.dst
        client = self.client_by_name.get(dst)
        if client is not None:
            if isinstance(pkt.body, ClientReply):
                self.client_receive(client, pkt.body)
            return
        if not self.alive(dst):
            return
        if pkt.src in self.rt and self.cut[(pkt.src, dst)]:
            return
        if self.paused_until[dst] > self.now_ms:
            self.push(self.paused_until[dst], _NET, dst, pkt)
            return
        body = pkt.body
        self.note("deliver", f"{pkt.src}->{dst} {describe(body)}")
        if isinstance(body, Answer) or (isinstance(body, Close) and body.to_master):
            self.master_receive(dst, pkt.src, body)
        elif isinstance(body, CatchUpRequest):
            self.serve_catchup(dst, pkt.src, body)
        elif isinstance(body, CatchUpReply):
            self.on_catchup_reply(dst, pkt.src, body)
        elif isinstance(body, ClientWrite):
            self.client_write(dst, pkt.src, body)
        else:
            self.slave_receive(dst, pkt)

    # ----------------------------------------------------------------- liveness

    def replication_converged(self, leader: str) -> bool:
        """The leader serves; every live replica holds its log, all of it committed."""
        rt = self.rt[leader]
        core = rt.core
        if core is None or core.deposed:
            return False
        if not self.quiesced:
            if self.acked_after_heal[(leader, core.epoch)] >= LIVENESS_WRITES:
                self.quiesced = True  # clients stop: the rest is catching up
                self.drain_deadline_ms = self.drain_deadline(leader)
            return False
        log = self.stores[leader].log
        if core.pending_writes or core.commit_lsn != len(log):
            return False
        for node in self.nodes:
            if node == leader or not self.alive(node):
                continue
            other = self.rt[node]
            follower = other.driver.core.follower if other.driver is not None else None
            if (
                follower is None
                or other.epoch != core.epoch
                or other.writes
                or len(self.stores[node].log) != len(log)
                or follower.commit_lsn != len(log)
            ):
                return False
        return True

    def drain_deadline(self, leader: str) -> int:
        """When the live replicas must hold the master's log, counted from when the clients
        stop: one window per round trip for what the furthest behind lacks.

        The window is the configured flow control (``inflight_entries_max`` and
        ``inflight_bytes_max``, 1 entry and 1 byte at least in the service's
        configuration): a slave takes at most one window per round trip, and a window of
        one entry, or of fewer bytes than two entries, is stop-and-wait, one entry per
        round trip. After healing a round trip takes up to twice the network's delay
        (``delay_max_ms``, an eighth of the member timeout) plus a store write (a written
        ack waits for it), whatever the master does. The fixed deadline after healing
        (``LIVENESS_DEADLINE_MS``) holds a pipelined window's catch-up, not that of a
        one-entry window with a long backlog: seed 6345 (a one-entry, 64-byte window,
        acks ALL, round trips up to 100 ms) had slaves 55 entries behind when the clients
        stopped 2.6 s after healing, one entry per round trip as configured, and
        converged 5.6 s after healing. The bound is the configured window's worst case: it
        outlasts the fixed deadline only where the window makes the catch-up long (3 seeds
        of 0-999 and 5000-7999). That every ack is answered with a full window is
        ``tests/unit/test_replication.py``'s
        ``test_a_slave_40_entries_behind_takes_a_full_window_per_round_trip``."""
        log = self.stores[leader].log
        lacking, first = 0, len(log)
        for node in self.nodes:
            if node == leader or not self.alive(node):
                continue
            theirs = self.stores[node].log
            common = 0
            while common < min(len(theirs), len(log)) and theirs[common] == log[common]:
                common += 1
            lacking = max(lacking, len(log) - common)
            first = min(first, common)
        # The writes still unanswered may be appended yet: one entry each.
        lacking += sum(len(client.inflight) for client in self.clients)
        largest = max((entry_size_bytes(entry) for entry in log[first:]), default=1)
        p = self.params
        per_round_trip = max(1, min(p.window_entries, p.window_bytes // largest))
        round_trip_ms = 2 * self.delay_max_ms + p.store_delay_max_ms
        round_trips = -(-lacking // per_round_trip)
        return self.now_ms + round_trips * round_trip_ms + DRAIN_SLACK_MS

    def final_check(self, leader: str) -> None:
        """The final checks once converged."""
        log = self.stores[leader].log
        live = {x: self.stores[x].log for x in self.nodes if self.alive(x)}
        for node, other in live.items():
            if other != log:
                raise self.fail(f"after healing node {node}'s log differs from master {leader}'s")
        for node in live:
            self.final_store_check(node)
        try:
            self.rchecker.final(live)
            for node in live:
                state = self.topic_state(node)
                info = state.get_topic(topic_state.TOPIC)
                self.rchecker.final_receipts(
                    node,
                    info.topic_id if info is not None else 0,
                    lambda offset, state=state: topic_state.event_at(state, offset),  # type: ignore[misc]
                )
        except InvariantViolation as exc:
            raise self.violation(exc) from None

    def final_store_check(self, node: str) -> None:
        """The real store holds what the checker's view says: the same log from its log
        start, and the record of every acknowledged plain write (snapshots included)."""
        store = self.stores[node]
        self.check_store(node)
        start = store.db.log_start_lsn()
        count = len(store.log) - start + 1
        held = store.db.read_log(start, count) if count > 0 else []
        if held != store.log[start - 1 :]:
            raise self.fail(
                f"invariant: after healing node {node}'s store holds another log than it was sent"
            )
        if self.rchecker.degraded:
            return
        for lsn, entry in sorted(self.rchecker.acked.items()):
            op = replica_pb2.Operation.FromString(entry.operation)
            name = op.create_topic.name
            # A plain write's topic (the topic workload's may be destroyed since).
            if name and name != topic_state.TOPIC and store.db.get_topic(name) is None:
                raise self.fail(
                    f"invariant: after healing node {node}'s store lacks the acknowledged "
                    f"write {short(entry)} (LSN {lsn})"
                )

    def run_repl(self) -> ReplResult:
        """Run both phases; raise SimFailure on any violation or a missed deadline."""
        self.schedule_scenario()
        for node in self.nodes:
            self.push(self.rrng.randint(0, RTICK_MS), _RTICK, node)
        for client in self.clients:
            self.push(self.rrng.randint(0, self.params.client_interval_ms), _CLIENT, client.name)
        for at, fault, duration_ms in self.params.master_faults:
            self.push(at, _MASTER_FAULT, "", (fault, duration_ms))
        deadline = self.sc.safety_ms + self.sc.liveness_deadline_ms
        while self.queue:
            at, kind, _, _, node, payload = heapq.heappop(self.queue)
            if at > max(deadline, self.drain_deadline_ms):
                break
            self.now_ms = at
            self.events += 1
            if self.events > EVENTS_MAX:
                raise self.fail(f"more than {EVENTS_MAX} events: a message storm")
            self.handle(kind, node, payload)
            if self.healed_at is None or self.now_ms < self.next_converge_check:
                continue
            self.next_converge_check = self.now_ms + CONVERGE_CHECK_MS
            leader = self.converged()
            if leader is None:
                continue
            if self.rchecker.degraded:
                return self.result(leader)
            if self.replication_converged(leader):
                self.final_check(leader)
                return self.result(leader)
        drain = ""
        if self.drain_deadline_ms > deadline:
            drain = (
                f" (or, once the clients stopped, within the {self.drain_deadline_ms - deadline}"
                " ms more the configured window needs to bring the replicas up: drain_deadline)"
            )
        raise self.fail(
            f"liveness: within {self.sc.liveness_deadline_ms} ms of healing{drain} the live "
            "nodes did not form one normal group whose master serves, acknowledges a new write "
            "and has every live replica caught up to its commit LSN"
        )

    def result(self, leader: str) -> ReplResult:
        """What the run measured (a degraded seed ends once the election converged)."""
        p = self.params
        core = self.rt[leader].core
        return ReplResult(
            seed=self.sc.seed,
            nodes=len(self.nodes),
            events=self.events,
            acked=self.rchecker.acked_writes,
            commit_lsn=core.commit_lsn if core is not None else 0,
            converge_ms=self.now_ms - self.sc.safety_ms,
            degraded=self.rchecker.degraded,
            snapshots=self.snapshots,
            refusals=self.refusals,
            policies=f"{p.acks.name}/{p.master_sync.name}/{p.replica_sync.name}",
            flush_failures=self.flush_failures,
        )


@contextlib.contextmanager
def quiet_replica_log() -> Iterator[None]:
    """The replica's drivers log as in production; thousands of simulated refusals, role
    changes and depositions need not (a failure's trace names what happened)."""
    logger = logging.getLogger("squall.replica")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


def run_seed(seed: int) -> ReplResult:
    """Run one seed of the replication simulator."""
    with quiet_coordinator_log(), quiet_replica_log():
        return ReplicationSimulation(seed).run_repl()
