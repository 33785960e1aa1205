"""The master's synchronous replication steps alone (``master_steps.py``), over the
in-memory store with no event loop, streams or futures (what a simulator runs).

A slave behind the master is sent the log it lacks read from the store, a new write is
sent from the tail cache, the slave's ack commits the write with a receipt naming both
holders, and a deposed master fails what is still waiting; each output comes in the
order ``replication.Actions`` documents. A log record that fails its checksum is never
sent: the node reports the fault and the stream closes.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.master_steps import MasterOutputs, MasterSteps
from squall_server.replica.replication import (
    AckPolicy,
    MasterConfig,
    ReplicationMaster,
    SyncPolicy,
)
from squall_server.replica.store import Store
from tests.sim.replica_transport import flip_a_byte


def _entry(lsn: int, epoch: int) -> replica_pb2.LogEntry:
    operation = replica_pb2.Operation(
        create_topic=replica_pb2.CreateTopicOp(name=f"t{lsn}")
    ).SerializeToString()
    return replica_pb2.LogEntry(
        lsn=lsn, epoch=epoch, checksum=zlib.crc32(operation), operation=operation
    )


def _steps(
    master_sync: SyncPolicy = SyncPolicy.SYNC,
    members: tuple[str, ...] = ("n1", "n2"),
    nodes: tuple[str, ...] = (),
    learners: tuple[str, ...] = (),
    acks: AckPolicy = AckPolicy.MAJORITY,
) -> tuple[MasterSteps[str], Store, list[tuple[str, object]]]:
    """A master of epoch 2 over a store holding LSNs 1..3 of epoch 1, recording outputs;
    the node set is the members unless ``nodes`` says more."""
    store = Store.open_memory()
    store.append([_entry(lsn, 1) for lsn in (1, 2, 3)], sync=True)
    core: ReplicationMaster[str] = ReplicationMaster(
        MasterConfig(
            node_id="n1",
            nodes=nodes or members,
            learners=learners,
            master_sync=master_sync,
            replica_sync=SyncPolicy.SYNC,
            acks=acks,
        ),
        epoch=2,
        members=members,
        last_lsn=3,
        history=[(1, 1)],
    )
    seen: list[tuple[str, object]] = []

    def record(kind: str):  # type: ignore[no-untyped-def]
        return lambda *args: seen.append((kind, args[0] if len(args) == 1 else args))

    outputs: MasterOutputs[str] = MasterOutputs(
        send=record("send"),
        heartbeat=record("heartbeat"),
        snapshot=record("snapshot"),
        close_stream=record("close"),
        completed=lambda done: seen.append(("completed", list(done))),
        failed=lambda failed: seen.append(("failed", list(failed))),
        committed=record("committed"),
        room=lambda: seen.append(("room", None)),
        deposed=record("deposed"),
        fault=record("fault"),
    )
    return MasterSteps("n1", core, lambda: store, outputs, tail_bytes_max=1 << 20), store, seen


def _batches(seen: Sequence[tuple[str, object]]) -> list[list[int]]:
    out = []
    for kind, value in seen:
        if kind == "send":
            node_id, message = value  # type: ignore[misc]
            assert node_id == "n2"
            out.append([e.lsn for e in message.entries.entries])
    return out


def test_a_slave_gets_the_log_it_lacks_then_a_new_write_commits_with_both_holders() -> None:
    steps, store, seen = _steps()
    core = steps.core
    stream = core.connect("n2")
    steps.apply(core.on_position("n2", stream, last_epoch=0, last_lsn=0, history=[]))
    assert _batches(seen) == [[1, 2, 3]]  # read from the store: the tail cache is empty

    seen.clear()
    store.append([_entry(4, 2)], sync=True)
    steps.appended([_entry(4, 2)], synced=True)
    steps.apply(core.register_writes([(4, "write-4")]))
    assert _batches(seen) == [[4]]
    assert not any(kind == "completed" for kind, _ in seen)  # n2 has not acked yet

    seen.clear()
    steps.apply(core.on_ack("n2", stream, received_lsn=4, written_lsn=4, synced_lsn=4))
    kinds = [kind for kind, _ in seen]
    assert ("completed", ["write-4"]) in seen and ("committed", 4) in seen
    # The commit first: its readers (followers, push) wake ahead of the writers' answers.
    assert kinds.index("committed") < kinds.index("completed") < kinds.index("room")
    receipt = common_pb2.BatchReceipt.FromString(steps.receipt_stamp(4))
    assert receipt.master_id == "n1"
    assert {h.node_id for h in receipt.holders} == {"n1", "n2"}


def test_a_log_record_that_fails_its_checksum_is_not_sent_the_fault_is_reported() -> None:
    steps, store, seen = _steps()
    flip_a_byte(store, "log", (2).to_bytes(8, "big"))
    core = steps.core
    stream = core.connect("n2")
    steps.apply(core.on_position("n2", stream, last_epoch=0, last_lsn=0, history=[]))
    assert _batches(seen) == []  # not LSN 1 alone either: the batch is not cut at the damage
    (fault,) = [value for kind, value in seen if kind == "fault"]
    assert isinstance(fault, str)
    assert "checksum error reading the log for node n2" in fault
    assert "0000000000000002" in fault  # the record's key
    assert ("close", ("n2", stream, fault)) in seen
    # Nothing counts as sent: once the stream ends, the next one starts from the same LSN
    # and meets the same record, reported as the same fault.
    steps.stream_ended("n2", stream)  # as the shell's stream task ends
    seen.clear()
    again = core.connect("n2")
    steps.apply(core.on_position("n2", again, last_epoch=0, last_lsn=0, history=[]))
    assert ("fault", fault) in seen and _batches(seen) == []


def test_a_deposed_master_fails_its_waiting_writes_and_says_why() -> None:
    steps, store, seen = _steps()
    store.append([_entry(4, 2)], sync=True)
    steps.appended([_entry(4, 2)], synced=True)
    steps.apply(steps.core.register_writes([(4, "write-4")]))
    seen.clear()
    steps.apply(steps.core.depose("a newer epoch exists"))
    kinds = [kind for kind, _ in seen]
    assert ("failed", ["write-4"]) in seen
    assert kinds.index("failed") < kinds.index("room") < kinds.index("deposed")
    assert ("deposed", "a newer epoch exists") in seen


def test_an_unflushed_batch_goes_out_and_commits_once_flushed_or_a_failed_flush_deposes() -> None:
    for flush_ok in (True, False):
        steps, store, seen = _steps()
        core = steps.core
        stream = core.connect("n2")
        steps.apply(core.on_position("n2", stream, last_epoch=1, last_lsn=3, history=[(1, 1)]))
        seen.clear()
        store.append([_entry(4, 2)], sync=False)
        steps.appended([_entry(4, 2)], synced=False)  # sent before the master's flush
        steps.apply(core.register_writes([(4, "write-4")]))
        assert _batches(seen) == [[4]]
        steps.apply(core.on_ack("n2", stream, received_lsn=4, written_lsn=4, synced_lsn=4))
        assert not any(kind == "completed" for kind, _ in seen)  # the master's flush counts
        seen.clear()
        if flush_ok:
            steps.synced(4)
            assert ("completed", ["write-4"]) in seen and ("committed", 4) in seen
        else:
            steps.sync_failed("EIO")
            assert ("failed", ["write-4"]) in seen
            assert ("deposed", "local store flush failed after sending: EIO") in seen
            assert core.commit_lsn < 4 and core.deposed


def _holders(steps: MasterSteps[str], lsn: int) -> list[tuple[str, int]]:
    stamp = common_pb2.BatchReceipt.FromString(steps.receipt_stamp(lsn))
    return [(h.node_id, h.durability) for h in stamp.holders]


def test_receipt_stamps_name_each_lsns_holders_as_the_acks_move() -> None:
    """Stamps are reused across writes (the same holders commit write after write): each
    LSN's still names exactly who holds it, with what sync policy, as acks arrive."""
    steps, store, _ = _steps()
    core = steps.core
    stream = core.connect("n2")
    steps.apply(core.on_position("n2", stream, last_epoch=1, last_lsn=3, history=[(1, 1)]))
    for lsn in (4, 5):
        store.append([_entry(lsn, 2)], sync=True)
        steps.appended([_entry(lsn, 2)], synced=True)
    sync, written = common_pb2.SYNC_POLICY_SYNC, common_pb2.SYNC_POLICY_WRITE_NO_SYNC
    steps.apply(core.on_ack("n2", stream, received_lsn=4, written_lsn=4, synced_lsn=4))
    assert _holders(steps, 4) == [("n1", sync), ("n2", sync)]
    assert _holders(steps, 5) == [("n1", sync)]  # n2 has not acked 5 yet
    steps.apply(core.on_ack("n2", stream, received_lsn=5, written_lsn=5, synced_lsn=4))
    assert _holders(steps, 5) == [("n1", sync), ("n2", written)]
    assert _holders(steps, 4) == [("n1", sync), ("n2", sync)]


