"""Tests of squall_server.replica.replication: the master's ack tracking, commit LSN, flow windows,
snapshot fallback and deposal.

Two levels: direct calls on a ``ReplicationMaster`` for the precise rules (which ack
counts under which policy), and a small in-memory cluster (``Cluster``) that drives the
master and real ``Follower`` machines the way the gRPC driver will, applying every
``Actions`` record in its documented order, over FIFO streams that can be paused or
broken (two tests reorder one, as the replication simulator does). A seeded random run
checks the invariants (commit never decreases, a completed write is held by the required
count, memory stays within the windows, logs converge); a failure names the seed that
replays it.
"""

from __future__ import annotations

import ast
import random
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from squall_server.common.errors import Code
from squall_server.replica.divergence import epoch_at, truncate_history
from squall_server.replica.follower import (
    BatchAccepted,
    Follower,
    FollowerConfig,
    HelloAccepted,
    Refusal,
    RefusalCode,
    SnapshotAccepted,
)
from squall_server.replica.replication import (
    Ack,
    AckPolicy,
    Actions,
    MasterConfig,
    RejectCode,
    ReplicationConfigError,
    ReplicationError,
    ReplicationMaster,
    SlaveState,
    SyncPolicy,
    batch_size_bytes,
    entry_size_bytes,
    fit_batch,
)

CLUSTER = "c0ffee"


@dataclass(frozen=True)
class Entry:
    """A log entry with the fields replication looks at."""

    lsn: int
    epoch: int
    checksum: int
    operation: bytes


def entry(lsn: int, epoch: int, size: int = 8) -> Entry:
    op = bytes([lsn % 251]) * size
    return Entry(lsn, epoch, zlib.crc32(op), op)


def history_of(log: list[Entry]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for e in log:
        if not out or out[-1][0] != e.epoch:
            out.append((e.epoch, e.lsn))
    return out


def config(nodes: Iterable[str] = ("1", "2", "3"), **kwargs: object) -> MasterConfig:
    return MasterConfig(node_id="1", nodes=tuple(nodes), **kwargs)  # type: ignore[arg-type]


def new_master(
    cfg: MasterConfig | None = None,
    *,
    members: Iterable[str] | None = None,
    last_lsn: int = 0,
    epoch: int = 1,
) -> ReplicationMaster[str]:
    cfg = cfg or config()
    history = [(epoch - 1, 1)] if last_lsn else []
    return ReplicationMaster(
        cfg,
        epoch=epoch,
        members=cfg.nodes if members is None else members,
        last_lsn=last_lsn,
        history=history,
    )


def stream(master: ReplicationMaster[str], node: str, last_lsn: int = 0) -> int:
    """Connects node, answers with a Position equal to the master's old log, sends the first
    batch; returns the stream id."""
    sid = master.connect(node)
    history = [(master.epoch - 1, 1)] if last_lsn else []
    actions = master.on_position(
        node,
        sid,
        last_epoch=master.epoch - 1 if last_lsn else 0,
        last_lsn=last_lsn,
        history=history,
    )
    assert actions.rejection is None, actions.rejection
    send_all(master, actions)
    return sid


def send_all(master: ReplicationMaster[str], actions: Actions[str]) -> list[Actions[str]]:
    """Sends every grant in full (sizes from the test entries); returns what each on_sent gave."""
    out: list[Actions[str]] = []
    pending = deque(actions.sends)
    for _ in range(10_000):
        if not pending:
            return out
        grant = pending.popleft()
        last = grant.from_lsn - 1 + grant.entries_max
        size = sum(entry_size_bytes(entry(lsn, 1)) for lsn in range(grant.from_lsn, last + 1))
        follow = master.on_sent(grant.node_id, grant.stream_id, last, size)
        out.append(follow)
        pending.extend(follow.sends)
    raise AssertionError("sends did not settle")


def ack(
    master: ReplicationMaster[str], node: str, sid: int, r: int, w: int, s: int
) -> Actions[str]:
    return master.on_ack(node, sid, received_lsn=r, written_lsn=w, synced_lsn=s)


# --- purity


@pytest.mark.parametrize("module", ["replication", "follower", "divergence"])
def test_the_core_imports_no_io_clock_randomness_or_threads(module: str) -> None:
    source = (Path(__file__).parents[2] / "services" / "replica" / f"{module}.py").read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"grpc", "lmdb", "asyncio", "time", "random", "threading"})


# --- configuration


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": ()}, "nodes: 1 to 64"),
        ({"nodes": ("1", "1")}, "duplicate node id"),
        ({"nodes": ("2", "3")}, "node_id '1' is not one of the nodes"),
        ({"acks": 0}, "acks: unknown policy"),
        ({"replica_sync": 7}, "replica_sync: unknown policy"),
        ({"inflight_entries_max": 0}, "inflight_entries_max: must be 1.."),
        ({"inflight_bytes_max": -1}, "inflight_bytes_max: must be 1.."),
        ({"pending_writes_max": 0}, "pending_writes_max"),
        ({"quorum_override": 4}, "quorum_override: must be 0..3"),
    ],
)
def test_bad_settings_are_refused_with_a_sentence(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"node_id": "1", "nodes": ("1", "2", "3")} | kwargs
    with pytest.raises(ReplicationConfigError, match=message):
        MasterConfig(**fields).validate()  # type: ignore[arg-type]


def test_a_group_below_the_quorum_cannot_master() -> None:
    with pytest.raises(ReplicationError, match="quorum is 2"):
        new_master(members=["1"])
    # A designated primary (or an operator's override) may run alone.
    new_master(config(quorum_override=1), members=["1"])


# --- commit rules


def test_majority_commits_when_one_of_two_slaves_holds_the_entry_written() -> None:
    master = new_master()  # SYNC master, WRITE_NO_SYNC replicas, majority of 3
    sid2 = stream(master, "2")
    stream(master, "3")
    actions = master.on_appended(3, synced=True)
    assert actions.commit_lsn == 0
    send_all(master, actions)
    master.register_writes([(2, "w2"), (3, "w3")])
    # Received is not enough under WRITE_NO_SYNC.
    actions = ack(master, "2", sid2, 3, 0, 0)
    assert actions.commit_lsn == 0 and actions.completed == ()
    actions = ack(master, "2", sid2, 3, 2, 0)
    assert actions.commit_lsn == 2 and actions.completed == ("w2",)
    actions = ack(master, "2", sid2, 3, 3, 0)
    assert actions.commit_lsn == 3 and actions.completed == ("w3",)
    assert master.pending_writes == 0
    assert master.holders(3) == (("1", SyncPolicy.SYNC), ("2", SyncPolicy.WRITE_NO_SYNC))


@pytest.mark.parametrize(
    ("policy", "ack_values", "committed"),
    [
        (SyncPolicy.SYNC, (5, 5, 4), 4),
        (SyncPolicy.WRITE_NO_SYNC, (5, 3, 0), 3),
        (SyncPolicy.NO_SYNC, (5, 0, 0), 5),
    ],
)
def test_the_replica_sync_policy_picks_which_ack_lsn_counts(
    policy: SyncPolicy, ack_values: tuple[int, int, int], committed: int
) -> None:
    master = new_master(config(replica_sync=policy))
    sid = stream(master, "2")
    send_all(master, master.on_appended(5, synced=True))
    assert ack(master, "2", sid, *ack_values).commit_lsn == committed


def test_the_masters_own_sync_policy_counts_too() -> None:
    master = new_master(config(master_sync=SyncPolicy.SYNC, acks=AckPolicy.NONE))
    assert master.on_appended(4, synced=False).commit_lsn == 0
    assert master.on_local_synced(3).commit_lsn == 3
    relaxed = new_master(config(master_sync=SyncPolicy.WRITE_NO_SYNC, acks=AckPolicy.NONE))
    assert relaxed.on_appended(4, synced=False).commit_lsn == 4


def test_majority_is_counted_over_all_configured_nodes() -> None:
    # Five nodes configured, a group of three: the majority is 3, so the master needs
    # BOTH its slaves, not "a majority of the group".
    master = new_master(config(nodes=("1", "2", "3", "4", "5")), members=["1", "2", "3"])
    sid2, sid3 = stream(master, "2"), stream(master, "3")
    send_all(master, master.on_appended(2, synced=True))
    assert ack(master, "2", sid2, 2, 2, 2).commit_lsn == 0
    assert ack(master, "3", sid3, 2, 1, 1).commit_lsn == 1


