"""The coordinator's synchronous driver (services/coordinator/driver.py) without gRPC or
asyncio: a one-node cluster on a manual clock, a recording transport and an in-memory
state store. What the asyncio shell and the simulator both rely on: a role command
reaches the role loop, a deactivated replica's answer becomes the report that lets the
group form, a refused role makes the driver recover with a fresh Election, and a quiet
replica is reported to the election and cleared when it answers.

The last tests are about stopping: a state the driver could not save is neither acted on
nor followed by anything (a full disk), and the asyncio node around it stops its process
when one of its loops dies, instead of answering calls while it no longer elects.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from pathlib import Path

import pytest

from squall.v1 import replica_pb2
from squall_server.common.clock import ManualClock
from squall_server.coordinator import codec
from squall_server.coordinator.driver import (
    CoordinatorDriver,
    DriverTimings,
    Failure,
    MemoryStateStore,
    ReplicaAnswer,
    ReplicaFailure,
    RoleNext,
    StateSaveError,
)
from squall_server.coordinator.election import ElectionConfig
from squall_server.coordinator.messages import (
    AreYouCoordinator,
    NodeState,
    PeerMessage,
    PersistedState,
    Ready,
    ReplicaReport,
    RoleCommandKind,
    StoreState,
)
from squall_server.coordinator.node import CoordinatorNode
from tests.observability_harness import cluster_config

HEARTBEAT_MS = 100


class Recorder:
    """A peer transport that keeps what it is given."""

    def __init__(self) -> None:
        self.sent: list[PeerMessage] = []

    def send(self, message: PeerMessage) -> None:
        self.sent.append(message)


def _driver(
    clock: ManualClock,
    store: MemoryStateStore,
    save_failed: Callable[[str], None] | None = None,
) -> CoordinatorDriver:
    config = ElectionConfig(
        node_id="1",
        priorities={"1": 1},
        heartbeat_interval_ms=HEARTBEAT_MS,
        member_timeout_ms=400,
        probe_interval_ms=200,
        merge_delay_ms_per_priority=50,
        replica_timeout_ms=300,
    )
    timings = DriverTimings(
        heartbeat_interval_ms=HEARTBEAT_MS,
        lease_ms=400,
        rpc_timeout_ms=1000,
        replica_timeout_ms=300,
        store_stall_timeout_ms=2000,
    )
    ids = iter(f"g{i}" for i in range(100))
    return CoordinatorDriver(
        config,
        timings,
        clock,
        Recorder(),
        store,
        lambda: next(ids),
        lambda: "cluster-a",
        save_failed=save_failed,
    )


def _answer(active: bool = False, lsn: int = 0) -> ReplicaAnswer:
    report = ReplicaReport(
        cluster_id="",
        last_epoch=0,
        last_lsn=lsn,
        store_state=StoreState.EMPTY,
        active=active,
        command_seq=0,
    )
    return ReplicaAnswer(report=report)


def _to_master(driver: CoordinatorDriver, clock: ManualClock) -> None:
    """Tick until the driver wants its replica deactivated, answer, and follow to MASTER."""
    for _ in range(20):
        driver.tick()
        command = driver.role_wanted()
        if command is not None and command.kind is RoleCommandKind.MASTER:
            return
        if command is not None:
            assert driver.role_outcome(command, _answer()) is RoleNext.WAIT
        clock.advance(HEARTBEAT_MS)
    raise AssertionError(f"no master role: {driver.election.status()}")


def test_a_deactivated_replica_s_answer_lets_a_one_node_group_form_and_persist() -> None:
    clock, store = ManualClock(), MemoryStateStore()
    driver = _driver(clock, store)
    _to_master(driver, clock)
    status = driver.election.status()
    assert status.state is NodeState.NORMAL and status.epoch == 1
    # The epoch was persisted before the master role was handed on, with the minted id.
    assert store.state.epoch == 1 and store.state.cluster_id == "cluster-a"


def test_a_refused_master_role_makes_the_driver_recover_with_a_fresh_election() -> None:
    clock, store = ManualClock(), MemoryStateStore()
    driver = _driver(clock, store)
    _to_master(driver, clock)
    before = driver.election
    command = driver.role_wanted()
    assert command is not None
    refused = ReplicaFailure(Failure.REFUSED, "FAILED_PRECONDITION", "epoch 1 already held")
    assert driver.role_outcome(command, refused) is RoleNext.AGAIN
    assert driver.election is not before
    assert driver.election.status().state is not NodeState.NORMAL
    assert driver.election.persisted.epoch == 1  # recovery keeps the persisted vote


def test_a_quiet_replica_is_reported_and_cleared_when_it_answers() -> None:
    clock, store = ManualClock(), MemoryStateStore()
    driver = _driver(clock, store)
    _to_master(driver, clock)
    command = driver.role_wanted()
    assert command is not None
    assert driver.role_outcome(command, _answer(active=True)) is RoleNext.WAIT
    assert not driver.watch()  # it just answered
    clock.advance(HEARTBEAT_MS * 2)
    no_answer = ReplicaFailure(Failure.NO_ANSWER, "DEADLINE_EXCEEDED", "no answer")
    assert driver.role_outcome(command, no_answer) is RoleNext.WAIT
    assert driver.watch()  # quiet: probe it, and the election knows since when
    assert driver.election.status().state is NodeState.NORMAL
    clock.advance(300)  # replica_timeout_ms after its last answer: the node leaves
    driver.tick()
    assert driver.election.status().replica_unreachable_since_ms is not None
    assert driver.election.status().state is not NodeState.NORMAL
    driver.replica_answered()
    assert driver.election.status().replica_unreachable_since_ms is None
    assert not driver.watch()


class _FullDisk(MemoryStateStore):
    """A state store on a disk with no room left: every save fails as the file's does."""

    def __init__(self) -> None:
        super().__init__()
        self.saves = 0

    def save(self, state: PersistedState) -> None:
        self.saves += 1
        raise OSError(errno.ENOSPC, "coordinator-state.json: No space left on device")


