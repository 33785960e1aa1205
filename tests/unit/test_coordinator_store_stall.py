"""The coordinator's driver and a stuck disk (issue 14: 1): what a role answer's
``store_stalled_ms`` becomes as election input.

Goal: a stall past ``timeouts.store_stall_timeout_ms`` is reported once as a silent replica
(since the stall's start, marked as a stalled store) and takes the node out of its group;
a health probe's answer (which says nothing of the store) does not end it; an answer
whose store writes again does, and the node rejoins. A stall below the timeout (a slow
disk) changes nothing. The real driver and election decide; peer messages are recorded
instead of sent (no network, no asyncio).
"""

from __future__ import annotations

from dataclasses import replace

from squall_server.common.clock import ManualClock
from squall_server.coordinator.driver import (
    CoordinatorDriver,
    Failure,
    MemoryStateStore,
    ReplicaAnswer,
    ReplicaFailure,
)
from squall_server.coordinator.messages import Ready, ReplicaReport, RoleCommand, StoreState
from tests.unit.test_coordinator_driver import _driver, _to_master


def _stalled(ms: int) -> ReplicaAnswer:
    report = ReplicaReport(
        cluster_id="cluster-a",
        last_epoch=1,
        last_lsn=1,
        store_state=StoreState.DIRTY,
        active=True,
        command_seq=0,
    )
    return ReplicaAnswer(report=report, store_stalled_ms=ms)


def _recording(driver: CoordinatorDriver) -> list[Ready]:
    applied: list[Ready] = []
    apply = driver.apply

    def record(ready: Ready) -> None:
        applied.append(ready)
        apply(ready)

    driver.apply = record  # type: ignore[method-assign]
    return applied


def test_a_stalled_store_takes_the_node_out_until_an_answer_says_it_writes() -> None:
    clock, store = ManualClock(monotonic_start_ms=10_000), MemoryStateStore()
    driver = _driver(clock, store)
    _to_master(driver, clock)
    command = driver.role_wanted()
    assert command is not None
    applied = _recording(driver)

    def events() -> list[str]:
        return [e.event for r in applied for e in r.events]

    driver.role_outcome(command, _stalled(1999))  # a slow disk: nothing happens
    assert driver.election.status().replica_unreachable_since_ms is None
    assert "replica-store-stalled" not in events()

    driver.role_outcome(command, _stalled(2500))
    status = driver.election.status()
    assert status.replica_unreachable_since_ms is not None
    assert status.last_change_reason.startswith(
        "replica store stalled: no write completed for 2500 ms"
    )
    assert "replica-store-stalled" in events()
    reported = len(applied)

    clock.advance(500)
    driver.replica_answered()  # a health probe answers: the store still stalls
    driver.role_outcome(command, _stalled(3000))  # the same stall, longer: reported once
    assert len(applied) == reported
    assert driver.election.status().replica_unreachable_since_ms is not None

    clock.advance(500)
    driver.role_outcome(command, _stalled(0))  # writes complete again
    assert driver.election.status().replica_unreachable_since_ms is None
    assert "replica-back" in events()
    back = [e.message for r in applied for e in r.events if e.event == "replica-back"]
    assert "replica store writes complete again after 3500 ms stalled" in back[0]


def test_a_recovery_during_a_stall_tells_the_new_election_again() -> None:
    clock, store = ManualClock(monotonic_start_ms=10_000), MemoryStateStore()
    driver = _driver(clock, store)
    _to_master(driver, clock)
    command = driver.role_wanted()
    assert command is not None
    driver.role_outcome(command, _stalled(2500))
    assert driver.election.status().replica_unreachable_since_ms is not None
    driver.recover("a refused role, say")
    # The replica still answers (the watch stays quiet); the stall is not forgotten.
    assert driver.election.status().replica_unreachable_since_ms is not None


def _serving_master() -> tuple[ManualClock, CoordinatorDriver, RoleCommand]:
    clock, store = ManualClock(monotonic_start_ms=10_000), MemoryStateStore()
    driver = _driver(clock, store)
    _to_master(driver, clock)
    command = driver.role_wanted()
    assert command is not None
    return clock, driver, command


def _silent_for(driver: CoordinatorDriver, clock: ManualClock, ms: int) -> bool:
    """Lets ms pass with no answer, watched every 50 ms; whether the node is out."""
    for _ in range(ms // 50):
        clock.advance(50)
        driver.watch()
        driver.apply(driver.election.tick(clock.monotonic_ms()))
    return driver.election.status().replica_unreachable_since_ms is not None


def test_a_silence_after_slow_role_calls_is_allowed_more_and_after_quick_ones_not() -> None:
    """The round trips the node times (role_outcome's took_ms) reach the election with the
    silence that follows: the longest renewal of about the last two seconds, doubled, on
    top of replica_timeout_ms. A role change's call (which may wait on purpose) and a call
    that got no answer count for nothing."""
    clock, driver, command = _serving_master()
    driver.role_outcome(replace(command), _stalled(0), took_ms=900)  # not a renewal
    driver.role_outcome(command, _stalled(0), took_ms=40)
    driver.role_outcome(command, _stalled(0), took_ms=120)
    driver.role_outcome(command, ReplicaFailure(Failure.NO_ANSWER, "DEADLINE_EXCEEDED", ""), 900)
    driver.replica_answered()  # a health probe: the silence counts from here
    applied = _recording(driver)
    assert not _silent_for(driver, clock, 500)
    assert _silent_for(driver, clock, 100)  # 300 + 240 ms: out
    lost = [e.message for r in applied for e in r.events if e.event == "replica-unreachable"]
    assert "not answered for 550 ms (replica_timeout_ms 300 + 240 allowed" in lost[0]

    clock, driver, command = _serving_master()
    driver.role_outcome(command, _stalled(0), took_ms=120)
    clock.advance(2500)  # long ago: forgotten
    driver.role_outcome(command, _stalled(0), took_ms=5)
    assert _silent_for(driver, clock, 350)  # 300 + 10 ms
