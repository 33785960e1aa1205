"""`squall store ...`: a node's store, read and marked offline (docs/operations.md).

    squall store inspect DIR [--json]          cluster id, shutdown id, state, epoch, log, counts
    squall store mark-clean DIR [--shutdown-id ID]
    squall store mark-dirty DIR

DIR is a node's `data_dir`. `inspect` never changes the store: with the replica stopped it
opens LMDB read-only without its lock file (nothing at all is written); with the replica
running it reads through LMDB's lock, as any reader does. `mark-clean` and `mark-dirty`
refuse while a replica holds the directory (DIR/replica.lock), and change only the store's
state and shutdown id.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import uuid
from pathlib import Path
from typing import TextIO, cast

from squall.v1 import common_pb2
from squall_server.cli.store_backup import store_commands
from squall_server.common.clock import SYSTEM_CLOCK
from squall_server.common.loss import new_loss_id, record_loss
from squall_server.common.loss_record import LossRecord
from squall_server.coordinator.persist import STATE_FILE_NAME, StateFileError, load_state
from squall_server.replica.datadir import DataDirBusy, DataDirLock, is_locked
from squall_server.replica.store import Store, StoreError, StoreMeta

# Room above the data file's size when opening it to write the state record (LMDB copies
# the pages it changes).
_WRITE_HEADROOM_BYTES = 16 << 20
_MIN_MAP_BYTES = 1 << 20
# Labels of `inspect`'s text output are padded to this width ("coordinator:").
_LABEL_WIDTH = 12
_STATE_NAMES = {
    common_pb2.STORE_STATE_EMPTY: "empty",
    common_pb2.STORE_STATE_CLEAN: "clean",
    common_pb2.STORE_STATE_DIRTY: "dirty",
}


log = logging.getLogger("squall.cli")


def manual_recovery_loss(
    node_id: str, meta: StoreMeta, shutdown_id: str, operator: str, at_ms: int
) -> LossRecord:
    """The loss report of `store mark-clean` on a dirty store: the cluster restarts from this
    log, so whatever acknowledged entries came after it on other stores are given up."""
    known = f", knew LSN {meta.commit_lsn} committed" if meta.commit_lsn is not None else ""
    return LossRecord(
        loss_id=new_loss_id(),
        node_id=node_id,
        at_ms=at_ms,
        cause="manual-recovery",
        operator_action=f"squall store mark-clean by {operator} (shutdown id {shutdown_id})",
        detail=(
            f"a dirty store (log epoch {meta.last_epoch} LSN {meta.last_lsn}{known}) was "
            "marked clean: the cluster restarts from its log, and any acknowledged event "
            "after it that only other stores held is given up (how many is unknown here; a "
            "store with a newer log that starts is refused, so start every store you have)"
        ),
        epoch=meta.epoch,
        first_epoch=meta.last_epoch,
        last_epoch=meta.last_epoch,
        first_lsn=meta.last_lsn + 1,
    )


class StoreToolError(Exception):
    """An offline store command failed; nothing was changed. The message says why."""


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `store inspect`, `store mark-clean` and `store mark-dirty`."""
    sub = store_commands(commands)
    inspect = sub.add_parser(
        "inspect", help="cluster id, shutdown id, state, epoch, last LSN and counts of a store"
    )
    inspect.add_argument("dir", metavar="DIR", help="the node's data directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    clean = sub.add_parser(
        "mark-clean",
        help="make this store the one a cluster restarts from after a total failure",
    )
    clean.add_argument("dir", metavar="DIR", help="the node's data directory (replica stopped)")
    clean.add_argument(
        "--shutdown-id",
        metavar="ID",
        help="record this shutdown id (default: a new one); give several stores holding the "
        "same log the same id",
    )
    dirty = sub.add_parser(
        "mark-dirty", help="stop a clean store from counting as clean (an older shutdown)"
    )
    dirty.add_argument("dir", metavar="DIR", help="the node's data directory (replica stopped)")


