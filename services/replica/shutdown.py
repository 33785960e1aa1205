"""The replica's part in a clean cluster shutdown (`squall cluster shutdown`).

The operator's command freezes every replica (no new role, and on the master no new
write), waits until every member holds the master's last LSN, stops the coordinators, and
then finishes each replica: it drops its role, records the shutdown id in its store
(CLEAN) if it holds exactly that common point, and exits. A store that was not at the
point stays DIRTY and is updated from a clean one at the next start. See
docs/operations.md, "Store lifecycle".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from squall.v1 import common_pb2
from squall_server.common.errors import Code, ServiceError
from squall_server.common.freeze import FREEZE_HOLD_DEFAULT_MS, FREEZE_HOLD_MAX_MS
from squall_server.replica.control_endpoints import ShutdownEndpoint
from squall_server.replica.store import StoreError

log = logging.getLogger("squall.replica")

_SHUTDOWN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Finished:
    """What finishing did: CLEAN with the shutdown id, or left DIRTY and why."""

    clean: bool
    reason: str


def _check_id(shutdown_id: str) -> None:
    if not _SHUTDOWN_ID_RE.fullmatch(shutdown_id):
        raise ServiceError(
            Code.INVALID_ARGUMENT,
            f"shutdown id {shutdown_id[:80]!r} is not 1-64 characters of A-Z a-z 0-9 _ -",
        )


async def freeze(node: ShutdownEndpoint, shutdown_id: str, operator: str, hold_ms: int = 0) -> None:
    """No new role, no new write for hold_ms (0: FREEZE_HOLD_DEFAULT_MS) unless finished
    or aborted first; returns once the writes queued before are done."""
    _check_id(shutdown_id)
    if hold_ms > FREEZE_HOLD_MAX_MS:
        raise ServiceError(
            Code.INVALID_ARGUMENT,
            f"a freeze may hold at most {FREEZE_HOLD_MAX_MS // 1000} s, not {hold_ms} ms",
        )
    hold_ms = hold_ms or FREEZE_HOLD_DEFAULT_MS
    name = node.node.id
    was_frozen = bool(node.frozen_for)
    now_ms = node.clock.monotonic_ms()
    await node.apply_effects(node.core.freeze(shutdown_id, now_ms, hold_ms))  # core.py
    if not was_frozen:
        log.warning(
            "replica %s frozen for cluster shutdown %s (asked by %s): no new writes or "
            "roles for %.0f s unless it finishes or aborts first; role=%s epoch=%d lsn=%d "
            "commit_lsn=%d",
            name,
            shutdown_id,
            operator or "unknown",
            hold_ms / 1000,
            common_pb2.Role.Name(node.role),
            node.epoch,
            node.last_lsn,
            node.commit_lsn,
        )
    await node.drain_writes()


async def finish(
    node: ShutdownEndpoint,
    shutdown_id: str,
    *,
    lsn: int,
    last_epoch: int,
    cluster_id: str,
    operator: str,
) -> Finished:
    """Drops the role, records CLEAN if at the common point (else leaves DIRTY), and asks
    the process to stop."""
    _check_id(shutdown_id)
    name = node.node.id
    # Refused unless frozen for this shutdown; else the role is dropped for good.
    await node.apply_effects(node.core.finish(shutdown_id))
    # From here on the process stops whatever fails (see the clean mark below).
    problems: list[str] = []
    if node.failed_reason:
        problems.append(f"it stopped serving writes: {node.failed_reason}")
    try:
        meta = node.store.meta()
    except StoreError as exc:
        problems.append(f"reading the store failed: {exc}")
    else:
        if meta.cluster_id != cluster_id:
            problems.append(f"its cluster is {meta.cluster_id or '(none)'}, not {cluster_id}")
        if (meta.last_epoch, meta.last_lsn) != (last_epoch, lsn):
            problems.append(
                f"its log ends at epoch {meta.last_epoch} LSN {meta.last_lsn}, not at the "
                f"shutdown point (epoch {last_epoch} LSN {lsn})"
            )
    clean = not problems
    if clean:
        store = node.store

        def mark_clean() -> None:
            # The shutdown point is committed (the master committed it and every member
            # holds it), but the master records its commit LSN only with its next batch:
            # record it, so a reader of the stopped store sees every committed event.
            store.record_commit(lsn)
            store.sync()
            store.set_state(common_pb2.STORE_STATE_CLEAN, shutdown_id)

        try:
            await node.store_write(mark_clean)
        except StoreError as exc:
            # The process stops all the same: a replica left frozen and running would
            # refuse every role of the restarted cluster, whose groups would then re-form
            # around it without end. Its log is at the point either way; the next start
            # reads whatever state the failed write left (DIRTY unless only the flush
            # after the mark failed) and updates a dirty store from a clean one.
            problems.append(f"marking the store clean failed: {exc}")
            clean = False
    if clean:
        log.warning(
            "replica %s store CLEAN: cluster shutdown %s (asked by %s) at epoch %d LSN %d; "
            "stopping",
            name,
            shutdown_id,
            operator or "unknown",
            last_epoch,
            lsn,
        )
    else:
        log.warning(
            "replica %s store left DIRTY by cluster shutdown %s: %s; stopping (it is "
            "updated from a clean store at the next start)",
            name,
            shutdown_id,
            "; ".join(problems),
        )
    if node.on_shutdown is not None:
        node.on_shutdown()
    return Finished(clean, "; ".join(problems))


def abort(node: ShutdownEndpoint, shutdown_id: str) -> None:
    """Undoes a freeze: writes and roles are accepted again."""
    _check_id(shutdown_id)
    name = node.node.id
    was_frozen = bool(node.frozen_for)
    refusal = node.core.abort(shutdown_id).refusal  # the rules: core.py
    if refusal is not None:
        raise refusal.error()
    if was_frozen:
        log.warning("replica %s: cluster shutdown %s aborted, serving again", name, shutdown_id)
