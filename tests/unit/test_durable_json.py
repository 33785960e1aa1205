"""The small JSON files beside the store (coordinator state, fault record, loss reports):
a write that fails part way, as on a full disk, leaves the old file whole and no
half-written twin beside it."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from squall_server.common import durable_json
from squall_server.common.durable_json import write_json_durably


def test_a_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "coordinator-state.json"
    write_json_durably(path, {"epoch": 1})
    write_json_durably(path, {"epoch": 2})
    assert json.loads(path.read_text()) == {"epoch": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["coordinator-state.json"]


def test_a_write_the_disk_refuses_keeps_the_old_file_and_removes_its_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "coordinator-state.json"
    write_json_durably(path, {"epoch": 1})

    def no_room(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(durable_json.os, "fsync", no_room)
    with pytest.raises(OSError, match="No space left on device"):
        write_json_durably(path, {"epoch": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coordinator-state.json"]
