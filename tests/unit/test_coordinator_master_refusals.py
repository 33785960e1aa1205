"""A replica that keeps refusing the master role must not keep its node leading, nor one
that keeps refusing the slave role its group re-forming.

Three shipped ``CoordinatorDriver``s on one manual clock, an instant network and replica
twins that take every role command, except node 1's (the highest priority), which refuses
the master role (FAILED_PRECONDITION: say storing the log fetched from its sync source fails
with a StoreError). Without a limit node 1 recovers, leads again and names its own replica
master again, for ever, while nodes 2 and 3 could serve.

The same harness cuts a replica's links to the other replicas while the coordinators
still reach each other: a master that hears from no slave for too long steps aside too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.clock import ManualClock
from squall_server.coordinator.driver import (
    MASTER_REFUSAL_HOLDOFF_MS,
    MASTER_REFUSALS_MAX,
    SLAVE_REFUSAL_HOLDOFF_MS,
    SLAVE_REFUSALS_MAX,
    STEP_ASIDE_HOLDOFF_MAX_MS,
    STEP_ASIDE_HOLDOFF_MIN_MS,
    CoordinatorDriver,
    DriverTimings,
    Failure,
    MemoryStateStore,
    ReplicaAnswer,
    ReplicaFailure,
    RoleNext,
)
from squall_server.coordinator.election import ElectionConfig
from squall_server.coordinator.messages import (
    NodeState,
    PeerMessage,
    ReplicaReport,
    RoleCommand,
    RoleCommandKind,
    StepAside,
    StoreState,
)
from squall_server.coordinator.node import replica_answer, replica_failure
from tests.unit.test_coordinator_driver import _driver as one_node_driver
from tests.unit.test_coordinator_driver import _to_master as to_master

HEARTBEAT_MS = 100
STEP_MS = 10
PRIORITIES = {"1": 3, "2": 2, "3": 1}
REFUSAL = "storing the log fetched from 2 failed: StoreError: disk full"


@dataclass
class Twin:
    """A replica that takes every role (node 1's refuses MASTER while ``refuse_master``)."""

    refuse_master: bool = False
    # Refuses every FOLLOW role while set (frozen for a cluster shutdown that an
    # operator's interrupted command left behind, say).
    refuse_follow: str = ""
    # How it refuses: FAILED_PRECONDITION (say, storing the fetched log failed), or
    # RESOURCE_EXHAUSTED (its store is full: it cannot even persist the role).
    refusal_code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION
    role: RoleCommandKind = RoleCommandKind.DEACTIVATE
    epoch: int = 0
    seq: int = 0
    cluster_id: str = ""
    # Since when its links to the other replicas are cut (None: they are not); when it
    # last took the master role.
    cut_since_ms: int | None = None
    master_since_ms: int = 0
    # The log it reports (the newest log in a group is its sync source).
    last_lsn: int = 0
    node_id: str = ""

    def answer(self, command: RoleCommand) -> ReplicaAnswer | ReplicaFailure:
        if command.kind is RoleCommandKind.MASTER and self.refuse_master:
            # As node.py takes the status (RESOURCE_EXHAUSTED is no refusal there).
            return replica_failure(
                self.refusal_code,
                f"cannot take the master role in epoch {command.epoch}: {REFUSAL}",
            )
        if command.kind is RoleCommandKind.FOLLOW and self.refuse_follow:
            return replica_failure(grpc.StatusCode.FAILED_PRECONDITION, self.refuse_follow)
        source = command.sync_source_id
        if command.kind is RoleCommandKind.MASTER and self.cut_since_ms is not None:
            if source and source != self.node_id:
                # The reorganization fetch cannot connect (UNAVAILABLE reaches the
                # driver as no answer, node.py's replica_failure).
                return ReplicaFailure(
                    Failure.NO_ANSWER,
                    "UNAVAILABLE",
                    f"cannot take the master role in epoch {command.epoch}: fetching the "
                    f"log from sync source {source} failed: connect: Invalid argument",
                )
        self.role, self.epoch, self.seq = command.kind, command.epoch, command.seq
        self.cluster_id = self.cluster_id or command.cluster_id
        active = command.kind is not RoleCommandKind.DEACTIVATE
        report = ReplicaReport(
            cluster_id=self.cluster_id,
            last_epoch=1 if self.last_lsn else 0,
            last_lsn=self.last_lsn,
            store_state=StoreState.DIRTY if self.cluster_id else StoreState.EMPTY,
            active=active,
            command_seq=command.seq,
            joined=bool(self.cluster_id),
        )
        return ReplicaAnswer(report=report)


class Cluster:
    """Three drivers; ``run`` steps them STEP_MS at a time and records who is master."""

    def __init__(self, *, every_member_acks: bool = False) -> None:
        self.every_member_acks = every_member_acks
        self.clock = ManualClock()
        self.queue: list[PeerMessage] = []
        self.twins = {node: Twin(node_id=node) for node in PRIORITIES}
        # Nodes whose both processes are down: not ticked, their messages lost.
        self.down: set[str] = set()
        self.drivers = {node: self._driver(node) for node in PRIORITIES}
        # (time, node, epoch) each time a replica took the master role, or node 1's was
        # named master (its refusals).
        self.masters: list[tuple[int, str, int]] = []
        self.refusals: list[tuple[int, int]] = []
        # Lead-back hand-overs asked for (from, to): node.py's would first wait for the
        # target's replica to hold the whole log, which the twins always do.
        self.hand_overs: list[tuple[str, str]] = []

    def _driver(self, node: str) -> CoordinatorDriver:
        config = ElectionConfig(node_id=node, priorities=PRIORITIES)
        timings = DriverTimings(
            heartbeat_interval_ms=HEARTBEAT_MS,
            lease_ms=400,
            rpc_timeout_ms=1000,
            replica_timeout_ms=300,
            store_stall_timeout_ms=2000,
        )
        ids = iter(f"g{i}" for i in range(1, 10_000))
        return CoordinatorDriver(
            config,
            timings,
            self.clock,
            self,
            MemoryStateStore(),
            lambda: next(ids),
            lambda: "c1",
            hand_over=lambda target: self.hand_overs.append((node, target)),
            every_member_acks=self.every_member_acks,
        )

    def send(self, message: PeerMessage) -> None:
        self.queue.append(message)

    def _deliver(self) -> None:
        for _ in range(10_000):
            if not self.queue:
                return
            message = self.queue.pop(0)
            if message.to_node not in self.down and message.from_node not in self.down:
                self.drivers[message.to_node].deliver(message)
        raise AssertionError("message storm")

    def _role(self, node: str) -> None:
        driver, twin = self.drivers[node], self.twins[node]
        for _ in range(10):
            command = driver.role_wanted()
            if command is None:
                return
            before = (twin.role, twin.epoch)
            outcome = twin.answer(command)
            if isinstance(outcome, ReplicaAnswer) and twin.role is RoleCommandKind.MASTER:
                if before != (twin.role, twin.epoch):
                    twin.master_since_ms = self.clock.monotonic_ms()
                outcome = self._master_answer(twin, outcome.report)
            if isinstance(outcome, ReplicaFailure):
                self.refusals.append((self.clock.monotonic_ms(), command.epoch))
            elif command.kind is RoleCommandKind.MASTER and before != (twin.role, twin.epoch):
                self.masters.append((self.clock.monotonic_ms(), node, command.epoch))
            if driver.role_outcome(command, outcome) is not RoleNext.AGAIN:
                return
        raise AssertionError(f"node {node}: role loop does not settle")

    def _master_answer(self, master: Twin, report: ReplicaReport) -> ReplicaAnswer:
        """What a master replica answers: its streaming slaves' lags (a slave it cannot
        reach streams nothing), how long it has heard from none (majority of three: one
        slave would do), and each slave's silence, except a slave's cut off since before
        this master began: never reached, it is catching up, and node.py's
        ``replica_answer`` reports no silence for it."""
        followers = [
            (n, t)
            for n, t in self.twins.items()
            if t.role is RoleCommandKind.FOLLOW and t.epoch == master.epoch
        ]
        reached = [
            n for n, t in followers if t.cut_since_ms is None and master.cut_since_ms is None
        ]
        now = self.clock.monotonic_ms()
        silences = tuple(
            (n, 0 if n in reached else now - max(master.master_since_ms, t.cut_since_ms or 0))
            for n, t in followers
            if n in reached or (t.cut_since_ms or 0) > master.master_since_ms
        )
        silent = 0
        if not reached:
            cuts = [t.cut_since_ms for _, t in [("", master), *followers] if t.cut_since_ms]
            since = max([master.master_since_ms, *cuts])
            silent = now - since
        return ReplicaAnswer(
            report=report,
            slave_lags=tuple((n, 0) for n in reached),
            quorum_silent_ms=silent,
            slave_silences=silences,
        )

    def run(self, until_ms: int) -> None:
        while self.clock.monotonic_ms() < until_ms:
            self.clock.advance(STEP_MS)
            up = [node for node in PRIORITIES if node not in self.down]
            for node in up:
                self.drivers[node].tick()
                self._deliver()
            for node in up:
                self._role(node)
                self._deliver()
            while self.hand_overs:
                frm, target = self.hand_overs.pop(0)
                self.drivers[frm].transfer_leadership(target, "coordinator", "lead-back")
                self._deliver()

    def master_now(self) -> str | None:
        serving = [n for n, t in self.twins.items() if t.role is RoleCommandKind.MASTER]
        assert len(serving) <= 1, f"two masters: {serving}"
        return serving[0] if serving else None


def _formed_with_node_1_refusing(
    code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION,
) -> Cluster:
    """The cluster forms with node 1 master; then its replica starts refusing."""
    cluster = Cluster()
    cluster.run(2000)
    assert cluster.master_now() == "1"
    cluster.twins["1"].refuse_master = True
    cluster.twins["1"].refusal_code = code
    # Its current role is lost (a replica restart, say): node 1 recovers and re-leads.
    cluster.twins["1"].role = RoleCommandKind.DEACTIVATE
    cluster.drivers["1"].recover("replica restarted")
    return cluster


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED],
    ids=["refused", "store-full"],
)
def test_a_node_whose_replica_keeps_refusing_master_steps_aside_for_the_others(
    caplog: pytest.LogCaptureFixture, code: grpc.StatusCode
) -> None:
    """A store too full to persist the role (RESOURCE_EXHAUSTED) is a refusal too: no
    retry in the next seconds changes it (chaos seed 57 under acks group: a slave with
    a full store led once the master's coordinator died, and nothing was acknowledged
    for 3 s)."""
    cluster = _formed_with_node_1_refusing(code)
    start = cluster.clock.monotonic_ms()
    with caplog.at_level(logging.WARNING, logger="squall.coordinator"):
        cluster.run(start + 5000)
    # Node 1 was named master at most MASTER_REFUSALS_MAX times before it stepped aside.
    assert 1 <= len(cluster.refusals) <= MASTER_REFUSALS_MAX, cluster.refusals
    others = [(t, n, e) for t, n, e in cluster.masters if n != "1" and t > start]
    assert others, f"no other node became master; node 1 refused {len(cluster.refusals)} times"
    # ...and within a bound: a few re-formations, each well under a second.
    assert others[0][0] - start < 3000
    assert cluster.master_now() in ("2", "3")
    # One warning names the node, the count, the last reason and the hold-off.
    warnings = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "coordinator 1" in warnings[0] and f"{MASTER_REFUSALS_MAX} " in warnings[0]
    assert "disk full" in warnings[0] and f"{MASTER_REFUSAL_HOLDOFF_MS} ms" in warnings[0]
    status = cluster.drivers["1"].election.status()
    assert status.lead_held_off_until_ms is not None
    assert "disk full" in status.lead_held_off_reason