def test_a_learners_acks_count_for_no_commit() -> None:
    """A learner (a node added or replaced at runtime, still copying the log) gets the
    stream, but its acks neither make a majority nor hold an ALL commit back; a group
    that is a quorum only with the learner cannot master."""
    three = config(nodes=("1", "2", "3"), learners=("4",))
    master = new_master(three, members=["1", "2", "4"])
    sid2, sid4 = stream(master, "2"), stream(master, "4")
    send_all(master, master.on_appended(2, synced=True))
    # The learner holds both entries, the voter 2 nothing yet: no commit.
    assert ack(master, "4", sid4, 2, 2, 2).commit_lsn == 0
    assert ack(master, "2", sid2, 2, 1, 1).commit_lsn == 1
    every = new_master(
        config(nodes=("1", "2"), learners=("3",), acks=AckPolicy.ALL), members=["1", "2", "3"]
    )
    sid2 = stream(every, "2")
    stream(every, "3")  # the learner never acks: ALL still commits on the voters
    send_all(every, every.on_appended(2, synced=True))
    assert ack(every, "2", sid2, 2, 2, 2).commit_lsn == 2
    with pytest.raises(ReplicationError, match="2 voting nodes cannot replicate"):
        new_master(config(nodes=("1", "2", "3", "5"), learners=("4",)), members=["1", "2", "4"])
    # Losing a voter deposes the master even while the learner stays.
    assert master.set_members(["1", "4"]).deposed


def test_all_waits_for_every_member_and_none_for_the_master_alone() -> None:
    master = new_master(config(acks=AckPolicy.ALL))
    sid2, sid3 = stream(master, "2"), stream(master, "3")
    send_all(master, master.on_appended(2, synced=True))
    assert ack(master, "2", sid2, 2, 2, 2).commit_lsn == 0
    assert ack(master, "3", sid3, 2, 2, 2).commit_lsn == 2
    alone = new_master(config(acks=AckPolicy.NONE))
    assert alone.on_appended(2, synced=True).commit_lsn == 2


def test_all_waits_for_a_member_that_joined_behind_only_once_it_has_caught_up() -> None:
    """A node rejoining the group behind (restarted, back after a partition) must not hold
    every commit back for as long as its catch-up takes: under ALL a commit waits for a
    majority and for each member that has caught up: held the master's log as of the
    epoch's start (or the commit LSN of when its stream opened, if later)."""
    cfg = config(acks=AckPolicy.ALL)
    master = ReplicationMaster(cfg, epoch=2, members=cfg.nodes, last_lsn=10, history=[(1, 1)])
    sid2 = stream(master, "2", last_lsn=10)  # up to date: waited for at once
    sid3 = master.connect("3")
    actions = master.on_position("3", sid3, last_epoch=1, last_lsn=4, history=[(1, 1)])
    assert any("holds the log to LSN 4, behind LSN 10" in e for e in actions.events)
    send_all(master, actions)
    assert master.progress("3").catching_up and not master.progress("2").catching_up
    send_all(master, master.on_appended(11, synced=True))  # the epoch-start entry
    assert ack(master, "2", sid2, 11, 11, 11).commit_lsn == 11  # node 3 holds nothing back
    assert ack(master, "3", sid3, 9, 9, 9).commit_lsn == 11
    assert master.progress("3").catching_up  # still short of LSN 10
    actions = ack(master, "3", sid3, 10, 10, 10)
    assert not master.progress("3").catching_up
    assert any("node 3 caught up" in e for e in actions.events)
    # From now on every commit waits for node 3 as well.
    send_all(master, master.on_appended(12, synced=True))
    assert ack(master, "2", sid2, 12, 12, 12).commit_lsn == 11
    assert ack(master, "3", sid3, 12, 12, 12).commit_lsn == 12
    # Its stream breaking does not make it catching up again: a stopped member that had
    # caught up holds commits back until the group drops it.
    master.disconnected("3", sid3)
    send_all(master, master.on_appended(13, synced=True))
    assert ack(master, "2", sid2, 13, 13, 13).commit_lsn == 12
    assert master.set_members(["1", "2"]).commit_lsn == 13


def test_all_does_not_wait_for_a_member_it_never_heard_from() -> None:
    """A member whose replica cannot be reached (its links alone cut when it rejoined)
    holds nothing back; it still shows as silent."""
    master = new_master(config(acks=AckPolicy.ALL))
    master.tick(0)
    sid2 = stream(master, "2")
    send_all(master, master.on_appended(1, synced=True))
    assert ack(master, "2", sid2, 1, 1, 1).commit_lsn == 1
    master.tick(5_000)
    ack(master, "2", sid2, 1, 1, 1)  # node 2 answers a heartbeat
    silent = master.progress("3")
    assert silent.catching_up and silent.silent_ms == 5_000
    assert master.quorum_silent_ms() == 0
    # Under majority the flag is reported too (status shows it), and changes nothing.
    majority = new_master(config())
    sid = stream(majority, "2")
    send_all(majority, majority.on_appended(1, synced=True))
    assert ack(majority, "2", sid, 1, 1, 1).commit_lsn == 1
    assert majority.progress("3").catching_up and not majority.progress("2").catching_up


def test_all_does_not_wait_for_a_member_installing_a_snapshot() -> None:
    """A member that needs a snapshot is catching up until it holds what was committed
    when the snapshot began."""
    cfg = config(acks=AckPolicy.ALL)
    master = ReplicationMaster(
        cfg,
        epoch=2,
        members=cfg.nodes,
        last_lsn=10,
        history=[(1, 1)],
        log_start_lsn=8,
    )
    sid2 = stream(master, "2", last_lsn=10)
    sid3 = master.connect("3")
    actions = master.on_position("3", sid3, last_epoch=1, last_lsn=4, history=[(1, 1)])
    assert actions.snapshots == ("3",)
    master.on_snapshot_started("3", sid3, 10)
    send_all(master, master.on_appended(11, synced=True))
    assert ack(master, "2", sid2, 11, 11, 11).commit_lsn == 11
    assert master.progress("3").catching_up
    actions = ack(master, "3", sid3, 10, 10, 10)  # the snapshot at LSN 10 installed
    assert not master.progress("3").catching_up
    send_all(master, actions)
    send_all(master, master.on_appended(12, synced=True))
    assert ack(master, "2", sid2, 12, 12, 12).commit_lsn == 11


def test_all_stops_waiting_for_a_member_whose_store_is_full() -> None:
    """A slave that refuses the log for want of room would otherwise hold every write
    back until an operator freed its disk."""
    master = new_master(config(acks=AckPolicy.ALL))
    sid2, sid3 = stream(master, "2"), stream(master, "3")
    send_all(master, master.on_appended(1, synced=True))
    assert ack(master, "2", sid2, 1, 1, 1).commit_lsn == 0
    actions = master.cannot_store("3", "RESOURCE_EXHAUSTED: store full")
    assert actions.commit_lsn == 1
    assert any("node 3 cannot store the log" in e for e in actions.events)
    assert master.progress("3").catching_up
    master.disconnected("3", sid3)
    send_all(master, master.on_appended(2, synced=True))
    assert ack(master, "2", sid2, 2, 2, 2).commit_lsn == 2
    # Room again: it reconnects behind, catches up, and is waited for again.
    sid3 = master.connect("3")
    send_all(master, master.on_position("3", sid3, last_epoch=0, last_lsn=0, history=[]))
    assert master.progress("3").catching_up
    ack(master, "3", sid3, 2, 2, 2)
    assert not master.progress("3").catching_up
    send_all(master, master.on_appended(3, synced=True))
    assert ack(master, "2", sid2, 3, 3, 3).commit_lsn == 2
    assert ack(master, "3", sid3, 3, 3, 3).commit_lsn == 3
    # A node the group no longer has is ignored.
    assert master.cannot_store("9", "RESOURCE_EXHAUSTED").events == ()


def test_all_counts_the_current_group_only() -> None:
    master = new_master(config(acks=AckPolicy.ALL))
    sid2 = stream(master, "2")
    stream(master, "3")
    send_all(master, master.on_appended(2, synced=True))
    assert ack(master, "2", sid2, 2, 2, 2).commit_lsn == 0
    # Node 3 went silent and the coordinator dropped it: the group is {1, 2}.
    assert master.set_members(["1", "2"]).commit_lsn == 2
    with pytest.raises(ReplicationError, match="groups only shrink"):
        master.set_members(["1", "2", "3"])


def test_older_epoch_entries_commit_only_with_this_epochs_first_entry() -> None:
    # LSNs 1..10 are from epoch 1, not known committed; this master (epoch 2) must get
    # its epoch-start entry (LSN 11) onto a majority before it counts any of them.
    master = new_master(last_lsn=10, epoch=2)
    sid = master.connect("2")
    actions = master.on_position("2", sid, last_epoch=1, last_lsn=4, history=[(1, 1)])
    (grant,) = actions.sends
    assert (grant.from_lsn, grant.entries_max, grant.truncate_after_lsn) == (5, 6, None)
    send_all(master, actions)
    actions = ack(master, "2", sid, 10, 10, 10)
    assert actions.commit_lsn == 0  # a majority holds 1..10, but none of it is epoch 2's
    send_all(master, master.on_appended(11, synced=True))
    assert master.history == ((1, 1), (2, 11))
    assert ack(master, "2", sid, 11, 11, 11).commit_lsn == 11


