"""A new master's reorganization sync, run in the background of the SetRole call.

Before a replica takes the master role it brings its log to the sync source's state
(``TakingMaster._sync_from``: a ``FetchLog`` of the entries it lacks, a truncation of a
divergent suffix, or a whole snapshot). That can take far longer than the coordinator's
``SetRole`` deadline (``timeouts.rpc_timeout_ms``) for a large store, so the replica runs
it as a task that outlives the call:

* ``SetRole(MASTER, epoch, sync source)`` starts the task and waits for it at most a
  heartbeat interval (``answer_wait_s``). A fast sync (the usual few entries) is answered
  with the role taken, as before; a long one is answered with role INACTIVE and
  ``ReplicaState.reorganization`` (this module's ``SyncProgress``).
* The coordinator repeats the same command every heartbeat interval (its role renewal);
  each repetition joins the running task and answers with its progress. Once the task has
  finished, the next one answers with the role taken, or with the error that ended the
  sync (FAILED_PRECONDITION makes the coordinator recover; UNAVAILABLE is retried by
  the next repetition, which starts the sync again).
* Any other role command (a new epoch, DEACTIVATE, a slave role) cancels the task and
  waits for it to stop before it is applied, so two role changes never run at once.

The election is untouched: its group is NORMAL as before, and the replica refuses writes
(UNAVAILABLE, retried by gateways and clients) until the sync is done and the epoch-start
entry appended, exactly as while the SetRole call used to block. What bounds the sync is
progress, not total time: the source must send each message within ``rpc_timeout_ms``
(``read_within``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from squall.v1 import replica_pb2
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.transport import FetchCall


@dataclass
class SyncProgress:
    """How far one reorganization sync got (``replica_pb2.ReorganizationProgress``)."""

    epoch: int
    source_id: str
    started_ms: int
    attempt: int = 1
    phase: str = "fetching log"
    entries_fetched: int = 0
    snapshot_lsn: int = 0
    snapshot_chunks: int = 0
    snapshot_records: int = 0

    def describe(self, now_ms: int) -> str:
        """One line for logs and refusals."""
        snapshot = (
            f", snapshot at LSN {self.snapshot_lsn}: {self.snapshot_chunks} chunks, "
            f"{self.snapshot_records} records installed"
            if self.snapshot_lsn
            else ""
        )
        return (
            f"{self.phase} from sync source {self.source_id} for epoch {self.epoch} "
            f"(attempt {self.attempt}, {max(0, now_ms - self.started_ms)} ms, "
            f"{self.entries_fetched} entries fetched{snapshot})"
        )

    def to_proto(self, now_ms: int) -> replica_pb2.ReorganizationProgress:
        """The progress as ReplicaState reports it."""
        return replica_pb2.ReorganizationProgress(
            epoch=self.epoch,
            sync_source_id=self.source_id,
            phase=self.phase,
            entries_fetched=self.entries_fetched,
            snapshot_lsn=self.snapshot_lsn,
            snapshot_chunks=self.snapshot_chunks,
            snapshot_records=self.snapshot_records,
            elapsed_ms=max(0, now_ms - self.started_ms),
            attempt=self.attempt,
        )


@dataclass
class Taking:
    """A master role being taken in the background: the command's epoch and sync source,
    the task and its progress. Which command it carries out, and when a repetition joins
    it, is the role core's to say (``core.ReplicaCore.taking``)."""

    epoch: int
    source_id: str
    task: asyncio.Task[None]
    progress: SyncProgress


def answer_wait_s(heartbeat_interval_ms: int, rpc_timeout_ms: int) -> float:
    """How long SetRole waits for the sync before answering with its progress: a
    heartbeat interval (the coordinator renews at that pace), well inside its deadline."""
    return min(heartbeat_interval_ms, rpc_timeout_ms // 2) / 1000


def outcome(task: asyncio.Task[None]) -> ServiceError | None:
    """A finished sync task's error as the coordinator should see it (None: success)."""
    if task.cancelled():
        return ServiceError(Code.UNAVAILABLE, "the reorganization sync was cancelled")
    error = task.exception()
    if error is None:
        return None
    if isinstance(error, ServiceError):
        return error
    return ServiceError(Code.UNAVAILABLE, f"the reorganization sync failed: {error!r}")


async def read_within(
    call: FetchCall, idle_timeout_s: float, what: str
) -> replica_pb2.FetchLogResponse | None:
    """The next message of a FetchLog stream (``transport.FetchCall``), or None at its end;
    UNAVAILABLE (the call cancelled) when nothing arrives within idle_timeout_s. What
    bounds a long transfer is then its progress, not its total time."""
    try:
        async with asyncio.timeout(idle_timeout_s):  # (wait_for may swallow a cancel)
            message = await call.read()
    except TimeoutError:
        call.cancel()
        raise ServiceError(
            Code.UNAVAILABLE,
            f"{what} sent nothing for {idle_timeout_s * 1000:.0f} ms (timeouts.rpc_timeout_ms)",
        ) from None
    return message
