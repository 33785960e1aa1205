"""A busy replica keeps answering its coordinator (issue 14: one fate per node).

The coordinator takes its node out of the group when its replica does not answer for
``timeouts.replica_timeout_ms`` (300 ms), so the replica's event loop must never wait for
the disk: a role's flushed store writes (the epoch of every rejoin, the DIRTY mark, the
cluster id) and a truncation's rename flush run on the store thread. The store here is a
slow disk: each flushed write waits until a task on the event loop has run. Run on the
store thread, the loop runs that task at once; run on the loop, nothing can (the loop is
stuck in the write) until the write gives up waiting and records that it blocked the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.clock import SystemClock
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.loop_watch import watch_loop
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.store import Store, make_entry
from tests.example_config import example_config
from tests.unit.test_rebuild import _publish as publish_entry

CLUSTER = "c0ffee"
# How long a flushed write waits for the event loop to run before it records that it
# blocked it: generous for a loaded machine (the loop runs its task within milliseconds
# when it is free); spent only when the write does block the loop.
DISK_WAIT_S = 5.0
MAP_BYTES = 16 << 20


class _Disk:
    """The slow disk: a flush completes once a task on the event loop has run."""

    def __init__(self) -> None:
        self.flushed = threading.Event()
        self.blocked: list[str] = []  # flushed writes during which the loop could not run

    def flush(self, what: str) -> None:
        self.flushed.clear()
        if not self.flushed.wait(DISK_WAIT_S):
            self.blocked.append(what)

    async def run(self) -> None:
        """The event loop's side: lets each waiting flush complete (until cancelled)."""
        while True:
            await asyncio.sleep(0.005)
            self.flushed.set()


class _SlowDiskStore(Store):
    """An in-memory store whose flushed writes wait for the slow disk."""

    disk: _Disk

    def set_epoch(self, epoch: int) -> None:
        self.disk.flush(f"set_epoch({epoch})")
        super().set_epoch(epoch)

    def set_state(self, state: common_pb2.StoreState.ValueType, shutdown_id: str = "") -> None:
        self.disk.flush(f"set_state({state})")
        super().set_state(state, shutdown_id)

    def set_cluster_id(self, cluster_id: str) -> None:
        self.disk.flush("set_cluster_id")
        super().set_cluster_id(cluster_id)


def _role(
    role: common_pb2.Role.ValueType, epoch: int, master: str, seq: int
) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        role=role,
        epoch=epoch,
        master=common_pb2.NodeEndpoint(node_id=master),
        members=[common_pb2.NodeEndpoint(node_id="n2")] if master == "n2" else [],
        sync_source_id="n2" if master == "n2" else "",
        seq=seq,
        lease_ms=60_000,
        cluster_id=CLUSTER,
    )


def test_a_replica_taking_roles_on_a_slow_disk_keeps_its_event_loop_running(tmp_path: Path) -> None:
    """Following a master in a new epoch (a rejoin) and taking the master role each flush
    the store; the event loop runs throughout (it would answer health probes)."""

    async def scenario() -> None:
        disk = _Disk()
        store = _SlowDiskStore.open_memory()
        assert isinstance(store, _SlowDiskStore)
        store.disk = disk
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), store)
        await node.start()
        loop_side = asyncio.create_task(disk.run())
        try:
            await node.apply_role(_role(common_pb2.ROLE_SLAVE, 3, "n1", 1))
            assert node.role == common_pb2.ROLE_SLAVE and node.epoch == 3
            await node.apply_role(_role(common_pb2.ROLE_MASTER, 4, "n2", 2))
            assert node.role == common_pb2.ROLE_MASTER and node.epoch == 4
        finally:
            loop_side.cancel()
            await node.stop()
        meta = store.meta()
        assert (meta.epoch, meta.cluster_id, meta.state) == (
            4,
            CLUSTER,
            common_pb2.STORE_STATE_DIRTY,
        )
        assert disk.blocked == [], f"flushed writes run on the event loop: {disk.blocked}"

    asyncio.run(scenario())


