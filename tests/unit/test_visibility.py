"""Committed reads: the gate hides a publish until the commit LSN passes it."""

from __future__ import annotations

from services.replica.visibility import CommitGate


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
