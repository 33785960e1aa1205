"""The LMDB implementation of the store's key-value layer (production).

One ``lmdb.Environment`` holds every named database. It is opened with ``sync=False``
and ``metasync=False`` so a commit does not flush by itself: ``write(sync=True)`` calls
``env.sync(True)`` after the commit, and ``write(sync=False)`` (the WRITE_NO_SYNC policy)
leaves flushing to the operating system. Without ``writemap`` LMDB writes pages with
``pwrite``, so a process crash loses nothing committed; an operating-system crash may
lose (and, on a filesystem that reorders writes, damage) what was not yet synced —
which is why every record also carries its own checksum above this layer.

Read transactions never block the writer, so ``snapshot()`` is an ordinary read
transaction; py-lmdb opens every environment with ``MDB_NOTLS``, so it may be consumed
from one thread after another (never from two at once). While it lives, LMDB cannot
reuse the pages it sees: a long snapshot export lets the file grow by what is written
meanwhile, and takes one of ``max_readers`` reader slots.

``lmdb.MapFullError`` becomes ``KVFullError`` with the transaction aborted; LMDB's own
corruption reports on reads become ``KVCorruptError``; any other LMDB error ``KVError``.
A commit that failed because the filesystem is full says so (``_full_filesystem``): LMDB
reports the short write a nearly full filesystem gives as an I/O error, which reads like
a failing disk. It is still a ``KVError`` (the replica fail-stops, and another node with
room takes over), but the store is sound and the operator's remedy differs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager

import lmdb

from squall_server.replica import fault_hooks
from squall_server.replica.store.kv import KVCorruptError, KVError, KVFullError

_CORRUPT_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadChecksumError)

# What LMDB's commit says when the filesystem is out of room: the errno's own text, or
# EIO for a short write (mdb_page_flush: "short write, filesystem full?").
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")
_SHORT_WRITE_TEXT = "Input/output error"
# Below this much room, an I/O error on commit is taken for a full filesystem: a short
# write leaves next to nothing, and a failing disk that is also this full reads the same.
NEARLY_FULL_BYTES = 16 << 20


def _full_filesystem(path: str, exc: lmdb.Error) -> str:
    """Says so when exc is how LMDB reports a full filesystem under path ("" otherwise)."""
    text = str(exc)
    try:
        room = os.statvfs(path)
    except OSError:
        return ""
    available = room.f_bavail * room.f_frsize
    if not any(t in text for t in _FULL_TEXTS) and not (
        _SHORT_WRITE_TEXT in text and available < NEARLY_FULL_BYTES
    ):
        return ""
    return (
        f"the filesystem holding {path} is full ({available} of "
        f"{room.f_blocks * room.f_frsize} bytes available): the write was aborted and the "
        "store is sound; free space, then start the node's processes again "
        "(docs/operations.md, 'A full disk')"
    )


def _translate(db: str, exc: lmdb.Error) -> KVError:
    """Maps an LMDB error to the KV layer's errors."""
    if isinstance(exc, lmdb.MapFullError):
        return KVFullError(f"LMDB map full while writing {db}: {exc}")
    if isinstance(exc, _CORRUPT_ERRORS):
        return KVCorruptError(db, f"LMDB reports corruption: {exc}")
    return KVError(f"LMDB error on {db}: {exc}")


