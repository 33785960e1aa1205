"""`squall cluster shutdown` interrupted before it stopped anything: every replica it froze
is thawed at once, each freeze asked to hold only for the command's time, and a replica
the command cannot reach is named with when its freeze lapses by itself. The calls are a
fake cluster whose slave never reaches the master's log end, so the command is still
waiting for the shutdown point when the operator presses Ctrl-C (the task is cancelled, as
``asyncio.run`` does on SIGINT)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from squall.v1 import common_pb2, coordinator_pb2, replica_pb2
from squall_server.cli.cluster_shutdown import CallFailed, ShutdownError, run_shutdown
from squall_server.common.clock import SystemClock
from squall_server.common.config import NodeConfig, parse_config

ROOT = Path(__file__).resolve().parents[2]


class _StuckCluster:
    """n1 master of epoch 4 at LSN 10; n2 and n3 slaves, n3 stuck at LSN 9."""

    def __init__(self, unreachable_after_freeze: frozenset[str] = frozenset()) -> None:
        self.frozen: dict[str, replica_pb2.FreezeForShutdownRequest] = {}
        self.thawed: list[str] = []
        self.stopped: list[str] = []
        self.unreachable_after_freeze = unreachable_after_freeze
        self.waiting = asyncio.Event()

    def _state(self, node_id: str) -> replica_pb2.ReplicaState:
        master = node_id == "n1"
        lsn = 9 if node_id == "n3" else 10
        return replica_pb2.ReplicaState(
            role=common_pb2.ROLE_MASTER if master else common_pb2.ROLE_SLAVE,
            epoch=4,
            last_epoch=4,
            last_lsn=lsn,
            commit_lsn=lsn,
            slaves=[common_pb2.SlaveProgress(node_id=n) for n in ("n2", "n3")] if master else [],
            frozen_for_shutdown_id=self.frozen[node_id].shutdown_id
            if node_id in self.frozen
            else "",
        )

    async def replica_state(self, node: NodeConfig) -> replica_pb2.ReplicaState:
        if self.frozen:
            self.waiting.set()  # polling for the point
        return self._state(node.id)

    async def coordinator_status(self, node: NodeConfig) -> coordinator_pb2.CoordinatorStatus:
        return coordinator_pb2.CoordinatorStatus(
            coordinator_id="n1", state=common_pb2.NODE_STATE_NORMAL, epoch=4
        )

    async def freeze(
        self, node: NodeConfig, request: replica_pb2.FreezeForShutdownRequest, timeout_s: float
    ) -> replica_pb2.ReplicaState:
        self.frozen[node.id] = request
        return self._state(node.id)

    async def thaw(self, node: NodeConfig, request: replica_pb2.AbortShutdownRequest) -> None:
        if node.id in self.unreachable_after_freeze:
            raise CallFailed("UNAVAILABLE: connection refused")
        self.thawed.append(node.id)

    async def stop_coordinator(
        self, node: NodeConfig, request: coordinator_pb2.CoordinatorShutdownRequest
    ) -> None:
        self.stopped.append(f"coordinator {node.id}")

    async def finish(
        self, node: NodeConfig, request: replica_pb2.FinishShutdownRequest
    ) -> replica_pb2.FinishShutdownResponse:
        self.stopped.append(f"replica {node.id}")
        return replica_pb2.FinishShutdownResponse(clean=True)

    async def answering(self, kind: str, node: NodeConfig) -> bool:
        return False


def _interrupted(calls: _StuckCluster) -> str:
    """Runs the command with a 30 s timeout, presses Ctrl-C while it waits for the point;
    returns the error it ended with."""
    config = parse_config((ROOT / "deploy" / "cluster.example.toml").read_text(), ROOT)

    async def main() -> str:
        command = asyncio.create_task(
            run_shutdown(
                calls,
                config.nodes,
                io.StringIO(),
                clock=SystemClock(),
                timeout_s=30.0,
                operator="alice",
                shutdown_id="s1",
            )
        )
        waiting = asyncio.create_task(calls.waiting.wait())
        await asyncio.wait([command, waiting], timeout=10.0, return_when="FIRST_COMPLETED")
        assert not command.done(), "the command ended before the interrupt"
        command.cancel()
        with pytest.raises(ShutdownError) as ended:
            await command
        return str(ended.value)

    return asyncio.run(main())


def test_an_interrupted_shutdown_thaws_every_replica_it_froze_and_stops_nothing() -> None:
    calls = _StuckCluster()
    message = _interrupted(calls)
    assert sorted(calls.frozen) == ["n1", "n2", "n3"]
    assert sorted(calls.thawed) == ["n1", "n2", "n3"]
    assert calls.stopped == []
    assert "abandoned: interrupted before any service was stopped" in message
    assert "every replica serves again, nothing was changed" in message
    # Each freeze holds for the command's timeout and the steps after it, not for good.
    assert {r.hold_ms for r in calls.frozen.values()} == {90_000}


def test_a_replica_the_interrupted_shutdown_cannot_thaw_is_named_with_when_it_lapses() -> None:
    calls = _StuckCluster(unreachable_after_freeze=frozenset({"n2"}))
    message = _interrupted(calls)
    assert sorted(calls.thawed) == ["n1", "n3"]
    assert "could not thaw n2 (UNAVAILABLE: connection refused)" in message
    assert "once its freeze lapses (90 s after it was frozen)" in message
    assert calls.stopped == []
