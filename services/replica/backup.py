"""Backup and restore of one replica's store, live: an LMDB copy taken from one read
transaction, read back in full before it counts, and a restore that never overwrites a
store.

``backup`` opens the store read-only beside the running replica (LMDB allows any number
of processes to read while one writes), copies it compacted from one read transaction
(``mdb_env_copy2`` with ``MDB_CP_COMPACT``), then opens the copy and reads back every
log entry and every state record, checking each checksum, before it moves the copy into
place with one rename: the destination holds a verified backup or nothing. A manifest
(``squall-backup.json``) says what the copy holds (cluster id, epoch, last LSN, state).

``restore`` copies a backup's ``data.mdb`` into a node's data directory that holds no
store yet, flushed and renamed into place; the node, started on it, rejoins its group
as a member with a dirty store and catches up from the master like any returning node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from squall.v1 import common_pb2
from squall_server.common.clock import SYSTEM_CLOCK, Clock
from squall_server.replica.store import DATABASES, Store, StoreError, StoreMeta
from squall_server.replica.store.kv import KVError
from squall_server.replica.store.kv_lmdb import LmdbKV

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
MANIFEST_FILE = "squall-backup.json"
MANIFEST_FORMAT = 1
# Log entries read back per call while verifying a copy.
_VERIFY_BATCH_ENTRIES = 4096
# Bytes per read/write while restoring a data file (one progress report each).
_RESTORE_CHUNK_BYTES = 8 << 20
# How often the size of a copy LMDB is writing is looked at, for progress reports.
_COPY_POLL_INTERVAL_S = 0.5

# progress(phase, done, total): "copy" and "restore" count bytes, "verify" log entries.
# The operator commands show it as a rate and an ETA (services/cli/progress.py).
Progress = Callable[[str, int, int], None]


def no_progress(phase: str, done: int, total: int) -> None:
    pass


class BackupError(Exception):
    """A backup or restore could not be made; nothing was left behind. Says why."""


class PreconditionError(BackupError):
    """The arguments name the wrong things (no store, a destination in use): nothing done."""


@dataclasses.dataclass(frozen=True)
class BackupInfo:
    """What a backup holds, as written in its manifest."""

    source: str
    host: str
    created_unix_s: float
    cluster_id: str
    store_state: str
    epoch: int
    last_lsn: int
    last_epoch: int
    log_start_lsn: int
    topics: int
    state_records: int
    data_bytes: int

    def to_json(self) -> str:
        """The manifest's text."""
        return json.dumps({"format": MANIFEST_FORMAT, **dataclasses.asdict(self)}, indent=2) + "\n"


def _state_name(state: common_pb2.StoreState.ValueType) -> str:
    name: str = common_pb2.StoreState.Name(state)
    return name.removeprefix("STORE_STATE_").lower()


def _check_store_dir(data_dir: Path) -> None:
    if not data_dir.is_dir():
        raise PreconditionError(f"{data_dir} is not a directory")
    if not (data_dir / DATA_FILE).is_file():
        raise PreconditionError(f"{data_dir} holds no {DATA_FILE}: not a Squall store directory")


def _check_empty_target(dest: Path, what: str) -> None:
    """dest must be missing or an empty directory, and its parent must exist."""
    if dest.exists():
        if not dest.is_dir():
            raise PreconditionError(f"{what} {dest} exists and is not a directory")
        if any(dest.iterdir()):
            raise PreconditionError(f"{what} {dest} is not empty; nothing was changed")
    elif not dest.parent.is_dir():
        raise PreconditionError(f"{what} {dest}: its parent directory {dest.parent} does not exist")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_copy(path: Path, progress: Progress = no_progress) -> tuple[StoreMeta, int, int]:
    """Reads every log entry and state record of the store copy at path, checking each.

    Returns (meta, topics, state records). Opened without a lock file: only for a copy
    that no process has open. Raises BackupError naming what failed.
    """
    try:
        store = Store(LmdbKV(path, DATABASES, map_size_bytes=0, readonly=True, lock=False))
    except (KVError, StoreError) as exc:
        raise BackupError(f"the copy at {path} does not open: {exc}") from exc
    try:
        meta = store.meta()
        lsn = meta.log_start_lsn
        total = max(0, meta.last_lsn - meta.log_start_lsn + 1)
        progress("verify", 0, total)
        # One step per batch of the log: bounded by its length.
        while lsn <= meta.last_lsn:
            entries = store.read_log(lsn, min(_VERIFY_BATCH_ENTRIES, meta.last_lsn - lsn + 1))
            if not entries or entries[0].lsn != lsn:
                raise BackupError(f"the copy's log has no entry at LSN {lsn}")
            lsn = entries[-1].lsn + 1
            progress("verify", lsn - meta.log_start_lsn, total)
        records = 0
        with contextlib.closing(store.snapshot_chunks()) as chunks:
            for chunk in chunks:  # every record's checksum is checked as it is read
                records += len(chunk.records)
        topics = len(store.list_topics())
    except StoreError as exc:
        raise BackupError(f"the copy at {path} does not read back: {exc}") from exc
    finally:
        store.close()
    return meta, topics, records


