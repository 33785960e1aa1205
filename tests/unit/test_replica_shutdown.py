"""The replica's side of the store lifecycle, on an in-memory store: the cluster id a role
command carries, the dirty mark and `joined`, and the freeze / finish / abort steps of a
clean cluster shutdown, including the refusals that change nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.common import freeze
from squall_server.common.clock import Clock, ManualClock
from squall_server.common.config import parse_config
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import shutdown
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.committed import gate_from_store
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store, StoreError, StoreMeta, StoreWriteError

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "c0ffee"


def _node(clock: Clock | None = None) -> ReplicaNode:
    config = parse_config((ROOT / "deploy" / "single.toml").read_text(), ROOT / "deploy" / "x")
    return build_replica_node(config, config.node("n1"), Store.open_memory(), clock)


def _run(
    body: Callable[[ReplicaNode, list[str]], Awaitable[None]], clock: Clock | None = None
) -> None:
    """Runs body against a started node (on `clock`, else the system's); `stops` records
    each on_shutdown call."""

    async def main() -> None:
        node = _node(clock)
        stops: list[str] = []
        node.on_shutdown = lambda: stops.append("stop")
        await node.start()
        try:
            await body(node, stops)
        finally:
            await node.stop()

    asyncio.run(main())


def _master(epoch: int, cluster_id: str = CLUSTER, seq: int = 1) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        role=common_pb2.ROLE_MASTER,
        epoch=epoch,
        master=common_pb2.NodeEndpoint(node_id="n1"),
        members=[common_pb2.NodeEndpoint(node_id="n1")],
        sync_source_id="n1",
        seq=seq,
        cluster_id=cluster_id,
    )


async def _finish(node: ReplicaNode, meta: StoreMeta, lsn: int | None = None) -> shutdown.Finished:
    """Finishes shutdown s1 at the point meta names (or at another LSN)."""
    return await shutdown.finish(
        node,
        "s1",
        lsn=meta.last_lsn if lsn is None else lsn,
        last_epoch=meta.last_epoch,
        cluster_id=CLUSTER,
        operator="t",
    )


async def _refused(call: Awaitable[object], code: Code, text: str) -> None:
    with pytest.raises(ServiceError) as caught:
        await call
    assert caught.value.code is code
    assert text in caught.value.message


def test_a_role_records_the_groups_cluster_id_marks_the_store_dirty_and_joins() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        assert not node.joined
        assert node.store.meta().state == common_pb2.STORE_STATE_EMPTY
        await node.apply_role(_master(1))
        meta = node.store.meta()
        assert (meta.cluster_id, meta.state) == (CLUSTER, common_pb2.STORE_STATE_DIRTY)
        assert node.joined and node.role == common_pb2.ROLE_MASTER

    _run(body)


def test_a_master_role_naming_no_cluster_id_for_a_store_without_one_is_refused() -> None:
    """Only the first group's coordinator mints a cluster id (services/common/ids.py): a
    replica never makes one up, so a first master cannot leave a second id behind."""

    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await _refused(
            node.apply_role(_master(1, cluster_id="")),
            Code.FAILED_PRECONDITION,
            "the master role of epoch 1 names no cluster id and this store holds none",
        )
        assert node.store.meta().cluster_id == ""
        assert node.role != common_pb2.ROLE_MASTER

    _run(body)


def test_a_role_for_another_cluster_is_refused_naming_both_ids_and_changes_nothing() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        node.store.set_cluster_id("ours")
        await _refused(
            node.apply_role(_master(1, cluster_id="theirs")),
            Code.FAILED_PRECONDITION,
            "store belongs to cluster ours, but the group of epoch 1 is cluster 'theirs'",
        )
        meta = node.store.meta()
        assert (meta.cluster_id, meta.state, meta.epoch) == (
            "ours",
            common_pb2.STORE_STATE_EMPTY,
            0,
        )
        assert not node.joined and node.role == common_pb2.ROLE_INACTIVE

    _run(body)


def test_finish_without_a_freeze_is_refused_and_changes_nothing() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await _refused(
            shutdown.finish(node, "s1", lsn=1, last_epoch=1, cluster_id=CLUSTER, operator="t"),
            Code.FAILED_PRECONDITION,
            "not frozen for cluster shutdown s1 (frozen for: none); nothing was changed",
        )
        assert node.role == common_pb2.ROLE_MASTER
        assert node.store.meta().state == common_pb2.STORE_STATE_DIRTY
        assert stops == []

    _run(body)


def test_a_malformed_shutdown_id_is_refused() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await _refused(
            shutdown.freeze(node, "no spaces", "t"), Code.INVALID_ARGUMENT, "shutdown id"
        )
        assert node.frozen_for == ""

    _run(body)


def test_a_frozen_replica_refuses_writes_and_new_roles_until_the_freeze_is_aborted() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await shutdown.freeze(node, "s1", "t")
        with pytest.raises(ServiceError) as caught:
            node.check_writable()
        assert caught.value.code is Code.UNAVAILABLE
        assert "stopping for cluster shutdown s1" in caught.value.message
        await _refused(node.apply_role(_master(1)), Code.FAILED_PRECONDITION, "takes no new role")
        await _refused(
            shutdown.freeze(node, "s2", "t"),
            Code.FAILED_PRECONDITION,
            "frozen for cluster shutdown s1, not s2",
        )
        shutdown.abort(node, "s1")
        await node.apply_role(_master(1))
        assert node.role == common_pb2.ROLE_MASTER

    _run(body)


async def _lease_watch_ticks(node: ReplicaNode, count: int) -> None:
    """Returns once the replica's lease watch has ticked its core `count` more times
    (bounded: it ticks every 50 ms), so a check after it sees what those ticks decided."""
    core = node.core
    tick = core.tick
    seen = 0

    def counting(now_ms: int) -> object:
        nonlocal seen
        seen += 1
        return tick(now_ms)

    setattr(core, "tick", counting)  # noqa: B010 (an instance attribute over the method)
    try:
        for _ in range(500):
            if seen >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the lease watch ticked {seen} times, not {count}, in 5 s")
    finally:
        delattr(core, "tick")


def test_a_freeze_nobody_finishes_lapses_after_its_hold_and_the_replica_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The operator's command was killed between its freeze and its finish: the master
    takes writes and roles again once the hold it asked for ran out, instead of refusing
    every write until someone restarts it."""

    clock = ManualClock()

    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t", hold_ms=200)
        clock.advance(150)
        await _lease_watch_ticks(node, 2)  # they see 150 of 200 ms: still frozen
        with pytest.raises(ServiceError, match="stopping for cluster shutdown s1"):
            node.check_writable()
        assert node.freeze_remaining_ms() == 50
        clock.advance(51)
        for _ in range(100):  # bounded: the lease watch ticks every 50 ms
            if not node.frozen_for:
                break
            await asyncio.sleep(0.05)
        assert node.frozen_for == "" and node.freeze_remaining_ms() == 0
        node.check_writable()
        assert node.role == common_pb2.ROLE_MASTER and stops == []
        # Its finish, late, changes nothing: the store stays dirty and the process runs.
        await _refused(_finish(node, node.store.meta()), Code.FAILED_PRECONDITION, "not frozen")
        assert node.store.meta().state == common_pb2.STORE_STATE_DIRTY and stops == []

    with caplog.at_level("WARNING", logger="squall.replica"):
        _run(body, clock)
    assert any(
        "freeze for cluster shutdown s1 lapsed" in r.getMessage() and "replica n1" in r.getMessage()
        for r in caplog.records
    )


def test_a_freeze_from_an_older_command_naming_no_hold_holds_two_minutes() -> None:
    """A `squall` of an older release sends no hold_ms (0): its freeze still lapses, after
    the default hold, rather than never."""
    clock = ManualClock()

    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t", hold_ms=0)
        assert node.freeze_remaining_ms() == freeze.FREEZE_HOLD_DEFAULT_MS == 120_000
        clock.advance(freeze.FREEZE_HOLD_DEFAULT_MS - 1)
        await _lease_watch_ticks(node, 2)  # they see 1 ms left: still frozen
        assert node.frozen_for == "s1" and node.freeze_remaining_ms() == 1
        clock.advance(2)
        for _ in range(100):  # bounded: the lease watch ticks every 50 ms
            if not node.frozen_for:
                break
            await asyncio.sleep(0.05)
        assert node.frozen_for == ""
        node.check_writable()

    _run(body, clock)


def test_a_freeze_asking_to_hold_beyond_an_hour_is_refused_and_changes_nothing() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await _refused(
            shutdown.freeze(node, "s1", "t", hold_ms=freeze.FREEZE_HOLD_MAX_MS + 1),
            Code.INVALID_ARGUMENT,
            "at most 3600 s",
        )
        assert node.frozen_for == ""
        node.check_writable()

    _run(body)


def test_finish_at_the_point_marks_clean_and_stops_the_process() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t")
        meta = node.store.meta()
        done = await _finish(node, meta)
        assert done.clean and done.reason == ""
        after = node.store.meta()
        assert (after.state, after.shutdown_id) == (common_pb2.STORE_STATE_CLEAN, "s1")
        assert node.role == common_pb2.ROLE_INACTIVE and stops == ["stop"]
        # Finished: no new role, no second freeze.
        await _refused(node.apply_role(_master(2, seq=2)), Code.FAILED_PRECONDITION, "no new role")
        await _refused(shutdown.freeze(node, "s1", "t"), Code.FAILED_PRECONDITION, "already")

    _run(body)


def test_finish_at_the_point_records_the_point_as_committed() -> None:
    """The master records its commit LSN with its next batch; the shutdown point has none,
    so without this a stopped clean store hid its last committed events from readers."""

    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t")
        meta = node.store.meta()
        node.store.set_commit_lsn(meta.last_lsn - 1)
        done = await _finish(node, meta)
        assert done.clean
        assert node.store.meta().commit_lsn == meta.last_lsn
        assert gate_from_store(node.store).commit_lsn == meta.last_lsn

    _run(body)


def test_finish_away_from_the_point_leaves_the_store_dirty_and_says_why() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t")
        meta = node.store.meta()
        done = await _finish(node, meta, lsn=meta.last_lsn + 5)
        assert not done.clean
        assert f"its log ends at epoch 1 LSN {meta.last_lsn}, not at the shutdown point" in (
            done.reason
        )
        assert node.store.meta().state == common_pb2.STORE_STATE_DIRTY
        assert stops == ["stop"]

    _run(body)


def test_finish_whose_clean_mark_fails_still_stops_the_process_and_says_why() -> None:
    """A disk that fails as the store is marked clean: the replica stops all the same (a
    frozen one left running would refuse every role of the restarted cluster) and the
    shutdown hears why the store is not clean."""

    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t")
        meta = node.store.meta()

        def failing_state(*_: object) -> None:
            raise StoreWriteError("write failed: injected disk failure: EIO")

        node.store.set_state = failing_state  # type: ignore[method-assign]
        done = await _finish(node, meta)
        assert not done.clean
        assert "marking the store clean failed: write failed: injected disk failure" in (
            done.reason
        )
        assert stops == ["stop"]
        assert node.role == common_pb2.ROLE_INACTIVE

    _run(body)


def test_finish_that_cannot_read_its_store_still_stops_the_process() -> None:
    async def body(node: ReplicaNode, stops: list[str]) -> None:
        await node.apply_role(_master(1))
        await shutdown.freeze(node, "s1", "t")
        meta = node.store.meta()

        def failing_meta() -> None:
            raise StoreError("read failed: injected disk failure: EIO")

        node.store.meta = failing_meta  # type: ignore[assignment,method-assign]
        done = await _finish(node, meta)
        assert not done.clean
        assert "reading the store failed: read failed: injected disk failure" in done.reason
        assert stops == ["stop"]

    _run(body)
