"""The start-up decision over the stores' states (services/coordinator/lifecycle.py): which
groups may start from which stores, and what the refusal tells the operator."""

from __future__ import annotations

import pytest

from squall_server.coordinator.lifecycle import decide_start
from squall_server.coordinator.messages import MemberReport, StoreState

EMPTY, CLEAN, DIRTY = StoreState.EMPTY, StoreState.CLEAN, StoreState.DIRTY


def report(
    node: str,
    state: StoreState,
    log: tuple[int, int] = (0, 0),
    shutdown: str = "",
    joined: bool = False,
    cluster: str = "c1",
) -> MemberReport:
    """One member's report; a used store has a log and a cluster id."""
    return MemberReport(
        node_id=node,
        cluster_id="" if state is EMPTY and not log[1] else cluster,
        last_epoch=log[0],
        last_lsn=log[1],
        store_state=state,
        max_seen=3,
        epoch=log[0],
        shutdown_id=shutdown,
        joined=joined,
    )


def group(*reports: MemberReport) -> dict[str, MemberReport]:
    return {r.node_id: r for r in reports}


def test_every_store_empty_is_the_first_formation() -> None:
    decision = decide_start(group(report("1", EMPTY), report("2", EMPTY)), 3)
    assert decision.ok and decision.cold
    assert "first formation" in decision.reason


def test_clean_stores_of_one_shutdown_start_and_dirty_or_empty_ones_are_updated() -> None:
    decision = decide_start(
        group(
            report("1", CLEAN, (4, 120), "s1"),
            report("2", CLEAN, (4, 120), "s1"),
            report("3", DIRTY, (4, 100)),
            report("4", EMPTY),
        ),
        5,
    )
    assert decision.ok and decision.cold
    assert "clean shutdown s1" in decision.reason
    assert "4/120" in decision.reason


def test_all_dirty_after_a_total_failure_is_refused_with_the_recovery_procedure() -> None:
    decision = decide_start(
        group(report("1", DIRTY, (4, 120)), report("2", DIRTY, (4, 118)), report("3", EMPTY)),
        3,
    )
    assert not decision.ok and decision.cold
    assert decision.reason.startswith("refusing to start: no member has a clean store")
    # Every member is named with its state and log, so the operator can choose.
    for text in ("1 (dirty, log 4/120)", "2 (dirty, log 4/118)", "3 (empty, log 0/0)"):
        assert text in decision.reason
    assert "squall store mark-clean" in decision.reason
    assert "Manual recovery" in decision.reason


def test_clean_stores_from_different_shutdowns_are_refused_naming_both() -> None:
    decision = decide_start(
        group(report("1", CLEAN, (4, 120), "s2"), report("2", CLEAN, (3, 80), "s1")), 3
    )
    assert not decision.ok
    assert "different shutdowns" in decision.reason
    assert "clean shutdown s2" in decision.reason and "clean shutdown s1" in decision.reason
    assert "mark-dirty" in decision.reason


def test_a_dirty_store_newer_than_every_clean_one_is_refused() -> None:
    """A clean store the cluster ran past is not its last state: starting from it would
    roll acknowledged writes back."""
    decision = decide_start(
        group(report("1", CLEAN, (2, 40), "s1"), report("2", DIRTY, (5, 10))), 3
    )
    assert not decision.ok
    assert "2 (dirty, log 5/10) holds a newer log than every clean store" in decision.reason
    assert "best 1 (clean shutdown s1, log 2/40)" in decision.reason


def test_a_dirty_store_level_with_the_best_clean_one_is_no_obstacle() -> None:
    decision = decide_start(
        group(report("1", CLEAN, (5, 10), "s1"), report("2", DIRTY, (5, 10))), 3
    )
    assert decision.ok


def test_a_joined_member_means_the_cluster_is_running_whatever_the_stores() -> None:
    """A failover or a rejoin: the running cluster updates the others, no clean store needed."""
    decision = decide_start(
        group(report("1", DIRTY, (4, 120), joined=True), report("2", DIRTY, (4, 130))), 3
    )
    assert decision.ok and not decision.cold
    assert "running cluster: 1" in decision.reason


def test_a_one_node_cluster_starts_from_its_only_store() -> None:
    decision = decide_start(group(report("1", DIRTY, (4, 120))), 1)
    assert decision.ok and "one-node cluster" in decision.reason


def test_no_reports_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="at least one member report"):
        decide_start({}, 3)
