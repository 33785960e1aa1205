"""Tests of squall_server.replica.follower: what a slave accepts from the replication stream,
what it asks the store to write or truncate, and when it acknowledges.

Every refusal is checked to change nothing (the follower's whole state is compared
before and after) and to name the node, its epoch and the offending LSN.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace

import pytest

from squall.v1 import replica_pb2
from squall_server.common.errors import Code
from squall_server.replica.follower import (
    BatchAccepted,
    Follower,
    FollowerConfig,
    FollowerConfigError,
    FollowerError,
    HelloAccepted,
    Refusal,
    RefusalCode,
    SnapshotAccepted,
)
from squall_server.replica.replication import Ack, SyncPolicy
from squall_server.replica.store import make_entry

NODE = "2"
MASTER = "1"
CLUSTER = "c0ffee"


@dataclass(frozen=True)
class Entry:
    """A log entry with the fields replication looks at (replica_pb2.LogEntry has them too)."""

    lsn: int
    epoch: int
    checksum: int
    operation: bytes


def entry(lsn: int, epoch: int, size: int = 8) -> Entry:
    """A valid entry."""
    op = bytes([lsn % 251]) * size
    return Entry(lsn, epoch, zlib.crc32(op), op)


def entries(first: int, last: int, epoch: int) -> list[Entry]:
    """Valid consecutive entries."""
    return [entry(lsn, epoch) for lsn in range(first, last + 1)]


def make_follower(
    *,
    epoch: int = 3,
    last_lsn: int = 5,
    history: tuple[tuple[int, int], ...] = ((1, 1), (2, 4)),
    policy: SyncPolicy = SyncPolicy.WRITE_NO_SYNC,
    cluster_id: str = CLUSTER,
    commit_lsn: int = 0,
    entries_max: int = 16,
    bytes_max: int = 4096,
) -> Follower:
    """A slave of node 1 in ``epoch`` whose log ends at last_lsn."""
    return Follower(
        FollowerConfig(NODE, policy, entries_max, bytes_max),
        cluster_id=cluster_id,
        epoch=epoch,
        master_id=MASTER,
        last_lsn=last_lsn,
        history=history,
        commit_lsn=commit_lsn,
    )


def opened(**kwargs: object) -> Follower:
    """A follower with an accepted Hello from its epoch's master."""
    follower = make_follower(**kwargs)  # type: ignore[arg-type]
    result = follower.on_hello(master_id=MASTER, epoch=follower.epoch, cluster_id=CLUSTER)
    assert isinstance(result, HelloAccepted)
    return follower


def accepted(result: BatchAccepted[Entry] | Refusal) -> BatchAccepted[Entry]:
    assert isinstance(result, BatchAccepted), result
    return result


def refused(result: object, code: RefusalCode) -> Refusal:
    assert isinstance(result, Refusal), result
    assert result.code == code, result
    return result


# --- Hello


def test_hello_from_the_epochs_master_is_answered_with_the_position() -> None:
    follower = make_follower()
    result = follower.on_hello(master_id=MASTER, epoch=3, cluster_id=CLUSTER)
    assert isinstance(result, HelloAccepted)
    assert result.position.node_id == NODE
    assert (result.position.last_epoch, result.position.last_lsn) == (2, 5)
    assert result.position.history == ((1, 1), (2, 4))
    assert result.adopt_cluster_id == ""
    assert follower.state().stream_open


def test_an_empty_store_adopts_the_cluster_id() -> None:
    follower = make_follower(cluster_id="", last_lsn=0, history=())
    result = follower.on_hello(master_id=MASTER, epoch=3, cluster_id=CLUSTER)
    assert isinstance(result, HelloAccepted)
    assert result.adopt_cluster_id == CLUSTER
    assert follower.state().cluster_id == CLUSTER


