"""Log truncation for a store that cannot undo applied entries: rebuild from its own log.

The store applies each entry to its state in the append's transaction, so removing a
suffix of the log (a deposed master's uncommitted entries) cannot be done in place. But
the log is complete from LSN 1 (nothing compacts it yet), so the state as of any LSN
can be rebuilt by replaying the log up to it into a fresh store: ``stage`` does that
into a directory beside the store (the store keeps serving reads meanwhile), and
``install`` swaps the rebuilt LMDB file in with one atomic rename. A crash before the
rename leaves the old store (the truncation is redone); after it, the truncated one.

Once the store keeps a compacted log and snapshots, truncation below the retained log
start must go through a snapshot instead; ``stage`` refuses it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from squall.v1 import common_pb2
from squall_server.replica.store import Store, StoreError

# Entries copied per append while replaying.
_REPLAY_BATCH_ENTRIES = 1024
_STAGING_DIR = "truncate.staging"
_DATA_FILE = "data.mdb"


class TruncateError(StoreError):
    """The store could not be truncated; it is unchanged."""


class TruncationAbandoned(TruncateError):
    """The replay was given up (``abandoned`` said so); the store is unchanged."""


def _never() -> bool:
    return False


def rebuild_into(
    store: Store, fresh: Store, keep_lsn: int, abandoned: Callable[[], bool] = _never
) -> None:
    """Replays store's log up to keep_lsn into fresh, and carries its metadata over
    (cluster id, epoch, commit record, state); raises TruncateError when the log no longer
    holds those entries. The LMDB truncator stages a file with it; an in-memory store (the
    simulator's) is rebuilt with it in place.

    The replay starts after fresh's own last entry: at LSN 1 for an empty store, or where
    a replay given up before stopped (the caller vouches that fresh holds a prefix of
    store's log: ``LmdbTruncator`` resumes only into a copy of the same store).
    ``abandoned`` is asked before each batch of entries (it may be called from another
    thread than the one that can make it true): once it says so, the replay stops with
    ``TruncationAbandoned``. A replay takes ~25 µs per entry, seconds on a large log, and
    the replica cannot drop its role before it ends (docs/replication.md)."""
    meta = store.meta()
    if not 0 <= keep_lsn <= meta.last_lsn:
        raise TruncateError(f"truncate after LSN {keep_lsn}: the log ends at {meta.last_lsn}")
    next_lsn = fresh.meta().last_lsn + 1
    if next_lsn - 1 > keep_lsn:
        raise TruncateError(
            f"truncate after LSN {keep_lsn}: the copy being rebuilt already ends at {next_lsn - 1}"
        )
    # One replay step per batch of entries: bounded by the log's length.
    while next_lsn <= keep_lsn:
        if abandoned():
            raise TruncationAbandoned(
                f"truncation after LSN {keep_lsn} abandoned with {next_lsn - 1} entries replayed"
            )
        count = min(_REPLAY_BATCH_ENTRIES, keep_lsn - next_lsn + 1)
        entries = store.read_log(next_lsn, count)
        if len(entries) != count:
            raise TruncateError(
                f"the log is missing entries from LSN {next_lsn} (compacted?): "
                "a truncation this far back needs a snapshot"
            )
        fresh.append(entries, sync=False)
        next_lsn += count
    if meta.cluster_id:
        fresh.set_cluster_id(meta.cluster_id)
    fresh.set_epoch(meta.epoch)
    fresh.set_max_seen(meta.max_seen)
    if meta.commit_lsn is not None:
        # Truncation never removes a committed entry; the record stays a fact.
        fresh.set_commit_lsn(min(meta.commit_lsn, keep_lsn))
    state = meta.state
    if state == common_pb2.STORE_STATE_CLEAN:
        fresh.set_state(state, meta.shutdown_id)
    elif keep_lsn or state != common_pb2.STORE_STATE_EMPTY:
        fresh.set_state(common_pb2.STORE_STATE_DIRTY)


class LmdbTruncator:
    """Truncates an LMDB store's log by rebuilding it from its own log.

    A replay given up (``TruncationAbandoned``) keeps its copy, open, beside the store: the
    next truncation of the same store object to an LSN at or past the copy's end resumes
    it instead of replaying from LSN 1 again (chaos seed 86: a slave whose replay was given
    up at a re-formation became the next master and replayed its 10,240 entries again,
    seconds with no master). A store's log changes below its end only by a truncation,
    which replaces the store object, or by a snapshot's install, which the object counts
    (``Store.snapshots_installed``): while both are the same, the store still holds the
    prefix the copy has.
    """

    def __init__(self, data_dir: Path, *, map_size_bytes: int, dedupe_window: int) -> None:
        self.data_dir = data_dir
        self.map_size_bytes = map_size_bytes
        self.dedupe_window = dedupe_window
        # (the store it copies, its snapshots installed then, the copy): a replay given
        # up, to resume.
        self._given_up: tuple[Store, int, Store] | None = None

    def stage(self, store: Store, keep_lsn: int, abandoned: Callable[[], bool] = _never) -> Path:
        """Replays store's log up to keep_lsn into a fresh store beside it (slow; off-loop),
        or resumes a replay of the same store given up before; given up once ``abandoned``
        says so, its copy kept for the next stage of this store."""
        meta = store.meta()
        if not 0 <= keep_lsn <= meta.last_lsn:
            raise TruncateError(f"truncate after LSN {keep_lsn}: the log ends at {meta.last_lsn}")
        fresh = self._resumable(store, keep_lsn) or self._new_copy()
        try:
            rebuild_into(store, fresh, keep_lsn, abandoned)
        except TruncationAbandoned:
            self._given_up = (store, store.snapshots_installed, fresh)
            raise
        except BaseException:
            self._drop_copy(fresh)
            raise
        return self._finish_copy(fresh)

    def resumes_from(self, store: Store, keep_lsn: int) -> int:
        """The last LSN a replay of store given up has copied, when a truncation to
        keep_lsn would resume it (0: it would replay from LSN 1)."""
        if self._given_up is None:
            return 0
        source, installed, copy = self._given_up
        if source is not store or installed != store.snapshots_installed:
            return 0
        copied = copy.meta().last_lsn
        return copied if copied <= keep_lsn else 0

    def _resumable(self, store: Store, keep_lsn: int) -> Store | None:
        """The copy of a replay of store given up, when it can go on to keep_lsn; any
        other given-up copy is dropped."""
        resumes = self.resumes_from(store, keep_lsn) > 0
        given_up, self._given_up = self._given_up, None
        if given_up is None:
            return None
        copy = given_up[2]
        if resumes:
            return copy
        self._drop_copy(copy)
        return None

    def _new_copy(self) -> Store:
        """An empty store to replay into (the staging directory, made afresh)."""
        staging = self.data_dir / _STAGING_DIR
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return Store.open_lmdb(staging, self.map_size_bytes, dedupe_window=self.dedupe_window)

    def _drop_copy(self, copy: Store) -> None:
        copy.close()
        shutil.rmtree(self.data_dir / _STAGING_DIR, ignore_errors=True)

    def _finish_copy(self, copy: Store) -> Path:
        """The replayed copy made durable and closed: the path ``swap`` takes."""
        try:
            copy.sync()
        except BaseException:
            self._drop_copy(copy)
            raise
        copy.close()
        return self.data_dir / _STAGING_DIR

    def install(self, store: Store, staging: Path) -> Store:
        """Closes store, swaps the staged file in atomically, and opens the result."""
        installed = self.swap(store, staging)
        self.settle(staging)
        return installed

    def swap(self, store: Store, staging: Path) -> Store:
        """The quick half of ``install``: closes store, renames the staged file over it and
        opens the result. The rename is durable only once ``settle`` returned; nothing may
        be acknowledged from the truncated store before (a replica runs ``settle`` on its
        store thread, so its event loop does not wait for the disk)."""
        store.close()
        os.replace(staging / _DATA_FILE, self.data_dir / _DATA_FILE)
        return Store.open_lmdb(self.data_dir, self.map_size_bytes, dedupe_window=self.dedupe_window)

    def settle(self, staging: Path) -> None:
        """The slow half of ``install``: flushes the directory (the rename) and removes
        the staging directory."""
        dir_fd = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        shutil.rmtree(staging, ignore_errors=True)

    def discard(self) -> None:
        """Removes a staging directory left by a crash, or by a replay given up."""
        given_up, self._given_up = self._given_up, None
        if given_up is not None:
            self._drop_copy(given_up[2])
        shutil.rmtree(self.data_dir / _STAGING_DIR, ignore_errors=True)