def test_after_the_hold_off_the_node_may_lead_again_and_a_refusing_one_steps_aside_again() -> None:
    cluster = _formed_with_node_1_refusing()
    cluster.run(cluster.clock.monotonic_ms() + 3000)
    assert cluster.master_now() in ("2", "3")
    refusals = len(cluster.refusals)
    # Held off, node 1 is in no group: nobody hands the lead back to it.
    cluster.run(cluster.clock.monotonic_ms() + MASTER_REFUSAL_HOLDOFF_MS - 3500)
    assert cluster.master_now() in ("2", "3") and len(cluster.refusals) == refusals
    assert cluster.twins["1"].role is RoleCommandKind.DEACTIVATE
    # After the hold-off it rejoins (as a slave, to catch up) and the lead-back hands the
    # group to it: refused once more, it steps aside again at once, not after three.
    cluster.run(cluster.clock.monotonic_ms() + 2000)
    assert len(cluster.refusals) == refusals + 1
    assert cluster.master_now() in ("2", "3")
    assert cluster.drivers["1"].election.status().lead_held_off_until_ms is not None
    # Once its replica takes the role, the highest priority leads again, for good.
    cluster.twins["1"].refuse_master = False  # an operator freed the disk
    cluster.run(cluster.clock.monotonic_ms() + MASTER_REFUSAL_HOLDOFF_MS + 3000)
    assert cluster.master_now() == "1"
    assert cluster.drivers["1"].master_refusals == 0
    assert cluster.drivers["1"].election.status().lead_held_off_until_ms is None


