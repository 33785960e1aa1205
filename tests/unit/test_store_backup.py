"""`squall store backup` / `store restore` on real LMDB files: what a copy holds, and refusals.

Copying while a replica writes is exercised with real processes in
tests/integration/test_deployment_procedures.py; here the store is closed (LMDB forbids
opening one file twice in a process), and the point is what comes out: the same state,
read back and checked, or a clear refusal that leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from squall_server import cli
from squall_server.replica import backup
from squall_server.replica.store import Store
from tests.unit.test_store_contract import observe
from tests.unit.test_store_lmdb import MAP_SIZE_BYTES, fill


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot_of(path: Path) -> object:
    store = Store.open_lmdb(path, MAP_SIZE_BYTES)
    try:
        return observe(store, ("p",))
    finally:
        store.close()


def tree(path: Path) -> dict[str, bytes]:
    """Every file under path with its bytes, for 'nothing changed' checks."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A closed store with meta, topics, events, a cursor and dedupe records."""
    path = tmp_path / "n1"
    store = Store.open_lmdb(path, MAP_SIZE_BYTES)
    fill(store)
    store.close()
    return path


def test_backup_then_restore_gives_the_same_store(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = snapshot_of(source)
    dest = tmp_path / "backups" / "n1-today"
    dest.parent.mkdir()
    code, out, err = run(["store", "backup", str(source), str(dest)], capsys)
    assert (code, err) == (0, ""), err
    assert "cluster cluster-a, dirty store, epoch 2, log 1..6" in out
    assert sorted(p.name for p in dest.iterdir()) == ["data.mdb", "squall-backup.json"]
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")], "staging left"
    manifest = json.loads((dest / "squall-backup.json").read_text())
    assert manifest["format"] == 1
    assert (manifest["cluster_id"], manifest["store_state"], manifest["last_lsn"]) == (
        "cluster-a",
        "dirty",
        6,
    )
    assert manifest["topics"] == 2 and manifest["source"] == str(source)
    # Compacted: no free pages copied.
    assert manifest["data_bytes"] <= (source / "data.mdb").stat().st_size

    target = tmp_path / "n2"
    code, out, err = run(["store", "restore", str(dest), str(target)], capsys)
    assert (code, err) == (0, ""), err
    assert f"restored {dest} into {target}" in out
    assert snapshot_of(target) == expected


def test_restore_keeps_the_coordinator_state_and_drops_a_stale_lock(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "b"
    assert run(["store", "backup", str(source), str(dest)], capsys)[0] == 0
    target = tmp_path / "n3"
    target.mkdir()
    (target / "coordinator-state.json").write_text("{}")
    (target / "lock.mdb").write_bytes(b"stale")
    assert run(["store", "restore", str(dest), str(target)], capsys)[0] == 0
    assert (target / "coordinator-state.json").read_text() == "{}"
    assert not (target / "lock.mdb").exists()
    assert snapshot_of(target) == snapshot_of(source)


@pytest.mark.parametrize(
    ("make_dest", "message"),
    [
        (lambda tmp: tmp / "full", "is not empty; nothing was changed"),
        (lambda tmp: tmp / "file", "exists and is not a directory"),
        (lambda tmp: tmp / "no" / "such" / "dir", "does not exist"),
    ],
)
def test_backup_refuses_a_destination_in_use(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make_dest: object,
    message: str,
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    before = tree(tmp_path)
    dest = make_dest(tmp_path)  # type: ignore[operator]
    code, out, err = run(["store", "backup", str(source), str(dest)], capsys)
    assert (code, out) == (2, "")
    assert message in err and err.startswith("squall: ")
    assert tree(tmp_path) == before


def test_backup_refuses_a_directory_without_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    for not_a_store in (tmp_path / "empty", tmp_path / "missing"):
        code, _, err = run(["store", "backup", str(not_a_store), str(tmp_path / "b")], capsys)
        assert code == 2 and "not a" in err, err
    assert not (tmp_path / "b").exists()


def test_a_damaged_record_fails_the_backup_and_leaves_nothing(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_file = source / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    at = raw.find(b"MARKER-payload")
    assert at >= 0
    raw[at] ^= 0x01  # the first copy: in the log or in the events database
    data_file.write_bytes(bytes(raw))
    dest = tmp_path / "b"
    code, out, err = run(["store", "backup", str(source), str(dest)], capsys)
    assert (code, out) == (1, "")
    assert "does not read back" in err and "checksum" in err, err
    assert not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n1"], "staging left behind"


def test_restore_refuses_over_a_store_and_a_damaged_or_mismatched_backup(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "b"
    assert run(["store", "backup", str(source), str(dest)], capsys)[0] == 0

    before = tree(source)
    code, _, err = run(["store", "restore", str(dest), str(source)], capsys)
    assert code == 2 and "already holds a store" in err
    assert tree(source) == before

    code, _, err = run(["store", "restore", str(source), str(tmp_path / "x")], capsys)
    assert code == 2 and "not a Squall backup" in err
    assert not (tmp_path / "x").exists()

    manifest = dest / "squall-backup.json"
    document = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**document, "last_lsn": 99}))
    code, _, err = run(["store", "restore", str(dest), str(tmp_path / "x")], capsys)
    assert code == 1 and "not the one its manifest describes" in err, err
    assert not (tmp_path / "x").exists()
    manifest.write_text(json.dumps(document))

    raw = bytearray((dest / "data.mdb").read_bytes())
    raw[raw.find(b"MARKER-payload")] ^= 0x01
    (dest / "data.mdb").write_bytes(bytes(raw))
    target = tmp_path / "n2"
    target.mkdir()
    code, _, err = run(["store", "restore", str(dest), str(target)], capsys)
    assert code == 1 and "does not read back" in err, err
    assert list(target.iterdir()) == []


def test_verify_copy_reads_every_record(source: Path) -> None:
    meta, topics, records = backup.verify_copy(source)
    assert (meta.last_lsn, topics) == (6, 2)
    # 2 topics, 4 events, 1 cursor, 1 dedupe run, 1 publisher and its 2 topic index
    # records, the topic id counter.
    assert records == 12


def test_store_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["store"], ["store", "backup"], ["store", "restore", "only-one"]):
        code, _, err = run(argv, capsys)
        assert code == 2 and "usage: squall store" in err, argv