# --- windows


def test_the_window_bounds_entries_and_bytes_in_flight() -> None:
    size = entry_size_bytes(entry(1, 1))
    master = new_master(config(inflight_entries_max=4, inflight_bytes_max=10 * size))
    sid = stream(master, "2")
    actions = master.on_appended(20, synced=True)
    (grant,) = [g for g in actions.sends if g.node_id == "2"]
    assert (grant.from_lsn, grant.entries_max) == (1, 4)
    send_all(master, actions)
    assert master.progress("2").inflight_entries == 4
    assert master.progress("2").state == SlaveState.PAUSED
    # Nothing more until the slave acknowledges receipt.
    assert [g for g in master.on_appended(21, synced=True).sends if g.node_id == "2"] == []
    actions = ack(master, "2", sid, 2, 0, 0)
    (grant,) = [g for g in actions.sends if g.node_id == "2"]
    assert (grant.from_lsn, grant.entries_max) == (5, 2)


@pytest.mark.parametrize(
    ("entries_max", "bytes_in_entries", "round_trips"),
    [(1, 64, 40), (4, 64, 10), (64, 1, 40), (64, 64, 1)],
)
def test_a_slave_40_entries_behind_takes_a_full_window_per_round_trip(
    entries_max: int, bytes_in_entries: int, round_trips: int
) -> None:
    # Each ack frees the window and grants all of it again: a slave N entries behind
    # catches up (and a write waiting for it completes) in N / window round trips, one
    # entry per round trip at a one-entry window (or a byte window one entry fills). The
    # replication simulator's liveness bound counts on it (``drain_deadline``; seed 6345).
    size = entry_size_bytes(entry(1, 1))
    master = new_master(
        config(inflight_entries_max=entries_max, inflight_bytes_max=bytes_in_entries * size)
    )
    sid = stream(master, "2")
    actions = master.on_appended(40, synced=True, writes=[(40, "w40")])
    trips = 0
    while True:
        for grant in actions.sends:
            lsns = range(grant.from_lsn, grant.from_lsn + grant.entries_max)
            batch = fit_batch([entry(lsn, 1) for lsn in lsns], grant.bytes_max)
            assert len(batch) == min(entries_max, bytes_in_entries, 40 - grant.from_lsn + 1)
            follow = master.on_sent("2", sid, batch[-1].lsn, batch_size_bytes(batch))
            assert follow.sends == ()
        if actions.completed:
            break
        assert trips < 40, "the write did not complete within one round trip per entry"
        trips += 1
        sent = master.progress("2").next_lsn - 1
        actions = ack(master, "2", sid, sent, sent, sent)
    assert actions.completed == ("w40",)
    assert trips == round_trips


def test_fit_batch_keeps_the_byte_limit_but_always_sends_one_entry() -> None:
    small = [entry(i, 1, size=10) for i in range(1, 6)]
    assert len(fit_batch(small, 3 * entry_size_bytes(small[0]))) == 3
    big = [entry(1, 1, size=5000), entry(2, 1)]
    assert fit_batch(big, 100) == big[:1]
    assert batch_size_bytes(big[:1]) == entry_size_bytes(big[0])


# --- stale and bad input


def test_a_stale_streams_ack_is_ignored_and_changes_nothing() -> None:
    master = new_master()
    old = stream(master, "2")
    send_all(master, master.on_appended(3, synced=True))
    new = master.connect("2")  # the slave reconnected
    before = master.progress("2")
    actions = ack(master, "2", old, 3, 3, 3)
    assert actions.rejection is not None
    assert actions.rejection.code == RejectCode.STALE_STREAM
    assert actions.commit_lsn == 0 and master.progress("2") == before
    assert new != old


@pytest.mark.parametrize(
    ("values", "detail"),
    [((9, 9, 9), "<= 3 (sent)"), ((3, 3, 4), "is not ordered"), ((2, 3, 0), "is not ordered")],
)
def test_an_impossible_ack_is_refused_and_changes_nothing(
    values: tuple[int, int, int], detail: str
) -> None:
    master = new_master()
    sid = stream(master, "2")
    send_all(master, master.on_appended(3, synced=True))
    before = master.progress("2")
    actions = ack(master, "2", sid, *values)
    assert actions.rejection is not None and actions.rejection.code == RejectCode.BAD_ACK
    assert actions.rejection.status == Code.INVALID_ARGUMENT
    assert detail in actions.rejection.message
    assert master.progress("2") == before and master.commit_lsn == 0


@pytest.mark.parametrize(
    ("last_epoch", "last_lsn", "history", "detail"),
    [
        (1, 3, [(1, 2)], "not 1"),
        (2, 3, [(1, 1)], "last epoch 2 but the history gives 1"),
        (1, 3, [(1, 1), (1, 2)], "epochs must increase"),
        (5, 3, [(1, 1), (5, 3)], "never wrote"),  # entries of the master's own epoch
    ],
)
def test_an_impossible_position_is_refused(
    last_epoch: int, last_lsn: int, history: list[tuple[int, int]], detail: str
) -> None:
    master = new_master(epoch=5)
    send_all(master, master.on_appended(1, synced=True))
    sid = master.connect("2")
    before = master.progress("2")
    actions = master.on_position(
        "2", sid, last_epoch=last_epoch, last_lsn=last_lsn, history=history
    )
    assert actions.rejection is not None and actions.rejection.code == RejectCode.BAD_POSITION
    assert detail in actions.rejection.detail
    assert master.progress("2") == before


def test_truncating_a_slave_ahead_of_the_master_is_logged_loudly() -> None:
    master = new_master(last_lsn=5, epoch=3)  # its log: epoch 2, LSNs 1..5
    sid = master.connect("2")
    actions = master.on_position("2", sid, last_epoch=2, last_lsn=8, history=[(2, 1)])
    (grant,) = actions.sends
    assert grant.truncate_after_lsn == 5
    assert any(e.startswith("WARNING") and "ahead of this master" in e for e in actions.events)
    behind = master.connect("3")
    quiet = master.on_position("3", behind, last_epoch=2, last_lsn=3, history=[(2, 1)])
    assert quiet.events == () and quiet.sends[0].truncate_after_lsn is None


# --- deposal


def test_a_deposed_master_fails_pending_writes_as_indeterminate_and_never_commits_more() -> None:
    master = new_master()
    sid = stream(master, "2")
    send_all(master, master.on_appended(4, synced=True))
    master.register_writes([(1, "a"), (3, "b"), (4, "c")])
    assert ack(master, "2", sid, 1, 1, 1).completed == ("a",)
    actions = master.depose("role command for epoch 2")
    assert actions.deposed == "role command for epoch 2"
    assert actions.failed == ("b", "c") and actions.completed == ()
    assert master.pending_writes == 0 and master.write_room == 0
    # Acks that arrive afterwards are refused and raise nothing.
    late = ack(master, "2", sid, 4, 4, 4)
    assert late.rejection is not None and late.rejection.code == RejectCode.DEPOSED
    assert late.commit_lsn == 1 and master.commit_lsn == 1
    assert master.on_appended(5, synced=True).commit_lsn == 1
    assert master.register_write(5, "d").failed == ("d",)
    with pytest.raises(ReplicationError, match="deposed"):
        master.connect("3")


def test_a_newer_epoch_seen_anywhere_deposes_the_master() -> None:
    master = new_master(epoch=3)
    send_all(master, master.on_appended(2, synced=True))
    master.register_write(2, "w")
    assert master.observe_epoch(3).deposed == ""
    actions = master.observe_epoch(4)
    assert "epoch 4 superseded epoch 3" in actions.deposed and actions.failed == ("w",)
    other = new_master(epoch=3)
    sid = other.connect("2")
    deposed = other.on_position("2", sid, last_epoch=4, last_lsn=2, history=[(1, 1), (4, 2)])
    assert "newer than 3" in deposed.deposed


def test_losing_the_group_deposes_the_master() -> None:
    master = new_master(config(nodes=("1", "2", "3", "4", "5")))
    send_all(master, master.on_appended(1, synced=True))
    master.register_write(1, "w")
    assert master.set_members(["1", "2", "3"]).deposed == ""
    actions = master.set_members(["1", "2"])
    assert "below the quorum 3" in actions.deposed and actions.failed == ("w",)


# --- the in-memory cluster


@dataclass
class Hello:
    stream_id: int
    master_id: str
    epoch: int


@dataclass
class Batch:
    stream_id: int
    entries: list[Entry]
    commit_lsn: int
    truncate_after_lsn: int | None
    epoch: int


@dataclass
class Heartbeat:
    stream_id: int
    commit_lsn: int
    epoch: int


