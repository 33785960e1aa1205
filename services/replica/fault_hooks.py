"""Test hooks for the chaos suite (chaos/faults.py): a full LMDB map and a slow fsync.

Off unless the replica process starts with ``SQUALL_FAULT_CONTROL=/path/file.json`` in
its environment; then ``store.kv_lmdb`` calls ``before_commit(txn)`` before each write
transaction commits and ``before_sync`` before each flush, and they act on the file's
current content, re-read at most every ``POLL_S`` seconds::

    {"fsync_delay_ms": 250, "map_full": false}

``map_full`` makes the commit raise ``lmdb.MapFullError``, exactly what LMDB raises when
the map is full, so the store's real error path runs (the transaction is aborted, nothing
of it is visible). ``fsync_delay_ms`` sleeps before each flush, as a slow disk would. A
missing or malformed file means no fault. Without the variable both hooks are a call to
a function that returns at once: nothing is read, nothing is checked.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import lmdb

from squall_server.common.clock import SYSTEM_CLOCK, PreciseClock

log = logging.getLogger("squall.replica")

ENV_VAR = "SQUALL_FAULT_CONTROL"
POLL_S = 0.1
# Longest fsync delay honoured: a typo must not hang a store for minutes.
FSYNC_DELAY_MS_MAX = 10_000


@dataclass(frozen=True)
class Control:
    """The faults the control file asks for."""

    fsync_delay_ms: int = 0
    map_full: bool = False


def parse(text: str) -> Control:
    """The control file's faults; ValueError naming the field for a bad one."""
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ValueError(f"fault control must be a JSON object, not {type(document).__name__}")
    delay = document.get("fsync_delay_ms", 0)
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"fsync_delay_ms must be an integer >= 0, got {delay!r}")
    full = document.get("map_full", False)
    if not isinstance(full, bool):
        raise ValueError(f"map_full must be true or false, got {full!r}")
    return Control(min(delay, FSYNC_DELAY_MS_MAX), full)


class FaultControl:
    """Reads the control file, at most every POLL_S seconds, from any thread."""

    def __init__(self, path: str, clock: PreciseClock = SYSTEM_CLOCK) -> None:
        self._path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._checked = float("-inf")
        self._control = Control()

    def current(self) -> Control:
        with self._lock:
            now = self._clock.monotonic_ns() / 1e9
            if now - self._checked >= POLL_S:
                self._checked = now
                self._control = self._read()
            return self._control

    def _read(self) -> Control:
        try:
            with open(self._path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            return Control()
        except OSError as exc:
            log.warning("fault control %s unreadable, no fault: %s", self._path, exc)
            return Control()
        try:
            control = parse(text)
        except ValueError as exc:
            log.warning("fault control %s malformed, no fault: %s", self._path, exc)
            return Control()
        if control != self._control:
            log.warning("fault control %s now injects %s", self._path, control)
        return control

    def before_commit(self, txn: lmdb.Transaction[bytes]) -> None:
        if self.current().map_full:
            # As a failed mdb_txn_commit does: the transaction is freed, nothing stored.
            txn.abort()
            raise lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL: injected by " + self._path)

    def before_sync(self) -> None:
        delay_ms = self.current().fsync_delay_ms
        if delay_ms:
            time.sleep(delay_ms / 1000)


def _commit_off(txn: lmdb.Transaction[bytes]) -> None:
    return None


def _sync_off() -> None:
    return None


def _install() -> tuple[Callable[[lmdb.Transaction[bytes]], None], Callable[[], None]]:
    path = os.environ.get(ENV_VAR, "")
    if not path:
        return _commit_off, _sync_off
    control = FaultControl(path)
    log.warning("fault injection enabled: %s=%s (a test harness is running)", ENV_VAR, path)
    return control.before_commit, control.before_sync


before_commit, before_sync = _install()