def test_the_compaction_target_keeps_the_retention_and_a_snapshotting_slaves_tail() -> None:
    """Within the retention the log start stays; beyond it the last entries are kept, and
    a slave receiving a snapshot at S keeps the log from S+1 whatever the retention."""
    steps, store, _ = _steps()
    core = steps.core
    for lsn in range(4, 11):
        store.append([_entry(lsn, 2)], sync=True)
        steps.appended([_entry(lsn, 2)], synced=True)
    assert steps.compaction_target(100) == 1  # the whole log is within the retention
    assert steps.compaction_target(4) == 7  # LSNs 7..10 kept
    steps.set_log_start(3)
    stream = core.connect("n2")
    steps.apply(core.on_position("n2", stream, last_epoch=0, last_lsn=0, history=[]))
    steps.apply(core.on_snapshot_started("n2", stream, 3))  # n2 needs LSN 1, below 3
    assert steps.compaction_target(4) == 4  # the snapshot's tail, LSN 4 on
    assert steps.compaction_target(100) == 3


# --- a slave's stream, as MasterDriver and the replication simulator read it


def _position(
    last_epoch: int, last_lsn: int, *, reads_joined_publishes: bool = False
) -> replica_pb2.ReplicateResponse:
    return replica_pb2.ReplicateResponse(
        position=replica_pb2.ReplicationPosition(
            last_epoch=last_epoch,
            last_lsn=last_lsn,
            history=[replica_pb2.EpochBoundary(epoch=1, start_lsn=1)] if last_lsn else [],
            reads_joined_publishes=reads_joined_publishes,
        )
    )


