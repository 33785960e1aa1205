"""A loss report as plain data: acknowledged events a node discarded, and what allowed it.

Pure (no I/O): the election keeps these in its persisted state, the replica and the store
tools write them beside the store (``services/common/loss.py``), and the codecs turn them
into ``LossEvent`` messages. docs/operations.md, "Loss reports", says when one is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The stable message ids of the log lines (docs/operations.md, "Message ids").
LOSS_MESSAGE_ID = "SQUALL-LOSS-001"  # ERROR: acknowledged events were discarded
LOSS_ACK_MESSAGE_ID = "SQUALL-LOSS-002"  # WARNING: an operator acknowledged a loss report
# Most reports a node keeps (the oldest go first); a loss is rare and each is loud.
LOSS_RECORDS_MAX = 32
# Most acknowledged ids a coordinator remembers, so a replica still reporting one does
# not bring it back.
LOSS_ACKED_IDS_MAX = 64
# Longest text kept in a field read back.
_TEXT_CHARS_MAX = 2048
# Most topics listed in one report (the rest are summed under "...").
TOPICS_MAX = 32

CAUSES = ("truncation", "manual-recovery", "restore", "designated-primary-conflict")


class LossRecordError(ValueError):
    """A stored loss report is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class LossRecord:
    """One loss report. LSNs and epochs are 0 where unknown; ``topics`` holds
    (topic, events discarded) pairs, empty where unknown."""

    loss_id: str
    node_id: str
    at_ms: int
    cause: str
    operator_action: str
    detail: str
    epoch: int = 0
    first_epoch: int = 0
    last_epoch: int = 0
    first_lsn: int = 0
    last_lsn: int = 0
    topics: tuple[tuple[str, int], ...] = ()

    def events(self) -> int:
        """Events discarded over every topic listed."""
        return sum(count for _, count in self.topics)

    def summary(self) -> str:
        """One line for logs and `squall status`."""
        parts = [f"node {self.node_id}", f"cause {self.cause}"]
        if self.operator_action:
            parts.append(f"allowed by {self.operator_action}")
        if self.epoch:
            parts.append(f"epoch {self.epoch}")
        if self.first_lsn:
            epochs = f" (epochs {self.first_epoch}..{self.last_epoch})" if self.first_epoch else ""
            upto = self.last_lsn if self.last_lsn else "(end unknown)"
            parts.append(f"LSN {self.first_lsn}..{upto}{epochs}")
        if self.topics:
            listed = ", ".join(f"{topic}={count}" for topic, count in self.topics)
            parts.append(f"{self.events()} events: {listed}")
        text = "; ".join(parts)
        return f"{text}: {self.detail}" if self.detail else text

    def to_dict(self) -> dict[str, object]:
        """The JSON form (loss-events.json, coordinator-state.json)."""
        return {
            "loss_id": self.loss_id,
            "node_id": self.node_id,
            "at_ms": self.at_ms,
            "cause": self.cause,
            "operator_action": self.operator_action,
            "detail": self.detail,
            "epoch": self.epoch,
            "first_epoch": self.first_epoch,
            "last_epoch": self.last_epoch,
            "first_lsn": self.first_lsn,
            "last_lsn": self.last_lsn,
            "topics": [[topic, count] for topic, count in self.topics],
        }


def loss_from_dict(value: object, where: str) -> LossRecord:
    """Reads one report back; LossRecordError names what is wrong."""
    if not isinstance(value, Mapping):
        raise LossRecordError(f"{where} must be an object")
    texts: dict[str, str] = {}
    for key in ("loss_id", "node_id", "cause", "operator_action", "detail"):
        text = value.get(key)
        if not isinstance(text, str) or len(text) > _TEXT_CHARS_MAX:
            raise LossRecordError(f"{where}.{key} must be a short string, got {text!r}")
        texts[key] = text
    if not texts["loss_id"]:
        raise LossRecordError(f"{where}.loss_id is empty")
    numbers: dict[str, int] = {}
    for key in ("at_ms", "epoch", "first_epoch", "last_epoch", "first_lsn", "last_lsn"):
        number = value.get(key, 0)
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise LossRecordError(f"{where}.{key} must be a non-negative integer")
        numbers[key] = number
    raw_topics = value.get("topics", [])
    if not isinstance(raw_topics, list) or len(raw_topics) > TOPICS_MAX + 1:
        raise LossRecordError(f"{where}.topics must be a list of [topic, events]")
    topics: list[tuple[str, int]] = []
    for item in raw_topics:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], int)
            or isinstance(item[1], bool)
            or item[1] < 0
        ):
            raise LossRecordError(f"{where}.topics must be a list of [topic, events]")
        topics.append((item[0], item[1]))
    return LossRecord(
        loss_id=texts["loss_id"],
        node_id=texts["node_id"],
        at_ms=numbers["at_ms"],
        cause=texts["cause"],
        operator_action=texts["operator_action"],
        detail=texts["detail"],
        epoch=numbers["epoch"],
        first_epoch=numbers["first_epoch"],
        last_epoch=numbers["last_epoch"],
        first_lsn=numbers["first_lsn"],
        last_lsn=numbers["last_lsn"],
        topics=tuple(topics),
    )


def count_topics(counts: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """(topic, events) pairs by name, at most TOPICS_MAX, the rest summed under "..."."""
    ordered = sorted((topic, n) for topic, n in counts.items() if n > 0)
    if len(ordered) <= TOPICS_MAX:
        return tuple(ordered)
    rest = sum(n for _, n in ordered[TOPICS_MAX:])
    return (*ordered[:TOPICS_MAX], ("...", rest))