@dataclass
class Snapshot:
    stream_id: int
    snapshot_lsn: int
    snapshot_epoch: int
    history: tuple[tuple[int, int], ...]
    state: list[Entry]  # stands for the state databases at snapshot_lsn


@dataclass
class SlaveNode:
    node_id: str
    follower: Follower
    log: list[Entry]
    inbox: deque[Hello | Batch | Heartbeat | Snapshot] = field(default_factory=deque)
    stream_id: int = 0
    paused: bool = False
    refusals: list[Refusal] = field(default_factory=list)

    def inbox_entries(self) -> int:
        return sum(len(m.entries) for m in self.inbox if isinstance(m, Batch))


class Cluster:
    """A master and its slaves over in-memory streams, driven as the gRPC driver will."""

    def __init__(
        self,
        *,
        nodes: tuple[str, ...] = ("1", "2", "3"),
        members: tuple[str, ...] | None = None,
        acks: AckPolicy = AckPolicy.MAJORITY,
        replica_sync: SyncPolicy = SyncPolicy.WRITE_NO_SYNC,
        window_entries: int = 4,
        window_bytes: int = 1 << 20,
        pending_max: int = 1000,
        master_log: list[Entry] | None = None,
        slave_logs: dict[str, list[Entry]] | None = None,
        epoch: int = 2,
        truncate_by_snapshot: bool = False,
    ) -> None:
        members = members or nodes
        self.epoch = epoch
        self.cfg = MasterConfig(
            node_id="1",
            nodes=nodes,
            acks=acks,
            replica_sync=replica_sync,
            inflight_entries_max=window_entries,
            inflight_bytes_max=window_bytes,
            pending_writes_max=pending_max,
            truncate_by_snapshot=truncate_by_snapshot,
        )
        self.log: list[Entry] = list(master_log or [])
        self.synced_lsn = len(self.log)
        self.master: ReplicationMaster[str] = ReplicationMaster(
            self.cfg,
            epoch=epoch,
            members=members,
            last_lsn=len(self.log),
            history=history_of(self.log),
        )
        self.slaves: dict[str, SlaveNode] = {}
        for node in members:
            if node == "1":
                continue
            log = list((slave_logs or {}).get(node, []))
            follower = Follower(
                FollowerConfig(node, replica_sync, window_entries, window_bytes),
                cluster_id=CLUSTER,
                epoch=epoch,
                master_id="1",
                last_lsn=len(log),
                history=history_of(log),
            )
            self.slaves[node] = SlaveNode(node, follower, log)
        self.to_master: deque[tuple[str, int, Ack | HelloAccepted]] = deque()
        self.completed: list[str] = []
        self.failed: list[str] = []
        self.commits: list[int] = [self.master.commit_lsn]
        self.rejections: list[RejectCode] = []
        self.snapshots_sent: list[tuple[str, int]] = []
        self.max_inbox_entries = 0
        self.log_start = 1
        # Where each slave's own log starts (a compacted log cannot replay from LSN 1).
        self.slave_log_starts: dict[str, int] = {}

    # --- the master's driver

    def start(self) -> None:
        """The new master appends its epoch-start entry and opens a stream to each slave."""
        self.append(1, tokens=False)
        for node in self.slaves:
            self.connect(node)

    def connect(self, node: str) -> None:
        slave = self.slaves[node]
        slave.stream_id = self.master.connect(node)
        slave.inbox.clear()
        slave.inbox.append(Hello(slave.stream_id, "1", self.epoch))

    def disconnect(self, node: str) -> None:
        slave = self.slaves[node]
        slave.inbox.clear()
        self.apply(self.master.disconnected(node, slave.stream_id))
        slave.stream_id = 0

    def append(self, n: int, *, tokens: bool = True, size: int = 8, synced: bool = True) -> None:
        """Appends n entries (flushed unless synced=False: then they go to the slaves
        before the master's own flush, as the writer sends them, and `flush` follows)."""
        first = len(self.log) + 1
        self.log.extend(entry(lsn, self.epoch, size) for lsn in range(first, first + n))
        if synced:
            self.synced_lsn = len(self.log)
        self.apply(self.master.on_appended(len(self.log), synced=synced))
        if tokens:
            self.apply(
                self.master.register_writes((lsn, f"w{lsn}") for lsn in range(first, first + n))
            )

    def flush(self) -> None:
        """The master's own flush of what it appended unflushed succeeded."""
        self.synced_lsn = len(self.log)
        self.apply(self.master.on_local_synced(self.synced_lsn))

    def compact(self, log_start: int) -> None:
        self.log_start = log_start
        self.apply(self.master.set_log_start(log_start))

    def apply(self, actions: Actions[str]) -> None:
        """Applies one Actions record in its documented order."""
        assert actions.commit_lsn >= self.commits[-1], "the commit LSN went backwards"
        self.commits.append(actions.commit_lsn)
        if actions.rejection is not None:
            self.rejections.append(actions.rejection.code)
        for grant in actions.sends:
            slave = self.slaves[grant.node_id]
            assert grant.stream_id == slave.stream_id
            assert grant.from_lsn >= self.log_start, "granted entries the log no longer has"
            batch = self.log[grant.from_lsn - 1 : grant.from_lsn - 1 + grant.entries_max]
            batch = list(fit_batch(batch, grant.bytes_max)) if batch else []
            last = grant.from_lsn - 1 + len(batch)
            follow = self.master.on_sent(
                grant.node_id, grant.stream_id, last, batch_size_bytes(batch)
            )
            slave.inbox.append(
                Batch(
                    grant.stream_id, batch, grant.commit_lsn, grant.truncate_after_lsn, self.epoch
                )
            )
            self.max_inbox_entries = max(self.max_inbox_entries, slave.inbox_entries())
            self.apply(follow)
        for node in actions.snapshots:
            slave = self.slaves[node]
            lsn = len(self.log)
            self.snapshots_sent.append((node, lsn))
            history = truncate_history(self.master.history, lsn)
            self.apply(self.master.on_snapshot_started(node, slave.stream_id, lsn))
            slave.inbox.append(
                Snapshot(slave.stream_id, lsn, epoch_at(history, lsn), history, self.log[:lsn])
            )
        for node in actions.heartbeats:
            slave = self.slaves[node]
            slave.inbox.append(Heartbeat(slave.stream_id, actions.commit_lsn, self.epoch))
        for token in actions.completed:
            self.check_held(int(token[1:]))
        self.completed.extend(actions.completed)
        self.failed.extend(actions.failed)

    def check_held(self, lsn: int) -> None:
        """A completed write is held by the required count at the required durability."""
        # The master counts once flushed (its sync policy here is SYNC).
        holders = 1 if self.synced_lsn >= lsn else 0
        held_by = set()
        for node, slave in self.slaves.items():
            state = slave.follower.state()
            durable = slave.follower.ack().durable_lsn(self.cfg.replica_sync)
            if durable >= lsn and state.last_lsn >= lsn and slave.log[lsn - 1] == self.log[lsn - 1]:
                holders += 1
                held_by.add(node)
        if self.cfg.acks == AckPolicy.ALL:
            # Every member that caught up, and a majority in any case.
            waited = {
                node
                for node in self.master.members
                if node in self.slaves and not self.master.progress(node).catching_up
            }
            assert waited <= held_by, f"LSN {lsn} completed without {sorted(waited - held_by)}"
            required = self.cfg.quorum
        elif self.cfg.acks == AckPolicy.NONE:
            required = 1
        else:
            required = self.cfg.quorum
        assert holders >= required, f"LSN {lsn} completed with {holders} holders of {required}"

    # --- the slaves' drivers

    def deliver_to_slave(self, node: str) -> bool:
        slave = self.slaves[node]
        if slave.paused or not slave.inbox:
            return False
        msg = slave.inbox.popleft()
        follower = slave.follower
        sid = msg.stream_id
        if isinstance(msg, Hello):
            result = follower.on_hello(master_id=msg.master_id, epoch=msg.epoch, cluster_id=CLUSTER)
            if isinstance(result, Refusal):
                return self.refused(slave, result)
            self.to_master.append((node, sid, result))
        elif isinstance(msg, Batch):
            batch = follower.on_batch(
                epoch=msg.epoch,
                entries=msg.entries,
                commit_lsn=msg.commit_lsn,
                truncate_after_lsn=msg.truncate_after_lsn,
            )
            if isinstance(batch, Refusal):
                return self.refused(slave, batch)
            self.store_batch(slave, batch, sid)
        elif isinstance(msg, Heartbeat):
            hb = follower.on_heartbeat(epoch=msg.epoch, commit_lsn=msg.commit_lsn)
            if isinstance(hb, Refusal):
                return self.refused(slave, hb)
            self.to_master.append((node, sid, hb))
        else:
            snap = follower.on_snapshot_chunk(
                index=0,
                snapshot_lsn=msg.snapshot_lsn,
                snapshot_epoch=msg.snapshot_epoch,
                last=True,
                history=msg.history,
            )
            if isinstance(snap, Refusal):
                return self.refused(slave, snap)
            assert isinstance(snap, SnapshotAccepted) and snap.install
            slave.log = list(msg.state)
            sync = self.cfg.replica_sync == SyncPolicy.SYNC
            self.to_master.append((node, sid, follower.on_written(msg.snapshot_lsn, synced=sync)))
        return True

    def store_batch(self, slave: SlaveNode, batch: BatchAccepted[Entry], sid: int) -> None:
        if batch.ack_now is not None:
            self.to_master.append((slave.node_id, sid, batch.ack_now))
        if batch.write_needed:
            if batch.truncate_after_lsn is not None:
                del slave.log[batch.truncate_after_lsn :]
            slave.log.extend(batch.entries)
            assert len(slave.log) == batch.last_lsn
            written = slave.follower.on_written(batch.last_lsn, synced=batch.sync)
            self.to_master.append((slave.node_id, sid, written))

    def refused(self, slave: SlaveNode, refusal: Refusal) -> bool:
        slave.refusals.append(refusal)
        slave.inbox.clear()
        if refusal.code == RefusalCode.STALE_EPOCH:
            self.apply(self.master.observe_epoch(refusal.epoch))
        self.apply(self.master.disconnected(slave.node_id, slave.stream_id))
        return True

    def deliver_to_master(self) -> bool:
        if not self.to_master:
            return False
        node, sid, msg = self.to_master.popleft()
        if isinstance(msg, HelloAccepted):
            pos = msg.position
            actions = self.master.on_position(
                node,
                sid,
                last_epoch=pos.last_epoch,
                last_lsn=pos.last_lsn,
                history=pos.history,
                log_start_lsn=self.slave_log_starts.get(node, 1),
            )
        else:
            actions = self.master.on_ack(
                node,
                sid,
                received_lsn=msg.received_lsn,
                written_lsn=msg.written_lsn,
                synced_lsn=msg.synced_lsn,
            )
        self.apply(actions)
        return True

    def run(self, steps_max: int = 100_000) -> None:
        """Delivers every message until nothing moves (paused slaves keep theirs)."""
        for _ in range(steps_max):
            moved = self.deliver_to_master()
            for node in self.slaves:
                moved = self.deliver_to_slave(node) or moved
            if not moved:
                return
        raise AssertionError("the cluster did not settle")

    def converged(self) -> bool:
        return all(s.log == self.log for s in self.slaves.values())