def _ack(lsn: int) -> replica_pb2.ReplicateResponse:
    return replica_pb2.ReplicateResponse(
        ack=replica_pb2.ReplicationAck(received_lsn=lsn, written_lsn=lsn, synced_lsn=lsn)
    )


def test_a_stream_opens_only_on_a_position_and_then_only_acks_move_the_slave() -> None:
    steps, store, seen = _steps()
    core = steps.core
    stream = core.connect("n2")
    assert not steps.hello_answered("n2", stream, _ack(3))  # not an answer to the Hello
    assert seen == [] and core.progress("n2").received_lsn == 0

    stream = core.connect("n2")
    assert steps.hello_answered("n2", stream, _position(1, 2))
    assert _batches(seen) == [[3]]  # the core heard where n2's log ends: LSN 3 goes out
    store.append([_entry(4, 2)], sync=True)
    steps.appended([_entry(4, 2)], synced=True)
    steps.apply(core.register_writes([(4, "write-4")]))
    seen.clear()
    steps.received("n2", stream, _position(0, 0))  # a second Position is no input
    assert seen == [] and core.progress("n2").received_lsn == 2
    steps.received("n2", stream, _ack(4))
    assert ("completed", ["write-4"]) in seen and core.progress("n2").synced_lsn == 4


def test_a_refusal_naming_a_newer_epoch_deposes_the_master_and_others_mean_retry() -> None:
    steps, _, seen = _steps()
    stream = steps.core.connect("n2")
    # No epoch, or this master's own: the slave is away or busy; the shell reconnects.
    assert steps.refused("n2", "UNAVAILABLE", "restarting", ())
    assert steps.refused("n2", "FAILED_PRECONDITION", "stale", (("squall-epoch", "2"),))
    assert steps.refused("n2", "FAILED_PRECONDITION", "odd", (("squall-epoch", "x3"),))
    assert not steps.core.deposed and not any(kind == "deposed" for kind, _ in seen)
    assert steps.stream_ended("n2", stream)  # a new stream is due after the backoff

    assert not steps.refused(
        "n2", "FAILED_PRECONDITION", "superseded", (("other", "9"), ("squall-epoch", "3"))
    )
    assert steps.core.deposed == "epoch 3 superseded epoch 2"
    assert ("deposed", "epoch 3 superseded epoch 2") in seen
    assert not steps.stream_ended("n2", stream)  # a deposed master opens none


def test_under_acks_group_a_slave_refusing_the_log_for_a_full_store_holds_no_write_back() -> None:
    """Its store full, a slave refuses every batch (RESOURCE_EXHAUSTED) until an operator
    frees room; under acks group every write would wait for it that long."""
    steps, store, seen = _steps(members=("n1", "n2", "n3"), acks=AckPolicy.ALL)
    core = steps.core
    streams = {node: core.connect(node) for node in ("n2", "n3")}
    for node, stream in streams.items():
        assert steps.hello_answered(node, stream, _position(1, 3))
    store.append([_entry(4, 2)], sync=True)
    steps.appended([_entry(4, 2)], synced=True)
    steps.apply(core.register_writes([(4, "write-4")]))
    steps.received("n2", streams["n2"], _ack(4))
    assert ("completed", ["write-4"]) not in seen  # n3 is waited for
    assert steps.refused("n3", "RESOURCE_EXHAUSTED", "replica n3: store full", ())
    assert ("completed", ["write-4"]) in seen
    assert core.progress("n3").catching_up and not core.deposed