@pytest.mark.parametrize(
    ("master_id", "epoch", "cluster_id", "code", "status"),
    [
        (MASTER, 2, CLUSTER, RefusalCode.STALE_EPOCH, Code.FAILED_PRECONDITION),
        (MASTER, 4, CLUSTER, RefusalCode.FUTURE_EPOCH, Code.UNAVAILABLE),
        ("3", 3, CLUSTER, RefusalCode.WRONG_MASTER, Code.FAILED_PRECONDITION),
        (MASTER, 3, "other", RefusalCode.WRONG_CLUSTER, Code.FAILED_PRECONDITION),
        (MASTER, 3, "", RefusalCode.WRONG_CLUSTER, Code.FAILED_PRECONDITION),
    ],
)
def test_a_hello_not_from_this_epochs_master_is_refused_and_changes_nothing(
    master_id: str, epoch: int, cluster_id: str, code: RefusalCode, status: Code
) -> None:
    follower = opened()
    before = follower.state()
    refusal = refused(
        follower.on_hello(master_id=master_id, epoch=epoch, cluster_id=cluster_id), code
    )
    assert refusal.status == status
    assert (refusal.node_id, refusal.epoch, refusal.last_lsn) == (NODE, 3, 5)
    assert f"replica {NODE} (epoch 3, last LSN 5)" in refusal.message
    # The stream of the real master stays open.
    assert follower.state() == before


# --- batches


def test_a_batch_before_a_hello_is_refused() -> None:
    follower = make_follower()
    before = follower.state()
    result = follower.on_batch(
        epoch=3, entries=entries(6, 7, 3), commit_lsn=0, truncate_after_lsn=None
    )
    refused(result, RefusalCode.NO_STREAM)
    assert follower.state() == before


def test_a_batch_of_an_older_epoch_is_refused_and_changes_nothing() -> None:
    follower = opened()
    before = follower.state()
    result = follower.on_batch(
        epoch=2, entries=entries(6, 7, 2), commit_lsn=7, truncate_after_lsn=None
    )
    refusal = refused(result, RefusalCode.STALE_EPOCH)
    assert refusal.status == Code.FAILED_PRECONDITION
    assert follower.state() == before


def test_write_no_sync_acks_after_the_write() -> None:
    follower = opened()
    batch = entries(6, 8, 3)
    result = accepted(
        follower.on_batch(epoch=3, entries=batch, commit_lsn=4, truncate_after_lsn=None)
    )
    assert result.entries is batch  # handed over as is, not copied
    assert result.truncate_after_lsn is None
    assert result.write_needed and not result.sync
    assert result.ack_now is None
    assert follower.ack() == Ack(received_lsn=8, written_lsn=5, synced_lsn=0)
    assert follower.on_written(8, synced=False) == Ack(8, 8, 0)
    assert follower.on_synced(8) == Ack(8, 8, 8)
    assert follower.state().history == ((1, 1), (2, 4), (3, 6))
    assert follower.state().last_epoch == 3


def test_sync_asks_for_a_flushed_write_and_acks_it_synced() -> None:
    follower = opened(policy=SyncPolicy.SYNC)
    result = accepted(
        follower.on_batch(epoch=3, entries=entries(6, 7, 3), commit_lsn=0, truncate_after_lsn=None)
    )
    assert result.sync and result.ack_now is None
    assert follower.on_written(7, synced=True) == Ack(7, 7, 7)


def test_no_sync_acks_on_receipt_before_the_write() -> None:
    follower = opened(policy=SyncPolicy.NO_SYNC)
    result = accepted(
        follower.on_batch(epoch=3, entries=entries(6, 7, 3), commit_lsn=0, truncate_after_lsn=None)
    )
    assert result.ack_now == Ack(received_lsn=7, written_lsn=5, synced_lsn=0)
    assert not result.sync
    assert follower.on_written(7, synced=False) == Ack(7, 7, 0)


def test_an_empty_batch_is_acknowledged_at_once_with_nothing_to_write() -> None:
    follower = opened()
    follower.on_synced(5)
    result = accepted(follower.on_batch(epoch=3, entries=[], commit_lsn=5, truncate_after_lsn=None))
    assert not result.write_needed
    assert result.ack_now == Ack(5, 5, 5)


