"""What a store holds committed: the replica's start-up view, also read offline.

A replica applies entries before they are committed and records, with each batch, the
commit LSN it knew (store/, visibility.py). ``gate_from_store`` rebuilds the
``CommitGate`` a replica starts with from the store alone: at the recorded commit LSN,
hiding every publish above it (from the installed snapshot's list and from the log).
The replica calls it at start-up (``reopen_gate``, which also logs what it hides); the
chaos harness calls it on a stopped node's store to read exactly the events that node
would serve (``committed_events``).
"""

from __future__ import annotations

import logging

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.store import Store
from squall_server.replica.store.records import publishes
from squall_server.replica.visibility import CommitGate

log = logging.getLogger("squall.replica")

# Log entries read per step when rebuilding the gate (bounded memory on a long log).
RESTORE_STEP_ENTRIES = 1024
# Events read per step by committed_events.
_READ_STEP_EVENTS = 1000


def track(gate: CommitGate, entry: replica_pb2.LogEntry) -> None:
    """Tracks an entry's publish (if it is one) in gate."""
    for publish in publishes(replica_pb2.Operation.FromString(entry.operation)):
        gate.appended(entry.lsn, publish.topic, publish.first_offset)


def gate_from_store(store: Store) -> CommitGate:
    """The committed-reads gate for the store as it is (see the module docstring)."""
    meta = store.meta()
    commit_lsn = meta.commit_lsn
    if commit_lsn is None or commit_lsn >= meta.last_lsn:
        return CommitGate(meta.last_lsn if commit_lsn is None else commit_lsn)
    gate = CommitGate(commit_lsn)
    gate.restore(store.snapshot_uncommitted())
    next_lsn = max(commit_lsn, meta.log_start_lsn - 1) + 1
    # One step per RESTORE_STEP_ENTRIES entries: bounded by the log's end.
    while next_lsn <= meta.last_lsn:
        entries = store.read_log(next_lsn, min(RESTORE_STEP_ENTRIES, meta.last_lsn - next_lsn + 1))
        if not entries:
            break
        for entry in entries:
            track(gate, entry)
        next_lsn = entries[-1].lsn + 1
    return gate


def reopen_gate(store: Store, node_id: str, why: str) -> CommitGate:
    """``gate_from_store`` for a replica opening its store (on the store thread): at
    start-up and after an interrupted reorganization; logs what it hides."""
    gate = gate_from_store(store)
    meta = store.meta()
    if gate.commit_lsn < meta.last_lsn:
        log.info(
            "replica %s (%s): LSNs %d..%d are not known committed: %d publishes hidden "
            "from reads until a master commits them",
            node_id,
            why,
            gate.commit_lsn + 1,
            meta.last_lsn,
            gate.tracked,
        )
    return gate


def committed_events(store: Store, gate: CommitGate, topic: str) -> list[common_pb2.Event]:
    """Every event of topic the gate lets a subscriber see, verified, in offset order."""
    info = store.get_topic(topic)
    if info is None:
        return []
    hidden = gate.hidden_from(topic)
    end = info.next_offset if hidden is None else min(hidden, info.next_offset)
    events: list[common_pb2.Event] = []
    offset = info.first_offset
    # Bounded: each step reads at least one event or stops.
    while offset < end:
        batch = store.read_events(topic, offset, min(_READ_STEP_EVENTS, end - offset), end)
        if not batch:
            break
        events.extend(batch)
        offset = batch[-1].offset + 1
    return events