def test_only_the_current_stream_ending_calls_for_a_new_one() -> None:
    steps, _, _ = _steps()
    core = steps.core
    old = core.connect("n2")
    new = core.connect("n2")
    assert not steps.stream_ended("n2", old)  # replaced already: the core ignores it
    assert core.progress("n2").stream_id == new
    assert steps.stream_ended("n2", new)
    assert core.progress("n2").stream_id == 0


def test_the_writer_flushes_after_sending_only_under_sync_and_a_write_waits_for_its_epoch() -> None:
    steps, _, _ = _steps()  # SYNC by default
    assert steps.flush_after_send()
    # Epoch 2 starts at LSN 4: a duplicate answered from an entry of epoch 1 waits for it.
    assert steps.core.epoch_start_lsn == 4
    assert steps.wait_lsn(2) == 4 and steps.wait_lsn(4) == 4 and steps.wait_lsn(7) == 7
    for policy in (SyncPolicy.WRITE_NO_SYNC, SyncPolicy.NO_SYNC):
        assert not _steps(policy)[0].flush_after_send()


def test_an_ack_saying_readers_follow_gets_the_commit_as_a_heartbeat_at_once() -> None:
    steps, store, seen = _steps()
    core = steps.core
    stream = core.connect("n2")
    steps.apply(core.on_position("n2", stream, last_epoch=0, last_lsn=0, history=[]))
    store.append([_entry(4, 2)], sync=True)
    steps.appended([_entry(4, 2)], synced=True)
    seen.clear()
    # Two nodes: n2's ack of LSN 4 commits it; its batch carried the commit before it.
    ack = replica_pb2.ReplicationAck(
        received_lsn=4, written_lsn=4, synced_lsn=4, readers_following=True
    )
    steps.received("n2", stream, replica_pb2.ReplicateResponse(ack=ack))
    heartbeats = [value for kind, value in seen if kind == "heartbeat"]
    assert len(heartbeats) == 1
    node_id, message = heartbeats[0]  # type: ignore[misc]
    assert (node_id, message.heartbeat.commit_lsn, message.heartbeat.epoch) == ("n2", 4, 2)
    # Without readers the commit waits for n2's next batch or heartbeat.
    store.append([_entry(5, 2)], sync=True)
    steps.appended([_entry(5, 2)], synced=True)
    seen.clear()
    ack = replica_pb2.ReplicationAck(received_lsn=5, written_lsn=5, synced_lsn=5)
    steps.received("n2", stream, replica_pb2.ReplicateResponse(ack=ack))
    assert ("committed", 5) in seen
    assert not any(kind == "heartbeat" for kind, _ in seen)


def test_joined_entries_wait_until_every_node_of_the_node_set_says_it_reads_them() -> None:
    """A node of an older release never says reads_joined_publishes: while one may be among
    the nodes, each part of a joined request must be an entry of its own (it reads this
    log when it catches up, in the group or out of it)."""
    steps, _, _ = _steps(members=("n1", "n2", "n3"))
    core = steps.core
    assert not steps.joins_publishes()  # no slave has answered a Hello in this epoch
    assert steps.hello_answered("n2", core.connect("n2"), _position(1, 3))
    stream = core.connect("n3")
    assert steps.hello_answered("n3", stream, _position(1, 3, reads_joined_publishes=True))
    assert not steps.joins_publishes()  # n2 runs an older release
    stream2 = core.connect("n2")
    assert steps.hello_answered("n2", stream2, _position(1, 3, reads_joined_publishes=True))
    assert steps.joins_publishes()
    # Acks and a stream's end change nothing: the member's release is what counts.
    steps.received("n3", stream, _ack(3))
    steps.stream_ended("n3", stream)
    assert steps.joins_publishes()
    # n2 rolled back to the older release: its next stream's Position closes the gate.
    assert steps.hello_answered("n2", core.connect("n2"), _position(1, 3))
    assert not steps.joins_publishes()
    # A group shrunk to the members that read them keeps it closed: n2, dropped from the
    # group in this epoch, gets this epoch's entries when it catches up (the coordinated
    # simulator's first finding, seed 28).
    steps.apply(core.set_members(("n1", "n3")))
    assert not steps.joins_publishes()


def test_joined_entries_wait_for_a_node_that_is_not_in_the_group() -> None:
    """A node of the node set that never joined this epoch's group (down, cut off) reads
    its entries later: the gate waits for it too, learners included."""
    steps, _, _ = _steps(members=("n1", "n2"), nodes=("n1", "n2", "n3"), learners=("n4",))
    core = steps.core
    assert steps.hello_answered(
        "n2", core.connect("n2"), _position(1, 3, reads_joined_publishes=True)
    )
    assert not steps.joins_publishes()  # n3 and n4 have said nothing in this epoch
