"""The coordinator's persisted state file: round trips, older files, and broken files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from squall_server.coordinator.messages import PersistedState
from squall_server.coordinator.persist import StateFileError, load_state, save_state


def test_round_trip_keeps_the_cluster_id(tmp_path: Path) -> None:
    path = tmp_path / "coordinator-state.json"
    state = PersistedState(epoch=7, max_seen=3, quorum_override=1, cluster_id="c-1")
    save_state(path, state)
    assert load_state(path) == state


def test_a_file_from_before_cluster_ids_loads_with_none(tmp_path: Path) -> None:
    path = tmp_path / "coordinator-state.json"
    path.write_text(
        json.dumps({"epoch": 4, "max_seen": 3, "designated_primary": False, "quorum_override": 0})
    )
    assert load_state(path) == PersistedState(epoch=4, max_seen=3)


def test_a_missing_file_is_a_node_that_never_ran(tmp_path: Path) -> None:
    assert load_state(tmp_path / "absent.json") == PersistedState()


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"epoch": 1, "max_seen": 0, "designated_primary": False},
            r"missing \[.quorum_override.\]",
        ),
        (
            {
                "epoch": 1,
                "max_seen": 0,
                "designated_primary": False,
                "quorum_override": 0,
                "cluster_id": 5,
            },
            "cluster_id must be a string",
        ),
        (
            {
                "epoch": 1,
                "max_seen": 0,
                "designated_primary": False,
                "quorum_override": 0,
                "extra": 1,
            },
            r"unknown \[.extra.\]",
        ),
    ],
)
def test_broken_files_are_refused_naming_the_problem(
    tmp_path: Path, document: dict[str, object], message: str
) -> None:
    path = tmp_path / "coordinator-state.json"
    path.write_text(json.dumps(document))
    with pytest.raises(StateFileError, match=message):
        load_state(path)
