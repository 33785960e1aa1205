"""A replica's record of a fault that makes its node unfit to serve: a checksum error in its
store, or a store write that failed (the replica fail-stops).

The replica reports the fault to its coordinator in every ``ReplicaState``; the coordinator
quarantines the node (it then takes no part in any group) until an operator clears it. The
record carries a unique id, so the coordinator quarantines once per fault, and an operator
who cleared a fault is not overruled by the replica still reporting it. The record is kept
in ``replica-fault.json`` beside the store (not in it: the store may be what failed), so a
replica restarted before its coordinator heard of the fault still reports it. Writing it is
best effort, for the same reason. Repairing the store (moving the data directory aside)
removes it with the store.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from squall_server.common.durable_json import write_json_durably

if TYPE_CHECKING:
    from squall_server.common.clock import Clock

log = logging.getLogger("squall.replica")

FAULT_FILE_NAME = "replica-fault.json"
# Longest reason kept: a fault names a database and key, not a novel.
REASON_CHARS_MAX = 1024


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: a unique id, what happened, and when (wall-clock ms)."""

    fault_id: str
    reason: str
    at_ms: int


def new_fault(reason: str, at_ms: int) -> Fault:
    """A fault with a fresh id."""
    return Fault(uuid.uuid4().hex, reason[:REASON_CHARS_MAX], at_ms)


def load_fault(data_dir: Path) -> Fault | None:
    """The fault recorded in data_dir, if any; an unreadable record counts as a fault too."""
    path = data_dir / FAULT_FILE_NAME
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return Fault(_file_id(path), f"{path} unreadable: {exc}", 0)
    if (
        not isinstance(document, dict)
        or not isinstance(document.get("fault_id"), str)
        or not document["fault_id"]
        or not isinstance(document.get("reason"), str)
        or not isinstance(document.get("at_ms"), int)
    ):
        return Fault(_file_id(path), f"{path} is malformed", 0)
    return Fault(
        document["fault_id"][:64], document["reason"][:REASON_CHARS_MAX], document["at_ms"]
    )


def _file_id(path: Path) -> str:
    """An id for a damaged record: the same while the file stays as it is."""
    try:
        return f"damaged-record-{path.stat().st_mtime_ns}"
    except OSError:
        return "damaged-record"


def save_fault(data_dir: Path, fault: Fault) -> None:
    """Records the fault beside the store, atomically; logs (does not raise) on failure."""
    path = data_dir / FAULT_FILE_NAME
    try:
        write_json_durably(path, asdict(fault))
    except OSError as exc:
        log.error("could not record the fault in %s (it is reported all the same): %s", path, exc)


class FaultReports:
    """One node's fault record: the fault in force (``fault``, loaded from beside the
    store at start-up) and the reporting of a new one."""

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        clock: Clock,
        position: Callable[[], tuple[int, int]],
    ) -> None:
        """``position``: the node's (epoch, last LSN), for the log line."""
        self._node_id = node_id
        self._data_dir = data_dir
        self._clock = clock
        self._position = position
        self.fault: Fault | None = load_fault(data_dir)

    def report(self, reason: str) -> None:
        """Records a fault that makes this node unfit to serve; the coordinator reads it in
        the replica's state and quarantines the node. The same fault hit again (the same
        bad record read by every subscriber) is one fault: an operator who cleared it is
        not overruled; a different one is new and quarantines the node again."""
        if self.fault is not None and self.fault.reason == reason[:REASON_CHARS_MAX]:
            return
        self.fault = new_fault(reason, self._clock.wall_ms())
        epoch, last_lsn = self._position()
        log.error(
            "replica %s FAULT: %s (epoch=%d lsn=%d); reporting it to the coordinator, which "
            "quarantines this node",
            self._node_id,
            reason,
            epoch,
            last_lsn,
        )
        save_fault(self._data_dir, self.fault)
