"""The master side of replication as a pure state machine: ack tracking, the commit LSN,
per-slave flow windows, and when to send, acknowledge a client or fall back to a snapshot.

No network, disk, clock, randomness or thread in here (etcd-raft's shape): the driver
calls one input method per event, each returns one ``Actions`` record, and the driver
applies it in the order its docstring states. One ``ReplicationMaster`` lives for one
master epoch; a node that becomes master again gets a new one.

Per slave
---------
Each member slave has a stream (``connect`` gives its id; inputs naming an older stream
are refused as stale and change nothing) and a state:

* ``PROBING``: the stream is open and the Hello sent; waiting for the slave's
  ``ReplicationPosition``. ``on_position`` finds where the two logs part
  (``divergence.fork_lsn``) and starts streaming after that LSN; the first batch of the
  stream carries ``truncate_after_lsn`` when the slave holds a suffix the master does not
  (a deposed master's uncommitted entries) and is sent even when empty, so the slave's
  first ack says at once what it holds. Such a truncating batch goes alone: nothing more
  (no batch, heartbeat or commit notice) goes on that stream until the slave's first ack
  says it took it (``_Slave.truncation_unacked``). A slave that cannot truncate (its log is
  compacted, its store cannot undo entries) or whose log shares no entry with the
  master's gets a snapshot instead.
* ``STREAMING``: entries go out as ``SendGrant`` records, limited by the slave's in-flight
  window: at most ``inflight_entries_max`` entries and ``inflight_bytes_max`` bytes sent
  and not yet acknowledged as received (a single entry larger than the byte window still
  goes, alone). Memory per slave is bounded by the window whatever the slave does.
* ``PAUSED``: streaming with a full window: nothing more is sent until acks free room,
  then sending resumes from the first entry not yet sent (the stream is ordered and
  reliable; a broken stream reconnects and resumes from the slave's reported position).
* ``SNAPSHOTTING``: the slave needs an entry below the retained log start
  (``set_log_start``): the driver sends a snapshot taken at some LSN S from one read
  transaction, then the log from S+1. While a slave snapshots, ``retain_from_lsn`` keeps
  S+1 and the tail after it, so the snapshot is followed by the log, not another snapshot.
* ``DISCONNECTED``: no stream. Acks already received keep counting: the slave held those
  entries at that durability. A new stream's Position lowers them if the slave lost any.

Commit
------
A slave's durable LSN is what its acks say at the replica sync policy: ``SYNC`` counts
``synced_lsn``, ``WRITE_NO_SYNC`` ``written_lsn``, ``NO_SYNC`` ``received_lsn``; the
master's own log counts at the master sync policy (the driver reports appends and
flushes). An entry is committed once the master holds it at its policy and so do enough
member slaves at theirs: ``MAJORITY``: a majority of ALL configured nodes, master
included (or ``quorum_override`` nodes); ``ALL``: that majority and every member of the
current group that has caught up; ``NONE``: the master alone. A member has caught up
once its log held the master's log as it stood when the epoch began, or the commit LSN
of when its stream opened if later (at once, for a member that comes up to date): a
member that joins the group behind (restarted, or back after a partition, possibly
needing a snapshot) or that cannot be reached at all would otherwise hold every commit
back for as long as its catch-up takes (Qpid HA's primary likewise waits only for its
*ready* backups). Once caught up it is waited for until the group drops it or it needs a
snapshot (then again once it holds what was committed when the snapshot began).

The commit LSN never decreases, and it only advances to an LSN at or above this epoch's
first entry (the epoch-start entry the driver appends first): entries of older epochs
are committed by committing that entry after them, Raft's rule, so a count never commits
an entry a later master could still truncate.

A slave whose acks say it serves following readers (``on_ack(readers_following=True)``)
hears each commit at once: a record that leaves the commit LSN beyond what that slave was
told, and sends it no batch (which would carry it), names it in ``heartbeats``, a commit
notice, one per record. Without it, a slave learns the commit from the next batch or
heartbeat, up to ``heartbeat_interval_ms`` later, and its readers with it. A slave without
such readers (an older slave never says it has any) costs nothing more.

Client writes wait with ``register_writes(lsn, token)``; ``Actions.completed`` names the
tokens whose entries are committed. ``pending_writes_max`` bounds them: the driver admits
new writes only while ``write_room`` is positive, so a stalled commit (acks ``ALL`` with a
paused slave) slows publishers down instead of growing memory.

Deposed
-------
A master is deposed by ``depose`` (the coordinator's new role command), by seeing a newer
epoch (``observe_epoch``: a slave refused it as stale, or a Position shows a newer
epoch's entries), or by ``set_members`` leaving its group below the quorum. A deposed
master fails every pending token as indeterminate (the entry may yet be committed by the
next master, or truncated), never advances its commit LSN again, and sends nothing more.

Errors: a driver bug (an LSN going backwards, a write registered twice too many, an
unknown node) raises ``ReplicationError``; bad or stale peer input is an operating
condition, answered with ``Actions.rejection`` and changing nothing.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from squall_server.common.errors import Code
from squall_server.replica.divergence import (
    UINT64_MAX,
    BoundaryLike,
    History,
    HistoryError,
    as_history,
    check_history,
    epoch_at,
    fork_lsn,
    history_problem,
)

# The most nodes a cluster may configure (as the election's NODES_MAX).
NODES_MAX = 64
# Upper limits of the configurable bounds, so a typo cannot ask for unbounded memory.
INFLIGHT_ENTRIES_MAX_LIMIT = 1 << 20
INFLIGHT_BYTES_MAX_LIMIT = 1 << 36
PENDING_WRITES_MAX_LIMIT = 1 << 24
# What an entry costs on the wire beyond its operation bytes (LSN, epoch, checksum, tags).
ENTRY_OVERHEAD_BYTES = 32


class ReplicationError(RuntimeError):
    """A driver bug: an input that no correct driver makes. The message says which."""


class ReplicationConfigError(ValueError):
    """A replication setting is unusable; the message names it."""


class SyncPolicy(enum.IntEnum):
    """When a node counts an entry as held; numbered as ``common_pb2.SyncPolicy``."""

    SYNC = 1
    WRITE_NO_SYNC = 2
    NO_SYNC = 3


class AckPolicy(enum.IntEnum):
    """How many nodes must hold an entry to commit it; numbered as ``common_pb2.AckPolicy``."""

    MAJORITY = 1
    ALL = 2
    NONE = 3


class EntryLike(Protocol):
    """A log entry as both sides see it; ``replica_pb2.LogEntry`` is one."""

    @property
    def lsn(self) -> int:
        """Its log sequence number."""
        ...

    @property
    def epoch(self) -> int:
        """The epoch of the master that wrote it."""
        ...

    @property
    def checksum(self) -> int:
        """CRC-32 of ``operation``."""
        ...

    @property
    def operation(self) -> bytes:
        """The serialized operation."""
        ...


E = TypeVar("E", bound=EntryLike)
T = TypeVar("T")


def entry_size_bytes(entry: EntryLike) -> int:
    """What an entry counts against an in-flight byte window."""
    return len(entry.operation) + ENTRY_OVERHEAD_BYTES


def fit_batch(entries: Sequence[E], bytes_max: int) -> Sequence[E]:
    """The longest prefix of entries within bytes_max, but at least one entry.

    An entry larger than the window still goes, alone, or it could never be sent.
    """
    total = 0
    for i, entry in enumerate(entries):
        total += entry_size_bytes(entry)
        if total > bytes_max and i > 0:
            return entries[:i]
    return entries


def batch_size_bytes(entries: Iterable[EntryLike]) -> int:
    """The window cost of a batch (what ``on_sent`` wants as size_bytes)."""
    return sum(entry_size_bytes(entry) for entry in entries)


@dataclass(frozen=True, slots=True)
class Ack:
    """How far a slave holds the log (``replica_pb2.ReplicationAck``)."""

    received_lsn: int
    written_lsn: int
    synced_lsn: int

    def durable_lsn(self, policy: SyncPolicy) -> int:
        """The LSN this ack vouches for under a sync policy."""
        if policy == SyncPolicy.SYNC:
            return self.synced_lsn
        if policy == SyncPolicy.WRITE_NO_SYNC:
            return self.written_lsn
        return self.received_lsn


@dataclass(frozen=True)
class MasterConfig:
    """The master's replication settings (from DurabilityConfig, LimitsConfig, timeouts)."""

    node_id: str
    nodes: tuple[str, ...]
    """Every configured node, this one included: the majority is counted over these."""
    acks: AckPolicy = AckPolicy.MAJORITY
    master_sync: SyncPolicy = SyncPolicy.SYNC
    replica_sync: SyncPolicy = SyncPolicy.WRITE_NO_SYNC
    inflight_entries_max: int = 1024
    inflight_bytes_max: int = 8 << 20
    pending_writes_max: int = 65536
    heartbeat_interval_ms: int = 100
    quorum_override: int = 0
    """When > 0, the node count a group and a MAJORITY commit need (disaster recovery,
    designated primary); 0: a majority of ``nodes``."""
    truncate_by_snapshot: bool = False
    """Send a slave with a divergent suffix a snapshot instead of a truncation: for a
    store that cannot undo the state its applied entries built."""
    learners: tuple[str, ...] = ()
    """Members that are not ``nodes`` (the running set's learners): they get the log, but
    their acks count for no commit, MAJORITY or ALL, until the coordinator makes them
    voters (services/coordinator/membership.py)."""

    @property
    def quorum(self) -> int:
        """Nodes a group needs to replicate, and a MAJORITY commit needs to hold an entry."""
        return self.quorum_override or len(self.nodes) // 2 + 1

    def validate(self) -> None:
        """Raises ReplicationConfigError with a sentence naming the first bad setting."""
        if not 1 <= len(self.nodes) <= NODES_MAX:
            raise ReplicationConfigError(f"nodes: 1 to {NODES_MAX} node ids, got {len(self.nodes)}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ReplicationConfigError(f"nodes: duplicate node id in {list(self.nodes)}")
        if self.node_id not in self.nodes:
            raise ReplicationConfigError(f"node_id {self.node_id!r} is not one of the nodes")
        if set(self.learners) & set(self.nodes) or len(set(self.learners)) != len(self.learners):
            raise ReplicationConfigError(
                f"learners {list(self.learners)} must be distinct and not voting nodes"
            )
        if self.acks not in set(AckPolicy):
            raise ReplicationConfigError(f"acks: unknown policy {self.acks!r}")
        for name, policy in (
            ("master_sync", self.master_sync),
            ("replica_sync", self.replica_sync),
        ):
            if policy not in set(SyncPolicy):
                raise ReplicationConfigError(f"{name}: unknown policy {policy!r}")
        for name, value, high in (
            ("inflight_entries_max", self.inflight_entries_max, INFLIGHT_ENTRIES_MAX_LIMIT),
            ("inflight_bytes_max", self.inflight_bytes_max, INFLIGHT_BYTES_MAX_LIMIT),
            ("pending_writes_max", self.pending_writes_max, PENDING_WRITES_MAX_LIMIT),
            ("heartbeat_interval_ms", self.heartbeat_interval_ms, 3_600_000),
        ):
            if not 1 <= value <= high:
                raise ReplicationConfigError(f"{name}: must be 1..{high}, got {value}")
        if not 0 <= self.quorum_override <= len(self.nodes):
            raise ReplicationConfigError(
                f"quorum_override: must be 0..{len(self.nodes)}, got {self.quorum_override}"
            )


class SlaveState(enum.Enum):
    """Where replication to one slave stands (see the module docstring)."""

    DISCONNECTED = "disconnected"
    PROBING = "probing"
    STREAMING = "streaming"
    PAUSED = "paused"
    SNAPSHOTTING = "snapshotting"


@dataclass(frozen=True, slots=True)
class SlaveProgress:
    """One slave as the master sees it, for status, metrics (lag) and tests."""

    node_id: str
    state: SlaveState
    stream_id: int
    next_lsn: int
    received_lsn: int
    written_lsn: int
    synced_lsn: int
    inflight_entries: int
    inflight_bytes: int
    snapshot_lsn: int
    # How long, by the last tick, the master has not heard from it (counted from the
    # master's first tick if never); 0 for a learner, whose acks hold nothing back, and
    # once the master is deposed.
    silent_ms: int = 0
    # It has not yet held the master's log as of the epoch's start, or the commit LSN of
    # when its stream opened if later (or never answered): under ALL commits do not wait
    # for it yet.
    catching_up: bool = False


# Not frozen (nothing changes one once made): a frozen dataclass's __init__ sets every
# field through object.__setattr__, several times the cost, and the master makes a few
# records per publish (issue 16). The same for Actions.
@dataclass(slots=True)
class SendGrant:
    """Permission to send one ``EntryBatch`` to one slave.

    The driver reads up to ``entries_max`` entries from ``from_lsn`` (the store holds them:
    ``from_lsn`` is at or above the retained log start), keeps ``fit_batch(entries,
    bytes_max)`` of them, calls ``on_sent`` with the last LSN kept and the batch's
    ``batch_size_bytes``, writes ``EntryBatch(entries, commit_lsn, truncate_after_lsn,
    epoch)`` to the stream, and only then applies the Actions ``on_sent`` returned (they
    may grant the next batch, which must follow this one). ``on_sent`` comes before the
    write because the slave's ack may arrive before the write returns. ``entries_max`` 0
    is a stream's first batch with nothing to send yet: send it empty, it carries the
    truncation and asks for the slave's first ack. ``truncate_after_lsn`` None means no
    truncation; it is never 0 (a log sharing no entry with the master's gets a snapshot).
    """

    node_id: str
    stream_id: int
    from_lsn: int
    entries_max: int
    bytes_max: int
    commit_lsn: int
    truncate_after_lsn: int | None


class RejectCode(enum.Enum):
    """Why an input was refused (it changed nothing)."""

    STALE_STREAM = "STALE_STREAM"
    """From a stream that is no longer the slave's current one: ignore it."""
    BAD_POSITION = "BAD_POSITION"
    """A Position no valid log has, or one sent twice: close the stream."""
    BAD_ACK = "BAD_ACK"
    """An ack claiming more than was sent, or out of order: close the stream."""
    DEPOSED = "DEPOSED"
    """This master is deposed; it takes no more replication input."""


_REJECT_STATUS = {
    RejectCode.STALE_STREAM: Code.FAILED_PRECONDITION,
    RejectCode.BAD_POSITION: Code.INVALID_ARGUMENT,
    RejectCode.BAD_ACK: Code.INVALID_ARGUMENT,
    RejectCode.DEPOSED: Code.FAILED_PRECONDITION,
}


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused input: which node and stream, why, and the status to close the stream with."""

    code: RejectCode
    node_id: str
    stream_id: int
    epoch: int
    detail: str

    @property
    def status(self) -> Code:
        """The gRPC status for the stream the input came on."""
        return _REJECT_STATUS[self.code]

    @property
    def message(self) -> str:
        """One sentence for logs and the stream's status."""
        return (
            f"master epoch {self.epoch} refused input from node {self.node_id} "
            f"stream {self.stream_id}: {self.detail}"
        )


@dataclass(slots=True)
class Actions(Generic[T]):
    """Everything one input produced. The driver applies it in this order:

    1. ``rejection``: when set, the input was refused and changed nothing. Close the
       stream it came on with ``rejection.status`` unless the code is STALE_STREAM (that
       stream is already gone) or DEPOSED (step 7 closes every stream).
    2. ``sends``: for each grant, build the batch, call ``on_sent``, write the batch to
       the stream, then apply the Actions ``on_sent`` returned (``SendGrant`` says how).
    3. ``snapshots``: for each node id, take a snapshot at LSN S in one read transaction,
       call ``on_snapshot_started(node, stream, S)``, then stream its chunks; the slave's
       ack of S ends the snapshot and streaming resumes from S+1.
    4. ``heartbeats``: send ``ReplicationHeartbeat(commit_lsn, epoch)`` to each node (an
       idle slave's, or a commit notice to a slave serving following readers).
    5. ``completed``: answer these clients with success: their entries are at or below
       ``commit_lsn``, held as the ack policy requires.
    6. ``failed``: answer these clients "indeterminate" (``Code.UNKNOWN``): the entry may
       or may not survive; a retry with the same (publisher id, sequence) is safe.
    7. ``deposed``: when non-empty (the reason), this master is deposed: stop taking
       writes, close every replication stream, and report to the coordinator.
    8. ``events``: log them (each names the node, epoch and LSN).

    ``commit_lsn`` is the commit LSN after the input (committed reads may serve up to
    it); it never decreases.
    """

    commit_lsn: int
    sends: tuple[SendGrant, ...] = ()
    snapshots: tuple[str, ...] = ()
    heartbeats: tuple[str, ...] = ()
    completed: tuple[T, ...] = ()
    failed: tuple[T, ...] = ()
    deposed: str = ""
    rejection: Rejection | None = None
    events: tuple[str, ...] = ()


class _Phase(enum.Enum):
    DISCONNECTED = "disconnected"
    AWAITING_POSITION = "probing"
    STREAMING = "streaming"
    SNAPSHOTTING = "snapshotting"


class _Slave:
    """The master's record of one member slave."""

    __slots__ = (
        "catch_up_lsn",
        "caught_up",
        "commit_told",
        "first_batch",
        "flights",
        "grant",
        "heard_ms",
        "inflight_bytes",
        "next_lsn",
        "node_id",
        "phase",
        "readers_following",
        "received_lsn",
        "sent_since_heartbeat",
        "snapshot_lsn",
        "snapshot_wanted",
        "stream_id",
        "synced_lsn",
        "truncate_after",
        "truncation_unacked",
        "written_lsn",
    )

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.stream_id = 0
        self.phase = _Phase.DISCONNECTED
        self.next_lsn = 1  # the next LSN to send
        self.received_lsn = 0
        self.written_lsn = 0
        self.synced_lsn = 0
        # Batches sent and not yet received: (last LSN, bytes). Each holds at least one
        # entry, so there are at most inflight_entries_max of them.
        self.flights: deque[tuple[int, int]] = deque()
        self.inflight_bytes = 0
        self.grant: SendGrant | None = None
        self.truncate_after: int | None = None
        self.first_batch = False
        # The stream's first batch, which truncates the slave's log, is sent and no ack
        # has come back since: nothing more is sent on the stream until one does. Until
        # the slave has taken that batch, its log after the truncation point is a deposed
        # master's, and a message that overtook the batch (a stream that reorders: the
        # replication simulator's, never gRPC's) would be taken against that log: a
        # later batch continuing its LSNs would be written and acknowledged, then removed
        # by the late truncation, after its ack counted toward a commit (simulator seed
        # 5027); a heartbeat would make the slave count the master's commit LSN over
        # entries the master never wrote, and serve them as committed (seed 5493). Under
        # gRPC the wait costs little: the slave takes no later message before it has
        # written the truncation anyway; entries written meanwhile go one ack's trip later.
        self.truncation_unacked = False
        self.snapshot_lsn = 0  # 0 while the driver has not started the snapshot
        self.snapshot_wanted = False  # a snapshot instead of a truncation
        self.commit_told = 0
        self.sent_since_heartbeat = False
        self.readers_following = False  # as its last ack on the current stream said
        # When the slave last answered on a stream (a Position or an ack), by the core's
        # clock (the last tick); None: not since this master began.
        self.heard_ms: int | None = None
        # Under ALL a commit waits for this slave only once it caught up: it held
        # ``catch_up_lsn`` (``_catch_up_target`` when its stream opened). See _quorum_lsn.
        self.caught_up = False
        self.catch_up_lsn = 0

    def durable_lsn(self, policy: SyncPolicy) -> int:
        """What the slave's acks vouch for under the replica sync policy (as
        ``Ack.durable_lsn``, without an Ack per call: the commit counts it per input)."""
        if policy == SyncPolicy.SYNC:
            return self.synced_lsn
        if policy == SyncPolicy.WRITE_NO_SYNC:
            return self.written_lsn
        return self.received_lsn

    def clear_window(self) -> None:
        """Forgets everything in flight (the stream is gone or replaced)."""
        self.flights.clear()
        self.inflight_bytes = 0
        self.grant = None
        self.truncate_after = None
        self.first_batch = False
        self.truncation_unacked = False
        self.snapshot_wanted = False


class ReplicationMaster(Generic[T]):
    """One master epoch's replication: slaves' progress, the commit LSN, waiting writes."""

    def __init__(
        self,
        config: MasterConfig,
        *,
        epoch: int,
        members: Iterable[str],
        last_lsn: int,
        history: Iterable[tuple[int, int] | BoundaryLike],
        commit_lsn: int = 0,
        log_start_lsn: int = 1,
    ) -> None:
        """Starts as master of ``epoch`` over a log ending at ``last_lsn``.

        The first entry the driver appends (``last_lsn + 1``) must be this epoch's
        epoch-start entry. ``members``: the group, this node included.
        """
        config.validate()
        self.config = config
        if not 0 < epoch <= UINT64_MAX:
            raise ReplicationError(f"epoch {epoch} is not a positive uint64")
        self._epoch = epoch
        try:
            self._history: History = check_history(history, last_lsn)
        except HistoryError as exc:
            raise ReplicationError(f"the master's own log: {exc}") from None
        if self._history and self._history[-1][0] >= epoch:
            raise ReplicationError(
                f"the log already holds entries of epoch {self._history[-1][0]}; "
                f"a master of epoch {epoch} must be newer"
            )
        if not 0 <= commit_lsn <= last_lsn:
            raise ReplicationError(f"commit LSN {commit_lsn} is beyond the last LSN {last_lsn}")
        if not 1 <= log_start_lsn <= last_lsn + 1:
            raise ReplicationError(f"log start {log_start_lsn} outside 1..{last_lsn + 1}")
        self._members = self._check_members(members, initial=True)
        if self._voting_members() < config.quorum:
            raise ReplicationError(
                f"a group of {self._voting_members()} voting nodes cannot replicate: the "
                f"quorum is {config.quorum}"
            )
        self._slaves = {n: _Slave(n) for n in self._members if n != config.node_id}
        # The slaves by node id, in the order grants and status list them (the group only
        # shrinks within an epoch: set_members renews it).
        self._slave_order = tuple(self._slaves[n] for n in sorted(self._slaves))
        self._epoch_start_lsn = last_lsn + 1
        self._written_lsn = last_lsn  # the master's own log
        self._synced_lsn = 0
        self._commit_lsn = commit_lsn
        self._log_start_lsn = log_start_lsn
        self._pending: deque[tuple[int, T]] = deque()
        self._last_registered_lsn = 0
        self._deposed = ""
        self._stream_seq = 0
        self._now_ms: int | None = None
        self._started_ms: int | None = None  # the first tick's time
        self._next_heartbeat_ms = 0
        # Slaves whose acks say they serve following readers: 0 skips the notices' check.
        self._following = 0

    # --- queries

    @property
    def epoch(self) -> int:
        """This master's epoch."""
        return self._epoch

    @property
    def commit_lsn(self) -> int:
        """The highest LSN held as the ack policy requires (never decreases)."""
        return self._commit_lsn

    @property
    def last_lsn(self) -> int:
        """The master's own last appended LSN."""
        return self._written_lsn

    @property
    def epoch_start_lsn(self) -> int:
        """The LSN of this epoch's first entry; the commit LSN only advances to or past it."""
        return self._epoch_start_lsn

    @property
    def deposed(self) -> str:
        """Why this master was deposed ("" while it is not)."""
        return self._deposed

    @property
    def members(self) -> tuple[str, ...]:
        """The current group, this node included."""
        return self._members

    @property
    def pending_writes(self) -> int:
        """Client writes waiting for their entries to commit."""
        return len(self._pending)

    @property
    def write_room(self) -> int:
        """How many more writes may be registered (0: hold new writes back)."""
        return 0 if self._deposed else self.config.pending_writes_max - len(self._pending)

    @property
    def history(self) -> History:
        """The master's epoch history, its own epoch included once its first entry is in."""
        return self._history

    def quorum_silent_ms(self) -> int:
        """How long, by the last tick, this master has not heard from a majority's worth of
        voting slaves (0: it has, or its commits need no slave, or it is deposed).

        It grows when the master's replica cannot reach the others while its node looks
        well to its coordinator (the coordinators reach each other): every write waits,
        and only this master knows. Its coordinator steps aside past a bound (the
        coordinator's driver, ``quorum_lost_ms``). Counted from the first tick for a slave
        not heard from since this master began. A majority under every ack policy: under
        ``group`` a master that hears a majority but not every member is not the one cut
        off; the silent members are (each slave's ``silent_ms``), and they leave."""
        if self._deposed or self._now_ms is None or self.config.acks == AckPolicy.NONE:
            return 0
        need = self.config.quorum - 1
        if need <= 0:
            return 0
        silences = sorted(
            self._silent_ms(s) for s in self._slave_order if s.node_id not in self.config.learners
        )
        if need > len(silences):
            return 0  # the group is below what it needs: set_members deposes it
        return silences[need - 1]

    def progress(self, node_id: str) -> SlaveProgress:
        """One slave's progress."""
        return self._progress(self._slave(node_id))

    def status(self) -> tuple[SlaveProgress, ...]:
        """Every member slave's progress, by node id."""
        return tuple(self._progress(slave) for slave in self._slave_order)

    def holders(self, lsn: int) -> tuple[tuple[str, SyncPolicy], ...]:
        """Who holds ``lsn`` and how durably, the master first (for ``AckReceipt.holders``)."""
        out: list[tuple[str, SyncPolicy]] = []
        for node_id, received, written, synced in [
            (self.config.node_id, self._written_lsn, self._written_lsn, self._synced_lsn)
        ] + [(s.node_id, s.received_lsn, s.written_lsn, s.synced_lsn) for s in self._slave_order]:
            if synced >= lsn:
                out.append((node_id, SyncPolicy.SYNC))
            elif written >= lsn:
                out.append((node_id, SyncPolicy.WRITE_NO_SYNC))
            elif received >= lsn:
                out.append((node_id, SyncPolicy.NO_SYNC))
        return tuple(out)

    def retain_from_lsn(self) -> int:
        """The lowest LSN some member may still need from the log (compact below it only).

        Compacting past it sends that slave a snapshot instead; a snapshotting slave's
        tail (S+1 on) is always reported as needed.
        """
        needed = self._written_lsn + 1
        for slave in self._slaves.values():
            if slave.phase == _Phase.SNAPSHOTTING and slave.snapshot_lsn:
                needed = min(needed, slave.snapshot_lsn + 1)
            else:
                needed = min(needed, slave.written_lsn + 1)
        return max(needed, self._log_start_lsn)

    # --- the master's own log and client writes

    def on_appended(
        self, last_lsn: int, *, synced: bool, writes: Sequence[tuple[int, T]] = ()
    ) -> Actions[T]:
        """The master's store appended entries up to last_lsn (flushed when synced).

        ``writes``: client writes waiting for entries of this append (or earlier ones),
        registered in the same record as ``register_writes`` right after would (one
        record per commit batch, not two: the sends come first, then what completes)."""
        if not self._written_lsn <= last_lsn <= UINT64_MAX:
            raise ReplicationError(
                f"appended up to LSN {last_lsn}, but the log already ends at {self._written_lsn}"
            )
        if last_lsn >= self._epoch_start_lsn and (
            not self._history or self._history[-1][0] < self._epoch
        ):
            self._history = (*self._history, (self._epoch, self._epoch_start_lsn))
        self._written_lsn = last_lsn
        if synced:
            self._synced_lsn = last_lsn
        if writes:
            return self.register_writes(writes)
        return self._actions()

    def on_local_synced(self, lsn: int) -> Actions[T]:
        """The master's store flushed everything up to lsn (a WRITE_NO_SYNC flush)."""
        if lsn > self._written_lsn:
            raise ReplicationError(f"synced LSN {lsn} beyond the last LSN {self._written_lsn}")
        self._synced_lsn = max(self._synced_lsn, lsn)
        return self._actions()

    def register_write(self, lsn: int, token: T) -> Actions[T]:
        """A client write whose entry is at lsn; see ``register_writes``."""
        return self.register_writes(((lsn, token),))

    def register_writes(self, writes: Iterable[tuple[int, T]]) -> Actions[T]:
        """Client writes waiting for their entries (already appended) to commit.

        LSNs must not decrease across calls and must lie in this epoch's appended log;
        the number waiting must stay within ``write_room``. A deposed master fails them
        at once as indeterminate (their entries were appended).
        """
        batch = list(writes)
        if len(batch) > self.config.pending_writes_max:
            raise ReplicationError(
                f"{len(batch)} writes at once; pending_writes_max is "
                f"{self.config.pending_writes_max}"
            )
        last = self._last_registered_lsn
        for lsn, _ in batch:
            if not self._epoch_start_lsn <= lsn <= self._written_lsn:
                raise ReplicationError(
                    f"write at LSN {lsn} outside this epoch's appended log "
                    f"{self._epoch_start_lsn}..{self._written_lsn}"
                )
            if lsn < last:
                raise ReplicationError(f"write at LSN {lsn} registered after LSN {last}")
            last = lsn
        if self._deposed:
            return self._actions(failed=tuple(token for _, token in batch))
        if len(self._pending) + len(batch) > self.config.pending_writes_max:
            raise ReplicationError(
                f"{len(batch)} writes exceed the write room {self.write_room}; "
                "check write_room before taking writes"
            )
        self._pending.extend(batch)
        self._last_registered_lsn = last
        return self._actions()

    # --- streams

    def connect(self, node_id: str) -> int:
        """A new stream to a member slave (the Hello goes out); returns its stream id.

        Any earlier stream to the node is forgotten: its later input is refused as stale.
        """
        if self._deposed:
            raise ReplicationError(f"a deposed master opens no streams ({self._deposed})")
        slave = self._slave(node_id)
        self._stream_seq += 1
        slave.stream_id = self._stream_seq
        slave.phase = _Phase.AWAITING_POSITION
        slave.snapshot_lsn = 0
        slave.clear_window()
        self._set_following(slave, False)
        return slave.stream_id

    def disconnected(self, node_id: str, stream_id: int) -> Actions[T]:
        """The stream broke or was closed; what was acknowledged keeps counting."""
        slave, rejection = self._current(node_id, stream_id)
        if rejection is not None:
            return self._actions(rejection=rejection)
        slave.phase = _Phase.DISCONNECTED
        slave.stream_id = 0
        slave.snapshot_lsn = 0
        slave.clear_window()
        self._set_following(slave, False)
        return self._actions()

    def on_position(
        self,
        node_id: str,
        stream_id: int,
        *,
        last_epoch: int,
        last_lsn: int,
        history: Iterable[tuple[int, int] | BoundaryLike],
        log_start_lsn: int = 1,
    ) -> Actions[T]:
        """The slave's answer to the Hello: where its log ends and its epoch history.

        log_start_lsn: the first LSN in the slave's log. A slave whose log no longer
        starts at 1 (compacted, or installed from a snapshot) cannot truncate a divergent
        suffix by replaying its log, so it gets a snapshot instead (as with
        ``truncate_by_snapshot``); so does a slave whose log shares no entry with the
        master's (a fork at LSN 0).
        """
        slave, rejection = self._current(node_id, stream_id)
        if rejection is not None:
            return self._actions(rejection=rejection)
        if slave.phase != _Phase.AWAITING_POSITION:
            return self._reject(slave, RejectCode.BAD_POSITION, "a second Position on one stream")
        slave.heard_ms = self._now_ms
        try:
            slave_history = as_history(history)
        except (HistoryError, TypeError, ValueError) as exc:
            return self._reject(slave, RejectCode.BAD_POSITION, f"bad epoch history: {exc}")
        problem = history_problem(slave_history, last_lsn)
        if problem is not None:
            return self._reject(slave, RejectCode.BAD_POSITION, f"bad epoch history: {problem}")
        if epoch_at(slave_history, last_lsn) != last_epoch:
            return self._reject(
                slave,
                RejectCode.BAD_POSITION,
                f"last epoch {last_epoch} but the history gives "
                f"{epoch_at(slave_history, last_lsn)} at LSN {last_lsn}",
            )
        if last_epoch > self._epoch:
            return self._depose(
                f"node {node_id} holds entries of epoch {last_epoch}, newer than {self._epoch}"
            )
        fork = fork_lsn(self._history, self._written_lsn, slave_history, last_lsn)
        if last_lsn > fork and last_epoch == self._epoch:
            return self._reject(
                slave,
                RejectCode.BAD_POSITION,
                f"holds entries of this epoch after LSN {fork} that this master never wrote",
            )
        slave.clear_window()
        slave.phase = _Phase.STREAMING
        slave.first_batch = True
        slave.next_lsn = fork + 1
        events: tuple[str, ...] = ()
        if not slave.caught_up:
            slave.catch_up_lsn = self._catch_up_target()
            slave.caught_up = fork >= slave.catch_up_lsn
            if not slave.caught_up and self.config.acks == AckPolicy.ALL:
                events = (
                    f"master {self.config.node_id} epoch {self._epoch}: node {node_id} holds "
                    f"the log to LSN {fork}, behind LSN {slave.catch_up_lsn}: under acks "
                    "group commits wait for it once it has caught up to that LSN, and for a "
                    "majority meanwhile",
                )
        slave.truncate_after = fork if last_lsn > fork else None
        # It holds everything up to the fork (at least as written: it is in its store);
        # what is flushed, its first ack will say.
        slave.received_lsn = fork
        slave.written_lsn = min(slave.written_lsn, fork)
        slave.synced_lsn = min(slave.synced_lsn, fork)
        # A fork at LSN 0 (the logs share no entry) cannot be said on the wire, where
        # truncate_after_lsn 0 means "no truncation": the slave's whole log is replaced.
        if slave.truncate_after is not None and (
            self.config.truncate_by_snapshot or log_start_lsn > 1 or fork == 0
        ):
            slave.truncate_after = None
            slave.snapshot_wanted = True
        if slave.truncate_after is not None:
            events += (
                f"master {self.config.node_id} epoch {self._epoch}: node {node_id} "
                f"diverges after LSN {fork}; truncating its LSNs {fork + 1}..{last_lsn}",
            )
            # The reorganization makes the master's log at its epoch start the longest
            # (last epoch, last LSN) of its group; a slave beyond it missed that
            # reorganization, and what is truncated here is logged loudly.
            tail = self._epoch_start_lsn - 1
            if (last_epoch, last_lsn) > (epoch_at(self._history, tail), tail):
                events += (
                    f"WARNING master {self.config.node_id} epoch {self._epoch}: node "
                    f"{node_id}'s log (epoch {last_epoch}, LSN {last_lsn}) is ahead of this "
                    f"master's log at its epoch start (LSN {tail}); its entries after LSN "
                    f"{fork} are discarded as uncommitted",
                )
        return self._actions(events=events)

    def on_ack(
        self,
        node_id: str,
        stream_id: int,
        *,
        received_lsn: int,
        written_lsn: int,
        synced_lsn: int,
        readers_following: bool = False,
    ) -> Actions[T]:
        """A slave's ack: how far it holds the log received, written and flushed, and
        whether it serves following readers (then it hears each commit at once)."""
        slave, rejection = self._current(node_id, stream_id)
        if rejection is not None:
            return self._actions(rejection=rejection)
        if slave.phase == _Phase.AWAITING_POSITION:
            return self._reject(slave, RejectCode.BAD_ACK, "an ack before the Position")
        slave.heard_ms = self._now_ms
        sent = slave.next_lsn - 1
        if not 0 <= synced_lsn <= written_lsn <= received_lsn <= sent:
            return self._reject(
                slave,
                RejectCode.BAD_ACK,
                f"ack received={received_lsn} written={written_lsn} synced={synced_lsn} "
                f"is not ordered synced <= written <= received <= {sent} (sent)",
            )
        self._set_following(slave, readers_following)
        # The slave answers in order, and nothing but the truncating first batch was
        # sent since its Position: this ack follows it.
        slave.truncation_unacked = False
        if slave.phase == _Phase.SNAPSHOTTING and received_lsn < slave.snapshot_lsn:
            # Sent before the install began: it describes the log the install replaces.
            return self._actions()
        slave.received_lsn = max(slave.received_lsn, received_lsn)
        slave.written_lsn = max(slave.written_lsn, written_lsn)
        slave.synced_lsn = max(slave.synced_lsn, synced_lsn)
        while slave.flights and slave.flights[0][0] <= slave.received_lsn:
            slave.inflight_bytes -= slave.flights.popleft()[1]
        events: tuple[str, ...] = ()
        if (
            slave.phase == _Phase.SNAPSHOTTING
            and slave.snapshot_lsn
            and slave.written_lsn >= slave.snapshot_lsn
        ):
            events += (
                f"master {self.config.node_id} epoch {self._epoch}: node {node_id} installed "
                f"the snapshot at LSN {slave.snapshot_lsn}; streaming from "
                f"{slave.snapshot_lsn + 1}",
            )
            slave.phase = _Phase.STREAMING
            slave.snapshot_lsn = 0
        if not slave.caught_up and slave.phase == _Phase.STREAMING:
            durable = slave.durable_lsn(self.config.replica_sync)
            if durable >= slave.catch_up_lsn:
                slave.caught_up = True
                if self.config.acks == AckPolicy.ALL:
                    events += (
                        f"master {self.config.node_id} epoch {self._epoch}: node {node_id} "
                        f"caught up (it holds LSN {durable}, at least {slave.catch_up_lsn}): "
                        "under acks group every commit now waits for it",
                    )
        return self._actions(events=events)

    def cannot_store(self, node_id: str, reason: str) -> Actions[T]:
        """The slave refused the log for want of room (its store is full): it cannot hold
        what comes next, so under ALL commits stop waiting for it until it has caught up
        again (``_catch_up_target``); a majority still holds every commit. Otherwise a
        slave whose disk filled would hold every write back until an operator freed it.
        A node no longer in the group is ignored."""
        slave = self._slaves.get(node_id)
        if self._deposed or slave is None or not slave.caught_up:
            return self._actions()
        slave.caught_up = False
        slave.catch_up_lsn = self._catch_up_target()
        events: tuple[str, ...] = ()
        if self.config.acks == AckPolicy.ALL:
            events = (
                f"master {self.config.node_id} epoch {self._epoch}: node {node_id} cannot "
                f"store the log ({reason}): under acks group commits wait for it again once "
                f"it holds LSN {slave.catch_up_lsn}, and for a majority meanwhile",
            )
        return self._actions(events=events)

    def on_sent(self, node_id: str, stream_id: int, last_lsn: int, size_bytes: int) -> Actions[T]:
        """The driver built the batch of a grant: entries up to last_lsn, size_bytes in all.

        last_lsn = from_lsn - 1 means nothing was sent (an empty first batch, or entries
        the driver could not read).
        """
        slave, rejection = self._current(node_id, stream_id)
        if rejection is not None:
            return self._actions(rejection=rejection)
        grant = slave.grant
        if grant is None or grant.stream_id != stream_id:
            raise ReplicationError(f"on_sent for node {node_id} without a grant outstanding")
        count = last_lsn - grant.from_lsn + 1
        if not 0 <= count <= grant.entries_max or size_bytes < 0:
            raise ReplicationError(
                f"sent LSNs {grant.from_lsn}..{last_lsn} ({size_bytes} bytes) to node {node_id}; "
                f"the grant allowed {grant.entries_max} entries"
            )
        slave.grant = None
        slave.truncation_unacked = grant.truncate_after_lsn is not None
        slave.truncate_after = None
        slave.first_batch = False
        slave.sent_since_heartbeat = True
        slave.commit_told = max(slave.commit_told, grant.commit_lsn)
        if count:
            slave.flights.append((last_lsn, size_bytes))
            slave.inflight_bytes += size_bytes
            slave.next_lsn = last_lsn + 1
        return self._actions()

    def on_snapshot_started(self, node_id: str, stream_id: int, snapshot_lsn: int) -> Actions[T]:
        """The driver took the snapshot a slave needed, at snapshot_lsn; chunks go next."""
        slave, rejection = self._current(node_id, stream_id)
        if rejection is not None:
            return self._actions(rejection=rejection)
        if slave.phase != _Phase.SNAPSHOTTING or slave.snapshot_lsn:
            raise ReplicationError(f"node {node_id} was not waiting for a snapshot")
        if not self._log_start_lsn - 1 <= snapshot_lsn <= self._written_lsn:
            raise ReplicationError(
                f"snapshot at LSN {snapshot_lsn}: must be {self._log_start_lsn - 1}.."
                f"{self._written_lsn} so that the retained log follows it"
            )
        slave.clear_window()
        slave.snapshot_lsn = snapshot_lsn
        slave.next_lsn = snapshot_lsn + 1
        # The slave stages the chunks and keeps its old state and log until the last is
        # in (``finish_snapshot`` swaps them in one transaction; an install cut short
        # leaves the old state). What it acknowledged before counts no more until it
        # acknowledges the installed snapshot (a commit counting it would rely on
        # entries the install is about to replace).
        slave.received_lsn = slave.written_lsn = slave.synced_lsn = 0
        # Nor do commits wait for it until it holds what was committed by now.
        slave.caught_up = False
        slave.catch_up_lsn = self._catch_up_target()
        return self._actions()

    # --- group, log and epoch changes

    def set_members(self, members: Iterable[str]) -> Actions[T]:
        """The group shrank (the coordinator dropped silent members); within an epoch it
        never grows. Below the quorum the master is deposed."""
        new = self._check_members(members, initial=False)
        for node_id in set(self._slaves) - set(new):
            self._set_following(self._slaves.pop(node_id), False)
        self._slave_order = tuple(self._slaves[n] for n in sorted(self._slaves))
        self._members = new
        if not self._deposed and self._voting_members() < self.config.quorum:
            return self._depose(
                f"the group shrank to {self._voting_members()} of {len(self.config.nodes)} "
                "voting nodes, "
                f"below the quorum {self.config.quorum}"
            )
        return self._actions()

    def set_log_start(self, log_start_lsn: int) -> Actions[T]:
        """The log was compacted: entries below log_start_lsn are gone (snapshot only)."""
        if not self._log_start_lsn <= log_start_lsn <= self._written_lsn + 1:
            raise ReplicationError(
                f"log start {log_start_lsn} outside {self._log_start_lsn}..{self._written_lsn + 1}"
            )
        self._log_start_lsn = log_start_lsn
        return self._actions()

    def observe_epoch(self, epoch: int) -> Actions[T]:
        """Some peer reported ``epoch`` (a slave refusing us as stale): newer deposes us."""
        if epoch > self._epoch and not self._deposed:
            return self._depose(f"epoch {epoch} superseded epoch {self._epoch}")
        return self._actions()

    def depose(self, reason: str) -> Actions[T]:
        """The coordinator took the role away (new epoch, or the group was lost)."""
        if self._deposed:
            return self._actions()
        return self._depose(reason or "deposed")

    def tick(self, now_ms: int) -> Actions[T]:
        """Time passed: heartbeats to idle slaves and to slaves behind on the commit LSN."""
        if self._now_ms is not None and now_ms < self._now_ms:
            raise ReplicationError(f"time went backwards: {now_ms} after {self._now_ms}")
        self._now_ms = now_ms
        if self._started_ms is None:
            self._started_ms = now_ms
        for slave in self._slave_order:
            if slave.phase == _Phase.SNAPSHOTTING:
                # A slave acks a snapshot once, when it is installed: while its chunks
                # flow it counts as heard (a cut stream ends it: DISCONNECTED).
                slave.heard_ms = now_ms
        if self._deposed or now_ms < self._next_heartbeat_ms:
            return self._actions()
        self._next_heartbeat_ms = now_ms + self.config.heartbeat_interval_ms
        heartbeats: list[str] = []
        for slave in self._slave_order:
            node_id = slave.node_id
            due = not slave.sent_since_heartbeat or slave.commit_told < self._commit_lsn
            slave.sent_since_heartbeat = False
            if (
                slave.phase == _Phase.STREAMING
                and slave.grant is None
                and not slave.truncation_unacked
                and due
            ):
                heartbeats.append(node_id)
        return self._actions(heartbeats=tuple(heartbeats))

    # --- internals

    def _check_members(self, members: Iterable[str], *, initial: bool) -> tuple[str, ...]:
        out: list[str] = []
        for node_id in members:
            if len(out) >= NODES_MAX:
                raise ReplicationError(f"more than {NODES_MAX} members")
            out.append(node_id)
        known = (*self.config.nodes, *self.config.learners) if initial else self._members
        for node_id in out:
            if node_id not in known:
                raise ReplicationError(
                    f"member {node_id!r} is not "
                    + ("a configured node" if initial else "in the group (groups only shrink)")
                )
        if len(set(out)) != len(out):
            raise ReplicationError(f"duplicate member in {out}")
        if self.config.node_id not in out:
            raise ReplicationError(f"the master {self.config.node_id!r} must be a member")
        return tuple(sorted(out))

    def _slave(self, node_id: str) -> _Slave:
        try:
            return self._slaves[node_id]
        except KeyError:
            raise ReplicationError(f"{node_id!r} is not a slave of this group") from None

    def _current(self, node_id: str, stream_id: int) -> tuple[_Slave, Rejection | None]:
        """The slave, and a rejection when the input cannot be taken from that stream."""
        slave = self._slaves.get(node_id)
        if self._deposed:
            rejection = Rejection(
                RejectCode.DEPOSED, node_id, stream_id, self._epoch, f"deposed: {self._deposed}"
            )
            return slave or _Slave(node_id), rejection
        if slave is None or stream_id != slave.stream_id or stream_id == 0:
            current = slave.stream_id if slave is not None else 0
            rejection = Rejection(
                RejectCode.STALE_STREAM,
                node_id,
                stream_id,
                self._epoch,
                f"stale input ignored: the current stream is {current or 'none'}",
            )
            return slave or _Slave(node_id), rejection
        return slave, None

    def _reject(self, slave: _Slave, code: RejectCode, detail: str) -> Actions[T]:
        return self._actions(
            rejection=Rejection(code, slave.node_id, slave.stream_id, self._epoch, detail)
        )

    def _depose(self, reason: str) -> Actions[T]:
        self._deposed = reason
        failed = tuple(token for _, token in self._pending)
        self._pending.clear()
        for slave in self._slaves.values():
            slave.phase = _Phase.DISCONNECTED
            slave.stream_id = 0
            slave.clear_window()
        event = (
            f"master {self.config.node_id} epoch {self._epoch} deposed at commit LSN "
            f"{self._commit_lsn}, last LSN {self._written_lsn}: {reason}; "
            f"{len(failed)} pending writes indeterminate"
        )
        return Actions(commit_lsn=self._commit_lsn, failed=failed, deposed=reason, events=(event,))

    def _catch_up_target(self) -> int:
        """What a slave must hold before commits under ALL wait for it: the master's log
        as it stood when this epoch began (the reorganization made it the group's longest,
        so it holds everything an earlier master may have acknowledged), or the commit
        LSN when that is later."""
        return max(self._commit_lsn, self._epoch_start_lsn - 1)

    def _local_durable_lsn(self) -> int:
        if self.config.master_sync == SyncPolicy.SYNC:
            return self._synced_lsn
        # The master only counts entries once appended: received and written coincide.
        return self._written_lsn

    def _voting_members(self) -> int:
        """Members whose acks count (learners' do not)."""
        return sum(1 for x in self._members if x not in self.config.learners)

    def _quorum_lsn(self) -> int:
        """The highest LSN the master and enough voting member slaves hold, per the
        policies (under ALL: a majority and every member that caught up); a learner's
        acks count for nothing, so a learner still copying the log never holds a commit
        back and never stands in for a voter."""
        local = self._local_durable_lsn()
        if self.config.acks == AckPolicy.NONE:
            return local
        config = self.config
        need = config.quorum - 1
        policy, learners = config.replica_sync, config.learners
        if config.acks == AckPolicy.ALL:
            for slave in self._slave_order:
                if slave.caught_up and slave.node_id not in learners:
                    local = min(local, slave.durable_lsn(policy))
        if need <= 0:
            return local
        others = [s.durable_lsn(policy) for s in self._slave_order if s.node_id not in learners]
        if need > len(others):
            return 0
        if need == 1:  # three nodes, majority: the best slave's
            return min(local, max(others))
        others.sort(reverse=True)
        return min(local, others[need - 1])

    def _grants(self) -> tuple[list[SendGrant], list[str], list[str]]:
        """New send grants, and slaves that need a snapshot now (with log lines)."""
        grants: list[SendGrant] = []
        snapshots: list[str] = []
        events: list[str] = []
        cfg = self.config
        for slave in self._slave_order:
            if (
                slave.phase != _Phase.STREAMING
                or slave.grant is not None
                or slave.truncation_unacked
            ):
                continue
            node_id = slave.node_id
            if slave.next_lsn < self._log_start_lsn or slave.snapshot_wanted:
                why = (
                    "its log diverges"
                    if slave.snapshot_wanted
                    else f"it needs LSN {slave.next_lsn}, below the retained log start "
                    f"{self._log_start_lsn}"
                )
                slave.clear_window()
                slave.phase = _Phase.SNAPSHOTTING
                slave.snapshot_lsn = 0
                snapshots.append(node_id)
                events.append(
                    f"master {cfg.node_id} epoch {self._epoch}: sending node {node_id} a "
                    f"snapshot: {why}"
                )
                continue
            available = self._written_lsn - slave.next_lsn + 1
            room_entries = cfg.inflight_entries_max - (slave.next_lsn - 1 - slave.received_lsn)
            room_bytes = cfg.inflight_bytes_max - slave.inflight_bytes
            if not slave.first_batch and (available <= 0 or room_entries <= 0 or room_bytes <= 0):
                continue
            slave.grant = SendGrant(
                node_id=node_id,
                stream_id=slave.stream_id,
                from_lsn=slave.next_lsn,
                entries_max=max(0, min(available, room_entries)),
                bytes_max=max(0, room_bytes),
                commit_lsn=self._commit_lsn,
                truncate_after_lsn=slave.truncate_after,
            )
            grants.append(slave.grant)
        return grants, snapshots, events

    def _actions(
        self,
        *,
        rejection: Rejection | None = None,
        heartbeats: tuple[str, ...] = (),
        failed: tuple[T, ...] = (),
        events: tuple[str, ...] = (),
    ) -> Actions[T]:
        """Advances the commit LSN, completes writes, and grants sends after an input."""
        if self._deposed:
            return Actions(commit_lsn=self._commit_lsn, failed=failed, rejection=rejection)
        candidate = self._quorum_lsn()
        if candidate >= self._epoch_start_lsn and candidate > self._commit_lsn:
            self._commit_lsn = candidate
        completed: list[T] = []
        while self._pending and self._pending[0][0] <= self._commit_lsn:
            completed.append(self._pending.popleft()[1])
        grants, snapshots, grant_events = self._grants()
        if heartbeats or self._following:
            heartbeats = self._heartbeats(heartbeats)
        return Actions(
            commit_lsn=self._commit_lsn,
            sends=tuple(grants),
            snapshots=tuple(snapshots),
            heartbeats=heartbeats,
            completed=tuple(completed),
            failed=failed,
            rejection=rejection,
            events=events + tuple(grant_events),
        )

    def _heartbeats(self, due: tuple[str, ...]) -> tuple[str, ...]:
        """The heartbeats ``due`` (they carry the commit LSN) and the commit notices: a
        slave serving following readers that was told less than the commit LSN and gets
        no batch in this record (a grant carries the commit LSN)."""
        commit = self._commit_lsn
        out = list(due)
        for slave in self._slave_order:
            if slave.node_id in due:
                slave.commit_told = commit
            elif (
                slave.readers_following
                and slave.commit_told < commit
                and slave.phase == _Phase.STREAMING
                and slave.grant is None
                and not slave.truncation_unacked
            ):
                out.append(slave.node_id)
                slave.commit_told = commit
                slave.sent_since_heartbeat = True
        return tuple(out)

    def _set_following(self, slave: _Slave, following: bool) -> None:
        if slave.readers_following != following:
            slave.readers_following = following
            self._following += 1 if following else -1

    def _silent_ms(self, slave: _Slave) -> int:
        """How long, by the last tick, this master has not heard from ``slave`` (from its
        first tick if never; 0 before any tick)."""
        now = self._now_ms
        if now is None:
            return 0
        heard = slave.heard_ms if slave.heard_ms is not None else self._started_ms
        return max(0, now - (now if heard is None else heard))

    def _progress(self, slave: _Slave) -> SlaveProgress:
        inflight_entries = 0
        if slave.phase == _Phase.STREAMING:
            inflight_entries = max(0, slave.next_lsn - 1 - slave.received_lsn)
        state = {
            _Phase.DISCONNECTED: SlaveState.DISCONNECTED,
            _Phase.AWAITING_POSITION: SlaveState.PROBING,
            _Phase.STREAMING: SlaveState.STREAMING,
            _Phase.SNAPSHOTTING: SlaveState.SNAPSHOTTING,
        }[slave.phase]
        if state == SlaveState.STREAMING and (
            inflight_entries >= self.config.inflight_entries_max
            or slave.inflight_bytes >= self.config.inflight_bytes_max
        ):
            state = SlaveState.PAUSED
        silent_ms = 0
        if not self._deposed and slave.node_id not in self.config.learners:
            silent_ms = self._silent_ms(slave)
        return SlaveProgress(
            node_id=slave.node_id,
            state=state,
            stream_id=slave.stream_id,
            next_lsn=slave.next_lsn,
            received_lsn=slave.received_lsn,
            written_lsn=slave.written_lsn,
            synced_lsn=slave.synced_lsn,
            inflight_entries=inflight_entries,
            inflight_bytes=slave.inflight_bytes,
            snapshot_lsn=slave.snapshot_lsn,
            silent_ms=silent_ms,
            catching_up=not slave.caught_up,
        )
