"""Invariant checker for the replication simulator: runs after every simulated step.

Safety invariants (docs/architecture.md, "Invariants every change keeps"), checked as the
simulator reports each change, so the cost follows what changed rather than the log length:

* **acknowledged writes survive**: when a write is acknowledged its entry is committed and
  held by a majority of nodes (in their stores; under ``NO_SYNC`` a received entry counts,
  as the policy promises), and no node ever loses an acknowledged entry it held. At the end
  every live replica holds every acknowledged write at its LSN with the same content.
* **committed prefixes are identical**: every commit LSN any replica reports (a master's, or
  a slave's known-committed-and-written LSN) is checked against one committed sequence,
  so the entries at or below min(two replicas' commit LSNs) are identical; and a log never
  changes below the commit LSN its node has reported (no divergence below the commit LSN).
* **a deposed master never commits**: its commit LSN never moves after the deposal, and
  every LSN any master newly counts as committed is held by a majority at that moment.
* **log matching, epochs only grow**: one node writes each epoch's entries; an entry with a
  given (LSN, epoch) has one content on every node; epochs never decrease along a log; no
  node holds an entry newer than its persisted epoch; a node's role epochs never decrease.

* **a duplicate receipt points at a stored event** (the topic workload, see
  replication_sim.py): when a master answers a publish as a duplicate, the topic as that
  master holds it now stores the publisher's event with that sequence at the receipt's
  offset (a destroyed incarnation's state never answers); an acknowledged receipt names
  the event at its offset while its incarnation lives, two acknowledged receipts never
  name one offset of one incarnation for two events, and at the end every live replica
  holds every acknowledged event of the topic's final incarnation at its offset.

Under ``NO_SYNC`` a process crash may discard entries a slave acknowledged on receipt and
had not written: the policy promises nothing then. The simulator reports that with
``degrade`` and the checks that depend on durability stop for the rest of the seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from google.protobuf.message import DecodeError

from squall.v1 import replica_pb2
from tests.sim.election_checker import InvariantViolation

__all__ = ["Entry", "InvariantViolation", "ReplicationChecker", "TopicReceipt", "short"]

# What the topic checks see of a stored event: (topic id, publisher id, sequence).
StoredEvent = tuple[int, str, int]


class TopicReceipt(Protocol):
    """A master's answer to one topic publish (``topic_state.Receipt``)."""

    @property
    def topic_id(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def sequence(self) -> int: ...
    @property
    def duplicate(self) -> bool: ...


# A log entry as the replicas store and send it: the real ``replica_pb2.LogEntry``.
Entry = replica_pb2.LogEntry


def short(entry: Entry) -> str:
    """``lsn/epoch:operation`` of an entry, for failure messages (a plain write by the
    topic it creates, an epoch start as ``start``)."""
    try:
        op = replica_pb2.Operation.FromString(entry.operation)
        kind = op.WhichOneof("op")
    except DecodeError:
        kind = None
    if kind == "create_topic":
        what = op.create_topic.name
    elif kind == "epoch_start":
        what = f"start-{op.epoch_start.epoch}"
    elif kind is not None:
        what = kind
    else:
        what = entry.operation.decode(errors="replace")
    return f"{entry.lsn}/{entry.epoch}:{what}"


Holders = Callable[[int, Entry], int]
"""How many nodes hold ``entry`` at ``lsn`` right now (at the sync policy's level)."""


class ReplicationChecker:
    """Remembers committed and acknowledged history; raises InvariantViolation on a breach."""

    def __init__(self, nodes: Sequence[str], majority: int) -> None:
        """Start with no history."""
        self.nodes = tuple(nodes)
        self.majority = majority
        self.committed: list[Entry] = []
        self.committed_by: list[str] = []
        self.claimed: dict[str, int] = {node: 0 for node in nodes}
        self.acked: dict[int, Entry] = {}
        self.acked_writes = 0
        self.created: dict[tuple[int, int], bytes] = {}
        self.writer: dict[int, str] = {}
        self.core_commit: dict[tuple[str, int], int] = {}
        self.deposed_at: dict[tuple[str, int], int] = {}
        self.role_epoch: dict[str, int] = {node: 0 for node in nodes}
        self.degraded = ""
        # (topic id, offset) -> sequence of every acknowledged topic receipt.
        self.receipts: dict[tuple[int, int], int] = {}
        self.duplicates_checked = 0

    # ----------------------------------------------------------------- entries and logs

    def entry_created(self, node: str, entry: Entry) -> None:
        """A master wrote a new entry: one writer per epoch, one content per (LSN, epoch)."""
        writer = self.writer.setdefault(entry.epoch, node)
        if writer != node:
            raise InvariantViolation(
                f"node {node} wrote entry {short(entry)} but node {writer} already wrote "
                f"entries of epoch {entry.epoch}: two masters in one epoch"
            )
        key = (entry.lsn, entry.epoch)
        if key in self.created:
            raise InvariantViolation(
                f"node {node} wrote LSN {entry.lsn} of epoch {entry.epoch} twice"
            )
        self.created[key] = entry.operation

    def log_changed(
        self,
        node: str,
        log: Sequence[Entry],
        first: int,
        removed: Sequence[Entry],
        durable_epoch: int,
    ) -> None:
        """``node``'s log changed from index ``first`` on: ``removed`` went, ``log[first:]`` came.

        Checks the new entries (log matching, epochs) and that nothing acknowledged or
        committed on this node was removed.
        """
        prev_epoch = log[first - 1].epoch if first else 0
        for index in range(first, len(log)):
            entry = log[index]
            if entry.lsn != index + 1:
                raise InvariantViolation(
                    f"node {node}: entry {short(entry)} stored at position {index + 1}"
                )
            if self.created.get((entry.lsn, entry.epoch)) != entry.operation:
                raise InvariantViolation(
                    f"node {node} holds {short(entry)}, which epoch {entry.epoch}'s master "
                    "never wrote (log matching broken)"
                )
            if entry.epoch < prev_epoch:
                raise InvariantViolation(
                    f"node {node}: entry {short(entry)} follows an entry of epoch {prev_epoch}"
                )
            prev_epoch = entry.epoch
        if log and log[-1].epoch > durable_epoch:
            raise InvariantViolation(
                f"node {node} holds {short(log[-1])} but has persisted only epoch {durable_epoch}"
            )
        if self.degraded:
            return
        for entry in removed:
            if self.acked.get(entry.lsn) == entry and (
                len(log) < entry.lsn or log[entry.lsn - 1] != entry
            ):
                raise InvariantViolation(
                    f"node {node} lost acknowledged write {short(entry)}: "
                    + (
                        f"its log now ends at LSN {len(log)}"
                        if len(log) < entry.lsn
                        else f"LSN {entry.lsn} now holds {short(log[entry.lsn - 1])}"
                    )
                )
        claimed = self.claimed[node]
        if first < claimed:
            if len(log) < claimed:
                raise InvariantViolation(
                    f"node {node}'s log now ends at LSN {len(log)}, below the commit LSN "
                    f"{claimed} it reported"
                )
            for index in range(first, claimed):
                if log[index] != self.committed[index]:
                    raise InvariantViolation(
                        f"node {node}'s log diverges below its commit LSN {claimed}: LSN "
                        f"{index + 1} now holds {short(log[index])}, committed "
                        f"{short(self.committed[index])}"
                    )

    # ----------------------------------------------------------------- commits and acks

    def commit_reported(self, node: str, log: Sequence[Entry], commit_lsn: int) -> None:
        """A replica reports ``commit_lsn``: its prefix must match the committed sequence."""
        if self.degraded:
            return
        start = self.claimed[node]
        if commit_lsn <= start:
            return
        if commit_lsn > len(log):
            raise InvariantViolation(
                f"node {node} reports commit LSN {commit_lsn} beyond its log's end {len(log)}"
            )
        committed = self.committed
        for index in range(start, commit_lsn):
            entry = log[index]
            if index < len(committed):
                if committed[index] != entry:
                    raise InvariantViolation(
                        f"committed prefixes differ at LSN {index + 1}: node {node} has "
                        f"{short(entry)} committed, node {self.committed_by[index]} had "
                        f"{short(committed[index])}"
                    )
            else:
                committed.append(entry)
                self.committed_by.append(node)
        self.claimed[node] = commit_lsn

    def master_started(self, node: str, epoch: int, commit_lsn: int) -> None:
        """A ReplicationMaster was created with an initial (already committed) commit LSN."""
        self.core_commit[(node, epoch)] = commit_lsn

    def master_reported(
        self,
        node: str,
        epoch: int,
        commit_lsn: int,
        deposed: bool,
        log: Sequence[Entry],
        holders: Holders,
    ) -> None:
        """One Actions record of a master: its commit LSN never goes back, never moves once
        deposed, and every newly committed LSN is held by a majority."""
        key = (node, epoch)
        prev = self.core_commit.get(key, 0)
        if commit_lsn < prev:
            raise InvariantViolation(
                f"master {node} epoch {epoch}: commit LSN went back from {prev} to {commit_lsn}"
            )
        stopped = self.deposed_at.get(key)
        if stopped is not None and commit_lsn > stopped:
            raise InvariantViolation(
                f"master {node} epoch {epoch} was deposed at commit LSN {stopped} but now "
                f"reports {commit_lsn}: a deposed master committed"
            )
        if deposed and stopped is None:
            self.deposed_at[key] = commit_lsn
        if commit_lsn == prev:
            return
        self.core_commit[key] = commit_lsn
        if self.degraded:
            return
        if commit_lsn > len(log):
            raise InvariantViolation(
                f"master {node} epoch {epoch}: commit LSN {commit_lsn} beyond its log's end "
                f"{len(log)}"
            )
        for lsn in range(prev + 1, commit_lsn + 1):
            entry = log[lsn - 1]
            count = holders(lsn, entry)
            if count < self.majority:
                raise InvariantViolation(
                    f"master {node} epoch {epoch} counts LSN {lsn} ({short(entry)}) as "
                    f"committed, but only {count} nodes hold it; a majority is {self.majority}"
                )
        self.commit_reported(node, log, commit_lsn)

    def write_acked(self, node: str, entry: Entry, commit_lsn: int, holders: Holders) -> None:
        """A client write was acknowledged: committed, held by a majority, one per LSN."""
        self.acked_writes += 1
        if self.degraded:
            return
        if entry.lsn > commit_lsn:
            raise InvariantViolation(
                f"master {node} acknowledged {short(entry)} above its commit LSN {commit_lsn}"
            )
        prior = self.acked.get(entry.lsn)
        if prior is not None and prior != entry:
            raise InvariantViolation(
                f"two writes acknowledged at LSN {entry.lsn}: {short(prior)} and "
                f"{short(entry)} (by {node}); the first was lost"
            )
        self.acked[entry.lsn] = entry
        count = holders(entry.lsn, entry)
        if count < self.majority:
            raise InvariantViolation(
                f"master {node} acknowledged {short(entry)} held by only {count} nodes; "
                f"a majority is {self.majority}"
            )
        if entry.lsn > len(self.committed) or self.committed[entry.lsn - 1] != entry:
            raise InvariantViolation(
                f"master {node} acknowledged {short(entry)}, which is not the committed entry "
                f"at LSN {entry.lsn}"
            )

    # ----------------------------------------------------------------- topics

    def duplicate_planned(
        self, node: str, receipt: TopicReceipt, stored: StoredEvent | None
    ) -> None:
        """A master answers a publish as a duplicate: the event must be in the topic now."""
        self.duplicates_checked += 1
        if stored is None or stored[0] != receipt.topic_id or stored[2] != receipt.sequence:
            raise InvariantViolation(
                f"master {node} answered sequence {receipt.sequence} as a duplicate at offset "
                f"{receipt.offset} of topic incarnation {receipt.topic_id}, which holds "
                + ("nothing there" if stored is None else f"{stored} there")
            )

    def receipt_acked(
        self, node: str, receipt: TopicReceipt, topic_id: int, stored: StoredEvent | None
    ) -> None:
        """A topic publish was acknowledged; topic_id and stored: the master's state now."""
        if self.degraded:
            return
        if topic_id == receipt.topic_id and (stored is None or stored[2] != receipt.sequence):
            raise InvariantViolation(
                f"master {node} acknowledged sequence {receipt.sequence} at offset "
                f"{receipt.offset} of topic incarnation {receipt.topic_id}, which holds "
                + ("nothing there" if stored is None else f"{stored} there")
            )
        key = (receipt.topic_id, receipt.offset)
        prior = self.receipts.setdefault(key, receipt.sequence)
        if prior != receipt.sequence:
            raise InvariantViolation(
                f"master {node} acknowledged sequence {receipt.sequence} at offset "
                f"{receipt.offset} of topic incarnation {receipt.topic_id}, where sequence "
                f"{prior} was acknowledged before"
            )

    def final_receipts(
        self, node: str, topic_id: int, stored_at: Callable[[int], StoredEvent | None]
    ) -> None:
        """At the end: the node holds every acknowledged event of the topic's incarnation
        topic_id (its current one; 0: no topic) at its offset."""
        if self.degraded or not topic_id:
            return
        for (incarnation, offset), sequence in sorted(self.receipts.items()):
            if incarnation != topic_id:
                continue
            stored = stored_at(offset)
            if stored is None or stored[0] != topic_id or stored[2] != sequence:
                raise InvariantViolation(
                    f"after healing, node {node} holds {stored} at offset {offset} of topic "
                    f"incarnation {topic_id}, not the acknowledged sequence {sequence}"
                )

    def role_taken(self, node: str, epoch: int) -> None:
        """A replica took a role in ``epoch``: role epochs never decrease on a node."""
        if epoch < self.role_epoch[node]:
            raise InvariantViolation(
                f"node {node} took a role in epoch {epoch} after one in epoch "
                f"{self.role_epoch[node]}"
            )
        self.role_epoch[node] = epoch

    def degrade(self, reason: str) -> None:
        """The sync policy's promise no longer covers this run (see the module docstring)."""
        if not self.degraded:
            self.degraded = reason

    # ----------------------------------------------------------------- the end

    def final(self, live_logs: Mapping[str, Sequence[Entry]]) -> None:
        """After the liveness phase: every live replica holds every acknowledged write."""
        if self.degraded:
            return
        for node, log in live_logs.items():
            for lsn, entry in self.acked.items():
                if len(log) < lsn or log[lsn - 1] != entry:
                    held = short(log[lsn - 1]) if len(log) >= lsn else "nothing"
                    raise InvariantViolation(
                        f"after healing, node {node} holds {held} at LSN {lsn}, not the "
                        f"acknowledged write {short(entry)}"
                    )