def test_a_state_that_cannot_be_saved_stops_the_driver_before_it_acts_on_it() -> None:
    clock, store = ManualClock(), _FullDisk()
    failed: list[str] = []
    driver = _driver(clock, store, failed.append)
    with pytest.raises(StateSaveError, match="No space left on device"):
        _to_master(driver, clock)
    # Told once; the epoch the election moved to was neither saved nor acted on.
    assert failed == [driver.failed] and "saving its state failed" in failed[0]
    assert store.state.epoch == 0
    command = driver.role_wanted()
    assert command is None or command.kind is not RoleCommandKind.MASTER
    # Nothing after it is carried out either, and the disk is not tried again.
    saves = store.saves
    with pytest.raises(StateSaveError):
        driver.tick()
    assert store.saves == saves and failed == [driver.failed]


# --- the asyncio node around the driver: a loop that dies stops the process


def test_a_coordinator_whose_loop_dies_fail_stops_instead_of_running_on(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, ["n1"])
    node_config = config.node("n1")
    node_config.data_dir.mkdir(parents=True)

    async def scenario() -> tuple[str, bool]:
        stopped = asyncio.Event()
        node = CoordinatorNode(
            config, node_config, on_shutdown=stopped.set, store=MemoryStateStore()
        )

        def broken() -> int:
            raise RuntimeError("a bug in a tick")

        node.driver.tick = broken  # type: ignore[method-assign]
        await node.start()
        try:
            await asyncio.wait_for(stopped.wait(), 10)
        finally:
            await node.stop()  # does not raise the loop's error again
        return node.failed, stopped.is_set()

    failed, stopped = asyncio.run(scenario())
    assert stopped, "the process was not told to stop"
    assert failed == "its tick loop ended: RuntimeError('a bug in a tick')"


