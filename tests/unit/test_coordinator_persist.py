"""The coordinator's state file: operator controls and their audit trail survive a restart,
an older file (before the audit fields) still loads, and a damaged file is refused with a
sentence naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from squall_server.coordinator.messages import OperatorRecord, PersistedState
from squall_server.coordinator.persist import StateFileError, load_state, save_state


def test_round_trip_keeps_records_and_audit(tmp_path: Path) -> None:
    """Everything written is read back the same."""
    state = PersistedState(
        epoch=9,
        max_seen=3,
        quorum_override=1,
        quorum_override_record=OperatorRecord(1_700_000_000_000, "carol", "override 1", "dr"),
        quarantine=OperatorRecord(1_700_000_000_500, "replica", "quarantine", "checksum"),
        quarantine_fault_id="f2",
        cleared_fault_id="f1",
        audit=(OperatorRecord(1, "bob", "unquarantine", ""),),
    )
    path = tmp_path / "coordinator-state.json"
    save_state(path, state)
    assert load_state(path) == state


def test_a_file_from_before_the_audit_fields_loads(tmp_path: Path) -> None:
    """A node upgraded in place keeps its epoch and controls; the new fields default."""
    path = tmp_path / "coordinator-state.json"
    path.write_text(
        json.dumps({"epoch": 4, "max_seen": 3, "designated_primary": False, "quorum_override": 2})
    )
    assert load_state(path) == PersistedState(epoch=4, max_seen=3, quorum_override=2)


@pytest.mark.parametrize(
    ("document", "phrase"),
    [
        ({"epoch": 1, "max_seen": 1, "designated_primary": False}, "missing ['quorum_override']"),
        (
            {
                "epoch": 1,
                "max_seen": 1,
                "designated_primary": False,
                "quorum_override": 0,
                "colour": "blue",
            },
            "unknown ['colour']",
        ),
        (
            {
                "epoch": 1,
                "max_seen": 1,
                "designated_primary": False,
                "quorum_override": 0,
                "quarantine": {"at_ms": "noon", "operator": "x", "action": "q", "reason": ""},
            },
            "quarantine.at_ms must be an integer",
        ),
        (
            {
                "epoch": 1,
                "max_seen": 1,
                "designated_primary": False,
                "quorum_override": 0,
                "audit": [{"at_ms": 1}],
            },
            "audit[0] must hold at_ms, operator, action and reason",
        ),
    ],
)
def test_damaged_files_are_refused_with_the_reason(
    tmp_path: Path, document: dict[str, object], phrase: str
) -> None:
    """A state file that is not what the coordinator wrote stops it with a clear message."""
    path = tmp_path / "coordinator-state.json"
    path.write_text(json.dumps(document))
    with pytest.raises(StateFileError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        load_state(path)


def test_the_running_node_set_survives_a_restart(tmp_path: Path) -> None:
    """A membership change's node set is read back as written; a damaged one is refused."""
    from squall_server.coordinator.membership import Member, Membership

    membership = Membership(2, 7, (Member("1", 3, "h1:1", "h1:2"), Member("4", 1, "h4:1", "h4:2")))
    path = tmp_path / "coordinator-state.json"
    save_state(path, PersistedState(epoch=7, max_seen=2, membership=membership))
    assert load_state(path).membership == membership
    document = json.loads(path.read_text())
    document["membership"]["members"].append(dict(document["membership"]["members"][0]))
    path.write_text(json.dumps(document))
    with pytest.raises(StateFileError, match="repeats a node id"):
        load_state(path)