@contextlib.contextmanager
def _watch_size(path: Path, total: int, progress: Progress) -> Iterator[None]:
    """Reports path's growing size as "copy" progress while the body runs (LMDB's copy is
    one call that reports nothing itself)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_COPY_POLL_INTERVAL_S):
            with contextlib.suppress(OSError):
                progress("copy", min(path.stat().st_size, total), total)

    watcher = threading.Thread(target=watch, name="backup-progress", daemon=True)
    progress("copy", 0, total)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    with contextlib.suppress(OSError):
        # A compacted copy is smaller than the pages in use: done is the copy's size.
        size = path.stat().st_size
        progress("copy", size, size)


def backup(
    data_dir: Path,
    dest: Path,
    progress: Progress = no_progress,
    clock: Clock = SYSTEM_CLOCK,
) -> BackupInfo:
    """Copies the (possibly live) store in data_dir into dest, verified, with a manifest.

    dest must be missing or empty; on any failure it is left as it was.
    """
    data_dir, dest = data_dir.absolute(), dest.absolute()
    _check_store_dir(data_dir)
    _check_empty_target(dest, "backup destination")
    staging = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        try:
            source = LmdbKV(data_dir, DATABASES, map_size_bytes=0, readonly=True)
        except KVError as exc:
            raise BackupError(f"cannot open the store in {data_dir}: {exc}") from exc
        try:
            with _watch_size(staging / DATA_FILE, source.size_bytes(), progress):
                source.copy(staging)
        except KVError as exc:
            raise BackupError(str(exc)) from exc
        finally:
            source.close()
        meta, topics, records = verify_copy(staging, progress)
        data_file = staging / DATA_FILE
        _fsync_path(data_file)
        info = BackupInfo(
            source=str(data_dir),
            host=socket.gethostname(),
            created_unix_s=round(clock.wall_ms() / 1000, 3),
            cluster_id=meta.cluster_id,
            store_state=_state_name(meta.state),
            epoch=meta.epoch,
            last_lsn=meta.last_lsn,
            last_epoch=meta.last_epoch,
            log_start_lsn=meta.log_start_lsn,
            topics=topics,
            state_records=records,
            data_bytes=data_file.stat().st_size,
        )
        manifest = staging / MANIFEST_FILE
        manifest.write_text(info.to_json())
        _fsync_path(manifest)
        _fsync_path(staging)
        if dest.exists():
            dest.rmdir()  # empty, checked above; rename cannot replace it portably
        os.rename(staging, dest)
        _fsync_path(dest.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


def read_manifest(backup_dir: Path) -> BackupInfo:
    """The manifest of a backup directory (BackupError if missing or malformed)."""
    path = backup_dir / MANIFEST_FILE
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise PreconditionError(
            f"{backup_dir} holds no {MANIFEST_FILE}: not a Squall backup"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise BackupError(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise BackupError(f"{path}: not a format {MANIFEST_FORMAT} Squall backup manifest")
    fields = {f.name for f in dataclasses.fields(BackupInfo)}
    try:
        return BackupInfo(**{k: v for k, v in document.items() if k in fields})
    except TypeError as exc:
        raise BackupError(f"{path}: {exc}") from exc


def verify_backup(backup_dir: Path, progress: Progress = no_progress) -> BackupInfo:
    """Reads a backup back in full (`squall store verify`): its manifest, every log entry
    and state record with its checksum, and that the store is the one the manifest names.
    Returns the manifest; BackupError (PreconditionError: not a backup) if anything fails.
    """
    backup_dir = backup_dir.absolute()
    info = read_manifest(backup_dir)
    if not (backup_dir / DATA_FILE).is_file():
        raise BackupError(f"{backup_dir} holds no {DATA_FILE}")
    meta, _, _ = verify_copy(backup_dir, progress)
    if (meta.cluster_id, meta.last_lsn) != (info.cluster_id, info.last_lsn):
        raise BackupError(
            f"{backup_dir}: the store (cluster {meta.cluster_id!r}, LSN {meta.last_lsn}) is "
            f"not the one its manifest describes (cluster {info.cluster_id!r}, "
            f"LSN {info.last_lsn})"
        )
    return info


def _copy_file(source: Path, target: Path, progress: Progress) -> None:
    """shutil.copyfile in chunks, reporting "restore" progress in bytes."""
    total = source.stat().st_size
    done = 0
    progress("restore", 0, total)
    with open(source, "rb") as reader, open(target, "wb") as writer:
        # One step per chunk: bounded by the file's size.
        while chunk := reader.read(_RESTORE_CHUNK_BYTES):
            writer.write(chunk)
            done += len(chunk)
            progress("restore", done, total)


def restore(backup_dir: Path, data_dir: Path, progress: Progress = no_progress) -> BackupInfo:
    """Puts a backup's store into data_dir, which must hold no store; returns its manifest.

    data_dir may be missing (its parent must exist) or hold other files (the node's
    coordinator state), but not a data.mdb. The backup is read back first (a damaged one
    is refused before anything is written), then copied beside its final name, flushed,
    and renamed into place.
    """
    backup_dir, data_dir = backup_dir.absolute(), data_dir.absolute()
    read_manifest(backup_dir)
    if not (backup_dir / DATA_FILE).is_file():
        raise BackupError(f"{backup_dir} holds no {DATA_FILE}")
    if data_dir.exists():
        if not data_dir.is_dir():
            raise PreconditionError(f"data directory {data_dir} exists and is not a directory")
        if (data_dir / DATA_FILE).exists():
            raise PreconditionError(
                f"{data_dir} already holds a store ({DATA_FILE}); move it aside first, "
                "nothing was changed"
            )
    elif not data_dir.parent.is_dir():
        raise PreconditionError(
            f"data directory {data_dir}: its parent {data_dir.parent} does not exist"
        )
    info = verify_backup(backup_dir, progress)
    data_dir.mkdir(mode=0o750, exist_ok=True)
    partial = data_dir / f"{DATA_FILE}.partial"
    try:
        _copy_file(backup_dir / DATA_FILE, partial, progress)
        _fsync_path(partial)
        (data_dir / LOCK_FILE).unlink(missing_ok=True)  # left by the store moved aside
        os.rename(partial, data_dir / DATA_FILE)
        _fsync_path(data_dir)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return info