def test_a_paused_slave_fills_its_window_while_majority_commits_on_the_others() -> None:
    cluster = Cluster(window_entries=4)
    cluster.start()
    cluster.run()
    cluster.slaves["3"].paused = True
    for _ in range(30):
        cluster.append(1)
        cluster.run()
    assert cluster.master.commit_lsn == 31
    assert cluster.completed == [f"w{lsn}" for lsn in range(2, 32)]
    progress = cluster.master.progress("3")
    assert progress.state == SlaveState.PAUSED
    assert progress.inflight_entries == 4
    # Memory stays bounded: the paused slave's stream never held more than its window.
    assert cluster.slaves["3"].inbox_entries() <= 4
    assert cluster.max_inbox_entries <= 4
    # Resumed, it is sent the backlog from where it left off and catches up.
    cluster.slaves["3"].paused = False
    cluster.run()
    assert cluster.converged()
    assert cluster.master.progress("3").state == SlaveState.STREAMING
    assert cluster.master.progress("3").written_lsn == 31


def test_with_all_acks_a_paused_slave_stops_the_commit_and_slows_writers() -> None:
    cluster = Cluster(acks=AckPolicy.ALL, window_entries=4, pending_max=8)
    cluster.start()
    cluster.run()
    cluster.slaves["3"].paused = True
    written = 0
    for _ in range(30):
        if cluster.master.write_room == 0:
            break  # the driver holds new writes back: publishers slow down
        cluster.append(1)
        written += 1
        cluster.run()
    assert written == 8 and cluster.master.write_room == 0
    assert cluster.master.commit_lsn == 1  # nothing of the paused window is acknowledged
    assert cluster.completed == []
    assert cluster.max_inbox_entries <= 4
    cluster.slaves["3"].paused = False
    cluster.run()
    assert cluster.master.commit_lsn == 9
    assert cluster.completed == [f"w{lsn}" for lsn in range(2, 10)]
    assert cluster.master.write_room == 8


def test_the_byte_window_bounds_a_slave_with_big_entries() -> None:
    size = 1000
    cost = entry_size_bytes(entry(1, 1, size))
    cluster = Cluster(window_entries=100, window_bytes=3 * cost)
    cluster.start()
    cluster.run()
    cluster.slaves["3"].paused = True
    for _ in range(10):
        cluster.append(1, size=size)
        cluster.run()
    progress = cluster.master.progress("3")
    assert progress.inflight_bytes <= 3 * cost
    assert progress.state == SlaveState.PAUSED
    assert cluster.master.commit_lsn == 11
    cluster.slaves["3"].paused = False
    cluster.run()
    assert cluster.converged()


def test_a_reconnected_slave_is_sent_the_backlog_from_its_position() -> None:
    cluster = Cluster()
    cluster.start()
    cluster.append(5)
    cluster.run()
    cluster.disconnect("3")
    cluster.append(20)
    cluster.run()
    assert cluster.slaves["3"].log == cluster.log[:6]
    assert cluster.master.progress("3").state == SlaveState.DISCONNECTED
    cluster.connect("3")
    cluster.deliver_to_slave("3")  # the Hello
    while cluster.to_master:
        if cluster.to_master[0][0] == "3":
            break
        cluster.deliver_to_master()
    cluster.deliver_to_master()  # slave 3's Position
    (batch,) = list(cluster.slaves["3"].inbox)
    assert isinstance(batch, Batch)
    assert batch.entries[0].lsn == 7 and batch.truncate_after_lsn is None
    cluster.run()
    assert cluster.converged()


def test_a_divergent_suffix_from_a_deposed_master_is_truncated() -> None:
    # Epoch 1 wrote LSNs 1..5 everywhere; node 3 was master of epoch 2 and wrote 6..9
    # only to itself (never committed); node 1 is master of epoch 3.
    common = [entry(lsn, 1) for lsn in range(1, 6)]
    stale = common + [entry(lsn, 2, size=3) for lsn in range(6, 10)]
    cluster = Cluster(
        master_log=common, slave_logs={"2": common, "3": stale}, epoch=3, window_entries=3
    )
    cluster.start()
    cluster.append(6)
    cluster.run()
    assert cluster.converged()
    assert [e.epoch for e in cluster.slaves["3"].log] == [1] * 5 + [3] * 7
    assert cluster.slaves["3"].follower.state().history == ((1, 1), (3, 6))


def _deliver_newest_first(cluster: Cluster, node: str) -> None:
    """Delivers everything, the master's messages to ``node`` newest first (a stream that
    reorders: the replication simulator's, never gRPC's), checking after each that what
    ``node`` counts as committed is the master's log."""
    slave = cluster.slaves[node]
    for _ in range(1000):
        moved = cluster.deliver_to_master()
        if slave.inbox:
            slave.inbox.rotate(1)  # the newest message overtakes the others
        moved = cluster.deliver_to_slave(node) or moved
        commit = slave.follower.commit_lsn
        assert slave.log[:commit] == cluster.log[:commit], (
            f"node {node} serves as committed a log the master never wrote"
        )
        if not moved:
            return
    raise AssertionError("the cluster did not settle")


def test_a_write_acknowledged_through_a_truncated_slave_survives_a_reordered_stream() -> None:
    # Replication simulator seed 5027: node 2 holds LSN 2 of a deposed master (epoch 2);
    # the master of epoch 3 truncates it after LSN 1. A batch sent after the truncating
    # one overtook it: node 2 wrote LSN 3 over its own LSN 2 and acknowledged it, the
    # master completed the write, then the late truncation removed LSN 3 from node 2.
    common = [entry(1, 1)]
    cluster = Cluster(master_log=common, slave_logs={"2": [*common, entry(2, 2, size=3)]}, epoch=3)
    cluster.slaves["3"].paused = True  # the commit needs node 2
    cluster.start()  # the epoch-start entry at LSN 2, then the Hellos
    cluster.deliver_to_slave("2")  # the Hello
    cluster.deliver_to_master()  # node 2's Position: the first batch truncates after LSN 1
    cluster.append(1)  # LSN 3, a client's write
    _deliver_newest_first(cluster, "2")
    assert cluster.completed == ["w3"]
    # The acknowledged write is held by a majority (the master and node 2), whole.
    assert cluster.slaves["2"].log == cluster.log
    assert cluster.slaves["2"].follower.state().history == ((1, 1), (3, 2))