def _data_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "data.mdb").is_file():
        raise StoreToolError(f"no store at {path}: it holds no data.mdb (is it a data_dir?)")
    return path


def _map_size(path: Path, headroom: int) -> int:
    return max((path / "data.mdb").stat().st_size + headroom, _MIN_MAP_BYTES)


def _open(path: Path, *, write: bool, running: bool = False) -> Store:
    try:
        if write:
            return Store.open_lmdb(path, _map_size(path, _WRITE_HEADROOM_BYTES))
        return Store.open_lmdb(path, _map_size(path, 0), readonly=True, lock=running)
    except StoreError as exc:
        raise StoreToolError(f"cannot open the store at {path}: {exc}") from None


def inspect(path_text: str) -> dict[str, object]:
    """Everything `store inspect` shows, read without changing the store."""
    path = _data_dir(path_text)
    running = is_locked(path)
    store = _open(path, write=False, running=running)
    try:
        meta = store.meta()
        counts = store.counts()
    except StoreError as exc:
        raise StoreToolError(f"cannot read the store at {path}: {exc}") from None
    finally:
        store.close()
    report: dict[str, object] = {
        "dir": str(path.resolve()),
        "replica_running": running,
        "state": _STATE_NAMES.get(meta.state, str(meta.state)),
        "cluster_id": meta.cluster_id,
        "shutdown_id": meta.shutdown_id,
        "epoch": meta.epoch,
        "last_epoch": meta.last_epoch,
        "last_lsn": meta.last_lsn,
        "log_start_lsn": meta.log_start_lsn,
        "max_seen": meta.max_seen,
        "snapshot_pending": meta.snapshot_pending,
        "counts": {
            "topics": counts["topics"],
            "events": counts["events"],
            "subscriptions": counts["cursors"],
            "publishers": counts["publishers"],
            "dedupe_records": counts["dedupe"],
            "log_entries": counts["log"],
        },
    }
    state_file = path / STATE_FILE_NAME
    if state_file.exists():
        try:
            persisted = load_state(state_file)
        except StateFileError as exc:
            report["coordinator"] = {"error": str(exc)}
        else:
            report["coordinator"] = {
                "epoch": persisted.epoch,
                "max_seen": persisted.max_seen,
                "cluster_id": persisted.cluster_id,
                "quorum_override": persisted.quorum_override,
                "designated_primary": persisted.designated_primary,
            }
    return report


def _print_inspection(report: dict[str, object], out: TextIO) -> None:
    counts = cast(dict[str, int], report["counts"])
    state = str(report["state"])
    if report["shutdown_id"]:
        state += f" (shutdown {report['shutdown_id']})"
    if report["snapshot_pending"]:
        state += "; an unfinished snapshot install is staged (not part of what is shown)"
    running = "yes: its replica is running" if report["replica_running"] else "no"
    lines = [
        ("store", report["dir"]),
        ("in use", running),
        ("state", state),
        ("cluster id", report["cluster_id"] or "-"),
        ("epoch", f"{report['epoch']} (newest accepted)"),
        (
            "last entry",
            f"epoch {report['last_epoch']} LSN {report['last_lsn']} (log holds LSNs "
            f"{report['log_start_lsn']}..{report['last_lsn']})",
        ),
        ("counts", "  ".join(f"{name}={value}" for name, value in counts.items())),
    ]
    coordinator = report.get("coordinator")
    if isinstance(coordinator, dict):
        if "error" in coordinator:
            text = str(coordinator["error"])
        else:
            text = (
                f"epoch {coordinator['epoch']}, max seen {coordinator['max_seen']}, cluster "
                f"{coordinator['cluster_id'] or '-'}"
            )
            if coordinator["quorum_override"]:
                text += f", QUORUM OVERRIDE {coordinator['quorum_override']}"
            if coordinator["designated_primary"]:
                text += ", DESIGNATED PRIMARY"
        lines.append(("coordinator", text))
    for label, value in lines:
        print(f"{label + ':':<{_LABEL_WIDTH}} {value}", file=out)


