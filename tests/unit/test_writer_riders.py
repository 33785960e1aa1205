"""Writes that ride with the next commit batch (``Writer.submit_with_next``).

A push subscriber's cursor is written after each lone delivery, and nobody waits on it to
answer anyone. Written alone it was an append and a replication round beside every
publish; riding, it shares the next commit batch's. Checked on a fresh one-node master
over the in-memory store, the shipped node and writer: a rider shares the next batch's
append (one store transaction: one fsync, one replication message); with nothing else
written it goes alone once its wait is over; it boards only as far as the batch bound
leaves room; a drain, or a leadership hand-over's fence, sends it at once (a fenced
master's log must stop growing, and no new write comes to carry it); and a rider not begun
when the role goes fails as not stored, never stored later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deploy.processes import free_ports
from squall.v1 import common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import commands, handoff
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.commands import Planned
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store

WAIT_S = 30.0  # generous: the machine is shared
# Longer than any test here runs: a rider given it goes only with another batch.
NEVER_ALONE_S = 600.0


def _config(tmp_path: Path) -> ClusterConfig:
    ports = iter(free_ports(3))
    text = (
        '[cluster]\nname = "t"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        f'coordinator_address = "127.0.0.1:{next(ports)}"\n'
        f'replica_address = "127.0.0.1:{next(ports)}"\ndata_dir = "n1"\n'
        f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
        "\n[limits]\ncommit_batch_max_entries = 4\n"
    )
    config = parse_config(text, tmp_path / "cluster.toml")
    config.node("n1").data_dir.mkdir(parents=True, exist_ok=True)
    return config


def role_command(role: int, epoch: int, seq: int) -> replica_pb2.RoleCommand:
    """Node n1's role command from its coordinator; as master, of a group of itself."""
    command = replica_pb2.RoleCommand(
        role=role, epoch=epoch, seq=seq, lease_ms=600_000, cluster_id="c-test"
    )
    if role == common_pb2.ROLE_MASTER:
        command.master.node_id = "n1"
        command.members.add(node_id="n1")
    return command


def _topic(name: str) -> commands.CreateTopic:
    return commands.CreateTopic(name, common_pb2.TOPIC_KIND_REPLICATED)


def _run(tmp_path: Path, scenario: Callable[[ReplicaNode, list[int]], Awaitable[None]]) -> None:
    """Runs scenario on a started one-node master; the list it gets holds the number of
    entries of each store append from then on."""

    async def main() -> None:
        config = _config(tmp_path)
        node = build_replica_node(config, config.node("n1"), Store.open_memory())
        await node.start()
        try:
            await node.apply_role(role_command(common_pb2.ROLE_MASTER, 1, 1))
            await node.write(_topic("a"))
            await asyncio.wait_for(scenario(node, counted_appends(node)), WAIT_S)
        finally:
            await node.stop()

    asyncio.run(main())


def counted_appends(node: ReplicaNode) -> list[int]:
    """The number of entries of each store append the node's master writes from now on
    (one append: one store transaction, one fsync, one replication message)."""
    appends: list[int] = []
    driver = node.writer.driver
    append = driver.store_append

    def counted(entries: Any, **kwargs: Any) -> None:
        appends.append(len(entries))
        append(entries, **kwargs)

    driver.store_append = counted  # type: ignore[method-assign]
    return appends


async def _turns(count: int = 20) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def _names(node: ReplicaNode) -> list[str]:
    return sorted(topic.name for topic in node.store.list_topics())


def test_a_rider_shares_the_next_commit_batch(tmp_path: Path) -> None:
    async def scenario(node: ReplicaNode, appends: list[int]) -> None:
        rider = node.writer.submit_with_next(_topic("rider"), NEVER_ALONE_S)
        await _turns()
        assert not rider.done() and appends == []  # it waits for a batch to ride with
        assert not node.writes_idle()
        await node.write(_topic("w"))
        ridden = await rider
        assert appends == [2]  # one append for both: one fsync, one replication message
        assert isinstance(ridden, Planned) and ridden.topic is not None
        assert ridden.topic.name == "rider"
        assert _names(node) == ["a", "rider", "w"]
        assert node.writes_idle()

    _run(tmp_path, scenario)


def test_a_rider_goes_alone_once_its_wait_is_over(tmp_path: Path) -> None:
    async def scenario(node: ReplicaNode, appends: list[int]) -> None:
        planned = await node.write_with_next(_topic("rider"), 0.01)
        assert planned.topic is not None and planned.topic.name == "rider"
        assert appends == [1]
        assert _names(node) == ["a", "rider"]

    _run(tmp_path, scenario)


def test_riders_board_only_as_far_as_the_batch_bound_and_a_drain_sends_the_rest(
    tmp_path: Path,
) -> None:
    async def scenario(node: ReplicaNode, appends: list[int]) -> None:
        riders = [node.writer.submit_with_next(_topic(f"r{i}"), NEVER_ALONE_S) for i in range(5)]
        await node.write(_topic("w"))
        await _turns()
        # commit_batch_max_entries = 4: the write and three riders; two still wait.
        assert appends == [4]
        assert [rider.done() for rider in riders] == [True, True, True, False, False]
        await node.drain_writes()
        assert all(rider.done() and rider.exception() is None for rider in riders)
        assert appends == [4, 2]
        assert _names(node) == ["a", "r0", "r1", "r2", "r3", "r4", "w"]

    _run(tmp_path, scenario)


def test_a_rider_not_begun_when_the_role_goes_fails_as_not_stored(tmp_path: Path) -> None:
    async def scenario(node: ReplicaNode, appends: list[int]) -> None:
        rider = node.writer.submit_with_next(_topic("rider"), 0.05)
        await node.apply_role(role_command(common_pb2.ROLE_INACTIVE, 0, 2))
        with pytest.raises(ServiceError) as failed:
            await rider
        assert failed.value.code == Code.UNAVAILABLE
        assert "not stored" in str(failed.value)
        await asyncio.sleep(0.1)  # past its wait: nothing goes out later
        assert appends == []
        assert _names(node) == ["a"]

    _run(tmp_path, scenario)


def test_a_rider_on_a_replica_that_is_not_master_is_refused_at_once(tmp_path: Path) -> None:
    async def scenario(node: ReplicaNode, appends: list[int]) -> None:
        await node.apply_role(role_command(common_pb2.ROLE_INACTIVE, 0, 2))
        with pytest.raises(ServiceError):
            await node.write_with_next(_topic("rider"), 0.01)
        assert appends == []

    _run(tmp_path, scenario)


def test_a_hand_over_fence_sends_riders_at_once(tmp_path: Path) -> None:
    async def scenario(node: ReplicaNode, appends: list[int]) -> None:
        # A slave n2 that holds whatever the master's log holds: the hand-over waits only
        # for the master's own writes to end.
        def slave_status() -> list[SimpleNamespace]:
            lsn = node.last_lsn
            progress = SimpleNamespace(
                node_id="n2", received_lsn=lsn, written_lsn=lsn, synced_lsn=lsn
            )
            return [SimpleNamespace(progress=progress)]

        node.slave_status = slave_status  # type: ignore[method-assign]
        rider = node.writer.submit_with_next(_topic("rider"), NEVER_ALONE_S)
        ready = await handoff.prepare(
            node,
            replica_pb2.PrepareHandoffRequest(epoch=1, target_node_id="n2", timeout_ms=10_000),
        )
        assert rider.done() and rider.exception() is None
        assert appends == [1]
        assert ready.last_lsn == ready.target_lsn == ready.commit_lsn == node.last_lsn

    _run(tmp_path, scenario)