def test_an_unanswered_call_does_not_count_and_a_master_role_taken_resets_the_count() -> None:
    clock, store = ManualClock(), MemoryStateStore()
    driver = one_node_driver(clock, store)
    refused = ReplicaFailure(Failure.REFUSED, "FAILED_PRECONDITION", "StoreError: disk full")
    # UNAVAILABLE (the sync source unreachable) reaches the driver as no answer.
    unreachable = ReplicaFailure(Failure.NO_ANSWER, "UNAVAILABLE", "sync source 2 unreachable")

    def master() -> RoleCommand:
        to_master(driver, clock)
        command = driver.role_wanted()
        assert command is not None and command.kind is RoleCommandKind.MASTER
        return command

    for _ in range(MASTER_REFUSALS_MAX - 1):
        driver.role_outcome(master(), refused)
    command = master()
    for _ in range(5):
        assert driver.role_outcome(command, unreachable) is RoleNext.WAIT
    assert driver.master_refusals == MASTER_REFUSALS_MAX - 1
    # Still syncing is neither a refusal nor the role taken.
    syncing = ReplicaAnswer(report=_report(active=False), syncing="fetching log")
    driver.role_outcome(command, syncing)
    assert driver.master_refusals == MASTER_REFUSALS_MAX - 1
    driver.role_outcome(command, ReplicaAnswer(report=_report(active=True)))
    assert driver.master_refusals == 0
    for _ in range(MASTER_REFUSALS_MAX - 1):
        driver.role_outcome(master(), refused)
    assert driver.election.status().lead_held_off_until_ms is None
    driver.role_outcome(master(), refused)
    status = driver.election.status()
    assert status.lead_held_off_until_ms == clock.wall_ms() + MASTER_REFUSAL_HOLDOFF_MS
    assert "disk full" in status.last_change_reason


