"""The replica's synchronous driver alone: the slave side over the in-memory store, with
no event loop, threads or gRPC (what a simulator runs).

The driver follows a master, accepts its stream, stores a batch and acknowledges it,
learns the commit LSN from a heartbeat, refuses a superseded stream with its epoch for
a stale master, and maps a failing disk to UNAVAILABLE plus a fail-stop reason. Role
changes run as the core's ``Effects`` order them: the steps left to a shell come out
in that order, a refusal only after an abandoned taking stopped, a new store records
its cluster id and epoch before it follows, and a fail-stop reports its fault; a
master role checks its epoch and members before persisting anything and needs a
cluster id. A reorganization fetch is stepped message by message: entries continue the
log or are refused whole, a divergence is a truncation unless it reaches committed
entries, an empty batch moves the commit LSN. A sync source's answer is sent in batches
of the requester's step, ending where its log ended; a slave's batch is written in the
order of the driver's steps (truncate, append, compact); a log is truncated only when it
still starts at LSN 1 and the store can.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Generator
from contextlib import closing
from pathlib import Path

import pytest

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import load_config
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import commands
from squall_server.replica.committed import committed_events
from squall_server.replica.core import (
    EPOCH_KEY,
    CoreConfig,
    Effects,
    Follow,
    LogPosition,
    PersistRole,
    ReplicaCore,
    Role,
    RoleOrder,
    RoleRefusal,
    StoreFacts,
    TakeMaster,
)
from squall_server.replica.driver import (
    AppendBatch,
    CancelTaking,
    DropRole,
    FollowMaster,
    InstallFetched,
    RecordClusterId,
    RenewMembers,
    ReplicaDriver,
    StartTaking,
    StoreCall,
    StoreFetched,
    TruncateFetched,
    TruncateLog,
    master_config,
)
from squall_server.replica.fetch_serving import FetchServing
from squall_server.replica.follower import FollowerConfig
from squall_server.replica.replication import ReplicationMaster, SyncPolicy
from squall_server.replica.store import Store, StoreWriteError
from squall_server.replica.visibility import CommitGate
from tests.unit.test_store_contract import Writer, create, epoch_start, payloads, publish

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
NOW_MS = 1_000


def _entry(lsn: int, epoch: int) -> replica_pb2.LogEntry:
    operation = replica_pb2.Operation(
        create_topic=replica_pb2.CreateTopicOp(name=f"t{lsn}")
    ).SerializeToString()
    return replica_pb2.LogEntry(
        lsn=lsn, epoch=epoch, checksum=zlib.crc32(operation), operation=operation
    )


class _Disk(Store):
    """The in-memory store, whose appends fail once ``broken`` is set."""

    broken = False

    def append(self, entries, *, sync, commit_lsn=None):  # type: ignore[no-untyped-def]
        if self.broken:
            raise StoreWriteError("I/O error (simulated failing disk)")
        super().append(entries, sync=sync, commit_lsn=commit_lsn)


def _slave(epoch: int = 3) -> tuple[ReplicaDriver, _Disk, list[int]]:
    store = _Disk.open_memory()
    assert isinstance(store, _Disk)
    core = ReplicaCore(
        CoreConfig("n2", {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"}),
        stored_epoch=0,
        log=LogPosition(0, 1),
    )
    woken: list[int] = []
    driver = ReplicaDriver(
        "n2",
        core,
        store,
        CommitGate(0),
        follower_config=FollowerConfig(node_id="n2", sync_policy=SyncPolicy.SYNC),
        on_committed=lambda: woken.append(driver.gate.commit_lsn),
    )
    effects = core.role_command(
        RoleOrder(role=Role.SLAVE, epoch=epoch, master_id="n1", seq=1, lease_ms=60_000),
        NOW_MS,
        StoreFacts(0, ""),
    )
    assert effects.refusal is None and effects.follow is not None
    follow: Follow = effects.follow
    assert effects.persist_role == PersistRole(Role.SLAVE, epoch)
    driver.write_role(effects.persist_role)
    driver.follow(follow, NOW_MS)
    assert core.role == Role.SLAVE and store.meta().epoch == epoch
    return driver, store, woken


def _store_batch(
    driver: ReplicaDriver, stream: int, batch: replica_pb2.EntryBatch
) -> list[replica_pb2.ReplicationAck]:
    """One batch as a shell carries it out, every step of ``write_batch`` in line."""
    accepted, follower, acks = driver.batch(stream, batch)
    assert accepted.batch is not None
    steps = driver.write_batch(accepted, follower, batch.commit_lsn)
    try:
        step = next(steps)
        while True:
            assert isinstance(step, AppendBatch)  # no truncation, no compaction here
            driver.store_append(step.entries, sync=step.sync, commit_lsn=step.commit_lsn)
            step = steps.send(None)
    except StopIteration as done:
        written: list[replica_pb2.ReplicationAck] = done.value
    return acks + written


def test_a_slave_driver_stores_acks_and_learns_the_commit_lsn_without_an_event_loop() -> None:
    driver, store, woken = _slave()
    stream, position = driver.hello(
        replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c-1")
    )
    assert position.last_lsn == 0 and position.node_id == "n2"
    assert store.meta().cluster_id == "c-1"  # an empty store joins the master's cluster

    acks = _store_batch(
        driver, stream, replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3), _entry(2, 3)])
    )
    assert acks[-1].synced_lsn == 2
    assert [e.lsn for e in store.read_log(1, 10)] == [1, 2]

    record, ack = driver.heartbeat(stream, replica_pb2.ReplicationHeartbeat(epoch=3, commit_lsn=2))
    assert ack.written_lsn == 2
    assert driver.gate.commit_lsn == 2 and woken == [2]
    if record:  # the idle stream's commit LSN, recorded as a shell would in the background
        driver.commit_recorded(driver.store_record_commit(record))
        assert store.meta().commit_lsn == 2


def test_a_superseded_stream_is_refused_with_the_replicas_epoch() -> None:
    driver, _, _ = _slave()
    old, _ = driver.hello(replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c"))
    driver.hello(replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c"))
    with pytest.raises(ServiceError) as refused:
        driver.batch(old, replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3)]))
    assert refused.value.code == Code.FAILED_PRECONDITION
    assert "superseded" in refused.value.message
    assert (EPOCH_KEY, "3") in refused.value.metadata
    with pytest.raises(ServiceError) as stale:
        driver.hello(replica_pb2.ReplicationHello(master_id="n1", epoch=2, cluster_id="c"))
    assert stale.value.code == Code.FAILED_PRECONDITION
    assert (EPOCH_KEY, "3") in stale.value.metadata


def test_a_failing_disk_is_unavailable_and_fail_stops_and_nothing_is_acknowledged() -> None:
    driver, store, _ = _slave()
    stream, _ = driver.hello(replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c"))
    _store_batch(driver, stream, replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3)]))
    store.broken = True
    accepted, follower, acks = driver.batch(
        stream, replica_pb2.EntryBatch(epoch=3, entries=[_entry(2, 3)], commit_lsn=1)
    )
    assert accepted.batch is not None
    with pytest.raises(StoreWriteError) as raised:
        driver.store_append(accepted.batch.entries, sync=True, commit_lsn=1)
    error, fail_stop = driver.batch_failed(follower, raised.value)
    assert error.code == Code.UNAVAILABLE and "n2: store write failed" in error.message
    assert fail_stop.startswith("store write failed")
    assert all(ack.synced_lsn <= 1 for ack in acks)  # SYNC: nothing on receipt beyond 1
    assert driver.core.log.last_lsn == 1 and store.meta().last_lsn == 1


def test_the_writer_plans_a_batch_refusing_a_bad_command_without_losing_the_others() -> None:
    store = Store.open_memory()
    core = ReplicaCore(
        CoreConfig("n1", {"n1": "127.0.0.1:1"}), stored_epoch=0, log=LogPosition(0, 1)
    )
    driver = ReplicaDriver(
        "n1",
        core,
        store,
        CommitGate(0),
        follower_config=FollowerConfig(node_id="n1"),
        on_committed=lambda: None,
    )
    limits = load_config(CONFIG).limits
    batch = driver.plan_batch(
        [
            commands.CreateTopic("orders", common_pb2.TOPIC_KIND_REPLICATED),
            commands.Publish(broker_pb2.PublishRequest(topic="nowhere")),
            commands.Publish(
                broker_pb2.PublishRequest(
                    topic="orders", events=[common_pb2.EventData(payload=b"x")]
                )
            ),
        ],
        limits=limits,
        epoch=1,
        now_ms=NOW_MS,
    )
    assert [index for index, _, _ in batch.planned] == [0, 2]
    assert [lsn for _, _, lsn in batch.planned] == [1, 2]
    assert [(index, err.code) for index, err in batch.refused] == [(1, Code.NOT_FOUND)]
    assert [e.lsn for e in batch.entries] == [1, 2] and not batch.faults
    # The publish stays hidden from committed reads until its entry commits.
    assert driver.gate.tracked == 1
    driver.store_append(batch.entries, sync=True, commit_lsn=0)
    driver.batch_appended(2, 0)
    assert core.log.last_lsn == 2 and store.meta().last_lsn == 2


def _fresh(node_id: str = "n2") -> tuple[ReplicaDriver, list[str]]:
    """A driver over an empty memory store that logs its hooks' calls."""
    calls: list[str] = []
    driver = ReplicaDriver(
        node_id,
        ReplicaCore(
            CoreConfig(node_id, {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"}),
            stored_epoch=0,
            log=LogPosition(0, 1),
        ),
        Store.open_memory(),
        CommitGate(0),
        follower_config=FollowerConfig(node_id=node_id),
        on_committed=lambda: None,
        on_role_changed=lambda: calls.append("role changed"),
        on_fault=lambda reason: calls.append(f"fault: {reason}"),
    )
    return driver, calls


def test_role_steps_come_in_the_effects_order_and_a_refusal_waits_for_the_cancel() -> None:
    driver, calls = _fresh()
    take = TakeMaster(epoch=4, members=("n1", "n2"), sync_source_id="", reason="r", attempt=1)
    steps = driver.role_steps(
        Effects(
            role_changed=True,
            cancel_taking="newer command",
            drop_role="lost",
            persist_role=PersistRole(Role.MASTER, 4),
            take_master=take,
            members=("n2",),
            faults=("bad disk",),
        )
    )
    assert next(steps) == CancelTaking("newer command")
    assert calls == ["role changed"]  # counted before anything waits
    assert list(steps) == [
        DropRole("lost", was_active=True),
        StartTaking(take, PersistRole(Role.MASTER, 4)),
        RenewMembers(("n2",)),
    ]
    assert calls == ["role changed", "fault: bad disk"]  # faults last

    refused = driver.role_steps(
        Effects(
            cancel_taking="stale",
            refusal=RoleRefusal(Code.FAILED_PRECONDITION, "epoch 2 is stale"),
            drop_role="never reached",
        )
    )
    assert next(refused) == CancelTaking("stale")  # the abandoned taking stops first
    with pytest.raises(ServiceError) as error:
        next(refused)
    assert error.value.code == Code.FAILED_PRECONDITION and "stale" in error.value.message


def test_a_new_store_records_cluster_and_epoch_before_it_follows_and_fail_stop_reports() -> None:
    driver, calls = _fresh()
    effects = driver.core.role_command(
        RoleOrder(
            role=Role.SLAVE, epoch=5, master_id="n1", seq=1, lease_ms=60_000, cluster_id="c-9"
        ),
        NOW_MS,
        StoreFacts(0, ""),
    )
    steps = driver.role_steps(effects)
    # The flushed writes are steps of their own, which the shell runs off its event loop:
    # the cluster id first, then the epoch of the role the core names.
    assert next(steps) == RecordClusterId("c-9")
    driver.write_role(RecordClusterId("c-9"))
    assert driver.store.meta().epoch == 0  # the epoch only in its own step
    persist = next(steps)
    assert persist == PersistRole(Role.SLAVE, 5)
    driver.write_role(persist)
    step = next(steps)
    assert isinstance(step, FollowMaster) and step.follow.epoch == 5
    meta = driver.store.meta()  # persisted before the shell makes the follower
    assert meta.cluster_id == "c-9" and meta.epoch == 5
    assert meta.state == common_pb2.STORE_STATE_DIRTY
    driver.follow(step.follow, NOW_MS)
    assert list(steps) == []
    assert driver.core.role == Role.SLAVE and calls.count("role changed") >= 1

    driver.fail_stop("store write failed: I/O error")
    assert driver.core.role == Role.INACTIVE
    assert calls[-1] == "fault: fail-stop: store write failed: I/O error"
    with pytest.raises(ServiceError):  # a fail-stopped replica takes no role again
        list(
            driver.role_steps(
                driver.core.role_command(
                    RoleOrder(role=Role.SLAVE, epoch=6, master_id="n1", seq=2, lease_ms=60_000),
                    NOW_MS,
                    StoreFacts(5, "c-9"),
                )
            )
        )


def test_taking_the_master_role_checks_before_persisting_and_needs_a_cluster_id() -> None:
    driver, _ = _fresh("n1")
    with pytest.raises(ServiceError) as unknown:
        driver.take_master_persist(PersistRole(Role.MASTER, 2), ["n1", "n7"])
    assert unknown.value.code == Code.INVALID_ARGUMENT and "'n7'" in unknown.value.message
    assert driver.store.meta().epoch == 0  # refused before anything was persisted

    # this node always in
    assert driver.take_master_persist(PersistRole(Role.MASTER, 2), ["n2"]) == ["n2", "n1"]
    assert driver.store.meta().epoch == 2
    assert driver.store.meta().state == common_pb2.STORE_STATE_DIRTY
    with pytest.raises(ServiceError) as stale:
        driver.take_master_persist(PersistRole(Role.MASTER, 1), [])
    assert stale.value.code == Code.FAILED_PRECONDITION and "older" in stale.value.message

    config = master_config(load_config(CONFIG), "n1", 2, truncate_by_snapshot=True)
    with pytest.raises(ServiceError) as no_cluster:
        driver.master_core(config, 2, ["n1", "n2"])
    assert no_cluster.value.code == Code.FAILED_PRECONDITION
    assert "no cluster id" in no_cluster.value.message
    driver.store.set_cluster_id("c-1")
    core: ReplicationMaster[int] = driver.master_core(config, 2, ["n1", "n2"])
    assert core.epoch == 2 and set(core.members) == {"n1", "n2"}


def test_a_fetch_steps_through_the_sources_answer_and_refuses_a_gap() -> None:
    driver, _ = _fresh("n1")
    driver.store.append([_entry(1, 1), _entry(2, 1)], sync=True)
    driver.core.log_reset(2, 1)
    tail = driver.fetch_begin()
    assert (tail.last_lsn, tail.last_epoch) == (2, 1)

    def answer(**batch: object) -> replica_pb2.FetchLogResponse:
        return replica_pb2.FetchLogResponse(
            entries=replica_pb2.EntryBatch(**batch),  # type: ignore[arg-type]
            cluster_id="c-3",
        )

    step = driver.fetch_step(tail, answer(entries=[_entry(3, 2), _entry(4, 2)]), 2, "n2")
    assert isinstance(step, StoreFetched) and step.checked.last_lsn == 4
    assert driver.store.meta().cluster_id == "c-3"  # an empty-cluster store joins the source's
    driver.hide_uncommitted(step.entries, step.commit_lsn)
    driver.store_append(step.entries, sync=True, commit_lsn=step.commit_lsn)
    driver.fetched_stored(step.entries[-1].lsn, step.commit_lsn)
    driver.fetched_entries_stored(tail, step)
    assert (tail.last_lsn, tail.last_epoch, tail.entries) == (4, 2, 2)

    with pytest.raises(ServiceError) as gap:  # LSN 6 does not continue LSN 4
        driver.fetch_step(tail, answer(entries=[_entry(6, 2)]), 2, "n2")
    assert gap.value.code == Code.FAILED_PRECONDITION
    assert "nothing of that batch was stored" in gap.value.message

    assert driver.fetch_step(tail, answer(commit_lsn=3), 2, "n2") is None
    assert driver.gate.commit_lsn == 3  # an empty batch moves the commit LSN only

    again = driver.fetch_begin(tail)  # a second pass keeps the counts
    assert again.entries == 2 and again.store_last_lsn == 4
    assert driver.fetch_step(again, answer(truncate_after_lsn=3), 2, "n2") == TruncateFetched(3)
    with pytest.raises(ServiceError) as below:  # LSN 3 is known committed here
        driver.fetch_step(again, answer(truncate_after_lsn=2), 2, "n2")
    assert "would remove committed entries" in below.value.message
    # Under acks = "none" a commit was this node's alone: its sync source rightly lacks
    # it, and refusing would refuse every master role its coordinator gives it again.
    driver.local_commits = True
    assert driver.fetch_step(again, answer(truncate_after_lsn=2), 2, "n2") == TruncateFetched(2)
    driver.local_commits = False
    snapshot = driver.fetch_step(
        again,
        replica_pb2.FetchLogResponse(snapshot=replica_pb2.SnapshotChunk(snapshot_lsn=9)),
        2,
        "n2",
    )
    assert isinstance(snapshot, InstallFetched) and snapshot.chunk.snapshot_lsn == 9


def test_a_sync_sources_answer_goes_in_the_requesters_steps_up_to_where_its_log_ended() -> None:
    driver, _ = _fresh("n2")
    driver.store.set_cluster_id("c-1")
    driver.store.append([_entry(lsn, 1) for lsn in range(1, 6)], sync=True, commit_lsn=4)
    driver.core.log_reset(5, 1)
    driver.advance_commit(4)
    request = replica_pb2.FetchLogRequest(
        node_id="n1",
        epoch=2,
        cluster_id="c-1",
        last_lsn=2,
        history=[replica_pb2.EpochBoundary(epoch=1, start_lsn=1)],
        max_entries=2,
    )
    serving = FetchServing(
        driver.fetch_answer(request, is_master=False, step_max=64),
        lambda: driver.gate.commit_lsn,
    )
    assert not serving.snapshot
    opening = serving.opening()
    assert opening.cluster_id == "c-1"
    assert (opening.entries.truncate_after_lsn, opening.entries.commit_lsn) == (0, 4)
    sent: list[list[int]] = []
    while (read := serving.next_read()) is not None:
        response = serving.entries_read(driver.store.read_log(*read))
        assert response is not None and response.entries.commit_lsn == 4
        sent.append([e.lsn for e in response.entries.entries])
    assert sent == [[3, 4], [5]]  # two per batch, as the requester asked

    # A read that finds nothing ends the answer (the log was cut meanwhile).
    again = FetchServing(driver.fetch_answer(request, is_master=False, step_max=64), lambda: 0)
    assert again.next_read() == (3, 2)
    assert again.entries_read([]) is None and again.next_read() is None


def test_a_slaves_diverging_batch_is_truncate_then_append_then_acks() -> None:
    driver, _, _ = _slave()
    stream, _ = driver.hello(replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c"))
    _store_batch(
        driver, stream, replica_pb2.EntryBatch(entries=[_entry(1, 3), _entry(2, 3)], epoch=3)
    )
    accepted, follower, _ = driver.batch(
        stream, replica_pb2.EntryBatch(entries=[_entry(2, 3)], epoch=3, truncate_after_lsn=1)
    )
    steps = driver.write_batch(accepted, follower, 0)
    assert next(steps) == TruncateLog(1)
    append = steps.send(None)
    assert isinstance(append, AppendBatch) and [e.lsn for e in append.entries] == [2]
    with pytest.raises(StopIteration) as done:
        steps.send(None)
    assert [a.written_lsn for a in done.value.value] == [2]  # acks once written, no compaction


def test_a_log_is_truncated_only_from_lsn_1_and_by_a_store_that_can() -> None:
    driver, _ = _fresh("n2")
    driver.store.append([_entry(lsn, 1) for lsn in range(1, 6)], sync=True)
    driver.check_truncation(3, "master n1", can_truncate=True)  # no refusal
    with pytest.raises(ServiceError) as cannot:
        driver.check_truncation(3, "master n1", can_truncate=False)
    assert cannot.value.code == Code.FAILED_PRECONDITION
    assert "after LSN 3 (master n1), and this store cannot" in cannot.value.message
    driver.store.compact_log(3)
    with pytest.raises(ServiceError) as compacted:
        driver.check_truncation(4, "master n1", can_truncate=True)
    assert "its log starts at LSN 3" in compacted.value.message
    assert "it needs a snapshot" in compacted.value.message


# --- the commit gate across a snapshot's swap


def _swap_scene() -> tuple[ReplicaDriver, Store, list[replica_pb2.SnapshotChunk], list[int]]:
    """A slave whose state holds a deposed master's uncommitted publish, and a snapshot
    from a source that knows less committed and holds uncommitted publishes of its own
    (one in a topic the slave does not have)."""
    shared = (
        epoch_start(1),
        create("orders"),
        publish("orders", 0, payloads(2)),
        publish("orders", 2, payloads(1)),
    )
    store = Store.open_memory()
    old = Writer(store)
    for op in shared:
        old.append(op)
    old.append(publish("orders", 3, payloads(1)))  # LSN 5: never committed
    source = Store.open_memory()
    new = Writer(source)
    for op in shared:
        new.append(op)
    new.append(epoch_start(2), epoch=2)
    new.append(create("fresh"), publish("orders", 3, payloads(2)), publish("fresh", 0, payloads(1)))
    with closing(source.snapshot_chunks()) as exported:
        chunks = [replica_pb2.SnapshotChunk.FromString(c.SerializeToString()) for c in exported]
    # Stamped as a source at commit LSN 3 stamps it (ReplicaDriver.stamp_snapshot).
    source_gate = CommitGate(3)
    source_gate.appended(4, "orders", 2)
    source_gate.appended(7, "orders", 3)
    source_gate.appended(8, "fresh", 0)
    chunks[-1].commit_lsn = 3
    chunks[-1].uncommitted.extend(
        replica_pb2.UncommittedPublish(topic=t, first_offset=o, last_lsn=lsn)
        for t, o, lsn in source_gate.uncommitted(8)
    )
    core = ReplicaCore(
        CoreConfig("n2", {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"}),
        stored_epoch=1,
        log=LogPosition(5, 1),
    )
    woken: list[int] = []
    gate = CommitGate(4)
    gate.appended(5, "orders", 3)
    driver = ReplicaDriver(
        "n2",
        core,
        store,
        gate,
        follower_config=FollowerConfig(node_id="n2", sync_policy=SyncPolicy.SYNC),
        on_committed=lambda: woken.append(driver.gate.commit_lsn),
    )
    return driver, store, chunks, woken


def _served(driver: ReplicaDriver, store: Store) -> dict[str, list[int]]:
    """The offsets committed reads serve per topic, and the commit LSN a fetch is told."""
    served = {
        t.name: [e.offset for e in committed_events(store, driver.gate, t.name)]
        for t in store.list_topics()
    }
    served["commit"] = [driver.gate.commit_lsn]
    return served


def _install_until_finish(
    driver: ReplicaDriver, chunks: list[replica_pb2.SnapshotChunk]
) -> tuple[Generator[StoreCall, None, int | None], StoreCall]:
    """Steps the install of a one-chunk snapshot as the shell does, up to its finish call."""
    assert len(chunks) == 1
    steps = driver.install_snapshot(
        chunks[0],
        last=True,
        history=[(b.epoch, b.start_lsn) for b in chunks[0].history],
        source="master n1",
    )
    call = next(steps)
    # Bounded: begin, the chunk, then the finish.
    for _ in range(3):
        assert isinstance(call, functools.partial)
        if call.func.__name__ == "finish_snapshot":
            return steps, call
        call()
        call = steps.send(None)
    raise AssertionError("no finish_snapshot step")


def test_reads_during_a_snapshots_swap_never_see_what_either_state_holds_uncommitted() -> None:
    driver, store, chunks, woken = _swap_scene()
    assert _served(driver, store) == {"orders": [0, 1, 2], "commit": [4]}
    steps, finish = _install_until_finish(driver, chunks)
    # The old state is still live: its committed events only (the snapshot's LSN 4 is
    # committed in both, but the source's commit LSN 3 is what both agree on).
    assert _served(driver, store) == {"orders": [0, 1], "commit": [3]}
    finish()  # the store thread swapped the state in; the event loop may read now
    assert _served(driver, store) == {"orders": [0, 1], "fresh": [], "commit": [3]}
    with pytest.raises(StopIteration) as done:
        steps.send(None)
    assert done.value.value == 8
    # The snapshot's exact gate: hidden from its first uncommitted offset per topic.
    assert _served(driver, store) == {"orders": [0, 1], "fresh": [], "commit": [3]}
    assert driver.gate.tracked == 2 and woken
    driver.advance_commit(7)
    assert _served(driver, store) == {"orders": [0, 1, 2, 3, 4], "fresh": [], "commit": [7]}
    driver.advance_commit(8)
    assert _served(driver, store)["fresh"] == [0]


def test_a_failed_swap_puts_the_gate_back_and_a_cancelled_one_keeps_hiding() -> None:
    driver, store, chunks, woken = _swap_scene()
    steps, _ = _install_until_finish(driver, chunks)
    # The store raised: finish_snapshot left the old state live, served as before.
    with pytest.raises(StoreWriteError):
        steps.throw(StoreWriteError("I/O error (simulated)"))
    assert _served(driver, store) == {"orders": [0, 1, 2], "commit": [4]}
    assert driver.gate.tracked == 1 and woken == [4]
    driver.advance_commit(5)
    assert _served(driver, store) == {"orders": [0, 1, 2, 3], "commit": [5]}

    driver, store, chunks, _ = _swap_scene()
    steps, finish = _install_until_finish(driver, chunks)
    finish()
    steps.close()  # cancelled: the shell never learns whether the swap happened
    assert _served(driver, store) == {"orders": [0, 1], "fresh": [], "commit": [3]}
    driver.advance_commit(7)  # what the snapshot held uncommitted in orders committed
    assert _served(driver, store) == {"orders": [0, 1, 2, 3, 4], "fresh": [], "commit": [7]}
    driver.advance_commit(8)
    assert _served(driver, store)["fresh"] == [0]
