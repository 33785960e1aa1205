"""Truncating the log after a divergence, and the loss reports it may leave.

A deposed master's uncommitted suffix (a slave's batch naming ``truncate_after_lsn``, or a
new master's reorganization fetch finding its log parts from the sync source's) is
removed by rebuilding the store from its log (``rebuild``, ``LmdbTruncator``); entries
this node knew committed that go with it are recorded first as a loss report beside the
store (``squall_server.common.loss``, SQUALL-LOSS-001), which the coordinator hears of in
the next ReplicaState.

``Truncation`` is given what it touches: the driver (the store and the commit gate it
owns, replaced with the rebuilt store), the store thread, the commit lock, the clock and
the fail-stop callback; ``ReplicaNode`` holds one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from squall_server.common.clock import Clock
from squall_server.common.errors import Code, ServiceError
from squall_server.common.loss import load_losses, record_loss
from squall_server.common.loss_record import LossRecord
from squall_server.replica.core import ReplicaCore
from squall_server.replica.core_view import CoreView
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.loss_scan import scan_discarded, truncation_loss
from squall_server.replica.rebuild import LmdbTruncator, TruncationAbandoned
from squall_server.replica.store import StoreError, StoreFullError
from squall_server.replica.store.stall import StallMeter
from squall_server.replica.telemetry import PublishedTraces, ReplicaInstruments

log = logging.getLogger("squall.replica")


class Truncation(CoreView):
    """Truncates this node's log after an LSN and keeps its loss reports."""

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        core: ReplicaCore,
        driver: ReplicaDriver,
        truncator: LmdbTruncator | None,
        *,
        stall: StallMeter,
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        clock: Clock,
        published_traces: PublishedTraces,
        instruments: ReplicaInstruments | None,
        fail_stop: Callable[[str], None],
    ) -> None:
        """``truncator`` None: refuse truncation (the memory twin)."""
        self.node_id = node_id
        self.data_dir = data_dir
        self.core = core
        self.driver = driver
        self.truncator = truncator
        self._stall = stall
        self._io = io
        self._commit_lock = commit_lock
        self.clock = clock
        self.published_traces = published_traces
        self._instruments = instruments
        self._fail_stop = fail_stop
        # Loss reports beside the store (acknowledged entries this node discarded);
        # reported to the coordinator in every ReplicaState (services/common/loss.py).
        # The offline store tools name the node after its directory: the file is this
        # node's, so its id is what the reports carry.
        self.losses: tuple[LossRecord, ...] = tuple(
            dataclasses.replace(r, node_id=node_id) for r in load_losses(data_dir)
        )
        # The truncation whose loss was reported last, (keep LSN, commit LSN): one refused
        # for want of room is asked for again (in this epoch or a later one), and the
        # entries it would discard are still there: one loss, reported once.
        self._loss_reported: tuple[int, int] | None = None

    async def truncate_after(self, keep_lsn: int, why: str) -> None:
        """Removes the log after keep_lsn (a deposed master's uncommitted suffix)."""
        async with self._commit_lock:
            await self.truncate_locked(keep_lsn, why)

    async def truncate_locked(self, keep_lsn: int, why: str) -> None:
        """truncate_after with the commit lock held."""
        truncator = self.truncator
        self.driver.check_truncation(keep_lsn, why, can_truncate=truncator is not None)
        assert truncator is not None  # (check_truncation refused otherwise)
        meta = self.store.meta()
        resumed = truncator.resumes_from(self.store, keep_lsn)
        log.warning(
            "replica %s truncating its log after LSN %d (it ends at %d; %s): epoch=%d%s",
            self.node_id,
            keep_lsn,
            meta.last_lsn,
            why,
            self.epoch,
            f"; resuming a replay given up after LSN {resumed}" if resumed else "",
        )
        loop = asyncio.get_running_loop()
        known_commit = self.gate.commit_lsn
        if keep_lsn < known_commit and self._loss_reported != (keep_lsn, known_commit):
            # Entries this node knew committed (acknowledged to publishers) go: only a group
            # formed without a majority holding them (or acks = "none", where a commit
            # needs no other replica) can ask that. Reported before the
            # truncation, so a crash in between cannot lose the report.
            discarded = await loop.run_in_executor(
                self._io, lambda: scan_discarded(self.store, keep_lsn, known_commit)
            )
            self.record_loss(
                truncation_loss(
                    self.node_id,
                    self.epoch,
                    why,
                    discarded,
                    at_ms=self.clock.wall_ms(),
                    local_commits=self.driver.local_commits,
                )
            )
            self._loss_reported = (keep_lsn, known_commit)
        # The role this truncation is for: once the coordinator drops it (or a new epoch
        # replaces it) the replay gives up, so that the drop, which waits for the commit
        # lock, is not held for the rest of a replay (chaos seed 87: a slave truncating
        # for 1.9 s answered its DEACTIVATE only then, and its group's re-formation, which
        # waits for every member's stopped state, served nothing for a second). Its
        # store is unchanged; whoever needs the truncation asks for it again, and the
        # replay resumes where it stopped (``LmdbTruncator``).
        core = self.core
        role_at_start = (core.role, core.epoch, core.taking)

        def abandoned() -> bool:
            return (core.role, core.epoch, core.taking) != role_at_start

        try:
            try:
                staging = await loop.run_in_executor(
                    self._io, lambda: truncator.stage(self.store, keep_lsn, abandoned)
                )
            except TruncationAbandoned as exc:
                log.info(
                    "replica %s: %s: its role changed (now %s, epoch %d); the store is as "
                    "it was, and the next truncation resumes the replay",
                    self.node_id,
                    exc,
                    core.role.name.lower(),
                    core.epoch,
                )
                raise ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self.node_id}: truncation after LSN {keep_lsn} abandoned: "
                    "its role changed",
                ) from exc
            except StoreFullError as exc:
                # The rebuilt copy did not fit its map (LMDB's MDB_MAP_FULL): the store is
                # as it was, as after any write a full store refuses. Refused, not a fault
                # (which quarantines the node until an operator clears it: chaos seed 63);
                # the next stream asks for the truncation again.
                raise ServiceError(
                    Code.RESOURCE_EXHAUSTED,
                    f"replica {self.node_id}: store full, log not truncated after LSN "
                    f"{keep_lsn}: {exc}",
                ) from exc
            self.store = truncator.swap(self.store, staging)
            self.store.stall_meter = self._stall
            # The rename's flush (a journal commit, long on a busy disk) off the loop; the
            # commit lock held until it is done, so nothing is appended after the
            # truncation before it is durable.
            await loop.run_in_executor(self._io, truncator.settle, staging)
        except (StoreError, OSError) as exc:
            self._fail_stop(f"truncating the log after LSN {keep_lsn} failed: {exc}")
            raise ServiceError(
                Code.UNAVAILABLE, f"replica {self.node_id}: truncation failed: {exc}"
            ) from exc
        self.published_traces.clear()  # their offsets may be reused by the new log
        self.driver.truncated(keep_lsn, self.store)

    def record_loss(self, record: LossRecord) -> None:
        """Keeps a loss report beside the store, logs it (SQUALL-LOSS-001) and counts it;
        the coordinator hears of it in the next ReplicaState."""
        self.losses = tuple(
            dataclasses.replace(r, node_id=self.node_id)
            for r in record_loss(self.data_dir, record, log)
        )
        if self._instruments is not None:
            self._instruments.loss_reports.add(1, {"node": self.node_id, "cause": record.cause})
            self._instruments.loss_events.add(record.events(), {"node": self.node_id})
