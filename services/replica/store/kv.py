"""The small key-value transaction interface the replica's store runs on.

Two twins implement it: ``kv_lmdb.LmdbKV`` (production) and ``kv_memory.MemoryKV``
(tests and simulation). The store keeps all its logic above this line, so both twins
behave the same as long as they honour these rules:

* A KV holds a fixed set of named databases, given when it is opened. Keys are bytes
  ordered bytewise; a key is at most ``MAX_KEY_BYTES`` long (LMDB's limit).
* One write transaction at a time (the caller serializes writers). Leaving ``write()``
  normally commits; leaving it with an exception aborts, and nothing of the
  transaction is visible to anyone.
* Read transactions see one committed state for their whole life, whatever writes
  commit meanwhile, and may run in any thread while a write is in progress.
* ``scan`` yields ``[start, end)`` in key order. Do not change a database while
  iterating over it in the same transaction.
* ``snapshot()`` is a read transaction meant to live long (a snapshot export consumed
  chunk by chunk while the replica keeps writing): it sees one committed state and never
  blocks the writer, even in the same thread.
* ``WriteTxn.generation()`` names the committed state a write transaction began from, so
  a writer may keep what it knows of the state between its transactions (the store's
  log tail, ``Store.append``) and know when someone else changed it.
* ``clear(db)`` empties a database inside the write transaction in one step (LMDB frees
  its pages instead of deleting key by key); an abort restores it like any change.
* Errors: ``KVFullError`` when the store has no room (the write transaction is
  aborted, earlier data stays readable, later smaller writes may succeed);
  ``KVCorruptError`` when the engine itself detects damage on a read; ``KVError`` for
  anything else the engine reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

# LMDB's compiled-in key limit; the memory twin enforces it too so both refuse the same.
MAX_KEY_BYTES = 511


class KVError(Exception):
    """The key-value engine failed."""


class KVFullError(KVError):
    """No room left: the write transaction was aborted, the store is intact."""


class KVCorruptError(KVError):
    """The engine detected damage while reading a database."""

    def __init__(self, db: str, detail: str) -> None:
        super().__init__(f"{db}: {detail}")
        self.db = db


class ReadTxn(Protocol):
    """A consistent read-only view of every database."""

    def get(self, db: str, key: bytes) -> bytes | None:
        """Returns the value stored under key, or None."""
        ...

    def scan(
        self, db: str, start: bytes = b"", end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Yields (key, value) for start <= key < end (no end: to the last key), in order."""
        ...

    def count(self, db: str) -> int:
        """How many keys db holds (without reading them)."""
        ...


class WriteTxn(ReadTxn, Protocol):
    """A read view that also changes the databases; it sees its own writes."""

    def generation(self) -> int:
        """Which committed state this transaction began from: it grows with every
        transaction that commits a change, by one each (any writer's, and a machine
        crash's loss too), so two write transactions of one KV with the same generation
        began from the same state, and one that began right after a transaction of
        generation g committed has generation g + 1."""
        ...

    def put(self, db: str, key: bytes, value: bytes) -> None:
        """Stores value under key, replacing any earlier value."""
        ...

    def put_many(
        self, db: str, items: Iterable[tuple[bytes, bytes]], *, append: bool = False
    ) -> None:
        """Stores every pair; append promises ascending keys above every key in db."""
        ...

    def delete(self, db: str, key: bytes) -> bool:
        """Removes key; returns whether it was there."""
        ...

    def delete_range(self, db: str, start: bytes, end: bytes) -> int:
        """Removes every key in [start, end); returns how many."""
        ...

    def clear(self, db: str) -> int:
        """Removes every key of db; returns how many there were."""
        ...


class KV(Protocol):
    """A set of named, ordered key-value databases with transactions."""

    def read(self) -> AbstractContextManager[ReadTxn]:
        """Opens a read transaction for the duration of the with-block."""
        ...

    def snapshot(self) -> AbstractContextManager[ReadTxn]:
        """Opens a long-lived read transaction that does not block the writer."""
        ...

    def write(self, *, sync: bool) -> AbstractContextManager[WriteTxn]:
        """Opens the write transaction; commits on normal exit (flushed when sync)."""
        ...

    def sync(self) -> None:
        """Flushes every committed transaction to disk."""
        ...

    def size_bytes(self) -> int:
        """Bytes the databases occupy (for the store-size metric)."""
        ...

    def close(self) -> None:
        """Releases the databases; safe to call twice."""
        ...
