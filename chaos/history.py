"""The history of a chaos run: one JSON object per line, written as things happen.

Every record has ``t`` (seconds since the run started, from the monotonic clock) and
``type``. The workload, the fault scheduler and the final-state dump all write here, and
the checker reads nothing else, so a history file is a complete, replayable account of a
run. The record types:

``run``       first line: ``seed``, ``duration_s``, ``nodes`` (ids), ``gateways`` (ids),
              ``faults`` (names of the fault kinds enabled), ``topics``, ``started_at``
              (ISO 8601 wall time, for people only). Optional (chaos/run.py):
              ``faults_skipped`` ({kind: why it was left out}), ``netns`` (bool: nodes
              in network namespaces), ``host_address``.
``invoke``    an operation starts: ``id`` (unique int), ``process`` (e.g. "pub-3"),
              ``op`` ("publish"), ``path`` ("gateway" | "replicated" | "non_replicated" |
              "gateway_unary"),
              ``topic``, ``publisher_id`` (str or null), ``events``: list of
              ``{"seq": int | null, "value": str}`` in publish order.
``complete``  an operation ends: ``id``, ``outcome`` ("ok" | "fail" | "indeterminate"),
              ``error`` (a status code and message, or null), ``offsets`` (list of int,
              one per event, for "ok"; else empty). "fail" means definitely not stored;
              "indeterminate" means it may or may not have been.
``deliver``   a subscriber received events: ``process`` ("sub-1"), ``mode`` ("stream" |
              "push"), ``topic``, ``subscription``, ``events``: list of
              ``{"offset": int, "value": str}`` in the order received.
``fault``     a fault starts or ends: ``fault`` (kind, e.g. "kill", "pause",
              "kill_replica", "kill_coordinator", "pause_replica", "pause_coordinator",
              "stop", "stop_replica", "stop_coordinator", "partition",
              "partition_replica", "partition_coordinator", "map_full", "corrupt",
              "slow_disk", "clock_jump"), ``phase``
              ("start" | "end"), ``targets`` (node or gateway ids), ``detail`` (free
              text).
``unavailable`` a client-observed window with no successful operation of one kind:
              written by the checker, not the run (see chaos/checker.py).
``final_log`` after the run, per node and topic: ``node``, ``topic``, ``commit_lsn``,
              ``events``: list of ``[offset, value]`` for every committed event (value:
              the payload as UTF-8). Optional ``error``: the store could not be read.
``end``       last line: ``reason`` ("completed" | "aborted: ...").

Optional fields (a reader must not require them):

* ``run``: ``notes`` (list of str) — things the summary line repeats, e.g. a fault kind
  left out and why.
* ``invoke`` with ``op`` "subscribe" (the workload's subscribers): ``process``, ``mode``
  ("stream" | "push"), ``topic``, ``subscription`` (durable name or push subscriber id),
  ``start_offset`` (the first offset it is owed); its ``complete`` may carry the cluster's
  own ``start_offset`` (a push subscribe's cursor), which wins. Only subscribers whose
  subscribe completed "ok" are owed every committed event.
* ``invoke`` with ``op`` "list_push_subscribers" (``topic``): its ``complete`` carries
  ``subscriber_ids``; a push subscriber missing from the last such list was removed by the
  cluster and is not owed the rest.
* ``complete`` of an "ok" publish: ``duplicates`` (list of int) — the indices of its
  events whose receipt said duplicate (already stored under that publisher id and
  sequence, at the receipt's offset); absent when none did.
* ``final_log``: ``lagging`` (str) — why this node may hold only a prefix of the others'
  committed log (e.g. it was killed and not restarted); ``error`` (str) — its store could
  not be read. Without ``lagging`` every node's log must be identical.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

RECORD_TYPES = ("run", "invoke", "complete", "deliver", "fault", "final_log", "end")
OUTCOMES = ("ok", "fail", "indeterminate")


class HistoryError(Exception):
    """A history file that is not a well-formed run record; the message names the line."""


class HistoryWriter:
    """Appends records to a history file; safe to call from several threads and tasks.

    Each record is flushed as it is written, so the history survives the harness being
    killed and the checker can read a run that was cut short.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._next_id = 0

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self._start

    def new_op_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def write(self, record_type: str, **fields: Any) -> None:
        if record_type not in RECORD_TYPES:
            raise ValueError(f"unknown history record type {record_type!r}")
        record = {"t": round(self.now(), 6), "type": record_type, **fields}
        line = json.dumps(record, separators=(",", ":"), sort_keys=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def fault(self, fault: str, phase: str, targets: list[str], detail: str = "") -> None:
        self.write("fault", fault=fault, phase=phase, targets=targets, detail=detail)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_history(path: Path) -> list[Mapping[str, Any]]:
    """Every record of a history file, in order; HistoryError names a malformed line.

    A last line cut off mid-write (the harness was killed) is dropped, not an error.
    """
    return list(_records(path))


def _records(path: Path) -> Iterator[Mapping[str, Any]]:
    with path.open(encoding="utf-8") as file:
        lines = file.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not line.endswith("\n"):
                return
            raise HistoryError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or record.get("type") not in RECORD_TYPES:
            raise HistoryError(f"{path}:{number}: not a history record: {line[:80]!r}")
        if not isinstance(record.get("t"), int | float):
            raise HistoryError(f"{path}:{number}: record has no time 't'")
        yield record
