"""`squall store backup` and `squall store restore`: a live store's verified copy, and back.

    squall store backup DATA_DIR DEST      copy the store in DATA_DIR (the replica may run)
    squall store restore BACKUP DATA_DIR   put a backup into a stopped node's empty DATA_DIR
    squall store verify BACKUP             read a backup back in full (e.g. from cron)

Each shows a progress line (rate, ETA) on stderr while it copies or reads (--quiet: none).

Run them as the user the services run as (the backup opens the store's lock file to
register as a reader). Exit status 0 on success, 1 if the copy failed, 2 for bad
arguments (a destination that is not empty, a directory that holds no store); in every
failure nothing is left behind. See docs/deployment.md for the procedures.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import sys
from pathlib import Path
from typing import TextIO

from squall_server.cli.progress import ProgressLine
from squall_server.common.clock import SYSTEM_CLOCK
from squall_server.common.loss import new_loss_id, record_loss
from squall_server.common.loss_record import LossRecord
from squall_server.coordinator.persist import STATE_FILE_NAME, StateFileError, load_state
from squall_server.replica import backup as store_backup

log = logging.getLogger("squall.cli")


def restore_loss(
    node_id: str, info: store_backup.BackupInfo, node_epoch: int, operator: str, at_ms: int
) -> LossRecord | None:
    """The loss report of restoring a backup older than what the node had run: its
    coordinator had accepted an epoch above the backup's, so the store it replaced held
    entries the backup lacks. None when nothing says the backup is older."""
    if node_epoch <= info.epoch:
        return None
    return LossRecord(
        loss_id=new_loss_id(),
        node_id=node_id,
        at_ms=at_ms,
        cause="restore",
        operator_action=f"squall store restore by {operator}",
        detail=(
            f"a backup of epoch {info.epoch} (log up to LSN {info.last_lsn}, last entry's "
            f"epoch {info.last_epoch}) replaced a store that had run up to epoch "
            f"{node_epoch}: its entries after LSN {info.last_lsn} are gone from this node; "
            "the running cluster gives them back if a majority of the other stores holds "
            "them, otherwise acknowledged events after the backup are lost"
        ),
        epoch=node_epoch,
        first_epoch=info.last_epoch,
        first_lsn=info.last_lsn + 1,
    )


def store_commands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    """The `squall store` command group's subcommands, created on first use.

    Other modules add their own `store` subcommands through this, so the group is
    defined once whoever registers first.
    """
    existing = commands.choices.get("store")
    if existing is not None:
        for action in existing._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
    store = commands.add_parser("store", help="work on a node's store directory (offline tools)")
    sub: argparse._SubParsersAction = store.add_subparsers(  # type: ignore[type-arg]
        dest="store_command", required=True, metavar="ACTION"
    )
    return sub


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `store backup` and `store restore`."""
    sub = store_commands(commands)
    backup = sub.add_parser(
        "backup",
        help="copy a (live) store, verified, into an empty directory",
        description="Copies the store in DATA_DIR from one LMDB read transaction while its "
        "replica keeps running, reads the copy back, and writes it with a manifest to DEST.",
    )
    backup.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="a node's data_dir")
    backup.add_argument("dest", type=Path, metavar="DEST", help="missing or empty directory")
    backup.set_defaults(handler=run)
    restore = sub.add_parser(
        "restore",
        help="put a backup into a stopped node's data directory (which holds no store)",
    )
    restore.add_argument("backup", type=Path, metavar="BACKUP", help="a `store backup` DEST")
    restore.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="the node's data_dir")
    restore.set_defaults(handler=run)
    verify = sub.add_parser(
        "verify",
        help="read a backup back in full: every entry's checksum, the manifest (exit 1 if bad)",
    )
    verify.add_argument("backup", type=Path, metavar="BACKUP", help="a `store backup` DEST")
    verify.set_defaults(handler=run)
    for command in (backup, restore, verify):
        command.add_argument(
            "--quiet", action="store_true", help="no progress line (the result line only)"
        )


def _report_restore_loss(data_dir: Path, info: store_backup.BackupInfo, out: TextIO) -> None:
    """Records a loss report when the node's coordinator state shows it ran past the
    backup (the epoch it accepted is newer than the backup's)."""
    try:
        node_epoch = load_state(data_dir / STATE_FILE_NAME).epoch
    except StateFileError:
        node_epoch = 0
    record = restore_loss(
        data_dir.resolve().name, info, node_epoch, getpass.getuser(), SYSTEM_CLOCK.wall_ms()
    )
    if record is None:
        return
    record_loss(data_dir, record, log)
    print(
        f"{data_dir}: the node had run up to epoch {node_epoch}, past this backup (epoch "
        f"{info.epoch}): recorded loss report {record.loss_id}, shown in `squall status` "
        f"until `squall cluster ack-loss {record.loss_id}`",
        file=out,
    )


def _describe(info: store_backup.BackupInfo) -> str:
    return (
        f"cluster {info.cluster_id or '(none yet)'}, {info.store_state} store, "
        f"epoch {info.epoch}, log {info.log_start_lsn}..{info.last_lsn} "
        f"(last entry's epoch {info.last_epoch}), {info.topics} topics, "
        f"{info.state_records} state records, {info.data_bytes} bytes"
    )


def run(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    """Runs `store backup` or `store restore`; returns the exit status."""
    err = err if err is not None else sys.stderr
    progress = ProgressLine(err)
    report: store_backup.Progress = progress if not args.quiet else store_backup.no_progress
    try:
        if args.store_command == "backup":
            info = store_backup.backup(args.data_dir, args.dest, report)
            progress.finish()
            print(f"backed up {args.data_dir} to {args.dest}: {_describe(info)}", file=out)
        elif args.store_command == "verify":
            info = store_backup.verify_backup(args.backup, report)
            progress.finish()
            print(f"verified {args.backup}: {_describe(info)}", file=out)
        else:
            info = store_backup.restore(args.backup, args.data_dir, report)
            progress.finish()
            print(f"restored {args.backup} into {args.data_dir}: {_describe(info)}", file=out)
            _report_restore_loss(args.data_dir, info, out)
            print(
                "start the node; it rejoins its group and catches up from the master",
                file=out,
            )
    except store_backup.PreconditionError as exc:
        progress.finish()
        print(f"squall: {exc}", file=err)
        return 2
    except store_backup.BackupError as exc:
        progress.finish()
        print(f"squall: {exc}", file=err)
        return 1
    except OSError as exc:
        progress.finish()
        print(f"squall: {exc}", file=err)
        return 1
    return 0
