"""The coordinator's persisted state on disk: epoch, max seen, cluster id and operator controls.

The election promises never to go back to an older epoch, also across restarts, so the
state is written atomically (temporary file, fsync, rename, fsync of the directory)
before the driver sends anything that depends on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from services.coordinator.messages import PersistedState

STATE_FILE_NAME = "coordinator-state.json"
_FIELDS = ("epoch", "max_seen", "designated_primary", "quorum_override", "cluster_id")
# Keys a file written by an older version may lack (they take their defaults).
_OPTIONAL_FIELDS = frozenset({"cluster_id"})


class StateFileError(Exception):
    """The state file exists but cannot be read or is malformed; the message says how."""


def load_state(path: Path) -> PersistedState:
    """Reads the state; a missing file is a node that never ran (all zero)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return PersistedState()
    except OSError as exc:
        raise StateFileError(f"cannot read {path}: {exc}") from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateFileError(f"{path} is not valid JSON: {exc}") from exc
    if (
        not isinstance(document, dict)
        or not set(document) <= set(_FIELDS)
        or not set(_FIELDS) - _OPTIONAL_FIELDS <= set(document)
    ):
        raise StateFileError(f"{path} must hold exactly the keys {', '.join(_FIELDS)}")
    for key in ("epoch", "max_seen", "quorum_override"):
        value = document[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StateFileError(f"{path}: {key} must be a non-negative integer, got {value!r}")
    if not isinstance(document["designated_primary"], bool):
        raise StateFileError(f"{path}: designated_primary must be true or false")
    if not isinstance(document.get("cluster_id", ""), str):
        raise StateFileError(f"{path}: cluster_id must be a string")
    return PersistedState(**document)


def save_state(path: Path, state: PersistedState) -> None:
    """Writes the state durably and atomically: a crash leaves the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as handle:
        json.dump(asdict(state), handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
