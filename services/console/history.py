"""What the console remembers between polls: the election and failover timeline of the
last hour and the topics' publish and consume rates.

The cluster keeps no history of its elections (only each node's last change reason and
its operator audit trail), so the console keeps one itself from the status it polls: it
is as fine-grained as the poll interval and starts empty when the console starts. Both
classes are plain state fed with millisecond times from the caller's clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import squall
from squall_server.cli import explain as cli_explain

# How far back the timeline reaches (the issue asks for the last hour).
TIMELINE_WINDOW_MS = 3_600_000
# Most entries kept whatever the window: a flapping cluster cannot grow the console's memory.
TIMELINE_ENTRIES_MAX = 2_000
# Rates are measured over this window of polls (long enough to smooth one poll's jitter).
RATE_WINDOW_MS = 10_000
# Longest reason quoted in a timeline line.
REASON_CHARS_MAX = 160


@dataclass(frozen=True)
class TimelineEntry:
    """One thing that happened: when (wall ms), what kind, and a line for people."""

    at_ms: int
    kind: str  # "master", "state", "operator", "console"
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"at_ms": self.at_ms, "kind": self.kind, "text": self.text}


def _node_state(node: squall.NodeStatus) -> str:
    """The state column of the replica table (the same words the page and the CLI show)."""
    if not node.reachable and not node.coordinator_id:
        return "unreachable"
    return cli_explain.state_of(node)


def _short(text: str) -> str:
    """A reason cut to one readable line (gRPC errors run long)."""
    return text if len(text) <= REASON_CHARS_MAX else text[: REASON_CHARS_MAX - 1] + "…"


class Timeline:
    """Master changes, node state changes and operator actions, newest last."""

    def __init__(self) -> None:
        self._entries: deque[TimelineEntry] = deque(maxlen=TIMELINE_ENTRIES_MAX)
        self._master: tuple[str, int] | None = None
        self._states: dict[str, str] = {}
        self._audit_seen: set[tuple[str, int, str]] = set()

    def note(self, at_ms: int, kind: str, text: str) -> None:
        """Adds one entry (the console's own: a poll that failed, an action it ran)."""
        self._entries.append(TimelineEntry(at_ms, kind, text))

    def observe(self, at_ms: int, status: squall.ClusterStatus) -> None:
        """Compares a polled status with the last one and records what changed."""
        master = (status.master_id, status.epoch)
        if self._master is None:
            self.note(
                at_ms,
                "master",
                f"console started: master {status.master_id or 'none'} in epoch {status.epoch}",
            )
        elif master != self._master:
            was_id, was_epoch = self._master
            if status.master_id:
                self.note(
                    at_ms,
                    "master",
                    f"{status.master_id} is master in epoch {status.epoch} "
                    f"(was {was_id or 'none'} in epoch {was_epoch})",
                )
            else:
                self.note(at_ms, "master", f"no master (was {was_id} in epoch {was_epoch})")
        self._master = master
        for node in status.nodes:
            state = _node_state(node)
            before = self._states.get(node.node_id)
            if before is not None and before != state:
                cause = node.error if state == "unreachable" else node.last_change_reason
                reason = f": {_short(cause)}" if cause else ""
                self.note(at_ms, "state", f"{node.node_id} {before} -> {state}{reason}")
            self._states[node.node_id] = state
            # The coordinators' audit trail is the one history the cluster keeps: merge
            # its records in, each once, at the time the coordinator wrote them.
            for record in node.audit:
                key = (node.node_id, record.at_ms, record.action)
                if key in self._audit_seen:
                    continue
                self._audit_seen.add(key)
                reason = f": {record.reason}" if record.reason else ""
                self._entries.append(
                    TimelineEntry(
                        record.at_ms,
                        "operator",
                        f"{node.node_id}: {record.operator}: {record.action}{reason}",
                    )
                )

    def entries(self, now_ms: int) -> list[TimelineEntry]:
        """The entries of the last TIMELINE_WINDOW_MS, oldest first."""
        horizon = now_ms - TIMELINE_WINDOW_MS
        return sorted((e for e in self._entries if e.at_ms >= horizon), key=lambda e: e.at_ms)


class RateMeter:
    """Events per second of counters that only grow (a topic's next offset, the sum of
    its subscriptions' cursors), measured over the last RATE_WINDOW_MS of samples."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[int, int]]] = {}

    def sample(self, key: str, at_ms: int, value: int) -> float:
        """Records one reading and returns the rate (0.0 until two readings exist)."""
        samples = self._samples.setdefault(key, deque())
        if samples and value < samples[-1][1]:
            samples.clear()  # the counter went back (a topic recreated): start again
        samples.append((at_ms, value))
        while len(samples) > 2 and samples[1][0] <= at_ms - RATE_WINDOW_MS:
            samples.popleft()
        first_ms, first = samples[0]
        if at_ms <= first_ms:
            return 0.0
        return (value - first) * 1000.0 / (at_ms - first_ms)

    def forget_except(self, keys: set[str]) -> None:
        """Drops counters no longer polled (destroyed topics)."""
        for key in set(self._samples) - keys:
            del self._samples[key]
