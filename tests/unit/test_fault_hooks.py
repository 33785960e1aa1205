"""The chaos suite's store hooks (services/replica/fault_hooks.py): off without the
environment variable; with a control file, a commit fails exactly as a full LMDB map
fails (the store's StoreFullError path, nothing stored) until the file clears it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from squall.v1 import replica_pb2
from squall_server.replica import fault_hooks
from squall_server.replica.store import Store, StoreFullError, kv_lmdb, make_entry


def _entry(lsn: int) -> replica_pb2.LogEntry:
    op = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name=f"t{lsn}"))
    return make_entry(lsn, 1, op)


def _wait_for(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_without_the_variable_the_hooks_are_no_ops() -> None:
    assert fault_hooks.ENV_VAR == "SQUALL_FAULT_CONTROL"
    code = (
        "from squall_server.replica import fault_hooks as h; "
        "print(h.before_commit is h._commit_off, h.before_sync is h._sync_off)"
    )
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.split() == ["True", "True"]


def test_map_full_refuses_commits_like_lmdb_until_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control_path = tmp_path / "control.json"
    control = fault_hooks.FaultControl(str(control_path))
    monkeypatch.setattr(kv_lmdb.fault_hooks, "before_commit", control.before_commit)
    store = Store.open_lmdb(tmp_path / "store", 8 << 20)
    try:
        store.append([_entry(1)], sync=False)
        control_path.write_text(json.dumps({"map_full": True}))

        def refused() -> bool:
            try:
                store.append([_entry(store.meta().last_lsn + 1)], sync=False)
            except StoreFullError as exc:
                assert "MDB_MAP_FULL" in str(exc)
                return True
            return False

        _wait_for(refused)
        before = store.meta().last_lsn
        assert not _appends(store)
        assert store.meta().last_lsn == before  # the refused batch left nothing behind
        control_path.write_text(json.dumps({"map_full": False}))
        _wait_for(lambda: _appends(store))
    finally:
        store.close()


def _appends(store: Store) -> bool:
    try:
        store.append([_entry(store.meta().last_lsn + 1)], sync=True)
    except StoreFullError:
        return False
    return True


def test_the_control_file_sets_the_fsync_delay_and_bad_files_mean_no_fault(
    tmp_path: Path,
) -> None:
    path = tmp_path / "control.json"
    control = fault_hooks.FaultControl(str(path))
    assert control.current() == fault_hooks.Control()  # no file yet
    path.write_text(json.dumps({"fsync_delay_ms": 250}))
    _wait_for(lambda: control.current().fsync_delay_ms == 250)
    path.write_text("{not json")
    _wait_for(lambda: control.current() == fault_hooks.Control())
    path.write_text(json.dumps({"fsync_delay_ms": 10**9}))
    _wait_for(lambda: control.current().fsync_delay_ms == fault_hooks.FSYNC_DELAY_MS_MAX)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"fsync_delay_ms": -1}', "fsync_delay_ms"),
        ('{"fsync_delay_ms": "5"}', "fsync_delay_ms"),
        ('{"map_full": 1}', "map_full"),
        ("[]", "JSON object"),
    ],
)
def test_parse_names_the_bad_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        fault_hooks.parse(text)
