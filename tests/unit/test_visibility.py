"""Committed reads: the gate hides a publish until the commit LSN passes it."""

from __future__ import annotations

import pytest

from squall_server.replica.visibility import CommitGate


def test_a_publish_is_hidden_until_committed() -> None:
    gate = CommitGate(commit_lsn=4)
    gate.appended(5, "orders", 10)
    gate.appended(6, "orders", 12)
    gate.appended(7, "audit", 0)
    assert gate.hidden_from("orders") == 10
    assert gate.hidden_from("audit") == 0
    assert gate.hidden_from("other") is None
    assert gate.advance(5)
    assert gate.hidden_from("orders") == 12
    assert gate.advance(7)
    assert (gate.hidden_from("orders"), gate.hidden_from("audit"), gate.tracked) == (None, None, 0)


def test_the_commit_lsn_never_goes_back_and_committed_publishes_are_not_tracked() -> None:
    gate = CommitGate(commit_lsn=9)
    gate.appended(8, "orders", 3)  # already committed: visible at once
    assert gate.hidden_from("orders") is None
    assert not gate.advance(5)
    assert gate.commit_lsn == 9


def test_truncation_forgets_the_removed_publishes() -> None:
    gate = CommitGate(commit_lsn=1)
    gate.appended(2, "orders", 0)
    gate.appended(3, "orders", 4)
    gate.truncated(2)
    assert gate.tracked == 1
    assert gate.hidden_from("orders") == 0
    gate.truncated(0)
    assert (gate.tracked, gate.commit_lsn, gate.hidden_from("orders")) == (0, 0, None)


def test_a_restart_hides_what_the_log_holds_above_the_recorded_commit() -> None:
    # The replica recorded commit LSN 4 and its log ends at 7: at start-up it tracks the
    # publishes at 5..7 from its log, in LSN order, as if just appended.
    gate = CommitGate(commit_lsn=4)
    for lsn, topic, offset in [(3, "orders", 2), (5, "orders", 6), (7, "audit", 1)]:
        gate.appended(lsn, topic, offset)
    assert (gate.hidden_from("orders"), gate.hidden_from("audit")) == (6, 1)
    assert gate.advance(6) and (gate.hidden_from("orders"), gate.hidden_from("audit")) == (None, 1)


def test_publishes_must_be_tracked_in_lsn_order() -> None:
    gate = CommitGate(commit_lsn=0)
    gate.appended(5, "orders", 0)
    with pytest.raises(ValueError, match="LSN 4 tracked after LSN 5"):
        gate.appended(4, "orders", 0)


def test_a_snapshot_lists_per_topic_what_it_holds_above_the_commit() -> None:
    gate = CommitGate(commit_lsn=10)
    gate.appended(11, "orders", 100)
    gate.appended(12, "audit", 7)
    gate.appended(13, "orders", 104)
    gate.appended(15, "orders", 110)  # after the snapshot's LSN: not in it
    gate.appended(16, "later", 0)
    assert gate.uncommitted(14) == [("audit", 7, 12), ("orders", 100, 13)]
    assert gate.uncommitted(10) == []


def test_a_receiver_hides_a_snapshots_uncommitted_publishes_until_the_last_commits() -> None:
    gate = CommitGate(commit_lsn=0)
    gate.truncated(0)  # the install began
    gate.advance(10)  # the sender's commit LSN
    assert gate.restore([("orders", 100, 13), ("audit", 7, 12), ("old", 3, 9)]) == 2
    assert (gate.hidden_from("orders"), gate.hidden_from("audit")) == (100, 7)
    assert gate.hidden_from("old") is None  # at or below the commit: visible
    gate.appended(15, "orders", 110)  # the log after the snapshot
    assert gate.advance(12) and gate.hidden_from("audit") is None
    # Conservative: the committed publish at 11 stays hidden until 13 commits too.
    assert gate.hidden_from("orders") == 100
    assert gate.advance(13) and gate.hidden_from("orders") == 110