def _node_of(path: Path) -> str:
    """The node whose data directory this is, as far as the tool can tell (its name)."""
    return path.resolve().name


def _describe(meta: StoreMeta) -> str:
    return f"cluster {meta.cluster_id or '-'}, log epoch {meta.last_epoch} LSN {meta.last_lsn}"


def mark_clean(path_text: str, shutdown_id: str | None, out: TextIO) -> None:
    """Records a shutdown id in a stopped node's store: it becomes CLEAN."""
    path = _data_dir(path_text)
    chosen = shutdown_id or f"manual-{uuid.uuid4().hex[:20]}"
    if not chosen or len(chosen) > 64 or not all(c.isalnum() or c in "_-" for c in chosen):
        raise StoreToolError(
            f"shutdown id {chosen[:80]!r} is not 1-64 characters of A-Z a-z 0-9 _ -"
        )
    try:
        with DataDirLock(path):
            store = _open(path, write=True)
            try:
                meta = store.meta()
                if meta.state == common_pb2.STORE_STATE_EMPTY or not meta.cluster_id:
                    raise StoreToolError(
                        f"{path} is an empty store (no cluster id, LSN {meta.last_lsn}): there "
                        "is nothing to recover from it; nothing was changed"
                    )
                if meta.state == common_pb2.STORE_STATE_CLEAN and meta.shutdown_id == chosen:
                    print(f"{path}: already clean (shutdown {chosen}); {_describe(meta)}", file=out)
                    return
                store.sync()
                store.set_state(common_pb2.STORE_STATE_CLEAN, chosen)
            except StoreError as exc:
                raise StoreToolError(f"cannot mark {path} clean: {exc}") from None
            finally:
                store.close()
    except DataDirBusy as exc:
        raise StoreToolError(f"{exc}; nothing was changed") from None
    was = _STATE_NAMES.get(meta.state, str(meta.state))
    if meta.state == common_pb2.STORE_STATE_DIRTY:
        record = manual_recovery_loss(
            _node_of(path), meta, chosen, getpass.getuser(), SYSTEM_CLOCK.wall_ms()
        )
        record_loss(path, record, log)
        print(
            f"{path}: recorded loss report {record.loss_id} (a manual recovery may give up "
            "acknowledged events; shown in `squall status` until `squall cluster ack-loss "
            f"{record.loss_id}`)",
            file=out,
        )
    print(
        f"{path}: marked clean with shutdown id {chosen} (was {was}); {_describe(meta)}.\n"
        "Start every node: the cluster restarts from this store, the others are updated "
        "from it.",
        file=out,
    )


def mark_dirty(path_text: str, out: TextIO) -> None:
    """Makes a stopped node's CLEAN store DIRTY (a shutdown the cluster ran past)."""
    path = _data_dir(path_text)
    try:
        with DataDirLock(path):
            store = _open(path, write=True)
            try:
                meta = store.meta()
                if meta.state != common_pb2.STORE_STATE_CLEAN:
                    state = _STATE_NAMES.get(meta.state, str(meta.state))
                    print(f"{path}: not clean ({state}); nothing to do", file=out)
                    return
                store.set_state(common_pb2.STORE_STATE_DIRTY)
            except StoreError as exc:
                raise StoreToolError(f"cannot mark {path} dirty: {exc}") from None
            finally:
                store.close()
    except DataDirBusy as exc:
        raise StoreToolError(f"{exc}; nothing was changed") from None
    print(
        f"{path}: marked dirty (was clean, shutdown {meta.shutdown_id}); {_describe(meta)}",
        file=out,
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Runs one `squall store` command; returns the exit status."""
    if args.store_command == "inspect":
        report = inspect(args.dir)
        if args.json:
            print(json.dumps(report, indent=2, sort_keys=True), file=out)
        else:
            _print_inspection(report, out)
        return 0
    if args.store_command == "mark-clean":
        mark_clean(args.dir, args.shutdown_id, out)
        return 0
    mark_dirty(args.dir, out)
    return 0
