"""The in-memory twin of the store's key-value layer, for unit tests and the simulator.

It keeps each named database as a dict plus a sorted key list (bisect), so ordered scans
behave like LMDB's. One lock serializes transactions: a read transaction holds it for
its with-block, so it sees one committed state, and a write transaction holds it until
it commits or rolls back. A write changes the data in place and keeps an undo log, so
an abort restores the state exactly. ``capacity_bytes`` (sum of key and value lengths)
simulates LMDB's map full: the put that would exceed it raises ``KVFullError`` and the
transaction rolls back.

``snapshot()`` (a long-lived read, for a snapshot export) copies every database's index
under the lock and then reads the copy without it: writes go on meanwhile, even from the
thread consuming the export, and the copy costs a reference per record, not the bytes.
``clear(db)`` swaps in an empty database and keeps the old one for a rollback.

A process crash loses nothing committed (as with LMDB, whose commits reach the operating
system at once). A machine crash loses what was committed since the last flush: with
``keep_unsynced`` the twin keeps the undo log of every transaction committed since the
last ``write(sync=True)`` or ``sync()``, and ``lose_unsynced()`` rolls them back, newest
first, to the state LMDB comes back to after a power loss (its last synced meta page);
the damage a filesystem that reorders writes may add is not modelled.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from squall_server.replica.store.kv import MAX_KEY_BYTES, KVError, KVFullError


class _Db:
    """One named database: values by key, and the keys in order."""

    __slots__ = ("data", "keys")

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.keys: list[bytes] = []

    def copy(self) -> _Db:
        """A copy sharing the key and value objects (bytes are immutable)."""
        other = _Db()
        other.data = dict(self.data)
        other.keys = list(self.keys)
        return other


class _ReadTxn:
    """A read transaction; valid only inside its with-block."""

    def __init__(self, kv: MemoryKV, dbs: dict[str, _Db] | None = None) -> None:
        self._kv = kv
        self._dbs = kv.dbs if dbs is None else dbs  # a snapshot reads its own copy
        self.live = True

    def _db(self, db: str) -> _Db:
        if not self.live:
            raise KVError("transaction is finished")
        if self._kv.closed:
            raise KVError("the store is closed")  # as LMDB, even for a snapshot's copy
        try:
            return self._dbs[db]
        except KeyError:
            raise KVError(f"no database named {db!r}") from None

    def get(self, db: str, key: bytes) -> bytes | None:
        """Returns the value stored under key, or None."""
        if not key:
            raise KVError("empty key")  # as LMDB: MDB_BAD_VALSIZE
        return self._db(db).data.get(key)

    def scan(
        self, db: str, start: bytes = b"", end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Yields (key, value) for start <= key < end, in order."""
        d = self._db(db)
        i = bisect_left(d.keys, start)
        while self.live and i < len(d.keys):
            key = d.keys[i]
            if end is not None and key >= end:
                return
            yield key, d.data[key]
            i += 1
        if not self.live:
            raise KVError("transaction finished during a scan")

    def count(self, db: str) -> int:
        """How many keys db holds."""
        return len(self._db(db).keys)