def test_a_recreated_topics_uncommitted_events_stay_hidden_behind_the_old_ones() -> None:
    """An uncommitted publish of an old incarnation at offset 5, then the topic destroyed
    and created again and a publish at offset 0: offsets 0.. of the new incarnation are
    hidden too until their own LSN commits (the gate must never hide less)."""
    gate = CommitGate(commit_lsn=9)
    gate.appended(10, "dd", 5)
    gate.appended(13, "dd", 0)  # LSNs 11 and 12: destroy and create
    assert gate.hidden_from("dd") == 0
    assert gate.uncommitted(13) == [("dd", 0, 13)]
    assert gate.advance(10)
    assert gate.hidden_from("dd") == 0
    assert gate.advance(13)
    assert gate.hidden_from("dd") is None
    gate.appended(14, "dd", 3)
    assert gate.hidden_from("dd") == 3  # one incarnation again: the usual order


def _receiver() -> CommitGate:
    """A gate at commit LSN 20 hiding orders from 50 (LSN 21) and audit from 4 (LSN 22)."""
    gate = CommitGate(commit_lsn=20)
    gate.appended(21, "orders", 50)
    gate.appended(22, "audit", 4)
    return gate


def _view(gate: CommitGate) -> tuple[int, int | None, int | None, int | None, int]:
    return (
        gate.commit_lsn,
        gate.hidden_from("orders"),
        gate.hidden_from("audit"),
        gate.hidden_from("fresh"),
        gate.tracked,
    )


def test_while_a_snapshot_swaps_in_the_gate_hides_what_either_state_holds_uncommitted() -> None:
    """The store thread swaps a snapshot in while reads go on: until the driver learns
    the outcome, neither the old state's nor the snapshot's uncommitted events show (a
    topic only the snapshot has from offset 0), at the lower commit LSN."""
    gate = _receiver()
    gate.swapping(17, [("orders", 40, 19), ("fresh", 0, 23), ("old", 2, 16)])
    assert _view(gate) == (17, 40, 4, 0, 4)  # ("old", 16) committed in both
    # A snapshot this node sends meanwhile lists them too (whichever state it read).
    assert gate.uncommitted(22) == [("orders", 40, 21), ("audit", 4, 22)]
    # A commit learnt meanwhile lifts what it passes in either state.
    assert gate.advance(19) and _view(gate) == (19, 50, 4, 0, 3)
    # It swapped in: the driver sets the snapshot's exact gate.
    gate.truncated(0)
    gate.advance(17)
    assert gate.restore([("orders", 40, 19), ("fresh", 0, 23)]) == 2
    assert _view(gate) == (17, 40, None, 0, 2)


def test_a_failed_swap_leaves_the_gate_as_it_was_and_an_unknown_one_keeps_hiding() -> None:
    gate = _receiver()
    gate.swapping(17, [("orders", 40, 19), ("fresh", 0, 23)])
    assert gate.swap_failed()  # the old state is live: exactly as before
    assert _view(gate) == _view(_receiver())
    assert not gate.swap_failed()  # nothing pending any more

    # A commit learnt during a swap that then failed stays learnt.
    gate = _receiver()
    gate.swapping(17, [("orders", 40, 19), ("fresh", 0, 23)])
    assert gate.advance(21)
    assert gate.swap_failed() and _view(gate) == (21, None, 4, None, 1)

    # A swap whose outcome was never learnt (cancelled) stays hidden, at its commit LSN,
    # through a later swap that fails, until commits pass it.
    gate = _receiver()
    gate.swapping(17, [("orders", 40, 19), ("fresh", 0, 23)])
    gate.swapping(17, [("fresh", 3, 24)])
    assert gate.swap_failed() and _view(gate) == (17, 40, 4, 0, 4)
    assert gate.advance(23) and _view(gate) == (23, None, None, None, 0)
    # A truncation of the old state removes what only it could hold; a truncation of a
    # snapshot's state never goes below the snapshot's LSN, which keeps every entry.
    gate.swapping(17, [("orders", 40, 19), ("fresh", 0, 30)])
    gate.truncated(25)
    assert _view(gate) == (17, 40, None, None, 1)
