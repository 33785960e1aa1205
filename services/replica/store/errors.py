"""The errors the replica's store raises (``StoreError`` and its kinds)."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises."""


class StoreFullError(StoreError):
    """The LMDB map (or the memory twin's capacity) is full: the write was aborted."""


class StoreWriteError(StoreError):
    """A write failed for another reason: fail-stop, the replica stops serving."""


class InvalidEntryError(StoreError):
    """An entry was refused before anything was written."""


class StaleEpochError(StoreError):
    """An epoch older than the store's newest accepted epoch."""


class UnknownTopicError(StoreError):
    """A read named a topic the store does not hold."""


class LogCompactedError(StoreError):
    """The log entries asked for were compacted away: only a snapshot holds them now."""

    def __init__(self, from_lsn: int, log_start_lsn: int) -> None:
        super().__init__(
            f"log entry LSN {from_lsn} was compacted: the log starts at LSN {log_start_lsn}"
        )
        self.from_lsn = from_lsn
        self.log_start_lsn = log_start_lsn


class SnapshotError(StoreError):
    """A snapshot call out of order, or a chunk that does not fit the install in progress.

    Nothing was written. (A chunk whose record fails its checksum raises
    ``CorruptRecordError`` instead.)
    """


class CorruptRecordError(StoreError):
    """A stored record failed its checks; its data is not returned."""

    def __init__(self, db: str, key: bytes, detail: str) -> None:
        super().__init__(f"corrupt record in {db} at key {key.hex() or '?'}: {detail}")
        self.db = db
        self.key = key
