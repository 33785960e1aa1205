"""The coordinator's persisted state on disk: epoch, max seen, cluster id, operator controls
and their audit trail, and the running node set once a membership change made one.

The election promises never to go back to an older epoch, also across restarts, so the
state is written atomically (temporary file, fsync, rename, fsync of the directory)
before the driver sends anything that depends on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from squall_server.common.durable_json import write_json_durably
from squall_server.common.loss_record import (
    LOSS_ACKED_IDS_MAX,
    LOSS_RECORDS_MAX,
    LossRecordError,
    loss_from_dict,
)
from squall_server.coordinator.membership import MEMBERS_MAX, Member, Membership
from squall_server.coordinator.messages import AUDIT_RECORDS_MAX, OperatorRecord, PersistedState

STATE_FILE_NAME = "coordinator-state.json"
# Every file has these; the others came later and default when missing (older files).
_REQUIRED = ("epoch", "max_seen", "designated_primary", "quorum_override")
_OPTIONAL = (
    "quorum_override_record",
    "quarantine",
    "quarantine_fault_id",
    "cleared_fault_id",
    "audit",
    "cluster_id",
    "losses",
    "acked_loss_ids",
    "peer_designated",
    "membership",
)
# Longest string kept in a record read back (operator names and reasons are short).
_TEXT_CHARS_MAX = 4096


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
    if not isinstance(document, dict):
        raise StateFileError(f"{path} must hold a JSON object")
    missing = [key for key in _REQUIRED if key not in document]
    unknown = sorted(set(document) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise StateFileError(
            f"{path} must hold the keys {', '.join(_REQUIRED)} (and may hold "
            f"{', '.join(_OPTIONAL)}); missing {missing or 'none'}, unknown {unknown or 'none'}"
        )
    for key in ("epoch", "max_seen", "quorum_override"):
        value = document[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StateFileError(f"{path}: {key} must be a non-negative integer, got {value!r}")
    if not isinstance(document["designated_primary"], bool):
        raise StateFileError(f"{path}: designated_primary must be true or false")
    for key in ("quarantine_fault_id", "cleared_fault_id", "cluster_id"):
        value = document.get(key, "")
        if not isinstance(value, str) or len(value) > _TEXT_CHARS_MAX:
            raise StateFileError(f"{path}: {key} must be a string, got {value!r}")
    audit = document.get("audit", [])
    if not isinstance(audit, list) or len(audit) > AUDIT_RECORDS_MAX:
        raise StateFileError(f"{path}: audit must be a list of at most {AUDIT_RECORDS_MAX} records")
    losses = document.get("losses", [])
    if not isinstance(losses, list) or len(losses) > LOSS_RECORDS_MAX:
        raise StateFileError(f"{path}: losses must be a list of at most {LOSS_RECORDS_MAX}")
    try:
        loss_records = tuple(loss_from_dict(r, f"losses[{i}]") for i, r in enumerate(losses))
    except LossRecordError as exc:
        raise StateFileError(f"{path}: {exc}") from exc
    names: dict[str, tuple[str, ...]] = {}
    for key, most in (("acked_loss_ids", LOSS_ACKED_IDS_MAX), ("peer_designated", 64)):
        value = document.get(key, [])
        if (
            not isinstance(value, list)
            or len(value) > most
            or not all(isinstance(v, str) and len(v) <= 128 for v in value)
        ):
            raise StateFileError(f"{path}: {key} must be a list of at most {most} strings")
        names[key] = tuple(value)
    return PersistedState(
        epoch=document["epoch"],
        max_seen=document["max_seen"],
        designated_primary=document["designated_primary"],
        quorum_override=document["quorum_override"],
        quorum_override_record=_record(path, "quorum_override_record", document),
        quarantine=_record(path, "quarantine", document),
        quarantine_fault_id=document.get("quarantine_fault_id", ""),
        cleared_fault_id=document.get("cleared_fault_id", ""),
        audit=tuple(_parse_record(path, f"audit[{i}]", r) for i, r in enumerate(audit)),
        cluster_id=document.get("cluster_id", ""),
        losses=loss_records,
        acked_loss_ids=names["acked_loss_ids"],
        peer_designated=names["peer_designated"],
        membership=_membership(path, document.get("membership")),
    )


def _membership(path: Path, value: object) -> Membership | None:
    """The persisted node set (None: the config file's); StateFileError names the bad field."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"version", "epoch", "members"}:
        raise StateFileError(f"{path}: membership must hold version, epoch and members")
    for key in ("version", "epoch"):
        number = value[key]
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise StateFileError(f"{path}: membership.{key} must be a non-negative integer")
    members = value["members"]
    if not isinstance(members, list) or not 1 <= len(members) <= MEMBERS_MAX:
        raise StateFileError(f"{path}: membership.members must list 1 to {MEMBERS_MAX} nodes")
    parsed: list[Member] = []
    fields = {"node_id", "priority", "coordinator_address", "replica_address"}
    for i, member in enumerate(members):
        # ``learner`` came later: a file written before it holds voters only.
        if not isinstance(member, dict) or set(member) - {"learner"} != fields:
            raise StateFileError(f"{path}: membership.members[{i}] must hold {sorted(fields)}")
        priority = member["priority"]
        learner = member.get("learner", False)
        if not isinstance(learner, bool):
            raise StateFileError(f"{path}: membership.members[{i}].learner must be true/false")
        texts = [member[k] for k in fields - {"priority"}]
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or priority < 0
            or not all(isinstance(t, str) and len(t) <= _TEXT_CHARS_MAX for t in texts)
        ):
            raise StateFileError(f"{path}: membership.members[{i}] is malformed: {member!r}")
        parsed.append(
            Member(
                member["node_id"],
                priority,
                member["coordinator_address"],
                member["replica_address"],
                learner,
            )
        )
    ids = [m.node_id for m in parsed]
    if len(set(ids)) != len(ids):
        raise StateFileError(f"{path}: membership.members repeats a node id: {ids}")
    return Membership(value["version"], value["epoch"], tuple(parsed))


def _record(path: Path, key: str, document: dict[str, Any]) -> OperatorRecord | None:
    value = document.get(key)
    return None if value is None else _parse_record(path, key, value)


def _parse_record(path: Path, where: str, value: object) -> OperatorRecord:
    """One operator record; StateFileError names the bad field."""
    if not isinstance(value, dict) or set(value) != {"at_ms", "operator", "action", "reason"}:
        raise StateFileError(f"{path}: {where} must hold at_ms, operator, action and reason")
    at_ms = value["at_ms"]
    if not isinstance(at_ms, int) or isinstance(at_ms, bool):
        raise StateFileError(f"{path}: {where}.at_ms must be an integer, got {at_ms!r}")
    for field in ("operator", "action", "reason"):
        text = value[field]
        if not isinstance(text, str) or len(text) > _TEXT_CHARS_MAX:
            raise StateFileError(f"{path}: {where}.{field} must be a short string")
    return OperatorRecord(at_ms, value["operator"], value["action"], value["reason"])


def save_state(path: Path, state: PersistedState) -> None:
    """Writes the state durably and atomically: a crash leaves the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_durably(path, asdict(state))