FROZEN = "replica 3 takes no new role: it is stopping for cluster shutdown op-1"


def _formed_with_node_3_refusing_follow() -> Cluster:
    """The cluster forms with node 1 master; then node 3's replica restarts into a state
    where it refuses the slave role (frozen for a cluster shutdown left unfinished)."""
    cluster = Cluster()
    cluster.run(2000)
    assert cluster.master_now() == "1"
    cluster.twins["3"].refuse_follow = FROZEN
    cluster.twins["3"].role = RoleCommandKind.DEACTIVATE
    cluster.drivers["3"].recover("replica restarted")
    return cluster


def test_a_node_whose_replica_keeps_refusing_the_slave_role_steps_aside_from_its_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a limit nodes 1 and 2, which could serve all along, re-formed their group
    for node 3 every 50 ms: each time a new epoch, node 1 deposed and its writes in
    flight indeterminate (179 refusals in 9 s before this limit)."""
    cluster = _formed_with_node_3_refusing_follow()
    start = cluster.clock.monotonic_ms()
    with caplog.at_level(logging.WARNING, logger="squall.coordinator"):
        cluster.run(start + SLAVE_REFUSAL_HOLDOFF_MS - 1000)
    assert len(cluster.refusals) == SLAVE_REFUSALS_MAX, cluster.refusals
    reformed = [(t, n, e) for t, n, e in cluster.masters if t > start]
    assert len(reformed) <= SLAVE_REFUSALS_MAX, reformed
    assert {n for _, n, _ in reformed} <= {"1"} and cluster.master_now() == "1"
    assert cluster.twins["2"].role is RoleCommandKind.FOLLOW
    warnings = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "coordinator 3" in warnings[0] and "slave role 3 times in a row" in warnings[0]
    assert FROZEN in warnings[0] and f"{SLAVE_REFUSAL_HOLDOFF_MS} ms" in warnings[0]
    status = cluster.drivers["3"].election.status()
    assert status.lead_held_off_until_ms is not None
    assert "refused the slave role" in status.lead_held_off_reason


def test_a_node_refusing_the_slave_role_again_after_its_hold_off_steps_aside_at_once() -> None:
    cluster = _formed_with_node_3_refusing_follow()
    cluster.run(cluster.clock.monotonic_ms() + SLAVE_REFUSAL_HOLDOFF_MS + 2000)
    # Back after the hold-off, refused once more: out again at once, not after three.
    assert len(cluster.refusals) == SLAVE_REFUSALS_MAX + 1, cluster.refusals
    assert cluster.drivers["3"].election.status().lead_held_off_until_ms is not None
    assert cluster.master_now() == "1"
    # The freeze lapses: after the hold-off node 3 rejoins as a slave, the count reset.
    cluster.twins["3"].refuse_follow = ""
    cluster.run(cluster.clock.monotonic_ms() + SLAVE_REFUSAL_HOLDOFF_MS + 3000)
    assert cluster.twins["3"].role is RoleCommandKind.FOLLOW
    assert cluster.drivers["3"].slave_refusals == 0
    assert cluster.drivers["3"].election.status().lead_held_off_until_ms is None
    assert cluster.master_now() == "1"


def _report(active: bool) -> ReplicaReport:
    return ReplicaReport(
        cluster_id="cluster-a",
        last_epoch=0,
        last_lsn=0,
        store_state=StoreState.DIRTY,
        active=active,
        command_seq=0,
        joined=True,
    )


def test_a_master_whose_replica_is_cut_off_from_the_others_steps_aside_until_it_heals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Node 1's replica loses its links to the other replicas while the coordinators still
    reach each other: nothing commits and only that replica knows. Its node steps aside
    once the silence passes the bound, the others elect a master, and node 1, back after
    the hold-off, does not take the lead while the cut lasts (nobody reports it caught
    up); healed, it catches up and leads again."""
    cluster = Cluster()
    cluster.run(2000)
    assert cluster.master_now() == "1"
    driver = cluster.drivers["1"]
    start = cluster.clock.monotonic_ms()
    cluster.twins["1"].cut_since_ms = start
    with caplog.at_level(logging.WARNING, logger="squall.coordinator"):
        cluster.run(start + driver.quorum_lost_ms - STEP_MS)
        assert cluster.master_now() == "1"  # not before the bound
        cluster.run(start + driver.quorum_lost_ms + 2000)
    assert cluster.master_now() in ("2", "3")
    others = [(t, n) for t, n, _ in cluster.masters if n != "1" and t > start]
    assert others and others[0][0] - start < driver.quorum_lost_ms + 1500, others
    warnings = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "coordinator 1" in warnings[0] and "heard from no majority" in warnings[0]
    assert f"{STEP_ASIDE_HOLDOFF_MIN_MS} ms" in warnings[0]
    # Past the hold-off (1 s), the cut still there: node 1 is back in the group, behind
    # the new master's epoch, and stays a slave (nobody can report it caught up).
    status = driver.election.status()
    assert (status.state, status.coordinator_id != "1") == (NodeState.NORMAL, True), status
    cluster.run(cluster.clock.monotonic_ms() + STEP_ASIDE_HOLDOFF_MIN_MS + 5000)
    assert cluster.master_now() in ("2", "3")
    assert not [n for t, n, _ in cluster.masters if n == "1" and t > start]
    assert driver.election.status().lead_held_off_until_ms is None
    # Healed: it catches up (its lag is reported) and the lead-back hands it the group.
    cluster.twins["1"].cut_since_ms = None
    cluster.run(cluster.clock.monotonic_ms() + 5000)
    assert cluster.master_now() == "1"