def test_a_slave_being_truncated_is_not_told_the_commit_lsn_over_its_old_log() -> None:
    # Replication simulator seed 5493: node 2 holds LSNs 2..3 of a deposed master (epoch
    # 2). A heartbeat sent after the truncating first batch overtook it: node 2 took the
    # master's commit LSN 3 over its own LSNs 2..3 and counted them committed.
    common = [entry(1, 1), entry(2, 1)]
    stale = [entry(1, 1), entry(2, 2, size=3), entry(3, 2, size=3)]
    cluster = Cluster(master_log=common, slave_logs={"2": stale, "3": common}, epoch=3)
    cluster.slaves["2"].paused = True
    cluster.start()
    cluster.run()  # node 3 takes the epoch-start entry: LSN 3 commits
    assert cluster.master.commit_lsn == 3
    cluster.slaves["2"].paused = False
    cluster.deliver_to_slave("2")  # the Hello
    cluster.deliver_to_master()  # node 2's Position: its first batch truncates after LSN 1
    for now_ms in (0, 100, 200, 300):  # heartbeats fall due meanwhile
        cluster.apply(cluster.master.tick(now_ms))
    _deliver_newest_first(cluster, "2")
    assert cluster.slaves["2"].log == cluster.log
    assert cluster.slaves["2"].follower.commit_lsn == 3


def test_a_sync_master_sends_before_its_flush_and_commits_only_once_flushed() -> None:
    master = new_master()  # SYNC master, WRITE_NO_SYNC replicas, majority of 3
    sid2 = stream(master, "2")
    sid3 = stream(master, "3")
    # Appended unflushed: the batch is granted to both slaves at once, before the flush.
    actions = master.on_appended(3, synced=False)
    assert sorted((g.node_id, g.from_lsn, g.entries_max) for g in actions.sends) == [
        ("2", 1, 3),
        ("3", 1, 3),
    ]
    send_all(master, actions)
    master.register_writes([(2, "w2"), (3, "w3")])
    # Both slaves hold everything written: still no commit without the master's flush.
    ack(master, "2", sid2, 3, 3, 3)
    actions = ack(master, "3", sid3, 3, 3, 3)
    assert actions.commit_lsn == 0 and actions.completed == ()
    assert master.holders(3) == (
        ("1", SyncPolicy.WRITE_NO_SYNC),
        ("2", SyncPolicy.SYNC),
        ("3", SyncPolicy.SYNC),
    )
    actions = master.on_local_synced(3)
    assert actions.commit_lsn == 3 and actions.completed == ("w2", "w3")


def test_a_flush_failing_after_sending_deposes_the_master_and_commits_nothing_of_it() -> None:
    cluster = Cluster(epoch=1)
    cluster.start()
    cluster.run()
    assert cluster.master.commit_lsn == 1
    cluster.append(3, synced=False)
    cluster.run()
    # The slaves hold and acknowledge LSNs 2..4; the master never flushed them.
    assert all(len(s.log) == 4 for s in cluster.slaves.values())
    assert cluster.master.commit_lsn == 1 and cluster.completed == []
    # The flush fails: the writer deposes the master (MasterSteps.sync_failed).
    cluster.apply(cluster.master.depose("local store flush failed after sending: EIO"))
    assert cluster.failed == ["w2", "w3", "w4"]  # indeterminate, never acknowledged
    assert cluster.master.commit_lsn == 1 and cluster.master.write_room == 0
    assert cluster.master.on_local_synced(4).commit_lsn == 1  # a late flush commits nothing


@pytest.mark.parametrize("next_master", ["the old master", "a slave holding the suffix"])
def test_entries_sent_before_a_failed_flush_are_settled_by_the_next_masters_epoch(
    next_master: str,
) -> None:
    # Epoch 1: LSN 1 committed everywhere; LSNs 2..4 went to both slaves, the master's
    # flush failed and its machine lost them (it holds LSN 1 only).
    committed = [entry(1, 1)]
    suffix = committed + [entry(lsn, 1) for lsn in range(2, 5)]
    if next_master == "the old master":
        # It lacks the suffix: the slaves' copies (never acknowledged) are truncated.
        cluster = Cluster(master_log=committed, slave_logs={"2": suffix, "3": suffix}, epoch=2)
        kept = committed
    else:
        # A slave with the suffix leads (node "1" here); the old master ("2") gets it, and
        # the epoch-2 start entry commits it (Raft's rule), as any uncommitted suffix.
        cluster = Cluster(master_log=suffix, slave_logs={"2": committed, "3": suffix}, epoch=2)
        kept = suffix
    cluster.start()
    cluster.append(2)
    cluster.run()
    assert cluster.converged()
    assert cluster.log[: len(kept)] == kept
    assert [e.epoch for e in cluster.log] == [1] * len(kept) + [2] * 3
    assert cluster.master.commit_lsn == len(cluster.log)
    assert cluster.completed == [f"w{lsn}" for lsn in range(len(kept) + 2, len(kept) + 4)]


def test_a_store_that_cannot_undo_gets_a_snapshot_instead_of_a_truncation() -> None:
    common = [entry(lsn, 1) for lsn in range(1, 6)]
    stale = common + [entry(lsn, 2, size=3) for lsn in range(6, 10)]
    cluster = Cluster(
        master_log=common, slave_logs={"2": common, "3": stale}, epoch=3, truncate_by_snapshot=True
    )
    truncations: list[int | None] = []
    apply = cluster.apply

    def watch(actions: Actions[str]) -> None:
        truncations.extend(g.truncate_after_lsn for g in actions.sends)
        apply(actions)

    cluster.apply = watch  # type: ignore[method-assign]
    cluster.start()
    cluster.append(3)
    cluster.run()
    assert cluster.converged()
    assert [node for node, _ in cluster.snapshots_sent] == ["3"]
    assert set(truncations) == {None}


def test_a_divergent_slave_with_a_compacted_log_gets_a_snapshot_not_a_truncation() -> None:
    # Truncating by replaying the log needs the log from LSN 1: node 3 compacted its own,
    # so the master (whose store could truncate) sends it a snapshot instead.
    common = [entry(lsn, 1) for lsn in range(1, 6)]
    stale = common + [entry(lsn, 2, size=3) for lsn in range(6, 10)]
    cluster = Cluster(master_log=common, slave_logs={"2": common, "3": stale}, epoch=3)
    cluster.slave_log_starts["3"] = 4
    truncations: list[int | None] = []
    apply = cluster.apply

    def watch(actions: Actions[str]) -> None:
        truncations.extend(g.truncate_after_lsn for g in actions.sends)
        apply(actions)

    cluster.apply = watch  # type: ignore[method-assign]
    cluster.start()
    cluster.append(3)
    cluster.run()
    assert cluster.converged()
    assert [node for node, _ in cluster.snapshots_sent] == ["3"]
    assert set(truncations) == {None}


def test_a_log_sharing_no_entry_with_the_masters_is_replaced_by_a_snapshot() -> None:
    # Node 3 mastered epoch 1 alone and wrote LSNs 1..3 that nobody else has; node 1
    # masters epoch 2. The logs part before LSN 1, which truncate_after_lsn cannot say
    # (0 means "no truncation" on the wire): node 3 gets a snapshot, though its store
    # could truncate, and then the log.
    stale = [entry(lsn, 1) for lsn in range(1, 4)]
    for master_log in ([], [entry(1, 2)]):
        cluster = Cluster(master_log=master_log, slave_logs={"3": stale}, epoch=3)
        truncations: list[int | None] = []
        apply = cluster.apply

        def watch(
            actions: Actions[str],
            apply: Callable[[Actions[str]], None] = apply,
            truncations: list[int | None] = truncations,
        ) -> None:
            truncations.extend(g.truncate_after_lsn for g in actions.sends)
            apply(actions)

        cluster.apply = watch  # type: ignore[method-assign]
        cluster.start()
        (first,) = [m for m in cluster.slaves["3"].inbox if isinstance(m, Hello)]
        assert first.epoch == 3
        cluster.append(2)
        cluster.run()
        assert cluster.converged()
        assert [node for node, _ in cluster.snapshots_sent] == ["3"]
        assert set(truncations) == {None}
        assert [e.epoch for e in cluster.slaves["3"].log] == [e.epoch for e in cluster.log]
        assert 1 not in {e.epoch for e in cluster.slaves["3"].log}


def _slave_3_behind_the_retained_log() -> Cluster:
    """Node 3 missed 20 entries that were compacted (LSNs 1..14 gone): it reconnects and
    is sent a snapshot."""
    cluster = Cluster()
    cluster.start()
    cluster.append(4)
    cluster.run()
    cluster.disconnect("3")
    cluster.append(20)
    cluster.run()
    cluster.compact(15)
    assert cluster.master.retain_from_lsn() == 15
    cluster.connect("3")
    cluster.deliver_to_slave("3")
    while cluster.to_master:
        cluster.deliver_to_master()
    return cluster


