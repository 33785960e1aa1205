"""What a sync source sends a new master's reorganization fetch, message by message:
synchronous and store-free, so the asyncio sync source (``sync_source.py``) and the
replication simulator (``tests/sim/replication_sim.py``) send the same answer.

``ReplicaDriver.fetch_answer`` decides the answer (the log after the fork, or a snapshot
and the log after it); ``FetchServing`` then says, in order, which messages carry it: the
opening batch (the truncation point and the commit LSN) or each snapshot chunk, then one
batch per read of at most ``step`` entries, up to where the log ended (after a snapshot:
as far as it reached once the snapshot was read). The shell reads the store and the
snapshot where it must (a store thread, the snapshot pump) and hands each result back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from squall.v1 import replica_pb2
from squall_server.replica.driver import FetchAnswer


class FetchServing:
    """One answer to a fetch as it is sent: the shell asks ``opening`` (or sends each
    snapshot chunk through ``snapshot_chunk`` and then calls ``snapshot_sent``), then
    alternates ``next_read`` (what to read) and ``entries_read`` (the message to send)
    until ``next_read`` says nothing is left."""

    def __init__(self, answer: FetchAnswer, commit_lsn: Callable[[], int]) -> None:
        """``commit_lsn``: this node's commit LSN as of now (what the requester may show
        its subscribers of each batch)."""
        self.answer = answer
        self._commit_lsn = commit_lsn
        self._snapshot_lsn = 0
        # The log part: from next_lsn to to_lsn (none until the opening or the snapshot).
        self._next_lsn = answer.fork + 1
        self._to_lsn = answer.meta.last_lsn
        self._done = bool(answer.why_snapshot)

    @property
    def snapshot(self) -> bool:
        """Does the answer begin with a snapshot of this store (``why_snapshot``)?"""
        return bool(self.answer.why_snapshot)

    def _batch(self, batch: replica_pb2.EntryBatch) -> replica_pb2.FetchLogResponse:
        return replica_pb2.FetchLogResponse(entries=batch, cluster_id=self.answer.meta.cluster_id)

    def opening(self) -> replica_pb2.FetchLogResponse:
        """The first message of a log answer: where the requester truncates (0: it does
        not) and this node's commit LSN."""
        answer = self.answer
        return self._batch(
            replica_pb2.EntryBatch(
                epoch=answer.meta.epoch,
                truncate_after_lsn=answer.fork if answer.diverged else 0,
                commit_lsn=self._commit_lsn(),
            )
        )

    def snapshot_chunk(self, chunk: replica_pb2.SnapshotChunk) -> replica_pb2.FetchLogResponse:
        """The message carrying one chunk of this store's snapshot."""
        self._snapshot_lsn = chunk.snapshot_lsn
        return replica_pb2.FetchLogResponse(snapshot=chunk, cluster_id=self.answer.meta.cluster_id)

    def snapshot_sent(self, store_last_lsn: int) -> None:
        """The snapshot is sent: the log after it follows, as far as it reached when the
        fetch began (``store_last_lsn``: where it ends now; it may have grown while the
        snapshot was read: the rest is its tail)."""
        self._next_lsn = self._snapshot_lsn + 1
        self._to_lsn = max(self.answer.meta.last_lsn, store_last_lsn)
        self._done = False

    def next_read(self) -> tuple[int, int] | None:
        """The next read of the log, (first LSN, entries), or None when all is sent."""
        if self._done or self._next_lsn > self._to_lsn:
            return None
        return self._next_lsn, min(self.answer.step, self._to_lsn - self._next_lsn + 1)

    def entries_read(
        self, entries: Sequence[replica_pb2.LogEntry]
    ) -> replica_pb2.FetchLogResponse | None:
        """The message carrying what a read returned (None: it returned nothing, the log
        ends there and the answer with it)."""
        if not entries:
            self._done = True
            return None
        self._next_lsn = entries[-1].lsn + 1
        return self._batch(
            replica_pb2.EntryBatch(
                entries=entries, epoch=self.answer.meta.epoch, commit_lsn=self._commit_lsn()
            )
        )