class _StoppedReplica:
    """A replica link whose replica answers every role command as stopped."""

    async def set_role(self, command: object, reason: str) -> ReplicaAnswer:
        return _answer()

    async def check_health(self) -> bool:
        return True

    async def prepare_handoff(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no hand-over in this test")

    async def close(self) -> None:
        return None


def test_a_stopping_coordinator_goes_silent_before_its_server_drains(tmp_path: Path) -> None:
    """Chaos seed 87: a slave's coordinator asked to stop (SIGTERM) went on electing while
    its server drained calls for a second and took no answers: it lost its group, formed
    one of its own and probed the master's coordinator, which merged it back and waited
    member_timeout_ms for its accept, with no master meanwhile. Quiesced first, it answers
    nothing and sends nothing, as a killed node, which its group drops without waiting."""
    config = cluster_config(tmp_path, ["n1", "n2", "n3"])
    node_config = config.node("n3")
    node_config.data_dir.mkdir(parents=True)

    async def scenario() -> tuple[int, int, int, bool]:
        peers = Recorder()
        node = CoordinatorNode(
            config,
            node_config,
            peers=peers,
            replica=_StoppedReplica(),  # type: ignore[arg-type]
            store=MemoryStateStore(),
        )
        await node.start()
        try:
            probe = codec.to_proto(
                PeerMessage("n1", "n3", AreYouCoordinator("n1:g1", config.node("n1").priority))
            )
            before = len(peers.sent)
            assert node.deliver(probe) is None
            answered = len(peers.sent) - before
            node.quiesce()
            _, running = await asyncio.wait(node._tasks, timeout=5)
            loops_ended = not running
            quiet_from = len(peers.sent)
            node.deliver(probe)
            # Three probe intervals: a running election probes and answers in each.
            await asyncio.sleep(3 * config.timeouts.probe_interval_ms / 1000)
            return answered, quiet_from, len(peers.sent), loops_ended
        finally:
            await node.stop()

    answered, quiet_from, sent, loops_ended = asyncio.run(scenario())
    assert answered == 1, "a running coordinator answers a probe at once"
    assert sent == quiet_from, "a stopping coordinator sent messages"
    assert loops_ended


class _FencedReplica(_StoppedReplica):
    """A replica link that records the hand-over calls it is given."""

    def __init__(self) -> None:
        self.handoffs: list[replica_pb2.PrepareHandoffRequest] = []

    async def prepare_handoff(  # type: ignore[override]
        self, request: replica_pb2.PrepareHandoffRequest, timeout_s: float
    ) -> replica_pb2.PrepareHandoffResponse:
        self.handoffs.append(request)
        return replica_pb2.PrepareHandoffResponse()


def test_a_transfer_the_election_gives_up_lifts_the_replicas_write_fence(tmp_path: Path) -> None:
    """``Ready.transfer_dropped`` (the target left before taking over): the node asks its
    replica to lift the fence now (PrepareHandoff with cancel, for the node's epoch)."""
    config = cluster_config(tmp_path, ["n1", "n2", "n3"])
    node_config = config.node("n1")
    node_config.data_dir.mkdir(parents=True)
    replica = _FencedReplica()

    async def scenario() -> list[replica_pb2.PrepareHandoffRequest]:
        node = CoordinatorNode(
            config,
            node_config,
            peers=Recorder(),
            replica=replica,  # type: ignore[arg-type]
            store=MemoryStateStore(),
        )
        await node.start()
        try:
            node.apply(Ready(transfer_dropped="n2"))
            for _ in range(100):  # bounded: the lift runs in a task of its own
                if replica.handoffs:
                    break
                await asyncio.sleep(0.01)
            return list(replica.handoffs)
        finally:
            await node.stop()

    handoffs = asyncio.run(scenario())
    assert [(r.target_node_id, r.cancel) for r in handoffs] == [("n2", True)]