def test_a_slave_behind_the_retained_log_gets_a_snapshot_then_the_tail() -> None:
    cluster = _slave_3_behind_the_retained_log()
    assert cluster.snapshots_sent == [("3", 25)]
    assert cluster.master.progress("3").state == SlaveState.SNAPSHOTTING
    assert cluster.master.retain_from_lsn() == 26  # the tail after the snapshot stays
    cluster.append(3)  # writes go on during the snapshot
    cluster.run()
    assert cluster.converged()
    assert cluster.master.progress("3").state == SlaveState.STREAMING
    assert cluster.slaves["3"].follower.state().snapshot_lsn == 25
    assert len(cluster.snapshots_sent) == 1  # no endless chase


def test_a_stale_master_is_refused_by_slaves_and_deposed() -> None:
    cluster = Cluster(epoch=2)
    cluster.start()
    cluster.append(3)
    cluster.run()
    cluster.append(2)  # the writes in flight when the coordinators move on
    for slave in cluster.slaves.values():
        slave.follower.set_role(3, "4")  # a new group formed around another node
    cluster.run()
    codes = {r.code for s in cluster.slaves.values() for r in s.refusals}
    assert codes == {RefusalCode.STALE_EPOCH}
    assert "epoch 3 superseded epoch 2" in cluster.master.deposed
    assert cluster.failed == ["w5", "w6"]
    assert cluster.master.commit_lsn == 4
    assert all(s.log == cluster.log[:4] for s in cluster.slaves.values())


def test_heartbeats_go_to_idle_slaves_and_carry_the_commit() -> None:
    master = new_master()
    sid2 = stream(master, "2")
    stream(master, "3")
    assert master.tick(0).heartbeats == ()  # both were just sent their first batch
    assert master.tick(50).heartbeats == ()  # not yet due
    assert master.tick(100).heartbeats == ("2", "3")
    send_all(master, master.on_appended(2, synced=True))
    actions = ack(master, "2", sid2, 2, 2, 2)
    assert actions.commit_lsn == 2
    # Node 2 was sent entries, but its batch carried commit 0: it hears of 2.
    assert master.tick(200).heartbeats == ("2", "3")
    with pytest.raises(ReplicationError, match="backwards"):
        master.tick(150)


def test_driver_mistakes_raise() -> None:
    master = new_master()
    sid = master.connect("2")
    with pytest.raises(ReplicationError, match="not a slave"):
        master.connect("9")
    with pytest.raises(ReplicationError, match="without a grant"):
        master.on_sent("2", sid, 0, 0)
    master.on_appended(3, synced=True)
    with pytest.raises(ReplicationError, match="already ends at 3"):
        master.on_appended(2, synced=True)
    with pytest.raises(ReplicationError, match="outside this epoch's appended log"):
        master.register_write(4, "x")
    master.register_write(3, "x")
    with pytest.raises(ReplicationError, match="registered after LSN 3"):
        master.register_write(2, "y")
    small = new_master(config(pending_writes_max=1))
    small.on_appended(2, synced=True)
    small.register_write(1, "a")
    with pytest.raises(ReplicationError, match="write room"):
        small.register_write(2, "b")


# --- random runs


@pytest.mark.parametrize("seed", range(60))
def test_random_runs_keep_the_invariants_and_converge(seed: int) -> None:
    rng = random.Random(seed)
    acks = rng.choice(list(AckPolicy))
    policy = rng.choice(list(SyncPolicy))
    window = rng.randrange(1, 6)
    nodes = ("1", "2", "3", "4", "5")[: rng.choice([2, 3, 5])]
    cluster = Cluster(
        nodes=nodes,
        acks=acks,
        replica_sync=policy,
        window_entries=window,
        window_bytes=rng.choice([1 << 20, 3 * entry_size_bytes(entry(1, 1, 20))]),
        pending_max=rng.randrange(4, 40),
    )
    cluster.start()
    slaves = list(cluster.slaves)
    now_ms = 0
    where = f"reproduce with seed={seed} ({acks.name}, {policy.name}, window {window})"
    for _ in range(300):
        op = rng.random()
        node = rng.choice(slaves)
        slave = cluster.slaves[node]
        if op < 0.3:
            if cluster.master.write_room:
                cluster.append(
                    rng.randrange(1, 1 + min(3, cluster.master.write_room)),
                    size=rng.randrange(1, 40),
                )
        elif op < 0.4:
            slave.paused = not slave.paused
        elif op < 0.45:
            if slave.stream_id:
                cluster.disconnect(node)
            cluster.connect(node)
        elif op < 0.48:
            start = rng.randrange(cluster.log_start, len(cluster.log) + 2)
            cluster.compact(start)
        elif op < 0.55:
            now_ms += rng.randrange(0, 200)
            cluster.apply(cluster.master.tick(now_ms))
        elif op < 0.8:
            cluster.deliver_to_slave(node)
        else:
            cluster.deliver_to_master()
        assert cluster.max_inbox_entries <= window, where
        assert cluster.master.pending_writes <= cluster.cfg.pending_writes_max, where
    for slave in cluster.slaves.values():
        slave.paused = False
    cluster.run()
    assert cluster.converged(), where
    assert cluster.master.commit_lsn == len(cluster.log), where
    assert cluster.master.pending_writes == 0, where
    # Every slave that holds the log counts as caught up (under ALL commits wait for it).
    assert not any(p.catching_up for p in cluster.master.status()), where
    # Only acks and Positions still queued from a replaced stream were refused.
    assert set(cluster.rejections) <= {RejectCode.STALE_STREAM}, where
    assert [r for s in cluster.slaves.values() for r in s.refusals] == [], where


def _cluster_history(rng: random.Random, nodes: int) -> list[list[Entry]]:
    """Logs left by a few epochs of masters appending and replicas copying prefixes of
    the master's log (log matching holds; suffixes of deposed masters diverge)."""
    logs: list[list[Entry]] = [[] for _ in range(nodes)]
    uid = 0
    for epoch in range(1, rng.randrange(2, 8)):
        master = rng.randrange(nodes)
        for _ in range(rng.randrange(1, 4)):
            for _ in range(rng.randrange(1, 4)):
                uid += 1
                op = uid.to_bytes(4, "big")
                log = logs[master]
                log.append(Entry(len(log) + 1, epoch, zlib.crc32(op), op))
            for node in range(nodes):
                if node != master and rng.random() < 0.5:
                    fork = 0
                    while (
                        fork < min(len(logs[node]), len(logs[master]))
                        and logs[node][fork] == logs[master][fork]
                    ):
                        fork += 1
                    upto = rng.randrange(fork, len(logs[master]) + 1)
                    logs[node] = logs[node][:fork] + logs[master][fork:upto]
    return logs


@pytest.mark.parametrize("seed", range(60))
def test_random_divergent_logs_are_brought_to_the_new_masters(seed: int) -> None:
    """After random epochs, the member with the highest (last epoch, last LSN) masters the
    next epoch: every other log is truncated where it parts from the master's and
    streamed the rest, and the new epoch's writes commit everywhere."""
    rng = random.Random(seed)
    count = rng.choice([2, 3, 5])
    logs = _cluster_history(rng, count)
    logs.sort(key=lambda log: (log[-1].epoch, len(log)) if log else (0, 0), reverse=True)
    epoch = max((log[-1].epoch for log in logs if log), default=0) + 1
    nodes = tuple(str(i) for i in range(1, count + 1))
    cluster = Cluster(
        nodes=nodes,
        master_log=logs[0],
        slave_logs={str(i + 1): logs[i] for i in range(1, count)},
        epoch=epoch,
        window_entries=rng.randrange(1, 5),
    )
    cluster.start()
    cluster.append(rng.randrange(1, 6))
    cluster.run()
    where = f"reproduce with seed={seed}"
    assert cluster.converged(), where
    assert cluster.master.commit_lsn == len(cluster.log), where
    assert [r for s in cluster.slaves.values() for r in s.refusals] == [], where
    for slave in cluster.slaves.values():
        assert slave.follower.state().history == cluster.master.history, where
    assert sorted(cluster.completed, key=lambda t: int(t[1:])) == cluster.completed, where


