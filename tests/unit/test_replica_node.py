"""One ReplicaNode in process, over the in-memory store, driven by role commands.

* A slave whose store fails to write stops serving instead of acknowledging (issue 4);
  the replication stream is fed the way replication_server does.
* A publisher proxy's call is held while the replica can name no reachable master
  (issue 5's publish gap).
* The role lease runs on the injected clock: the driver ticks the core, which drops a role
  nobody renews; the lost epoch is then refused (issue 15's core and driver split).
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.clock import ManualClock
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.replication_server import Replication
from squall_server.replica.server import ReplicaControl, Subscriber
from squall_server.replica.store import DATABASES, Store, StoreFullError, StoreWriteError
from squall_server.replica.store.kv_memory import MemoryKV
from tests.example_config import example_config


def _entry(lsn: int, epoch: int) -> replica_pb2.LogEntry:
    operation = replica_pb2.Operation(
        create_topic=replica_pb2.CreateTopicOp(name=f"t{lsn}")
    ).SerializeToString()
    return replica_pb2.LogEntry(
        lsn=lsn, epoch=epoch, checksum=zlib.crc32(operation), operation=operation
    )


class _FailingStore(Store):
    """An in-memory store whose appends fail once `broken` is set."""

    broken = False

    def append(self, entries, *, sync, commit_lsn=None):  # type: ignore[no-untyped-def]
        if self.broken:
            raise StoreWriteError("I/O error (simulated failing disk)")
        super().append(entries, sync=sync, commit_lsn=commit_lsn)


async def _acks(node: ReplicaNode, stream: int, batch: replica_pb2.EntryBatch) -> list[object]:
    return [ack async for ack in node.replication_batch(stream, batch)]


def test_a_slave_whose_store_fails_stops_serving_and_never_acks_the_batch(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = example_config(tmp_path)
        store = _FailingStore.open_memory()
        assert isinstance(store, _FailingStore)
        node = build_replica_node(config, config.node("n2"), store)
        await node.start()
        try:
            await node.apply_role(
                replica_pb2.RoleCommand(
                    seq=1,
                    epoch=3,
                    role=common_pb2.ROLE_SLAVE,
                    master=common_pb2.NodeEndpoint(node_id="n1"),
                    lease_ms=60_000,
                )
            )
            stream, position = await node.replication_hello(
                replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c-test")
            )
            assert position.last_lsn == 0
            good = replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3)], commit_lsn=0)
            acks = await _acks(node, stream, good)
            assert acks and acks[-1].written_lsn == 1  # type: ignore[attr-defined]

            store.broken = True
            bad = replica_pb2.EntryBatch(epoch=3, entries=[_entry(2, 3)], commit_lsn=1)
            with pytest.raises(ServiceError) as raised:
                await _acks(node, stream, bad)
            assert raised.value.code == Code.UNAVAILABLE
            assert "store write failed" in raised.value.message
            assert "n2" in raised.value.message

            # It no longer serves: the role is gone, writes are refused naming the cause,
            # and the log still ends where the last acknowledged batch did.
            assert node.role == common_pb2.ROLE_INACTIVE
            assert "store write failed" in node.failed_reason
            with pytest.raises(ServiceError) as refused:
                node.start_publish(broker_pb2.PublishRequest(topic="t1"))
            assert refused.value.code == Code.UNAVAILABLE
            assert "stopped serving writes" in refused.value.message
            assert node.last_lsn == 1
        finally:
            await node.stop()

    asyncio.run(scenario())


class _EpochFailingStore(Store):
    """An in-memory store whose epoch writes fail once `broken` is set."""

    broken = False

    def set_epoch(self, epoch: int) -> None:
        if self.broken:
            raise StoreWriteError("I/O error (simulated failing disk)")
        super().set_epoch(epoch)


def test_a_role_whose_epoch_cannot_be_persisted_is_refused_and_the_replica_stops(
    tmp_path: Path,
) -> None:
    """Regression (found by tests/sim/shell_sim.py, seed 174): a store error persisting a
    slave role's epoch escaped apply_role raw (SetRole answered UNKNOWN) and the replica
    went on holding a role whose epoch its store did not have."""

    async def scenario() -> None:
        config = example_config(tmp_path)
        store = _EpochFailingStore.open_memory()
        assert isinstance(store, _EpochFailingStore)
        node = build_replica_node(config, config.node("n2"), store)
        await node.start()
        try:
            await node.apply_role(_slave_of("n1", 3, 1))
            assert node.role == common_pb2.ROLE_SLAVE
            store.broken = True
            with pytest.raises(ServiceError) as raised:
                await node.apply_role(_slave_of("n3", 4, 2))
            assert raised.value.code == Code.UNAVAILABLE
            assert "could not persist its new role" in raised.value.message
            assert "n2" in raised.value.message and "epoch 3" in raised.value.message
            assert node.role == common_pb2.ROLE_INACTIVE
            assert "persisting a new role" in node.failed_reason
            assert store.meta().epoch == 3
            with pytest.raises(ServiceError) as refused:  # and takes no role again
                await node.apply_role(_slave_of("n3", 5, 3))
            assert "fail-stopped" in refused.value.message
        finally:
            await node.stop()

    asyncio.run(scenario())


class _EpochFullStore(Store):
    """An in-memory store whose epoch writes find the store full once `full` is set."""

    full = False

    def set_epoch(self, epoch: int) -> None:
        if self.full:
            raise StoreFullError("LMDB map full (simulated)")
        super().set_epoch(epoch)


def test_a_role_a_full_store_cannot_persist_is_refused_and_taken_once_it_fits(
    tmp_path: Path,
) -> None:
    """A full store is not a failing disk (chaos seed 24's map_full fault): the role is
    refused RESOURCE_EXHAUSTED and dropped, the replica does not fail-stop (its coordinator
    would quarantine it), and the next command is taken once the write fits."""

    async def scenario() -> None:
        config = example_config(tmp_path)
        store = _EpochFullStore.open_memory()
        assert isinstance(store, _EpochFullStore)
        node = build_replica_node(config, config.node("n2"), store)
        await node.start()
        try:
            await node.apply_role(_slave_of("n1", 3, 1))
            store.full = True
            with pytest.raises(ServiceError) as raised:
                await node.apply_role(_slave_of("n3", 4, 2))
            assert raised.value.code == Code.RESOURCE_EXHAUSTED
            assert "store full" in raised.value.message and "epoch 3" in raised.value.message
            assert node.role == common_pb2.ROLE_INACTIVE
            assert node.failed_reason == ""
            assert store.meta().epoch == 3
            store.full = False
            await node.apply_role(_slave_of("n3", 5, 3))
            assert node.role == common_pb2.ROLE_SLAVE
            assert store.meta().epoch == 5
        finally:
            await node.stop()

    asyncio.run(scenario())


def _slave_of(master: str, epoch: int, seq: int) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        seq=seq,
        epoch=epoch,
        role=common_pb2.ROLE_SLAVE,
        master=common_pb2.NodeEndpoint(node_id=master),
        lease_ms=60_000,
    )


def test_a_replica_holds_a_proxy_call_until_it_can_name_a_reachable_master(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), Store.open_memory())
        await node.start()
        dead = config.node("n1").replica_address
        try:
            # No role: held.
            waiter = asyncio.create_task(node.wait_for_role(frozenset({dead}), 60))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiter.done()
            # The next role names another master: released at once, long before 60 s.
            await node.apply_role(_slave_of("n3", epoch=4, seq=1))
            await asyncio.wait_for(waiter, 5)
            assert node.master is not None and node.master.id == "n3"
            # A slave of the master the caller cannot reach, in the epoch the call found:
            # held, also across a renewal of that role.
            await node.apply_role(_slave_of("n1", epoch=5, seq=2))
            waiter = asyncio.create_task(node.wait_for_role(frozenset({dead}), 60))
            await node.apply_role(_slave_of("n1", epoch=5, seq=3))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiter.done()
            await node.apply_role(_slave_of("n3", epoch=6, seq=4))
            await asyncio.wait_for(waiter, 5)
            # A slave of a reachable master never holds; nor does a call naming nothing.
            await asyncio.wait_for(node.wait_for_role(frozenset({dead}), 60), 5)
            await asyncio.wait_for(node.wait_for_role(frozenset(), 60), 5)
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_a_held_call_goes_to_the_unreachable_master_once_a_newer_epoch_names_it(
    tmp_path: Path,
) -> None:
    # Issue 14: the master's replica restarted (or the node took the lead back) and the
    # group elected it again in a newer epoch. The caller still names it unreachable, from
    # before; the call must not wait out its hold for a master that is back.
    async def scenario() -> None:
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), Store.open_memory())
        await node.start()
        back = config.node("n1").replica_address
        try:
            await node.apply_role(_slave_of("n1", epoch=3, seq=1))
            waiter = asyncio.create_task(node.wait_for_role(frozenset({back}), 60))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiter.done()
            await node.apply_role(_slave_of("n1", epoch=4, seq=2))
            await asyncio.wait_for(waiter, 5)
            assert node.master is not None and node.master.id == "n1"
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_a_held_call_is_released_at_its_deadline(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), Store.open_memory())
        await node.start()
        try:
            await asyncio.wait_for(node.wait_for_role(frozenset({"127.0.0.1:1"}), 0.01), 5)
            assert node.role == common_pb2.ROLE_INACTIVE
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_an_unrenewed_role_lapses_on_the_injected_clock_and_its_epoch_is_not_resumed(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        config = example_config(tmp_path)
        clock = ManualClock()
        node = build_replica_node(config, config.node("n2"), Store.open_memory(), clock)
        await node.start()
        try:
            follow = _slave_of("n1", epoch=3, seq=1)
            follow.lease_ms = 3000
            await node.apply_role(follow)
            assert node.role == common_pb2.ROLE_SLAVE and node.master is not None
            # Real time passes, the node's clock does not: the role holds.
            await asyncio.sleep(0.3)
            assert node.role == common_pb2.ROLE_SLAVE
            clock.advance(2000)
            follow.seq = 2
            await node.apply_role(follow)  # the coordinator's renewal moves the lease on
            clock.advance(2500)
            await asyncio.sleep(0.3)
            assert node.role == common_pb2.ROLE_SLAVE
            clock.advance(501)
            # Bounded: the lease watch ticks the core every 50 ms.
            for _ in range(100):
                if node.role == common_pb2.ROLE_INACTIVE:
                    break
                await asyncio.sleep(0.05)
            assert node.role == common_pb2.ROLE_INACTIVE and node.master is None
            with pytest.raises(ServiceError) as refused:
                follow.seq = 3
                await node.apply_role(follow)
            assert refused.value.code is Code.FAILED_PRECONDITION
            assert "does not hold a role in epoch 3" in refused.value.message
            assert node.command_seq == 2
            await node.apply_role(_slave_of("n3", epoch=4, seq=4))
            assert node.role == common_pb2.ROLE_SLAVE and node.epoch == 4
        finally:
            await node.stop()

    asyncio.run(scenario())


class _Context:
    """The servicer context; the scenario below never aborts."""

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"unexpected abort {code}: {details}")


def test_a_stream_dropped_at_an_ack_does_not_keep_the_commit_lock(tmp_path: Path) -> None:
    """gRPC drops a cancelled stream's generator without closing it; the batch it was
    acknowledging must still release the commit lock at once, not when the garbage
    collector gets to the generator (a slave stalled for good after a map-full fault:
    every later stream waited for the lock, docs/chaos.md)."""

    async def scenario() -> None:
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), Store.open_memory())
        await node.start()
        try:
            await node.apply_role(_slave_of("n1", epoch=3, seq=1))
            requests: asyncio.Queue[replica_pb2.ReplicateRequest] = asyncio.Queue()

            async def incoming():  # type: ignore[no-untyped-def]
                while True:
                    yield await requests.get()

            servicer = Replication(node)
            stream = servicer.Replicate(incoming(), _Context())  # type: ignore[arg-type]
            hello = replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c")
            requests.put_nowait(replica_pb2.ReplicateRequest(hello=hello))
            assert (await stream.__anext__()).HasField("position")
            batch = replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3)], commit_lsn=0)
            requests.put_nowait(replica_pb2.ReplicateRequest(entries=batch))
            assert (await stream.__anext__()).ack.written_lsn == 1
            # The stream is dropped here, its generator suspended at the ack (still
            # referenced, as a cycle would keep it). The next stream must get through.
            _, position = await asyncio.wait_for(node.replication_hello(hello), 5)
            assert position.last_lsn == 1
            del stream
        finally:
            await node.stop()

    asyncio.run(scenario())


class _StuckDiskKV(MemoryKV):
    """An in-memory KV whose write commits and flushes hang until `disk_back` is set."""

    def __init__(self) -> None:
        super().__init__(DATABASES)
        self.disk_back = threading.Event()
        self.flushing = threading.Event()

    @contextmanager
    def write(self, *, sync: bool) -> Iterator[Any]:
        # Before the transaction: the memory twin's readers wait for its writer (LMDB's
        # do not), and the replica must still answer while its disk hangs.
        self._hang()
        with super().write(sync=sync) as txn:
            yield txn

    def sync(self) -> None:
        self._hang()
        super().sync()

    def _hang(self) -> None:
        self.flushing.set()
        assert self.disk_back.wait(30), "the test never gave the disk back"


def test_a_replica_reports_how_long_its_oldest_store_write_has_hung_on_its_clock(
    tmp_path: Path,
) -> None:
    """A stuck disk: the replica's answer to its coordinator says how long the store's
    oldest write has run (read on the injected clock), and 0 once writes complete."""

    async def scenario() -> None:
        config = example_config(tmp_path)
        clock = ManualClock()
        kv = _StuckDiskKV()
        store = Store(kv)
        node = build_replica_node(config, config.node("n2"), store, clock)
        control = ReplicaControl(node)
        request = replica_pb2.GetReplicaStateRequest()
        state = await control.GetReplicaState(request, _Context())  # type: ignore[arg-type]
        assert state.store_stalled_ms == 0
        flush = threading.Thread(target=store.sync, name="stuck-flush")
        flush.start()
        try:
            assert await asyncio.to_thread(kv.flushing.wait, 10)
            clock.advance(1200)
            commit = threading.Thread(target=store.record_commit, args=(0,), name="commit")
            commit.start()
            clock.advance(1800)
            # The oldest write in progress counts: the flush, stuck for 3000 ms.
            state = await control.GetReplicaState(request, _Context())  # type: ignore[arg-type]
            assert state.store_stalled_ms == 3000
        finally:
            kv.disk_back.set()
            await asyncio.to_thread(flush.join, 10)
            await asyncio.to_thread(commit.join, 10)
        assert not flush.is_alive() and not commit.is_alive()
        state = await control.GetReplicaState(request, _Context())  # type: ignore[arg-type]
        assert state.store_stalled_ms == 0

    asyncio.run(scenario())


class _FlushFailingStore(Store):
    """An in-memory store whose flushes fail once `broken` is set; each flush records
    what the master's replication core had counted when it began."""

    broken = False
    node: ReplicaNode | None = None
    seen: list[tuple[int, int]] = []

    def sync(self) -> None:
        driver = self.node.state.master if self.node is not None else None
        if driver is not None:
            self.seen.append((driver.core.last_lsn, driver.core.commit_lsn))
        if self.broken:
            raise StoreWriteError("I/O error (simulated failing flush)")
        super().sync()


def test_a_master_flush_failing_after_sending_deposes_it_and_fail_stops(tmp_path: Path) -> None:
    """Under SYNC the master hands its written batch to replication before the flush: the
    flush runs with the entry counted as written but not committed; when it fails, the
    publish is indeterminate (UNKNOWN), the master gives up its role and fail-stops."""

    async def scenario() -> None:
        from squall_server.replica import commands

        config = example_config(tmp_path)
        assert config.durability.master_sync == common_pb2.SYNC_POLICY_SYNC
        store = _FlushFailingStore.open_memory()
        assert isinstance(store, _FlushFailingStore)
        store.seen = []
        node = build_replica_node(config, config.node("n2"), store)
        store.node = node
        await node.start()
        try:
            await node.apply_role(
                replica_pb2.RoleCommand(
                    role=common_pb2.ROLE_MASTER,
                    epoch=4,
                    master=common_pb2.NodeEndpoint(node_id="n2"),
                    members=[common_pb2.NodeEndpoint(node_id="n2")],
                    seq=1,
                    lease_ms=60_000,
                    cluster_id="c-test",
                )
            )
            assert node.role == common_pb2.ROLE_MASTER
            await node.write(commands.CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
            last = node.last_lsn
            store.seen.clear()
            store.broken = True
            with pytest.raises(ServiceError) as raised:
                await asyncio.wait_for(
                    node.start_publish(
                        broker_pb2.PublishRequest(
                            topic="t",
                            publisher_id="p",
                            events=[common_pb2.EventData(payload=b"x", sequence=1)],
                        )
                    ),
                    10,
                )
            # The flush began with the entry appended (sent) and not committed.
            assert store.seen and store.seen[0][0] == last + 1 and store.seen[0][1] <= last
            assert raised.value.code == Code.UNKNOWN
            assert "indeterminate" in raised.value.message
            assert "retry with the same publisher id" in raised.value.message
            assert node.role == common_pb2.ROLE_INACTIVE
            assert "store flush failed" in node.failed_reason
            with pytest.raises(ServiceError) as refused:
                node.start_publish(broker_pb2.PublishRequest(topic="t"))
            assert refused.value.code == Code.UNAVAILABLE
        finally:
            await node.stop()

    asyncio.run(scenario())


async def _slave_of_n1_streaming(
    node: ReplicaNode,
) -> tuple[
    asyncio.Queue[replica_pb2.ReplicateRequest], AsyncIterator[replica_pb2.ReplicateResponse]
]:
    """The node as n1's slave in epoch 3 with n1's stream open (its Position answered):
    the queue feeds the stream, the iterator yields the slave's answers."""
    await node.apply_role(_slave_of("n1", epoch=3, seq=1))
    requests: asyncio.Queue[replica_pb2.ReplicateRequest] = asyncio.Queue()

    async def incoming():  # type: ignore[no-untyped-def]
        while True:
            yield await requests.get()

    stream = Replication(node).Replicate(incoming(), _Context())  # type: ignore[arg-type]
    hello = replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c")
    requests.put_nowait(replica_pb2.ReplicateRequest(hello=hello))
    assert (await stream.__anext__()).HasField("position")
    return requests, stream


def test_a_slaves_acks_say_whether_following_readers_are_open_there(tmp_path: Path) -> None:
    """The master tells a slave each commit at once only while its acks say it serves
    following readers: the first such reader sets the flag, the last one leaving clears
    it, and the acks in between keep saying it."""

    async def scenario() -> None:
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), Store.open_memory())
        await node.start()
        try:
            requests, stream = await _slave_of_n1_streaming(node)
            batch = replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3)], commit_lsn=0)
            requests.put_nowait(replica_pb2.ReplicateRequest(entries=batch))
            assert not (await stream.__anext__()).ack.readers_following

            async def heartbeat_ack() -> replica_pb2.ReplicationAck:
                beat = replica_pb2.ReplicationHeartbeat(epoch=3, commit_lsn=1)
                requests.put_nowait(replica_pb2.ReplicateRequest(heartbeat=beat))
                return (await stream.__anext__()).ack

            assert not (await heartbeat_ack()).readers_following  # topic t1 now committed

            async def follow() -> None:
                request = broker_pb2.SubscribeRequest(
                    topic="t1", follow=True, start=broker_pb2.START_POSITION_EARLIEST
                )
                async for _ in Subscriber(node).Subscribe(request, _Context()):  # type: ignore[arg-type]
                    pass

            async def readers_open(count: int) -> None:
                for _ in range(500):  # bounded: a reader opens within a few loop turns
                    if node.driver.following_readers == count:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"{node.driver.following_readers} readers, not {count}")

            first = asyncio.create_task(follow())
            await readers_open(1)
            assert (await heartbeat_ack()).readers_following  # 0 -> 1
            second = asyncio.create_task(follow())
            await readers_open(2)
            first.cancel()
            await readers_open(1)
            assert (await heartbeat_ack()).readers_following  # one still follows
            second.cancel()
            await readers_open(0)
            assert not (await heartbeat_ack()).readers_following  # 1 -> 0
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_a_replica_that_is_not_the_master_answers_an_offset_beyond_its_end_unavailable(
    tmp_path: Path,
) -> None:
    """A reader resuming at its next offset after a failover may reach a node that has not
    yet fetched the log it is to lead with (the gateway follows the coordinators' view), or
    a slave behind its master: its offset is good, so the answer is UNAVAILABLE (retry),
    not INVALID_ARGUMENT, which ended the reader's subscription (seen in CI: a follower
    in tests/integration/test_aio_client.py stopped after a master kill)."""

    class Aborted(Exception):
        pass

    class Context:
        code: object = None
        details = ""

        async def abort(self, code: object, details: str) -> None:
            self.code, self.details = code, details
            raise Aborted

    async def scenario() -> None:
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), Store.open_memory())
        await node.start()
        try:
            assert node.role == common_pb2.ROLE_INACTIVE
            requests, stream = await _slave_of_n1_streaming(node)
            batch = replica_pb2.EntryBatch(epoch=3, entries=[_entry(1, 3)], commit_lsn=1)
            requests.put_nowait(replica_pb2.ReplicateRequest(entries=batch))
            await stream.__anext__()  # topic t1 is here, empty: its next offset is 0
            context = Context()
            request = broker_pb2.SubscribeRequest(
                topic="t1", follow=True, start=broker_pb2.START_POSITION_OFFSET, offset=230
            )
            with pytest.raises(Aborted):
                async for _ in Subscriber(node).Subscribe(request, context):  # type: ignore[arg-type]
                    pass
            assert context.code == grpc.StatusCode.UNAVAILABLE, context.code
            assert "not the master: it may be behind" in context.details
        finally:
            await node.stop()

    asyncio.run(scenario())