class _SlowDiskTruncator(LmdbTruncator):
    """Truncates for real; its rename flush waits for the slow disk."""

    disk: _Disk

    def settle(self, staging: Path) -> None:
        self.disk.flush("truncation rename flush")
        super().settle(staging)


def test_a_replica_truncating_its_log_on_a_slow_disk_keeps_its_event_loop_running(
    tmp_path: Path,
) -> None:
    """A rejoining node truncates its deposed suffix (rebuilding its store from its log on
    the store thread); the flush that makes the new store durable runs there too."""

    async def scenario() -> None:
        disk = _Disk()
        store = Store.open_lmdb(tmp_path, MAP_BYTES)
        start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
        create = [
            replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name=f"t{i}"))
            for i in range(5)
        ]
        store.append(
            [make_entry(1, 1, start)] + [make_entry(2 + i, 1, op) for i, op in enumerate(create)],
            sync=True,
        )
        truncator = _SlowDiskTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=100)
        truncator.disk = disk
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), store, truncator=truncator)
        await node.start()
        loop_side = asyncio.create_task(disk.run())
        try:
            await node.truncation.truncate_after(3, "a test's deposed suffix")
            assert node.last_lsn == 3
            assert [t.name for t in node.store.list_topics()] == ["t0", "t1"]
        finally:
            loop_side.cancel()
            await node.stop()
            node.store.close()
        assert disk.blocked == [], f"flushed writes run on the event loop: {disk.blocked}"
        reopened = Store.open_lmdb(tmp_path, MAP_BYTES)  # the truncation is durable
        try:
            assert reopened.meta().last_lsn == 3
        finally:
            reopened.close()

    asyncio.run(scenario())


class _HeldReplayTruncator(LmdbTruncator):
    """Truncates for real; its first replay, after its first batch of entries, is held (as
    a long log's would be) until the truncation's role changes, or for REPLAY_HOLD_S at
    most."""

    started: threading.Event

    def stage(
        self, store: Store, keep_lsn: int, abandoned: Callable[[], bool] = lambda: False
    ) -> Path:
        asked = [0]

        def held() -> bool:
            asked[0] += 1
            if asked[0] == 2 and not self.started.is_set():
                self.started.set()
                deadline = time.monotonic() + REPLAY_HOLD_S
                while not abandoned() and time.monotonic() < deadline:
                    time.sleep(0.005)
            return abandoned()

        return super().stage(store, keep_lsn, held)


REPLAY_HOLD_S = 10.0