def test_protobuf_log_entries_are_accepted_as_they_are() -> None:
    follower = opened()
    op = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=3, master_id=MASTER))
    batch = [make_entry(6, 3, op), make_entry(7, 3, op)]
    result = follower.on_batch(epoch=3, entries=batch, commit_lsn=0, truncate_after_lsn=None)
    assert isinstance(result, BatchAccepted)
    assert list(result.entries) == batch


def test_an_lsn_gap_anywhere_refuses_the_whole_batch() -> None:
    follower = opened()
    before = follower.state()
    gap_first = entries(7, 8, 3)
    refusal = refused(
        follower.on_batch(epoch=3, entries=gap_first, commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.LSN_GAP,
    )
    assert refusal.lsn == 7 and refusal.status == Code.INVALID_ARGUMENT
    assert "entry LSN 7 does not follow LSN 5" in refusal.message
    gap_inside = [entry(6, 3), entry(7, 3), entry(9, 3)]
    refusal = refused(
        follower.on_batch(epoch=3, entries=gap_inside, commit_lsn=9, truncate_after_lsn=None),
        RefusalCode.LSN_GAP,
    )
    assert refusal.lsn == 9
    duplicate = [entry(5, 2)]
    refused(
        follower.on_batch(epoch=3, entries=duplicate, commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.LSN_GAP,
    )
    assert follower.state() == before


def test_a_wrong_checksum_refuses_the_whole_batch_with_data_loss() -> None:
    follower = opened()
    before = follower.state()
    batch = entries(6, 9, 3)
    batch[2] = replace(batch[2], checksum=batch[2].checksum ^ 1)
    refusal = refused(
        follower.on_batch(epoch=3, entries=batch, commit_lsn=9, truncate_after_lsn=None),
        RefusalCode.BAD_CHECKSUM,
    )
    assert refusal.status == Code.DATA_LOSS
    assert (refusal.node_id, refusal.epoch, refusal.lsn) == (NODE, 3, 8)
    assert "at LSN 8" in refusal.message
    assert follower.state() == before


def test_an_entry_older_than_the_one_before_is_refused() -> None:
    follower = opened()
    before = follower.state()
    regress_in_batch = [entry(6, 3), entry(7, 2)]
    refusal = refused(
        follower.on_batch(epoch=3, entries=regress_in_batch, commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.OLD_EPOCH,
    )
    assert refusal.lsn == 7
    regress_from_log = [entry(6, 1)]  # the log ends in epoch 2
    refused(
        follower.on_batch(epoch=3, entries=regress_from_log, commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.OLD_EPOCH,
    )
    assert follower.state() == before


def test_an_entry_newer_than_the_masters_epoch_or_of_epoch_zero_is_refused() -> None:
    follower = opened()
    before = follower.state()
    for bad in (entry(6, 4), entry(6, 0)):
        refused(
            follower.on_batch(epoch=3, entries=[bad], commit_lsn=0, truncate_after_lsn=None),
            RefusalCode.BAD_ENTRY_EPOCH,
        )
    assert follower.state() == before


def test_a_batch_larger_than_the_window_is_refused_but_one_big_entry_is_not() -> None:
    follower = opened(entries_max=4, bytes_max=100)
    before = follower.state()
    refused(
        follower.on_batch(
            epoch=3, entries=entries(6, 10, 3), commit_lsn=0, truncate_after_lsn=None
        ),
        RefusalCode.TOO_LARGE,
    )
    two_big = [entry(6, 3, size=80), entry(7, 3, size=80)]
    refusal = refused(
        follower.on_batch(epoch=3, entries=two_big, commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.TOO_LARGE,
    )
    assert refusal.status == Code.RESOURCE_EXHAUSTED
    assert follower.state() == before
    accepted(
        follower.on_batch(
            epoch=3, entries=[entry(6, 3, size=500)], commit_lsn=0, truncate_after_lsn=None
        )
    )


# --- truncation


def test_the_first_batch_truncates_a_deposed_masters_suffix() -> None:
    # LSNs 4..7 are epoch 2, written by a master deposed before they committed; the
    # master of epoch 3 agrees with this log up to LSN 5.
    follower = opened(last_lsn=7, commit_lsn=3)
    follower.on_synced(7)
    result = accepted(
        follower.on_batch(epoch=3, entries=entries(6, 8, 3), commit_lsn=4, truncate_after_lsn=5)
    )
    assert result.truncate_after_lsn == 5
    assert [e.lsn for e in result.entries] == [6, 7, 8]
    state = follower.state()
    assert state.history == ((1, 1), (2, 4), (3, 6))
    assert (state.last_lsn, state.last_epoch) == (8, 3)
    # The truncated LSNs no longer count as written or flushed.
    assert follower.ack() == Ack(received_lsn=8, written_lsn=5, synced_lsn=5)
    assert follower.on_written(8, synced=False) == Ack(8, 8, 5)


def test_truncation_may_remove_a_whole_epoch() -> None:
    follower = opened(last_lsn=7)
    result = accepted(follower.on_batch(epoch=3, entries=[], commit_lsn=0, truncate_after_lsn=2))
    assert result.truncate_after_lsn == 2 and result.write_needed and result.ack_now is None
    assert follower.state().history == ((1, 1),)
    assert follower.state().last_epoch == 1


def test_truncating_at_the_logs_end_is_no_truncation() -> None:
    follower = opened()
    result = accepted(
        follower.on_batch(epoch=3, entries=entries(6, 6, 3), commit_lsn=0, truncate_after_lsn=5)
    )
    assert result.truncate_after_lsn is None


def test_truncation_below_the_known_commit_is_refused() -> None:
    follower = opened(last_lsn=7, commit_lsn=6)
    before = follower.state()
    refusal = refused(
        follower.on_batch(epoch=3, entries=entries(6, 6, 3), commit_lsn=6, truncate_after_lsn=5),
        RefusalCode.TRUNCATE_BELOW_COMMIT,
    )
    assert refusal.lsn == 5 and "commit LSN 6" in refusal.message
    assert follower.state() == before


def test_truncation_beyond_the_log_is_a_gap() -> None:
    follower = opened()
    before = follower.state()
    refused(
        follower.on_batch(epoch=3, entries=entries(10, 10, 3), commit_lsn=0, truncate_after_lsn=9),
        RefusalCode.LSN_GAP,
    )
    assert follower.state() == before


# --- heartbeats, commit and roles


def test_heartbeats_teach_the_commit_lsn_and_reads_stop_at_what_is_written() -> None:
    follower = opened()
    accepted(
        follower.on_batch(epoch=3, entries=entries(6, 9, 3), commit_lsn=0, truncate_after_lsn=None)
    )
    assert follower.commit_lsn == 0
    ack = follower.on_heartbeat(epoch=3, commit_lsn=8)
    assert ack == Ack(9, 5, 0)
    assert follower.commit_lsn == 5  # known committed up to 8, written up to 5
    follower.on_written(9, synced=False)
    assert follower.commit_lsn == 8
    # A lower commit LSN (a new master that has not caught up) never lowers it.
    follower.on_heartbeat(epoch=3, commit_lsn=2)
    assert follower.commit_lsn == 8
    refused(follower.on_heartbeat(epoch=2, commit_lsn=20), RefusalCode.STALE_EPOCH)
    assert follower.commit_lsn == 8


def test_a_new_role_closes_the_stream_and_fences_the_old_master() -> None:
    follower = opened()
    follower.set_role(4, "3")
    refused(
        follower.on_batch(epoch=3, entries=entries(6, 6, 3), commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.STALE_EPOCH,
    )
    refused(
        follower.on_hello(master_id=MASTER, epoch=3, cluster_id=CLUSTER), RefusalCode.STALE_EPOCH
    )
    refused(
        follower.on_hello(master_id=MASTER, epoch=4, cluster_id=CLUSTER), RefusalCode.WRONG_MASTER
    )
    refused(
        follower.on_batch(epoch=4, entries=entries(6, 6, 4), commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.NO_STREAM,
    )
    assert isinstance(follower.on_hello(master_id="3", epoch=4, cluster_id=CLUSTER), HelloAccepted)
    accepted(
        follower.on_batch(epoch=4, entries=entries(6, 6, 4), commit_lsn=0, truncate_after_lsn=None)
    )


def test_driver_mistakes_raise() -> None:
    follower = opened()
    with pytest.raises(FollowerError, match="older than the current"):
        follower.set_role(2, MASTER)
    with pytest.raises(FollowerError, match="written LSN 9"):
        follower.on_written(9, synced=False)
    accepted(
        follower.on_batch(epoch=3, entries=entries(6, 7, 3), commit_lsn=0, truncate_after_lsn=None)
    )
    with pytest.raises(FollowerError, match="not written"):
        follower.on_hello(master_id=MASTER, epoch=3, cluster_id=CLUSTER)
    with pytest.raises(FollowerError, match="beyond the written"):
        follower.on_synced(7)
    with pytest.raises(FollowerError, match="store's own log"):
        make_follower(last_lsn=2, history=((1, 1), (2, 4)))
    with pytest.raises(FollowerConfigError, match="inflight_entries_max"):
        make_follower(entries_max=0)


def test_reset_rereads_the_store_after_a_failed_write() -> None:
    follower = opened()
    accepted(
        follower.on_batch(epoch=3, entries=entries(6, 7, 3), commit_lsn=0, truncate_after_lsn=None)
    )
    follower.reset(last_lsn=5, history=((1, 1), (2, 4)))
    state = follower.state()
    assert (state.last_lsn, state.received_lsn, state.written_lsn) == (5, 5, 5)
    assert not state.stream_open


def test_a_failed_write_of_a_truncating_batch_leaves_the_divergent_entries_truncatable() -> None:
    """A batch truncates the log after LSN 3 (entries 4-5 of epoch 2 diverge) and brings
    the master's log to LSN 9 with commit LSN 9; its write fails (the store is full) and
    the store still holds the old entries 4-5. The batch's commit LSN must not stay: it
    would call those entries committed, and every later truncation of them is refused,
    so the slave could never follow again."""
    follower = opened(epoch=3, last_lsn=5, history=((1, 1), (2, 4)))
    accepted(
        follower.on_batch(epoch=3, entries=entries(4, 9, 3), commit_lsn=9, truncate_after_lsn=3)
    )
    follower.reset(last_lsn=5, history=((1, 1), (2, 4)), commit_lsn=3)
    assert follower.on_hello(master_id=MASTER, epoch=3, cluster_id=CLUSTER)
    again = follower.on_batch(epoch=3, entries=entries(4, 9, 3), commit_lsn=9, truncate_after_lsn=3)
    assert accepted(again).truncate_after_lsn == 3


# --- snapshots


def test_a_snapshot_replaces_the_log_and_the_stream_continues_after_it() -> None:
    follower = opened(last_lsn=5)
    history = ((1, 1), (2, 4), (3, 10))
    first = follower.on_snapshot_chunk(index=0, snapshot_lsn=40, snapshot_epoch=3, last=False)
    assert first == SnapshotAccepted(0, install=False, snapshot_lsn=40, history=())
    follower.on_snapshot_chunk(index=1, snapshot_lsn=40, snapshot_epoch=3, last=False)
    done = follower.on_snapshot_chunk(
        index=2, snapshot_lsn=40, snapshot_epoch=3, last=True, history=history
    )
    assert done == SnapshotAccepted(2, install=True, snapshot_lsn=40, history=history)
    assert follower.on_written(40, synced=True) == Ack(40, 40, 40)
    state = follower.state()
    assert (state.last_lsn, state.last_epoch, state.snapshot_lsn) == (40, 3, 40)
    accepted(
        follower.on_batch(
            epoch=3, entries=entries(41, 42, 3), commit_lsn=0, truncate_after_lsn=None
        )
    )
    # Entries inside the snapshot cannot be truncated: the master must send a new one.
    follower.on_written(42, synced=False)
    refused(
        follower.on_batch(epoch=3, entries=[], commit_lsn=0, truncate_after_lsn=30),
        RefusalCode.TRUNCATE_BELOW_SNAPSHOT,
    )


def test_bad_snapshot_chunks_are_refused_and_change_nothing() -> None:
    follower = opened(commit_lsn=5)
    before = follower.state()
    refused(
        follower.on_snapshot_chunk(index=1, snapshot_lsn=40, snapshot_epoch=3, last=False),
        RefusalCode.BAD_SNAPSHOT,
    )
    refused(
        follower.on_snapshot_chunk(
            index=0, snapshot_lsn=4, snapshot_epoch=2, last=True, history=((1, 1), (2, 4))
        ),
        RefusalCode.BAD_SNAPSHOT,
    )  # older than what this replica knows is committed
    assert follower.state() == before
    follower.on_snapshot_chunk(index=0, snapshot_lsn=40, snapshot_epoch=3, last=False)
    during = follower.state()
    refused(
        follower.on_snapshot_chunk(index=2, snapshot_lsn=40, snapshot_epoch=3, last=False),
        RefusalCode.BAD_SNAPSHOT,
    )
    refused(
        follower.on_snapshot_chunk(index=1, snapshot_lsn=41, snapshot_epoch=3, last=False),
        RefusalCode.BAD_SNAPSHOT,
    )
    refused(
        follower.on_snapshot_chunk(
            index=1, snapshot_lsn=40, snapshot_epoch=3, last=True, history=((1, 1), (2, 4))
        ),
        RefusalCode.BAD_SNAPSHOT,
    )  # the history says LSN 40 is epoch 2
    refused(
        follower.on_batch(epoch=3, entries=entries(6, 6, 3), commit_lsn=0, truncate_after_lsn=None),
        RefusalCode.OUT_OF_ORDER,
    )
    assert follower.state() == during


# --- random bad input


@pytest.mark.parametrize("seed", range(100))
def test_random_corruption_of_a_valid_batch_is_refused_and_changes_nothing(seed: int) -> None:
    rng = random.Random(seed)
    follower = opened(last_lsn=5)
    batch = entries(6, 6 + rng.randrange(0, 8), 3)
    i = rng.randrange(len(batch))
    kind = rng.choice(["lsn", "epoch_old", "epoch_new", "checksum", "operation"])
    bad = batch[i]
    if kind == "lsn":
        bad = replace(bad, lsn=bad.lsn + rng.choice([-2, -1, 1, 2, 1000]))
        code = RefusalCode.LSN_GAP
    elif kind == "epoch_old":
        bad = replace(bad, epoch=rng.choice([1, 2]) if i == 0 else 2)
        code = RefusalCode.OLD_EPOCH
    elif kind == "epoch_new":
        bad = replace(bad, epoch=rng.choice([4, 9, 0]))
        code = RefusalCode.BAD_ENTRY_EPOCH
    elif kind == "checksum":
        bad = replace(bad, checksum=bad.checksum ^ (1 << rng.randrange(32)))
        code = RefusalCode.BAD_CHECKSUM
    else:
        flipped = bytearray(bad.operation)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        bad = replace(bad, operation=bytes(flipped))
        code = RefusalCode.BAD_CHECKSUM
    if kind == "epoch_old" and i == 0 and bad.epoch == 2:
        # Epoch 2 after the log's epoch 2 is no regression; make it one inside the batch.
        bad = replace(bad, epoch=1)
    batch[i] = bad
    before = follower.state()
    result = follower.on_batch(epoch=3, entries=batch, commit_lsn=20, truncate_after_lsn=None)
    assert isinstance(result, Refusal), f"reproduce with seed={seed}: {kind} at {i}"
    assert result.code == code, f"reproduce with seed={seed}: {kind} at {i}: {result}"
    assert result.lsn == bad.lsn, f"reproduce with seed={seed}"
    assert follower.state() == before, f"reproduce with seed={seed}"