def test_a_slave_sent_a_snapshot_counts_for_nothing_until_it_installed_it() -> None:
    # Regression (found by the replication simulator running the shipped slave, seed 635):
    # a slave then emptied its store when a snapshot's first chunk arrived and stayed
    # empty if the install was cut short; the master kept counting what it had
    # acknowledged before, and a new master committed old entries counting a replica that
    # no longer held them. The install is staged now (the old log stays until it
    # finishes), but what a slave acknowledged before still counts for nothing: the
    # install is about to replace it.
    cfg = config(truncate_by_snapshot=True, replica_sync=SyncPolicy.NO_SYNC)
    master = new_master(cfg, last_lsn=5, epoch=2)
    sid3 = stream(master, "3", last_lsn=5)
    ack(master, "3", sid3, 5, 5, 5)
    sid2 = master.connect("2")
    # Node 2 holds LSNs 1..5 as the master does, and 6..7 of epoch 1 the master never had.
    actions = master.on_position(
        "2", sid2, last_epoch=1, last_lsn=7, history=[(1, 1)], log_start_lsn=1
    )
    assert actions.rejection is None
    assert master.progress("2").received_lsn == 5  # it holds the common prefix
    assert "2" in dict(master.holders(5))
    appended = master.on_appended(6, synced=True)  # the epoch-start entry
    assert "2" in actions.snapshots + appended.snapshots
    send_all(master, appended)
    actions = master.on_snapshot_started("2", sid2, 6)
    progress = master.progress("2")
    assert (progress.received_lsn, progress.written_lsn, progress.synced_lsn) == (0, 0, 0)
    assert "2" not in dict(master.holders(5))
    # An ack node 2 sent before the first chunk reached it counts for nothing either.
    ack(master, "2", sid2, 5, 5, 5)
    assert "2" not in dict(master.holders(5))
    # Only node 3 and the master hold LSN 6: it commits with them, not with node 2.
    assert ack(master, "3", sid3, 6, 6, 6).commit_lsn == 6
    # The installed snapshot's ack makes node 2 a holder again.
    ack(master, "2", sid2, 6, 6, 6)
    assert "2" in dict(master.holders(6))
    assert master.progress("2").state == SlaveState.STREAMING


# --- commit notices to slaves serving following readers


def follow_ack(
    master: ReplicationMaster[str], node: str, sid: int, lsn: int, *, following: bool = True
) -> Actions[str]:
    return master.on_ack(
        node, sid, received_lsn=lsn, written_lsn=lsn, synced_lsn=lsn, readers_following=following
    )


def test_a_slave_serving_following_readers_hears_the_commit_when_it_moves() -> None:
    master = new_master()
    sid2 = stream(master, "2")
    sid3 = stream(master, "3")
    assert follow_ack(master, "2", sid2, 0).heartbeats == ()  # nothing committed yet
    send_all(master, master.on_appended(1, synced=True))
    # Node 3's ack commits LSN 1; node 2's batch carried commit 0: it is told at once,
    # node 3 (no following readers) waits for its next batch or heartbeat.
    moved = ack(master, "3", sid3, 1, 1, 1)
    assert (moved.commit_lsn, moved.heartbeats) == (1, ("2",))
    # Node 2's own ack moves nothing it was not told.
    assert follow_ack(master, "2", sid2, 1).heartbeats == ()
    # Three writes, one record each way: one notice per record, not one per write.
    send_all(master, master.on_appended(4, synced=True))
    assert follow_ack(master, "2", sid2, 4).heartbeats == ("2",)
    assert ack(master, "3", sid3, 4, 4, 4).heartbeats == ()
    # The idle heartbeat is not sent again for what the notice told.
    assert master.tick(100).heartbeats == ("3",)


def test_a_slave_whose_readers_start_after_the_commit_is_told_with_its_next_ack() -> None:
    master = new_master()
    sid2 = stream(master, "2")
    sid3 = stream(master, "3")
    send_all(master, master.on_appended(1, synced=True))
    assert ack(master, "3", sid3, 1, 1, 1).heartbeats == ()  # node 2 has no readers yet
    # A reader starts following on node 2: its next ack says so, and it is told the
    # commit its last batch did not carry.
    assert follow_ack(master, "2", sid2, 1).heartbeats == ("2",)


def test_no_notice_when_a_batch_in_the_same_record_carries_the_commit() -> None:
    master = new_master()
    sid2 = stream(master, "2")
    sid3 = stream(master, "3")
    send_all(master, master.on_appended(1, synced=False))
    follow_ack(master, "2", sid2, 1)
    assert ack(master, "3", sid3, 1, 1, 1).commit_lsn == 0  # the master has not flushed
    # The master's flush of LSN 2 commits LSN 1 and grants LSN 2 to both, carrying it.
    actions = master.on_appended(2, synced=True)
    assert actions.commit_lsn == 1
    assert [(g.node_id, g.commit_lsn) for g in actions.sends] == [("2", 1), ("3", 1)]
    assert actions.heartbeats == ()


def test_the_following_flag_clears_with_an_ack_without_it_or_a_new_stream() -> None:
    master = new_master()
    sid2 = stream(master, "2")
    sid3 = stream(master, "3")
    follow_ack(master, "2", sid2, 0)
    send_all(master, master.on_appended(1, synced=True))
    # The readers left: node 2's ack says so, and the next commit is left to its next
    # batch or heartbeat.
    follow_ack(master, "2", sid2, 1, following=False)
    assert ack(master, "3", sid3, 1, 1, 1).heartbeats == ()
    # A new stream starts without readers until its acks say otherwise.
    follow_ack(master, "2", sid2, 1)
    master.disconnected("2", sid2)
    sid2 = stream(master, "2", last_lsn=0)
    send_all(master, master.on_appended(2, synced=True))
    assert ack(master, "3", sid3, 2, 2, 2).heartbeats == ()
    assert follow_ack(master, "2", sid2, 2).heartbeats == ("2",)  # its readers are back
    send_all(master, master.on_appended(3, synced=True))
    assert ack(master, "3", sid3, 3, 3, 3).heartbeats == ("2",)


def test_quorum_silence_counts_from_the_last_slave_answer_a_commit_needs() -> None:
    """A master whose replica is cut off from the others hears nothing: the time since
    enough voting slaves answered grows, from the master's first tick for a slave never
    heard; one answer from either slave (majority of three) ends it."""
    master = new_master()
    assert master.quorum_silent_ms() == 0  # no tick yet: no clock
    master.tick(1_000)
    sid2 = master.connect("2")
    master.connect("3")
    assert master.tick(3_500).heartbeats == ()  # nothing streams: no heartbeat is due
    assert master.quorum_silent_ms() == 2_500  # counted from the first tick
    send_all(master, master.on_position("2", sid2, last_epoch=0, last_lsn=0, history=[]))
    master.tick(3_600)
    assert master.quorum_silent_ms() == 100  # node 2 answered at the last tick (3,500)
    send_all(master, master.on_appended(2, synced=True))
    master.tick(9_600)
    assert master.quorum_silent_ms() == 6_100  # no ack since
    ack(master, "2", sid2, 2, 2, 2)
    master.tick(9_700)
    assert master.quorum_silent_ms() == 100
    master.depose("a new epoch")
    assert master.quorum_silent_ms() == 0


def test_under_acks_all_quorum_silence_counts_a_majority_and_each_slave_its_own() -> None:
    """Under `group` (the enum's ALL) a master that hears a majority is not the one cut
    off: its quorum silence counts a majority as under `majority`, and each voting slave's
    own silence says which member holds the commits back (its coordinator drops that one).
    A learner's answers count for nothing and its silence is never reported."""
    master = new_master(
        config(nodes=("1", "2", "3"), learners=("4",), acks=AckPolicy.ALL),
        members=["1", "2", "3", "4"],
    )
    master.tick(0)
    sid2 = stream(master, "2")
    master.tick(1_000)
    ack(master, "2", sid2, 0, 0, 0)
    master.tick(1_500)
    assert master.quorum_silent_ms() == 500  # node 2's ack at 1,000: a majority
    silent = {p.node_id: p.silent_ms for p in master.status()}
    assert silent == {"2": 500, "3": 1_500, "4": 0}  # 3 never heard; 4 a learner
    stream(master, "3")  # its Position answers at the last tick (1,500)
    master.tick(1_600)
    assert master.progress("3").silent_ms == 100
    master.depose("a new epoch")
    assert [p.silent_ms for p in master.status()] == [0, 0, 0]
    none = new_master(config(acks=AckPolicy.NONE))
    none.tick(0)
    none.tick(5_000)
    assert none.quorum_silent_ms() == 0  # commits need no slave


def test_a_slave_receiving_a_snapshot_counts_as_heard_until_its_stream_ends() -> None:
    """A slave acks a snapshot once, when it is installed: a long install is no silence
    (a master whose other slave is gone does not step aside for it); a cut stream is."""
    cluster = _slave_3_behind_the_retained_log()
    master = cluster.master
    assert master.progress("3").state == SlaveState.SNAPSHOTTING
    cluster.disconnect("2")
    master.tick(10_000)
    master.tick(15_000)
    assert master.quorum_silent_ms() == 0  # node 3's snapshot flows
    cluster.disconnect("3")
    master.tick(17_000)
    assert master.quorum_silent_ms() == 2_000  # since the last tick that saw it flow