def test_a_slave_deactivated_while_truncating_gives_the_replay_up_and_resumes_it_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Chaos seed 87: a slave rebuilding its store to truncate a deposed suffix answered
    its coordinator's DEACTIVATE only once the replay had ended (1.9 s on 25,000 entries),
    and the group's re-formation, which waits for every member's stopped state, served
    nothing meanwhile. Now a dropped role makes the replay give up: the store is as it
    was (the suffix still there), no fault; asked again, it truncates, resuming the
    replay where it stopped (chaos seed 86: a slave whose replay was given up became the
    next master and replayed from LSN 1 again)."""

    async def scenario() -> None:
        store = Store.open_lmdb(tmp_path, MAP_BYTES)
        start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
        create = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name="t"))
        publishes = [publish_entry(3 + i, 1, i, b"event") for i in range(1500)]
        store.append([make_entry(1, 1, start), make_entry(2, 1, create), *publishes], sync=True)
        truncator = _HeldReplayTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=100)
        truncator.started = threading.Event()
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), store, truncator=truncator)
        await node.start()
        try:
            await node.apply_role(_role(common_pb2.ROLE_SLAVE, 3, "n1", 1))
            truncating = asyncio.create_task(
                node.truncation.truncate_after(1250, "a test's deposed suffix")
            )
            assert await asyncio.to_thread(truncator.started.wait, REPLAY_HOLD_S)
            await node.roles.deactivate("a test's coordinator merges a new group")
            with pytest.raises(ServiceError) as given_up:
                await truncating
            assert given_up.value.code is Code.UNAVAILABLE
            assert "abandoned: its role changed" in given_up.value.message
            assert node.role == common_pb2.ROLE_INACTIVE
            assert (node.failed_reason, node.fault) == ("", None)
            assert node.last_lsn == 1502 and node.store.meta().last_lsn == 1502
            assert truncator.resumes_from(node.store, 1250) == 1024  # the replay's first batch
            with caplog.at_level(logging.WARNING, logger="squall.replica"):
                await node.truncation.truncate_after(1250, "a test's deposed suffix")
            assert "resuming a replay given up after LSN 1024" in caplog.text
            assert node.last_lsn == 1250 and node.store.meta().last_lsn == 1250
            assert len(node.store.read_events("t", 0, 2000)) == 1248
            assert not (tmp_path / "truncate.staging").exists()
        finally:
            await node.stop()
            node.store.close()

    asyncio.run(scenario())


def test_a_stalled_event_loop_is_logged_with_how_long_it_was_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What an operator reads when a replica was too busy to answer: the stall's length
    beside replica_timeout_ms (loop_watch)."""

    async def scenario() -> None:
        watch = asyncio.create_task(watch_loop(SystemClock(), "n7", 300))
        await asyncio.sleep(0.1)  # the watch is asleep on the loop
        time.sleep(0.4)  # a synchronous call holding the loop (what must not happen)
        await asyncio.sleep(0.2)
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch

    with caplog.at_level(logging.WARNING, logger="squall.replica"):
        asyncio.run(scenario())
    held = [
        int(m.group(1))
        for r in caplog.records
        if (m := re.search(r"replica n7: event loop held for (\d+) ms", r.getMessage()))
    ]
    assert held and max(held) >= 300, caplog.text
    assert "[loop-stall-over-timeout]" in caplog.text


def test_a_truncation_whose_rebuilt_store_does_not_fit_is_refused_not_a_fault(
    tmp_path: Path,
) -> None:
    """A slave asked to truncate a deposed suffix while its store is full (the rebuilt copy
    meets LMDB's MDB_MAP_FULL) refuses with RESOURCE_EXHAUSTED and keeps its store as it
    was, as any write a full store refuses. Before, it fail-stopped and reported a fault,
    which quarantined its node until an operator cleared it (chaos seed 63: a map_full on a
    slave rejoining behind a new master, the cluster not normal 60 s later). With room
    again, the truncation is done."""

    async def scenario() -> None:
        store = Store.open_lmdb(tmp_path, MAP_BYTES)
        start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
        create = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name="t"))
        publishes = [publish_entry(3 + i, 1, i, bytes(8192)) for i in range(300)]
        store.append([make_entry(1, 1, start), make_entry(2, 1, create), *publishes], sync=True)
        # Committed, as after a group formed without a majority holding them: truncating
        # them is a loss, reported once however often the truncation is asked for.
        store.record_commit(302)
        # The kept prefix (~2 MB of events) cannot fit a 1 MiB map.
        truncator = LmdbTruncator(tmp_path, map_size_bytes=1 << 20, dedupe_window=100)
        config = example_config(tmp_path)
        node = build_replica_node(config, config.node("n2"), store, truncator=truncator)
        await node.start()
        try:
            with pytest.raises(ServiceError) as refused:
                await node.truncation.truncate_after(250, "a test's deposed suffix")
            assert refused.value.code is Code.RESOURCE_EXHAUSTED
            assert "store full" in refused.value.message
            assert (node.failed_reason, node.fault) == ("", None)
            assert node.last_lsn == 302 and node.store.meta().last_lsn == 302
            assert not (tmp_path / "truncate.staging").exists()
            assert len(node.truncation.losses) == 1
            truncator.map_size_bytes = MAP_BYTES  # room again
            await node.truncation.truncate_after(250, "a test's deposed suffix")
            assert node.last_lsn == 250
            assert len(node.truncation.losses) == 1, node.truncation.losses
            assert len(node.store.read_events("t", 0, 1000)) == 248
        finally:
            await node.stop()
            node.store.close()

    asyncio.run(scenario())
