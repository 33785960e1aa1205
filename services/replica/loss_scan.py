"""What a truncation of acknowledged entries discards, read from the log before it goes:
the LSN range, the epochs it spans and the events per topic (for its loss report).

A replica truncates below the commit LSN it knew only when a new master's log lacks
entries this node knew committed — a group that formed without a majority holding every
acknowledged write (a quorum override or a designated primary), or under ``acks = "none"``,
where a commit needs no other replica. docs/operations.md,
"Loss reports".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from squall.v1 import replica_pb2
from squall_server.common.loss import new_loss_id
from squall_server.common.loss_record import LossRecord, count_topics
from squall_server.replica.store import Store
from squall_server.replica.store.records import publishes

# Most entries read to count what is discarded (beyond it the counts say "at least").
SCAN_ENTRIES_MAX = 200_000
_READ_CHUNK_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class Discarded:
    """Entries first_lsn..last_lsn: their epochs and publishes per topic."""

    first_lsn: int
    last_lsn: int
    first_epoch: int
    last_epoch: int
    topics: tuple[tuple[str, int], ...]
    complete: bool  # False when the scan stopped at SCAN_ENTRIES_MAX


def scan_discarded(store: Store, after_lsn: int, up_to_lsn: int) -> Discarded:
    """Reads entries after_lsn+1..up_to_lsn (on the store thread); counts publishes."""
    counts: Counter[str] = Counter()
    first_epoch = last_epoch = 0
    lsn = after_lsn + 1
    read = 0
    while lsn <= up_to_lsn and read < SCAN_ENTRIES_MAX:
        want = min(_READ_CHUNK_ENTRIES, up_to_lsn - lsn + 1, SCAN_ENTRIES_MAX - read)
        entries = store.read_log(lsn, want)
        if not entries:
            break
        for entry in entries:
            first_epoch = first_epoch or entry.epoch
            last_epoch = entry.epoch
            for publish in publishes(replica_pb2.Operation.FromString(entry.operation)):
                counts[publish.topic] += len(publish.events)
        read += len(entries)
        lsn = entries[-1].lsn + 1
    return Discarded(
        first_lsn=after_lsn + 1,
        last_lsn=up_to_lsn,
        first_epoch=first_epoch,
        last_epoch=last_epoch,
        topics=count_topics(counts),
        complete=lsn > up_to_lsn,
    )


def truncation_loss(
    node_id: str,
    epoch: int,
    why: str,
    discarded: Discarded,
    *,
    at_ms: int,
    local_commits: bool = False,
) -> LossRecord:
    """The loss report of a truncation below the commit LSN this node knew
    (``local_commits``: under ``acks = "none"``, where no operator action is needed)."""
    counted = "" if discarded.complete else f" (counted over the first {SCAN_ENTRIES_MAX})"
    allowed_by = (
        'acks = "none" (a commit needed no other replica, and the group\'s sync source '
        "never had these entries)"
        if local_commits
        else "a quorum override or a designated primary (a group formed without a majority "
        "holding every acknowledged event; see the new master's audit trail)"
    )
    return LossRecord(
        loss_id=new_loss_id(),
        node_id=node_id,
        at_ms=at_ms,
        cause="truncation",
        operator_action=allowed_by,
        detail=(
            f"replica {node_id} truncated entries it knew committed, LSN "
            f"{discarded.first_lsn}..{discarded.last_lsn}, to follow {why} in epoch {epoch}"
            f"{counted}"
        ),
        epoch=epoch,
        first_epoch=discarded.first_epoch,
        last_epoch=discarded.last_epoch,
        first_lsn=discarded.first_lsn,
        last_lsn=discarded.last_lsn,
        topics=discarded.topics,
    )