def test_a_master_that_hears_from_a_majority_never_steps_aside() -> None:
    """One slave's replica cut off alone: the master commits with the other and keeps
    its role; the cut slave is a member that catches up once healed."""
    cluster = Cluster()
    cluster.run(2000)
    assert cluster.master_now() == "1"
    start = cluster.clock.monotonic_ms()
    cluster.twins["3"].cut_since_ms = start
    cluster.run(start + 3 * (MASTER_REFUSAL_HOLDOFF_MS))
    assert cluster.master_now() == "1"
    assert [n for t, n, _ in cluster.masters if t > start] == []
    assert cluster.drivers["1"].election.status().lead_held_off_until_ms is None


def test_a_leader_whose_replica_cannot_reach_its_sync_source_steps_aside_for_one_that_can() -> None:
    """Node 2's replica is cut off from the others while it is a slave (the master commits
    with node 3). Then the master's node goes down: nodes 2 and 3 form a group that node 2
    leads, and its replica must first fetch node 3's newer log, which it cannot reach. It
    fails the master role every renewal; past the bound node 2 steps aside, and once node 1
    is back, 1 and 3 serve while the cut lasts."""
    cluster = Cluster()
    cluster.run(2000)
    assert cluster.master_now() == "1"
    start = cluster.clock.monotonic_ms()
    cluster.twins["2"].cut_since_ms = start
    cluster.twins["3"].last_lsn = cluster.twins["1"].last_lsn = 10  # what 2 never got
    cluster.down.add("1")
    cluster.twins["1"].role = RoleCommandKind.DEACTIVATE  # killed: its replica restarts
    driver = cluster.drivers["2"]
    # The bound: long enough for a failed sync source to have been taken out of the group
    # (a new epoch), far shorter than the cut-off master's (quorum_lost_ms, which waits
    # for a slave's stuck disk too): 700 ms against 2,400 with these timeouts.
    bound_ms = driver.master_failing_ms_max(start)
    assert bound_ms == 300 + 400 < driver.quorum_lost_ms
    for _ in range(1000):  # bounded: node 2 leads within a few member timeouts
        if cluster.refusals:
            break
        cluster.run(cluster.clock.monotonic_ms() + STEP_MS)
    assert cluster.refusals, "node 2 never led the group: the scenario did not happen"
    first_failure_ms = cluster.refusals[0][0]
    cluster.run(first_failure_ms + bound_ms - STEP_MS)
    assert driver.election.status().lead_held_off_until_ms is None  # not before the bound
    cluster.run(first_failure_ms + bound_ms + HEARTBEAT_MS + STEP_MS)
    status = driver.election.status()
    assert status.lead_held_off_until_ms is not None, "not stepped aside a renewal past the bound"
    assert "failed to take the master role" in status.lead_held_off_reason
    assert "sync source 3" in status.lead_held_off_reason
    # Node 1 comes back while node 2 is held off: 1 and 3 form a group and 1 serves.
    cluster.down.discard("1")
    cluster.drivers["1"].recover("restarted")
    back = cluster.clock.monotonic_ms()
    cluster.run(back + 3000)
    assert cluster.master_now() == "1"
    # Past the hold-off node 2 rejoins as a slave; it never leads while the cut lasts.
    cluster.run(back + STEP_ASIDE_HOLDOFF_MAX_MS)
    assert cluster.master_now() == "1"
    assert not [n for t, n, _ in cluster.masters if n == "2" and t > start]