class _ReadTxn:
    """Wraps an LMDB transaction with database names instead of handles."""

    def __init__(self, txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
        self._txn = txn
        self._dbs = dbs

    def _db(self, db: str) -> lmdb._Database:
        try:
            return self._dbs[db]
        except KeyError:
            raise KVError(f"no database named {db!r}") from None

    def get(self, db: str, key: bytes) -> bytes | None:
        """Returns the value stored under key, or None."""
        # The handle looked up inline, not through _db: a publish makes ~10 gets.
        try:
            return self._txn.get(key, db=self._dbs[db])
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc
        except KeyError:
            raise KVError(f"no database named {db!r}") from None

    def scan(
        self, db: str, start: bytes = b"", end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Yields (key, value) for start <= key < end, in order."""
        try:
            with self._txn.cursor(self._db(db)) as cur:
                if not cur.set_range(start):
                    return
                for key, value in cur.iternext():
                    if end is not None and key >= end:
                        return
                    yield key, value
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc

    def count(self, db: str) -> int:
        """How many keys db holds (LMDB keeps the count: no scan)."""
        try:
            entries: int = self._txn.stat(self._db(db))["entries"]
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc
        return entries


class _ReadOnlyTxn(_ReadTxn):
    """A read transaction that is its own context manager: aborted at the end of the
    with-block (a class, not a generator: a read is a few microseconds, and committed
    reads open several per publish and per delivery)."""

    def __enter__(self) -> _ReadOnlyTxn:
        return self

    def __exit__(self, *exc: object) -> None:
        self._txn.abort()


class _WriteTxn(_ReadTxn):
    """The write transaction."""

    def generation(self) -> int:
        """The last committed transaction's id (LMDB numbers a write transaction one
        above it, and a commit without changes does not count)."""
        return int(self._txn.id()) - 1

    def put(self, db: str, key: bytes, value: bytes) -> None:
        """Stores value under key, replacing any earlier value."""
        try:
            self._txn.put(key, value, db=self._dbs[db])
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc
        except KeyError:
            raise KVError(f"no database named {db!r}") from None

    def put_many(
        self, db: str, items: Iterable[tuple[bytes, bytes]], *, append: bool = False
    ) -> None:
        """Stores every pair in one call; append uses MDB_APPEND (and packs pages fully)."""
        handle = self._db(db)
        try:
            if isinstance(items, list) and len(items) == 1:
                # One pair (a lone publish's event and log entry): a put, no cursor.
                key, value = items[0]
                consumed = 1
                added = int(self._txn.put(key, value, db=handle, append=append))
            else:
                with self._txn.cursor(handle) as cur:
                    consumed, added = cur.putmulti(items, append=append)
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc
        if consumed != added:
            raise KVError(f"{db}: {consumed - added} of {consumed} puts refused (append order?)")

    def delete(self, db: str, key: bytes) -> bool:
        """Removes key; returns whether it was there."""
        try:
            return self._txn.delete(key, db=self._db(db))
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc

    def delete_range(self, db: str, start: bytes, end: bytes) -> int:
        """Removes every key in [start, end); returns how many."""
        count = 0
        try:
            with self._txn.cursor(self._db(db)) as cur:
                if not cur.set_range(start):
                    return 0
                # delete() moves to the next key; an empty key means we ran off the end.
                while True:
                    key = cur.key()
                    if not key or key >= end or not cur.delete():
                        return count
                    count += 1
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc

    def clear(self, db: str) -> int:
        """Removes every key of db (mdb_drop: frees its pages); returns how many there were."""
        try:
            handle = self._db(db)
            count: int = self._txn.stat(handle)["entries"]
            self._txn.drop(handle, delete=False)
        except lmdb.Error as exc:
            raise _translate(db, exc) from exc
        return count


class _WriteScope(_WriteTxn):
    """The write transaction as its own context manager: committed on normal exit (then
    flushed when sync), aborted on an exception (a class, not a generator: every append
    opens one)."""

    def __init__(self, kv: LmdbKV, txn: lmdb.Transaction[bytes], sync: bool) -> None:
        super().__init__(txn, kv._dbs)
        self._kv = kv
        self._sync = sync

    def __enter__(self) -> _WriteTxn:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        txn = self._txn
        if kind is not None:
            txn.abort()
            return
        try:
            fault_hooks.before_commit(txn)  # chaos tests only: see fault_hooks
            txn.commit()  # LMDB frees the transaction even when the commit fails
        except lmdb.Error as exc:
            full = _full_filesystem(self._kv.path, exc)
            if full:
                raise KVError(f"LMDB error on commit: {exc}: {full}") from exc
            raise _translate("commit", exc) from exc
        if self._sync:
            self._kv.sync()


class LmdbKV:
    """Named LMDB databases in one environment, with the KV protocol's transactions."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        dbs: Iterable[str],
        *,
        map_size_bytes: int,
        max_readers: int = 126,
        readonly: bool = False,
        lock: bool = True,
    ) -> None:
        """Opens (creates) the environment; readonly opens an existing one as it is.

        readonly: no write transaction, no database created, and the map size the file
        records (map_size_bytes is ignored), so another process may keep writing it.
        lock=False only for a store no other process can have open (a fresh copy).
        """
        names = list(dbs)
        self.path = os.fspath(path)
        if map_size_bytes <= 0 and not readonly:
            raise ValueError(f"map_size_bytes must be positive, got {map_size_bytes}")
        if not lock and not readonly:
            raise ValueError("only a read-only open may go without LMDB's lock")
        try:
            self._env = lmdb.open(
                os.fspath(path),
                # 0: LMDB takes the size the writer recorded in the file.
                map_size=0 if readonly else map_size_bytes,
                max_dbs=len(names),
                max_readers=max_readers,
                writemap=False,
                sync=False,
                metasync=False,
                subdir=True,
                readonly=readonly,
                create=not readonly,
                lock=lock,
            )
            self._dbs: dict[str, lmdb._Database] = {}
            for name in names:
                try:
                    self._dbs[name] = self._env.open_db(name.encode(), create=not readonly)
                except lmdb.NotFoundError:
                    if not readonly:
                        raise
                    # A store last written before the database existed (a read-only open
                    # creates none): reading it fails, the others read as they are.
        except (lmdb.Error, OSError) as exc:
            raise KVError(f"cannot open LMDB environment at {os.fspath(path)!r}: {exc}") from exc
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise KVError("the store is closed")

    def read(self) -> AbstractContextManager[_ReadTxn]:
        """Opens a read transaction for the duration of the with-block."""
        self._check_open()
        try:
            txn = self._env.begin(write=False)
        except lmdb.Error as exc:
            raise KVError(f"cannot begin a read transaction: {exc}") from exc
        return _ReadOnlyTxn(txn, self._dbs)

    def snapshot(self) -> AbstractContextManager[_ReadTxn]:
        """A long-lived read transaction: LMDB readers never block the writer."""
        return self.read()

    def write(self, *, sync: bool) -> AbstractContextManager[_WriteTxn]:
        """Opens the write transaction; commits on normal exit, then flushes if sync."""
        self._check_open()
        try:
            txn = self._env.begin(write=True)
        except lmdb.Error as exc:
            raise KVError(f"cannot begin a write transaction: {exc}") from exc
        return _WriteScope(self, txn, sync)

    def sync(self) -> None:
        """Flushes every committed transaction to disk (fsync)."""
        self._check_open()
        fault_hooks.before_sync()  # chaos tests only: see fault_hooks
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            raise KVError(f"LMDB sync failed: {exc}") from exc

    def copy(self, path: str | os.PathLike[str]) -> None:
        """Writes a compacted, consistent copy of the environment into the empty dir path.

        LMDB copies from one read transaction (mdb_env_copy2 with MDB_CP_COMPACT), so the
        copy is the state of one commit even while another process keeps writing; it
        holds a reader slot, and so the writer's freed pages, until it is done.
        """
        self._check_open()
        try:
            self._env.copy(os.fspath(path), compact=True)
        except lmdb.Error as exc:
            raise KVError(
                f"cannot copy the LMDB environment to {os.fspath(path)!r}: {exc}"
            ) from exc

    def size_bytes(self) -> int:
        """Bytes of the data file in use: pages up to the highest LMDB has written."""
        self._check_open()
        try:
            pages = self._env.info()["last_pgno"] + 1
            page_bytes = self._env.stat()["psize"]
        except lmdb.Error as exc:
            raise KVError(f"cannot read the LMDB environment's size: {exc}") from exc
        return int(pages * page_bytes)

    def close(self) -> None:
        """Closes the environment; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._env.close()