class _WriteTxn(_ReadTxn):
    """The write transaction: changes in place, recording how to undo them."""

    def __init__(self, kv: MemoryKV) -> None:
        super().__init__(kv)
        self.undo: list[tuple[_Db, bytes, bytes | None]] = []
        self.cleared: list[tuple[str, _Db]] = []  # (name, the database clear() replaced)
        self.used_bytes_before = kv.used_bytes

    def generation(self) -> int:
        """How many transactions committed (or were lost to a machine crash) before it."""
        return self._kv.generation

    def _charge(self, delta_bytes: int) -> None:
        cap = self._kv.capacity_bytes
        if cap is not None and delta_bytes > 0 and self._kv.used_bytes + delta_bytes > cap:
            raise KVFullError(f"capacity of {cap} bytes reached")
        self._kv.used_bytes += delta_bytes

    def _store(self, d: _Db, key: bytes, value: bytes) -> bool:
        """Sets key's value (not its place in d.keys); returns whether the key is new."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise KVError(f"key of {len(key)} bytes (1..{MAX_KEY_BYTES} allowed)")
        old = d.data.get(key)
        self._charge(len(value) - len(old) if old is not None else len(key) + len(value))
        self.undo.append((d, key, old))
        d.data[key] = value
        return old is None

    def put(self, db: str, key: bytes, value: bytes) -> None:
        """Stores value under key, replacing any earlier value."""
        d = self._db(db)
        if self._store(d, key, value):
            insort(d.keys, key)

    def put_many(
        self, db: str, items: Iterable[tuple[bytes, bytes]], *, append: bool = False
    ) -> None:
        """Stores every pair; append promises ascending keys above every key in db."""
        d = self._db(db)
        if append:
            # The hot path (new events, log entries): check the promise, then one pass.
            pairs = list(items)
            keys = [key for key, _ in pairs]
            if any(not 0 < len(k) <= MAX_KEY_BYTES for k in keys):
                raise KVError(f"key size outside 1..{MAX_KEY_BYTES} bytes")
            if keys != sorted(set(keys)) or (d.keys and keys and keys[0] <= d.keys[-1]):
                raise KVError("append of keys not ascending above the last key")
            self._charge(sum(len(k) + len(v) for k, v in pairs))
            self.undo.extend((d, key, None) for key in keys)
            d.keys.extend(keys)
            d.data.update(pairs)
            return
        new_keys: list[bytes] = []
        try:
            for key, value in items:
                if self._store(d, key, value):
                    new_keys.append(key)
        finally:
            # d.keys must match d.data even when a put failed. New keys usually form one
            # block (the end of a topic's events): one slice insert, not one per key.
            if new_keys:
                new_keys.sort()
                i = bisect_left(d.keys, new_keys[0])
                if i == len(d.keys) or d.keys[i] > new_keys[-1]:
                    d.keys[i:i] = new_keys
                else:
                    d.keys.extend(new_keys)
                    d.keys.sort()

    def delete(self, db: str, key: bytes) -> bool:
        """Removes key; returns whether it was there."""
        d = self._db(db)
        old = d.data.pop(key, None)
        if old is None:
            return False
        del d.keys[bisect_left(d.keys, key)]
        self.undo.append((d, key, old))
        self._kv.used_bytes -= len(key) + len(old)
        return True

    def delete_range(self, db: str, start: bytes, end: bytes) -> int:
        """Removes every key in [start, end); returns how many."""
        d = self._db(db)
        i, j = bisect_left(d.keys, start), bisect_left(d.keys, end)
        doomed = d.keys[i:j]
        for key in doomed:
            old = d.data.pop(key)
            self.undo.append((d, key, old))
            self._kv.used_bytes -= len(key) + len(old)
        del d.keys[i:j]
        return len(doomed)

    def clear(self, db: str) -> int:
        """Removes every key of db; returns how many there were."""
        d = self._db(db)
        # Each undo record names its own _Db object, so changes made before and after
        # the swap roll back on the right one; the old database comes back afterwards.
        self.cleared.append((db, d))
        self._dbs[db] = _Db()
        self._kv.used_bytes -= sum(len(k) + len(v) for k, v in d.data.items())
        return len(d.keys)

    def rollback(self) -> None:
        """Undoes every change, newest first."""
        for d, key, old in reversed(self.undo):
            if old is None:
                del d.data[key]
                del d.keys[bisect_left(d.keys, key)]
            else:
                if key not in d.data:
                    insort(d.keys, key)
                d.data[key] = old
        self.undo.clear()
        for name, d in reversed(self.cleared):
            self._dbs[name] = d
        self.cleared.clear()
        self._kv.used_bytes = self.used_bytes_before


class MemoryKV:
    """Named ordered databases in memory, with the KV protocol's transactions."""

    def __init__(
        self,
        dbs: Iterable[str],
        *,
        capacity_bytes: int | None = None,
        keep_unsynced: bool = False,
    ) -> None:
        """``keep_unsynced``: remember the transactions committed since the last flush so
        ``lose_unsynced`` can drop them (off by default: that log grows until a flush)."""
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.dbs = {name: _Db() for name in dbs}
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.keep_unsynced = keep_unsynced
        # Transactions committed since the last flush, oldest first (keep_unsynced only).
        self._unsynced: list[_WriteTxn] = []
        self._lock = threading.Lock()
        self.closed = False
        # Transactions committed, and lost by lose_unsynced (WriteTxn.generation).
        self.generation = 0

    def _check_open(self) -> None:
        if self.closed:
            raise KVError("the store is closed")

    @contextmanager
    def read(self) -> Iterator[_ReadTxn]:
        """Opens a read transaction for the duration of the with-block."""
        with self._lock:
            self._check_open()
            txn = _ReadTxn(self)
            try:
                yield txn
            finally:
                txn.live = False

    @contextmanager
    def snapshot(self) -> Iterator[_ReadTxn]:
        """A long-lived read of a copy taken under the lock; writers go on meanwhile."""
        with self._lock:
            self._check_open()
            copy = {name: d.copy() for name, d in self.dbs.items()}
        txn = _ReadTxn(self, copy)
        try:
            yield txn
        finally:
            txn.live = False

    @contextmanager
    def write(self, *, sync: bool) -> Iterator[_WriteTxn]:
        """Opens the write transaction; commits on normal exit, flushed when sync (every
        earlier commit with it, as LMDB's ``env.sync``)."""
        with self._lock:
            self._check_open()
            txn = _WriteTxn(self)
            try:
                yield txn
            except BaseException:
                txn.rollback()
                raise
            finally:
                txn.live = False
            self.generation += 1
            if sync:
                self._unsynced.clear()
            elif self.keep_unsynced:
                self._unsynced.append(txn)

    def sync(self) -> None:
        """Flushes every committed transaction (nothing is lost by ``lose_unsynced``)."""
        self._check_open()
        # Not under the lock: a flush may come while a transaction is open (as LMDB's);
        # one committing meanwhile is flushed or not, either is true of a disk.
        self._unsynced.clear()

    def lose_unsynced(self) -> int:
        """A machine crash: rolls back every transaction committed since the last flush
        (``keep_unsynced`` only), newest first; returns how many were lost. Reopen the
        store over this KV afterwards, as a restarted process would."""
        with self._lock:
            lost, self._unsynced = self._unsynced, []
            for txn in reversed(lost):
                txn.rollback()
            self.generation += len(lost)
            return len(lost)

    def size_bytes(self) -> int:
        """Bytes of keys and values held (what capacity_bytes is measured against)."""
        return self.used_bytes

    def close(self) -> None:
        """Marks the KV closed; the data stays for whoever still holds the object."""
        self.closed = True