def test_under_acks_group_a_member_whose_replica_the_master_cannot_hear_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """acks "group": every commit waits for every member that has caught up. Node 2's
    replica is cut off from the others while the coordinators reach each other: the
    master (node 1) hears node 3, so it is not the one cut off and stays; past the bound
    its coordinator drops node 2 and tells it to step aside, and the group commits
    without it. Back after a short hold-off with the cut still there, node 2 is catching
    up, holds nothing back and stays. Healed and then cut again soon (a link that comes
    and goes), it is dropped again and stays out twice as long."""
    cluster = Cluster(every_member_acks=True)
    cluster.run(2000)
    assert cluster.master_now() == "1"
    master, member = cluster.drivers["1"], cluster.drivers["2"]
    start = cluster.clock.monotonic_ms()
    cluster.twins["2"].cut_since_ms = start
    with caplog.at_level(logging.WARNING, logger="squall.coordinator"):
        cluster.run(start + master.quorum_lost_ms - STEP_MS)
        assert "2" in master.election.status().members  # not before the bound
        cluster.run(start + master.quorum_lost_ms + 500)
    assert cluster.master_now() == "1"
    assert [n for t, n, _ in cluster.masters if t > start] == []  # no failover
    command = master.role_wanted()
    assert command is not None and command.kind is RoleCommandKind.MASTER
    assert command.members == ("1", "3")  # the master's replica commits without node 2
    status = member.election.status()
    assert status.lead_held_off_until_ms is not None
    assert "dropped it from" in status.lead_held_off_reason
    assert "has heard nothing from this node's replica" in status.lead_held_off_reason
    dropped = [r.getMessage() for r in caplog.records if "dropping member 2" in r.getMessage()]
    assert len(dropped) == 1, dropped
    held_off = status.lead_held_off_until_ms - cluster.clock.wall_ms()
    assert held_off <= STEP_ASIDE_HOLDOFF_MIN_MS
    # Past the hold-off node 2 rejoins with the cut still there: never reached by this
    # master, it is catching up and stays (before, each rejoin stalled writes for the
    # bound until it was dropped again).
    cluster.run(cluster.clock.monotonic_ms() + STEP_ASIDE_HOLDOFF_MIN_MS + 1000)
    assert set(master.election.status().members) == {"1", "2", "3"}
    cluster.run(cluster.clock.monotonic_ms() + 3 * master.quorum_lost_ms)
    assert cluster.master_now() == "1"
    assert set(master.election.status().members) == {"1", "2", "3"}
    assert member.election.status().lead_held_off_until_ms is None
    # Healed, it catches up; cut again soon after, it is dropped again, out twice as long.
    cluster.twins["2"].cut_since_ms = None
    cluster.run(cluster.clock.monotonic_ms() + 500)
    cluster.twins["2"].cut_since_ms = cluster.clock.monotonic_ms()
    cluster.run(cluster.clock.monotonic_ms() + master.quorum_lost_ms + 500)
    until = member.election.status().lead_held_off_until_ms
    assert until is not None and "2" not in master.election.status().members
    assert until - cluster.clock.wall_ms() > STEP_ASIDE_HOLDOFF_MIN_MS  # 2 s this time
    # Healed for good: back after the hold-off, it stays a member.
    cluster.twins["2"].cut_since_ms = None
    cluster.run(cluster.clock.monotonic_ms() + 4 * STEP_ASIDE_HOLDOFF_MIN_MS + 5000)
    assert cluster.master_now() == "1"
    assert set(master.election.status().members) == {"1", "2", "3"}
    assert member.election.status().lead_held_off_until_ms is None


