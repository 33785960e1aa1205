"""Where two replicas' logs part, found from their epoch histories alone (pure, no I/O).

A log's epoch history lists, oldest first, where each epoch's entries start:
``(epoch, start_lsn)``. The epoch of the entry at LSN ``x`` is the epoch of the last
boundary starting at or below ``x``.

Log matching: one master per epoch writes that epoch's entries, and a replica holds an
entry of epoch ``e`` only after truncating its log to where it agrees with that master
and copying the master's log from there. So two logs holding an entry with the same LSN
and epoch hold the same entry *and every entry before it*: the LSNs on which two logs
agree form a prefix ``1..fork``. Raft's "find conflict" by term, done here without
reading a single entry: ``fork`` is the last LSN below both logs' ends before the
first LSN at which the two histories name different epochs. Both histories are
piecewise constant between their boundaries, so only the boundaries need comparing.

The replica whose log is not the reference (a slave rejoining the master, a member
brought to the sync source) truncates everything after ``fork``: that suffix was written
by a deposed master and never committed (a committed entry is on a majority, so the
reorganization picked a sync source holding it).

Histories come from the store (``StoreMeta.history``, ``EpochBoundary`` objects), from
the wire (``replica_pb2.EpochBoundary``) or from tests (plain tuples); ``as_history``
accepts all three. A malformed history is refused with ``HistoryError`` naming the
problem; ``history_problem`` answers the same question without raising, for peer input.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from typing import Protocol

# A history longer than this is refused: one boundary per epoch that wrote an entry, so
# a real cluster stays far below it; it bounds what a peer can make us sort.
HISTORY_BOUNDARIES_MAX = 1 << 20
# LSNs and epochs are uint64 on the wire and in the store.
UINT64_MAX = (1 << 64) - 1

History = tuple[tuple[int, int], ...]
"""An epoch history: ``(epoch, start_lsn)`` pairs, oldest first."""


class BoundaryLike(Protocol):
    """Anything with ``epoch`` and ``start_lsn``: store and protobuf ``EpochBoundary``."""

    @property
    def epoch(self) -> int:
        """The epoch."""
        ...

    @property
    def start_lsn(self) -> int:
        """The LSN of its first entry."""
        ...


class HistoryError(ValueError):
    """An epoch history that no valid log can have; the message says what is wrong."""


def as_history(boundaries: Iterable[tuple[int, int] | BoundaryLike]) -> History:
    """Normalizes boundaries (tuples or objects with epoch/start_lsn) to a ``History``.

    Only the shape is converted here; ``check_history`` checks the values.
    """
    out: list[tuple[int, int]] = []
    for boundary in boundaries:
        if len(out) >= HISTORY_BOUNDARIES_MAX:
            raise HistoryError(f"epoch history longer than {HISTORY_BOUNDARIES_MAX} boundaries")
        if isinstance(boundary, tuple):
            epoch, start_lsn = boundary
        else:
            epoch, start_lsn = boundary.epoch, boundary.start_lsn
        out.append((int(epoch), int(start_lsn)))
    return tuple(out)


def history_problem(history: History, last_lsn: int) -> str | None:
    """What makes ``history`` impossible for a log ending at ``last_lsn``, or None if valid.

    A valid history is empty exactly when the log is (last LSN 0); otherwise its first
    epoch starts at LSN 1 (every log's first entry opens an epoch), epochs and start
    LSNs strictly increase, and the last epoch starts at or below the last LSN.
    """
    if not 0 <= last_lsn <= UINT64_MAX:
        return f"last LSN {last_lsn} is not a uint64"
    if len(history) > HISTORY_BOUNDARIES_MAX:
        return f"epoch history longer than {HISTORY_BOUNDARIES_MAX} boundaries"
    if last_lsn == 0:
        return None if not history else f"an empty log with {len(history)} epoch boundaries"
    if not history:
        return f"a log ending at LSN {last_lsn} with no epoch history"
    if history[0][1] != 1:
        return f"the first epoch {history[0][0]} starts at LSN {history[0][1]}, not 1"
    prev_epoch, prev_start = 0, 0
    for epoch, start_lsn in history:
        if not 0 < epoch <= UINT64_MAX:
            return f"epoch {epoch} is not a positive uint64"
        if epoch <= prev_epoch:
            return f"epoch {epoch} follows epoch {prev_epoch}: epochs must increase"
        if start_lsn <= prev_start:
            return (
                f"epoch {epoch} starts at LSN {start_lsn}, not after epoch {prev_epoch}'s "
                f"start {prev_start}"
            )
        prev_epoch, prev_start = epoch, start_lsn
    if prev_start > last_lsn:
        return f"epoch {prev_epoch} starts at LSN {prev_start}, beyond the last LSN {last_lsn}"
    return None


def check_history(boundaries: Iterable[tuple[int, int] | BoundaryLike], last_lsn: int) -> History:
    """The normalized history, or ``HistoryError`` if no log ending at last_lsn has it."""
    history = as_history(boundaries)
    problem = history_problem(history, last_lsn)
    if problem is not None:
        raise HistoryError(problem)
    return history


def epoch_at(history: History, lsn: int) -> int:
    """The epoch of the entry at ``lsn`` (0 for LSN 0, "before the first entry")."""
    if lsn <= 0:
        return 0
    i = bisect_right(history, lsn, key=lambda boundary: boundary[1])
    return history[i - 1][0] if i else 0


def truncate_history(history: History, after_lsn: int) -> History:
    """The history of the log once every entry after ``after_lsn`` is removed."""
    i = bisect_right(history, after_lsn, key=lambda boundary: boundary[1])
    return history[:i]


def fork_lsn(
    master_history: Iterable[tuple[int, int] | BoundaryLike],
    master_last_lsn: int,
    slave_history: Iterable[tuple[int, int] | BoundaryLike],
    slave_last_lsn: int,
) -> int:
    """The last LSN on which both logs agree; the slave truncates everything after it.

    Raises ``HistoryError`` if either history is impossible for its log.
    """
    master = check_history(master_history, master_last_lsn)
    slave = check_history(slave_history, slave_last_lsn)
    limit = min(master_last_lsn, slave_last_lsn)
    # Both epoch functions are constant between boundaries: comparing them at every
    # boundary within the common length finds the first LSN where they differ.
    starts = sorted({s for _, s in master if s <= limit} | {s for _, s in slave if s <= limit})
    for start_lsn in starts:
        if epoch_at(master, start_lsn) != epoch_at(slave, start_lsn):
            return start_lsn - 1
    return limit