def test_under_acks_majority_a_silent_member_is_kept() -> None:
    """Under `majority` the same cut holds nothing back: node 2 stays a member."""
    cluster = Cluster()
    cluster.run(2000)
    start = cluster.clock.monotonic_ms()
    cluster.twins["2"].cut_since_ms = start
    cluster.run(start + 3 * MASTER_REFUSAL_HOLDOFF_MS)
    assert cluster.master_now() == "1"
    assert set(cluster.drivers["1"].election.status().members) == {"1", "2", "3"}
    assert cluster.drivers["2"].election.status().lead_held_off_until_ms is None


def test_only_the_coordinator_drops_a_member_and_only_its_step_aside_counts() -> None:
    """A member's election ignores a drop it is asked to make, and a StepAside from
    anyone but its coordinator, or for another epoch; its coordinator's is acted on."""
    cluster = Cluster(every_member_acks=True)
    cluster.run(2000)
    member = cluster.drivers["2"].election
    status = member.status()
    now = cluster.clock.monotonic_ms()
    assert member.cut_off_member("3", 5000, 3000, now).messages == ()
    group, epoch = status.group_name, status.epoch

    def told(frm: str, body: StepAside) -> str:
        return member.step(PeerMessage(frm, "2", body), now).step_aside

    assert told("3", StepAside(group, epoch, 5000, 3000)) == ""  # not its coordinator
    assert told("1", StepAside(group, epoch - 1, 5000, 3000)) == ""  # an older epoch
    reason = told("1", StepAside(group, epoch, 5000, 3000))
    assert "coordinator 1 dropped it" in reason and "5000 ms (at most 3000)" in reason


def test_a_silent_member_still_catching_up_is_not_reported_for_dropping() -> None:
    """Under acks "group" a commit waits only for members that have caught up, so one
    still catching up (it rejoined behind, or its replica was never reached) holds
    nothing back: the master's answer reports no silence for it, and its coordinator
    keeps it in the group as under majority."""
    state = replica_pb2.ReplicaState(
        role=common_pb2.ROLE_MASTER,
        slaves=[
            common_pb2.SlaveProgress(node_id="n2", silent_ms=5_000, catching_up=True),
            common_pb2.SlaveProgress(node_id="n3", silent_ms=4_000),
        ],
    )
    answer = replica_answer(RoleCommand(RoleCommandKind.MASTER, epoch=3), state)
    assert answer.slave_silences == (("n3", 4_000),)
