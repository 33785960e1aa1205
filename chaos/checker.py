"""The history checker: what a chaos run proves, decided from its history file alone.

`check(path)` reads a history (chaos/history.py) and runs pure checks over its records;
nothing here talks to a cluster, so a history from any run (or one built by hand in a
test) can be judged again. The checks, each a `CheckResult` named as in the summary:

``history``     the run finished (an ``end`` record with reason "completed") and every
                ``complete`` answers an ``invoke``; a cut-short run proves nothing.
``lost``        every acknowledged publish ("ok") is in the final committed log at the
                offset its receipt named; every stored event was published by someone.
``duplicates``  no event of an idempotent publisher (publisher id + sequence) is stored
                twice; a non-idempotent publisher's repeats are counted, not failed.
``outcomes``    no event reported "fail" (definitely not stored) is stored; how many
                "indeterminate" events were in fact stored is counted.
``order``       per binding (publisher process + topic), acknowledged events are stored
                and first delivered to every subscriber in publish order (a publish that
                completed before another was invoked comes first; redelivery of an event
                already seen is allowed).
``delivery``    every committed event from a durable subscriber's start offset on was
                delivered to it at least once, and everything delivered is committed
                with that value (no reads of events that were later lost).
``logs``        every node's final committed log of every topic is identical; a strict
                prefix is allowed only for a ``final_log`` record that says why the node
                lags (its ``lagging`` field).
``churn``       master epochs grow with the faults, not with time: the newest epoch in
                any node's final store is at most ``EPOCHS_PER_FAULT_RECORD_MAX`` per
                fault record (a start or an end) plus ``EPOCHS_SLACK``; a node that makes
                its group re-form again and again (twenty times a second, say) loses
                nothing and would pass every other check.
``dup_receipts``  every receipt that says ``duplicate`` (the event was already stored
                under its publisher id and sequence) points at that event: the final
                committed log of the topic the publisher wrote to holds that payload at
                the receipt's offset. A duplicate receipt for an event stored nowhere
                (dedupe state outliving its topic) acknowledges an event that is lost.

Unavailability windows are reported, not judged: a gap longer than a threshold between
successful publishes (any path, and per path), with the faults that overlap it as cause.
Per fault, and summed up per fault kind (``FaultWindow``, ``kind_summary``), the checker
also measures what publishers saw: the time from the fault's start to the first
acknowledgement of a publish invoked after it started (a call already in flight at the
start says nothing about the new state), and the longest interval with no acknowledgement
at all from the fault's start to the first acknowledgement at or after its heal (so an
outage that lasts until the heal is counted whole). A fault after which nothing was
acknowledged again is reported as not recovered. Any path, and per publish path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos.history import HistoryError, read_history

GAP_THRESHOLD_S_DEFAULT = 1.0
# Each check lists at most this many examples; the counts are always complete.
EXAMPLES_MAX = 10
CHECK_NAMES = (
    "history",
    "lost",
    "duplicates",
    "dup_receipts",
    "outcomes",
    "order",
    "delivery",
    "logs",
    "churn",
)
# The churn bound (``churn``): runs of 240 s reached epoch 45-46 for 46-56 fault records
# (seeds 79 and 80, 2026-12-02), about one epoch per record.
EPOCHS_PER_FAULT_RECORD_MAX = 2
EPOCHS_SLACK = 25

Record = Mapping[str, Any]


@dataclass(frozen=True)
class CheckResult:
    """One property's verdict: a short headline for the summary and the evidence."""

    name: str
    ok: bool
    headline: str
    details: tuple[str, ...] = ()


@dataclass(frozen=True)
class Window:
    """A client-observed stretch without a successful publish (of one path, or "any")."""

    start: float
    end: float
    path: str
    causes: tuple[str, ...]

    @property
    def duration_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class FaultWindow:
    """What publishers (of one path, or "any") saw during one fault."""

    kind: str
    label: str  # "kill_replica n1"
    start: float
    end: float
    path: str
    first_ack_s: float | None
    """From the fault's start to the first ack of a publish invoked after it (None: never)."""
    longest_gap_s: float
    """The longest interval with no ack from the start to the first ack at or after the
    end (to the end of the history if none came)."""
    recovered: bool
    """Whether any publish was acknowledged after the fault ended."""


@dataclass(frozen=True)
class KindSummary:
    """The fault windows of one kind, over every fault of it (any path)."""

    kind: str
    faults: int
    first_ack_p50_s: float | None
    first_ack_max_s: float | None
    longest_gap_max_s: float
    not_recovered: int
    worst_path: str
    worst_path_gap_s: float

    def line(self) -> str:
        first = (
            f"first ack after start p50 {self.first_ack_p50_s:.2f} s, max "
            f"{self.first_ack_max_s:.2f} s"
            if self.first_ack_p50_s is not None and self.first_ack_max_s is not None
            else "no ack after start"
        )
        text = (
            f"{self.kind} ({self.faults}): {first}; longest without an ack "
            f"{self.longest_gap_max_s:.2f} s"
        )
        if self.worst_path:
            text += f" (worst path {self.worst_path}: {self.worst_path_gap_s:.2f} s)"
        if self.not_recovered:
            text += f"; {self.not_recovered} NOT recovered"
        return text


@dataclass(frozen=True)
class CheckReport:
    """Every check's result for one history, the unavailability windows and the counts."""

    seed: int | None
    checks: tuple[CheckResult, ...]
    windows: tuple[Window, ...]
    path_windows: tuple[Window, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """Said in the summary line (e.g. a fault kind the run left out, and why)."""
    info: tuple[str, ...] = ()
    """Only in the details (e.g. fault kinds not applicable to Squall)."""
    fault_windows: tuple[FaultWindow, ...] = ()

    def kind_summary(self) -> tuple[KindSummary, ...]:
        """Per fault kind (in order of first appearance), the windows summed up."""
        return summarize_kinds(self.fault_windows)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def result(self, name: str) -> CheckResult:
        """The result of the check called `name` (KeyError if there is none)."""
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    @property
    def failed(self) -> tuple[str, ...]:
        """The names of the checks that failed."""
        return tuple(c.name for c in self.checks if not c.ok)

    def summary_line(self) -> str:
        """One line: the verdict, then each check's headline and the windows."""
        seed = "?" if self.seed is None else str(self.seed)
        windows = len(self.windows)
        longest = max((w.duration_s for w in self.windows), default=0.0)
        window_text = f"{windows} unavailability window{'s' if windows != 1 else ''}"
        if windows:
            window_text += f" (max {longest:.1f} s)"
        parts = [self.result(name).headline for name in CHECK_NAMES if name != "history"]
        if not self.result("history").ok:
            parts.insert(0, self.result("history").headline)
        body = ", ".join([*parts, window_text, *self.notes])
        if self.ok:
            return f"chaos seed={seed} ok: {body}"
        return f"chaos seed={seed} FAILED ({', '.join(self.failed)}): {body}"

    def kind_lines(self) -> list[str]:
        """One line per fault kind: what publishers saw (see the module docstring)."""
        kinds = self.kind_summary()
        if not kinds:
            return []
        return ["unavailability per fault kind:", *(f"  {k.line()}" for k in kinds)]

    def describe(self) -> str:
        """The summary line, then every failed check's evidence and every window."""
        lines = [self.summary_line(), *(f"  note: {i}" for i in self.info)]
        lines.extend(f"  {line}" for line in self.kind_lines())
        for check in self.checks:
            mark = "ok  " if check.ok else "FAIL"
            lines.append(f"  {mark} {check.name}: {check.headline}")
            lines.extend(f"         {d}" for d in check.details)
        for window in self.windows:
            causes = "; ".join(window.causes)
            lines.append(
                f"  unavailable {window.start:.2f}-{window.end:.2f} s "
                f"({window.duration_s:.2f} s): {causes}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values (windows as "unavailable" records)."""
        return {
            "ok": self.ok,
            "seed": self.seed,
            "summary": self.summary_line(),
            "counts": dict(self.counts),
            "nodes": list(self.nodes),
            "notes": list(self.notes),
            "info": list(self.info),
            "checks": [asdict(c) for c in self.checks],
            "unavailable": [
                {"type": "unavailable", **asdict(w), "duration_s": round(w.duration_s, 6)}
                for w in (*self.windows, *self.path_windows)
            ],
            "fault_windows": [asdict(w) for w in self.fault_windows],
            "per_kind": {k.kind: asdict(k) for k in self.kind_summary()},
        }


# -- reading the history -----------------------------------------------------------------


class _Op:
    """One invoke and its complete (None while unanswered), with what the checks read.

    Plain attributes computed once: a long run has hundreds of thousands of these.
    """

    __slots__ = (
        "binding",
        "complete",
        "completed_t",
        "id",
        "idempotent",
        "invoke",
        "invoked_t",
        "outcome",
        "positions",
        "values",
    )

    def __init__(self, invoke: Record) -> None:
        self.invoke = invoke
        self.id = int(invoke["id"])
        events = invoke.get("events") or ()
        self.values: list[str] = [str(e["value"]) for e in events]
        self.positions = {value: i for i, value in enumerate(self.values)}
        self.idempotent = bool(invoke.get("publisher_id")) and all(
            e.get("seq") is not None for e in events
        )
        self.binding = (str(invoke.get("process")), str(invoke.get("topic")))
        self.invoked_t = float(invoke["t"])
        self.complete: Record | None = None
        self.completed_t: float | None = None
        # An op never answered may have happened.
        self.outcome = "indeterminate"

    def finish(self, complete: Record) -> None:
        self.complete = complete
        self.completed_t = float(complete["t"])
        self.outcome = str(complete.get("outcome"))


@dataclass
class _History:
    run: Record | None
    end: Record | None
    ops: list[_Op]
    stray_completes: list[Record]
    delivers: list[Record]
    faults: list[Record]
    final_logs: list[Record]

    publishes: list[_Op] = field(default_factory=list)
    deliveries: dict[tuple[str, str, str], list[tuple[int, str]]] = field(default_factory=dict)


def _parse(records: Sequence[Record]) -> _History:
    ops: dict[int, _Op] = {}
    stray: list[Record] = []
    run = end = None
    delivers: list[Record] = []
    faults: list[Record] = []
    final_logs: list[Record] = []
    for record in records:
        kind = record.get("type")
        if kind == "run" and run is None:
            run = record
        elif kind == "end":
            end = record
        elif kind == "invoke":
            ops[int(record["id"])] = _Op(record)
        elif kind == "complete":
            op = ops.get(int(record["id"]))
            if op is None or op.complete is not None:
                stray.append(record)
            else:
                op.finish(record)
        elif kind == "deliver":
            delivers.append(record)
        elif kind == "fault":
            faults.append(record)
        elif kind == "final_log":
            final_logs.append(record)
    history = _History(run, end, list(ops.values()), stray, delivers, faults, final_logs)
    history.publishes = [op for op in history.ops if op.invoke.get("op") == "publish"]
    history.deliveries = _deliveries(delivers)
    return history


def _examples(items: Iterable[str], total: int | None = None) -> tuple[str, ...]:
    listed: list[str] = []
    count = 0
    for item in items:
        count += 1
        if len(listed) < EXAMPLES_MAX:
            listed.append(item)
    total = count if total is None else total
    if total > len(listed):
        listed.append(f"... and {total - len(listed)} more")
    return tuple(listed)


# -- the committed logs ------------------------------------------------------------------


@dataclass
class _TopicLogs:
    """One topic's final logs per node, and the reference most nodes agree on."""

    topic: str
    by_node: dict[str, Record]
    reference: list[tuple[int, str]]
    reference_nodes: list[str]

    @property
    def value_at(self) -> dict[int, str]:
        return dict(self.reference)


def _events(record: Record) -> list[tuple[int, str]]:
    return [(int(offset), str(value)) for offset, value in record.get("events") or ()]


def _topic_logs(history: _History) -> dict[str, _TopicLogs]:
    grouped: dict[str, dict[str, Record]] = defaultdict(dict)
    for record in history.final_logs:
        if record.get("topic"):
            grouped[str(record["topic"])][str(record["node"])] = record
    result = {}
    for topic, by_node in grouped.items():
        readable = {n: r for n, r in by_node.items() if not r.get("error")}
        # The reference comes from the nodes not known to lag, when there are any: two
        # killed nodes' equal prefixes must not outvote the one full log.
        candidates = {n: r for n, r in readable.items() if not r.get("lagging")} or readable
        variants: dict[tuple[tuple[int, str], ...], list[str]] = defaultdict(list)
        for node in sorted(candidates):
            variants[tuple(_events(candidates[node]))].append(node)
        if variants:
            # The log most nodes hold; among equals the longest.
            events, nodes = max(variants.items(), key=lambda kv: (len(kv[1]), len(kv[0])))
            reference, reference_nodes = list(events), nodes
        else:
            reference, reference_nodes = [], []
        result[topic] = _TopicLogs(topic, by_node, reference, reference_nodes)
    return result


def _store_errors(history: _History) -> dict[str, str]:
    """Nodes whose whole store could not be read (a final_log with no topic and an error)."""
    return {
        str(r["node"]): str(r["error"])
        for r in history.final_logs
        if not r.get("topic") and r.get("error")
    }


def _topics(history: _History, logs: Mapping[str, _TopicLogs]) -> list[str]:
    named = list((history.run or {}).get("topics") or ())
    seen = {str(op.invoke.get("topic")) for op in history.publishes}
    return sorted({*map(str, named), *seen, *logs})


def _nodes(history: _History) -> list[str]:
    named = [str(n) for n in (history.run or {}).get("nodes") or ()]
    return sorted({*named, *(str(r["node"]) for r in history.final_logs)})


def _run_notes(run: Record) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(for the summary line, for the details): the run's notes and the faults it left out.

    A fault kind left out (no network namespaces without root) weakens what the run
    proves, so the summary says so; one not applicable to Squall is only listed.
    """
    summary = [str(n) for n in run.get("notes") or ()]
    details: list[str] = []
    skipped = run.get("faults_skipped") or {}
    for kind, why in sorted(skipped.items()) if isinstance(skipped, Mapping) else ():
        text = f"{kind} {why}"
        (summary if str(why).startswith("left out") else details).append(text)
    return tuple(summary), tuple(details)


# -- the checks --------------------------------------------------------------------------


def _check_history(history: _History) -> CheckResult:
    problems: list[str] = []
    if history.run is None:
        problems.append("no 'run' record: not the history of a run")
    if history.end is None:
        problems.append("no 'end' record: the run was cut short (the harness died or was killed)")
    elif str(history.end.get("reason")) != "completed":
        problems.append(f"the run ended early: {history.end.get('reason')}")
    if not history.final_logs:
        problems.append("no 'final_log' records: the stores were never read after the run")
    for record in history.stray_completes[:EXAMPLES_MAX]:
        problems.append(f"'complete' id {record.get('id')} answers no invoke (or answers twice)")
    open_ops = [op for op in history.ops if op.complete is None]
    notes: list[str] = []
    if open_ops:
        notes.append(
            f"{len(open_ops)} operations never completed (counted as indeterminate), "
            f"e.g. id {open_ops[0].id} of {open_ops[0].invoke.get('process')}"
        )
    if problems:
        return CheckResult("history", False, "history incomplete", tuple(problems + notes))
    return CheckResult("history", True, "history complete", tuple(notes))


def _acked(history: _History) -> dict[str, tuple[_Op, int]]:
    """Every acknowledged value: the ok op that acknowledged it and the offset it got."""
    acked: dict[str, tuple[_Op, int]] = {}
    for op in history.publishes:
        if op.outcome != "ok" or op.complete is None:
            continue
        offsets = list(op.complete.get("offsets") or ())
        for i, value in enumerate(op.values):
            offset = int(offsets[i]) if i < len(offsets) else -1
            acked.setdefault(value, (op, offset))
    return acked


def _check_lost(
    history: _History, logs: Mapping[str, _TopicLogs], acked: Mapping[str, tuple[_Op, int]]
) -> CheckResult:
    lost: list[str] = []
    misplaced: list[str] = []
    unreadable: list[str] = []
    stored_where: dict[str, dict[str, list[int]]] = _stored_offsets(logs)
    for value, (op, offset) in acked.items():
        topic = str(op.invoke.get("topic"))
        topic_logs = logs.get(topic)
        if topic_logs is None or not topic_logs.reference_nodes:
            unreadable.append(topic)
            continue
        where = stored_where[topic].get(value, [])
        if not where:
            lost.append(
                f"{value!r} ({op.invoke.get('process')}, op {op.id}, acked at "
                f"{op.completed_t:.3f} s, offset {offset}) is in no final log of '{topic}'"
            )
        elif offset >= 0 and offset not in where:
            misplaced.append(
                f"{value!r} was acknowledged at offset {offset} of '{topic}' but is stored at "
                f"{where}"
            )
    published = {v for op in history.publishes for v in op.values}
    phantoms = [
        f"'{topic}' offset {offset} holds {value!r}, which no one published"
        for topic, topic_logs in sorted(logs.items())
        for offset, value in topic_logs.reference
        if value not in published
    ]
    details = [
        f"no readable final_log of topic '{t}': cannot verify it" for t in sorted(set(unreadable))
    ]
    details += _examples(lost) + _examples(misplaced) + _examples(phantoms)
    ok = not (lost or misplaced or phantoms or unreadable)
    headline = f"{len(acked)} acked, {len(lost)} lost"
    if misplaced:
        headline += f", {len(misplaced)} at the wrong offset"
    if phantoms:
        headline += f", {len(phantoms)} stored but never published"
    if unreadable:
        headline += f", {len(set(unreadable))} topics unverifiable"
    return CheckResult("lost", ok, headline, tuple(details))


def _stored_offsets(logs: Mapping[str, _TopicLogs]) -> dict[str, dict[str, list[int]]]:
    where: dict[str, dict[str, list[int]]] = {}
    for topic, topic_logs in logs.items():
        by_value: dict[str, list[int]] = defaultdict(list)
        for offset, value in topic_logs.reference:
            by_value[value].append(offset)
        where[topic] = by_value
    return where


def _check_duplicates(history: _History, logs: Mapping[str, _TopicLogs]) -> CheckResult:
    idempotent: dict[str, tuple[str, Any]] = {}
    other: set[str] = set()
    for op in history.publishes:
        events = op.invoke.get("events") or ()
        for event in events:
            if op.idempotent:
                idempotent[str(event["value"])] = (str(op.invoke["publisher_id"]), event["seq"])
            else:
                other.add(str(event["value"]))
    violations = []
    repeats = 0
    for topic, topic_logs in sorted(logs.items()):
        counts = Counter(value for _, value in topic_logs.reference)
        for value, count in counts.items():
            if count < 2:
                continue
            if value in idempotent:
                publisher_id, seq = idempotent[value]
                offsets = [o for o, v in topic_logs.reference if v == value]
                violations.append(
                    f"'{topic}': publisher {publisher_id} sequence {seq} ({value!r}) is stored "
                    f"{count} times, at offsets {offsets}"
                )
            elif value in other:
                repeats += count - 1
    headline = f"{len(violations)} duplicates"
    details = list(_examples(violations))
    if repeats:
        details.append(f"{repeats} repeats of non-idempotent publishes (allowed: no dedup key)")
    return CheckResult("duplicates", not violations, headline, tuple(details))


def _check_dup_receipts(history: _History, logs: Mapping[str, _TopicLogs]) -> CheckResult:
    """Every duplicate receipt names where its event is stored: that topic, that offset,
    that payload (the ``complete`` record's ``duplicates``: indices of its events whose
    receipt said duplicate)."""
    wrong: list[str] = []
    checked = 0
    for op in history.publishes:
        if op.outcome != "ok" or op.complete is None:
            continue
        indices = op.complete.get("duplicates") or ()
        offsets = list(op.complete.get("offsets") or ())
        topic = str(op.invoke.get("topic"))
        topic_logs = logs.get(topic)
        if not indices or topic_logs is None or not topic_logs.reference_nodes:
            continue  # an unreadable topic fails the "lost" check already
        value_at = topic_logs.value_at
        for index in indices:
            index = int(index)
            checked += 1
            value = op.values[index] if index < len(op.values) else "?"
            offset = int(offsets[index]) if index < len(offsets) else -1
            stored = value_at.get(offset)
            if stored != value:
                held = "nothing" if stored is None else repr(stored)
                wrong.append(
                    f"{op.invoke.get('process')} op {op.id}: the receipt of {value!r} says "
                    f"duplicate at offset {offset} of '{topic}', which holds {held}"
                )
    headline = f"{checked} duplicate receipts"
    if wrong:
        headline += f", {len(wrong)} pointing at no such event"
    return CheckResult("dup_receipts", not wrong, headline, _examples(wrong))


def _check_outcomes(history: _History, logs: Mapping[str, _TopicLogs]) -> CheckResult:
    stored = {(t, v) for t, tl in logs.items() for _, v in tl.reference}
    # A value counts as definitely failed only if every op that carried it failed: an
    # idempotent retry after an indeterminate attempt may fail while the first stored it.
    outcomes: dict[tuple[str, str], set[str]] = defaultdict(set)
    counts: Counter[str] = Counter()
    for op in history.publishes:
        counts[op.outcome if op.complete is not None else "open"] += 1
        for value in op.values:
            outcomes[(str(op.invoke.get("topic")), value)].add(op.outcome)
    failed_stored = [
        f"{value!r} on '{topic}' was reported failed (definitely not stored) but is stored"
        for (topic, value), seen in sorted(outcomes.items())
        if seen == {"fail"} and (topic, value) in stored
    ]
    maybe = [key for key, seen in outcomes.items() if "indeterminate" in seen and "ok" not in seen]
    maybe_stored = sum(1 for key in maybe if key in stored)
    headline = (
        f"{counts['indeterminate'] + counts['open']} indeterminate "
        f"({maybe_stored} of {len(maybe)} events stored), {counts['fail']} failed"
    )
    if failed_stored:
        headline += f", {len(failed_stored)} failed but stored"
    return CheckResult("outcomes", not failed_stored, headline, _examples(failed_stored))


def _precedes(a: _Op, b: _Op) -> bool:
    """True when op a completed before op b was invoked (real-time order)."""
    done = a.completed_t
    return done is not None and done < b.invoked_t


@dataclass(frozen=True)
class _Subscriber:
    process: str
    topic: str
    subscription: str
    mode: str
    start_offset: int

    @property
    def label(self) -> str:
        return f"{self.process} ({self.mode} '{self.subscription}' on '{self.topic}')"


def _subscribers(history: _History) -> tuple[list[_Subscriber], list[str], set[tuple[str, str]]]:
    """The durable subscribers (subscribe ok), notes, and (topic, push id) pairs removed."""
    subscribers = []
    notes: list[str] = []
    for op in history.ops:
        if op.invoke.get("op") != "subscribe":
            continue
        invoke = op.invoke
        if op.outcome != "ok":
            notes.append(f"{invoke.get('process')} did not subscribe ({op.outcome}): not checked")
            continue
        subscribers.append(
            _Subscriber(
                str(invoke.get("process")),
                str(invoke.get("topic")),
                str(invoke.get("subscription")),
                str(invoke.get("mode")),
                # The cluster's answer (a push subscribe's cursor) beats the request.
                int(_start_offset(op)),
            )
        )
    # The last successful listing of each topic's push subscribers decides which were
    # removed by the cluster (retry count exhausted, endpoint said NOT_FOUND).
    listed: dict[str, set[str]] = {}
    for op in history.ops:
        if op.invoke.get("op") == "list_push_subscribers" and op.outcome == "ok" and op.complete:
            listed[str(op.invoke.get("topic"))] = set(op.complete.get("subscriber_ids") or ())
    removed = {
        (s.topic, s.subscription)
        for s in subscribers
        if s.mode == "push" and s.topic in listed and s.subscription not in listed[s.topic]
    }
    return subscribers, notes, removed


def _start_offset(op: _Op) -> int:
    answered = (op.complete or {}).get("start_offset")
    asked = op.invoke.get("start_offset")
    return int(answered if answered is not None else asked or 0)


def _deliveries(delivers: Sequence[Record]) -> dict[tuple[str, str, str], list[tuple[int, str]]]:
    got: dict[tuple[str, str, str], list[tuple[int, str]]] = defaultdict(list)
    for record in delivers:
        key = (
            str(record.get("process")),
            str(record.get("topic")),
            str(record.get("subscription")),
        )
        got[key].extend((int(e["offset"]), str(e["value"])) for e in record.get("events") or ())
    return dict(got)


def _order_violation(sequence: Iterable[str], acked: Mapping[str, tuple[_Op, int]]) -> str | None:
    """The first acked value of one binding that arrives after a later one, first time seen."""
    seen: set[str] = set()
    # The op, position and value furthest along in publish order so far.
    latest: tuple[_Op, int, str] | None = None
    for value in sequence:
        if value in seen:
            continue  # a redelivery
        seen.add(value)
        op = acked[value][0]
        position = op.positions[value]
        if latest is not None:
            last_op, last_position, last_value = latest
            if op is last_op:
                if position < last_position:
                    return f"{value!r} (op {op.id}) came after {last_value!r} (op {last_op.id})"
            elif _precedes(op, last_op):
                return f"{value!r} (op {op.id}) came after {last_value!r} (op {last_op.id})"
            elif not _precedes(last_op, op):
                continue  # concurrent ops: no order to keep
        latest = (op, position, value)
    return None


def _first_invoked(
    history: _History, acked: Mapping[str, tuple[_Op, int]]
) -> dict[str, tuple[_Op, int]]:
    """Each acknowledged value's first operation: where it stands in publish order.

    An indeterminate publish may have stored its events, and a publisher whose calls run
    at once (`gateway_unary`) may see a neighbouring call acknowledged before it sends
    them again: ordered from their acknowledgement, such events would be reported out of
    order. Every workload publisher sends an indeterminate event again before any new
    one, so ordering a value from the first time it was sent keeps every order the
    publisher asked for; for a publisher whose publishes run one at a time it is the
    same as ordering from the acknowledgement."""
    first: dict[str, tuple[_Op, int]] = {}
    for op in sorted(history.publishes, key=lambda o: o.invoked_t):
        for value in op.values:
            if value in acked and value not in first:
                first[value] = (op, 0)
    return first


def _check_order(
    history: _History,
    logs: Mapping[str, _TopicLogs],
    acked: Mapping[str, tuple[_Op, int]],
) -> CheckResult:
    acked = _first_invoked(history, acked)
    violations = []
    # In the committed log first: the order every subscriber should then see.
    for topic, topic_logs in sorted(logs.items()):
        per_binding: dict[tuple[str, str], list[str]] = defaultdict(list)
        for _, value in topic_logs.reference:
            if value in acked:
                per_binding[acked[value][0].binding].append(value)
        for binding, values in sorted(per_binding.items()):
            problem = _order_violation(values, acked)
            if problem:
                violations.append(f"log of '{topic}', binding {binding[0]}: {problem}")
    subscribers_checked = 0
    for key, events in sorted(history.deliveries.items()):
        subscribers_checked += 1
        per_binding = defaultdict(list)
        for _, value in events:
            if value in acked:
                per_binding[acked[value][0].binding].append(value)
        for binding, values in sorted(per_binding.items()):
            problem = _order_violation(values, acked)
            if problem:
                violations.append(
                    f"subscriber {key[0]} ('{key[2]}'), binding {binding[0]}: {problem}"
                )
    headline = "order ok" if not violations else f"order broken ({len(violations)} bindings)"
    return CheckResult("order", not violations, headline, _examples(violations))


def _check_delivery(history: _History, logs: Mapping[str, _TopicLogs]) -> CheckResult:
    subscribers, notes, removed = _subscribers(history)
    got = history.deliveries
    problems: list[str] = []
    checked = 0
    for sub in subscribers:
        key = (sub.process, sub.topic, sub.subscription)
        delivered = got.get(key, [])
        topic_logs = logs.get(sub.topic)
        value_at = topic_logs.value_at if topic_logs else {}
        wrong = [
            f"{sub.label} got offset {offset} = {value!r}, committed is "
            f"{value_at.get(offset, 'nothing')!r}"
            for offset, value in delivered
            if value_at.get(offset) != value
        ]
        problems.extend(_examples(wrong))
        if (sub.topic, sub.subscription) in removed:
            notes.append(f"{sub.label} was removed by the cluster: completeness not checked")
            continue
        if topic_logs is None or not topic_logs.reference_nodes:
            problems.append(f"{sub.label}: no readable final_log of '{sub.topic}' to check against")
            continue
        checked += 1
        have = {offset for offset, _ in delivered}
        missing = [o for o, _ in topic_logs.reference if o >= sub.start_offset and o not in have]
        if missing:
            problems.append(
                f"{sub.label} never got {len(missing)} committed events, offsets {_ranges(missing)}"
            )
    headline = (
        f"delivery ok ({checked} subscribers)"
        if not problems
        else f"delivery broken ({len(problems)} problems)"
    )
    return CheckResult("delivery", not problems, headline, tuple(problems + notes))


def _ranges(offsets: Sequence[int]) -> str:
    """Offsets as "3-7, 9" (at most EXAMPLES_MAX ranges)."""
    ranges: list[tuple[int, int]] = []
    for offset in sorted(offsets):
        if ranges and offset == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], offset)
        else:
            ranges.append((offset, offset))
    text = [str(a) if a == b else f"{a}-{b}" for a, b in ranges[:EXAMPLES_MAX]]
    if len(ranges) > EXAMPLES_MAX:
        text.append("...")
    return ", ".join(text)


def _check_logs(
    history: _History, logs: Mapping[str, _TopicLogs], nodes: Sequence[str]
) -> CheckResult:
    problems: list[str] = []
    notes: list[str] = []
    lagging_nodes: set[str] = set()
    store_errors = _store_errors(history)
    for topic in sorted(logs):
        topic_logs = logs[topic]
        reference = topic_logs.reference
        for node in nodes:
            record = topic_logs.by_node.get(node)
            if record is None and node in store_errors:
                problems.append(f"node {node}: its store could not be read: {store_errors[node]}")
                continue
            if record is None:
                problems.append(f"node {node}: no final_log of '{topic}' (its store was not read)")
                continue
            if record.get("error"):
                problems.append(f"node {node}: its store could not be read: {record['error']}")
                continue
            events = _events(record)
            offsets = [o for o, _ in events]
            if offsets and offsets != list(range(offsets[0], offsets[0] + len(offsets))):
                problems.append(f"node {node}: '{topic}' has gaps in its offsets")
            if events == reference:
                continue
            lagging = record.get("lagging")
            if len(events) < len(reference) and events == reference[: len(events)]:
                if lagging:
                    lagging_nodes.add(node)
                    notes.append(
                        f"node {node} holds {len(events)} of {len(reference)} events of "
                        f"'{topic}' (a prefix), lagging: {lagging}"
                    )
                    continue
                problems.append(
                    f"node {node} holds only {len(events)} of {len(reference)} committed events "
                    f"of '{topic}' (a prefix), and no reason it may lag"
                )
                continue
            problems.append(
                f"node {node} diverges from {','.join(topic_logs.reference_nodes)} on "
                f"'{topic}': {_first_difference(events, reference)}"
            )
    lagging = len(lagging_nodes)
    if problems:
        headline = f"logs differ ({len(problems)} problems)"
    elif lagging:
        headline = f"logs identical ({len(nodes)} nodes, {lagging} lagging by record)"
    else:
        headline = f"logs identical ({len(nodes)} nodes)"
    return CheckResult("logs", not problems, headline, tuple(problems + notes))


def _first_difference(a: Sequence[tuple[int, str]], b: Sequence[tuple[int, str]]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"at entry {i}: offset {x[0]} = {x[1]!r} vs offset {y[0]} = {y[1]!r}"
    return f"{len(a)} events vs {len(b)}"


# -- availability ------------------------------------------------------------------------


def _fault_intervals(history: _History, horizon: float) -> list[tuple[float, float, str]]:
    """(start, end, label) per fault; one never ended lasts to the horizon."""
    open_faults: dict[tuple[str, tuple[str, ...]], list[float]] = defaultdict(list)
    intervals = []
    for record in sorted(history.faults, key=lambda r: float(r["t"])):
        key = (str(record.get("fault")), tuple(str(t) for t in record.get("targets") or ()))
        if record.get("phase") == "start":
            open_faults[key].append(float(record["t"]))
        elif open_faults[key]:
            intervals.append((open_faults[key].pop(0), float(record["t"]), _fault_label(key)))
        else:
            intervals.append((float(record["t"]), float(record["t"]), _fault_label(key)))
    for key, starts in open_faults.items():
        intervals.extend((start, horizon, _fault_label(key)) for start in starts)
    return sorted(intervals)


def _fault_label(key: tuple[str, tuple[str, ...]]) -> str:
    kind, targets = key
    return f"{kind} {','.join(targets)}" if targets else kind


def fault_intervals(records: Sequence[Record]) -> list[tuple[float, float, str]]:
    """Every fault as (start, end, "kind targets"), for plots; open faults end with the run."""
    history = _parse(records)
    horizon = max((float(r["t"]) for r in records), default=0.0)
    return _fault_intervals(history, horizon)


def _windows(history: _History, threshold_s: float, path: str | None) -> list[Window]:
    publishes = [op for op in history.publishes if path is None or op.invoke.get("path") == path]
    if not publishes:
        return []
    successes = sorted(
        op.completed_t for op in publishes if op.outcome == "ok" and op.completed_t is not None
    )
    first = min(op.invoked_t for op in publishes)
    last = max(op.completed_t or op.invoked_t for op in publishes)
    marks = [first, *successes]
    if not successes or last > successes[-1]:
        marks.append(last)
    horizon = max(last, float(history.end["t"]) if history.end else last)
    faults = _fault_intervals(history, horizon)
    windows = []
    for start, end in itertools.pairwise(marks):
        if end - start > threshold_s:
            causes = tuple(
                dict.fromkeys(
                    label for f_start, f_end, label in faults if f_start <= end and f_end >= start
                )
            )
            windows.append(Window(start, end, path or "any", causes or ("no fault recorded",)))
    return windows


def unavailability_windows(
    records: Sequence[Record], threshold_s: float = GAP_THRESHOLD_S_DEFAULT, path: str | None = None
) -> list[Window]:
    """Gaps longer than threshold_s between successful publishes (of one path, or any)."""
    return _windows(_parse(records), threshold_s, path)


def _fault_windows(history: _History) -> list[FaultWindow]:
    """Per fault (start record) and publish path ("any" and each path), what publishers
    saw; see the module docstring for the definitions."""
    if not history.publishes:
        return []
    horizon = max(op.completed_t or op.invoked_t for op in history.publishes)
    if history.end is not None:
        horizon = max(horizon, float(history.end["t"]))
    acked = [op for op in history.publishes if op.outcome == "ok" and op.completed_t is not None]
    paths = ["any", *sorted({str(op.invoke.get("path")) for op in history.publishes})]
    per_path = {
        path: sorted(
            ((op.completed_t or 0.0), op.invoked_t)
            for op in acked
            if path == "any" or op.invoke.get("path") == path
        )
        for path in paths
    }
    gateways = {str(g) for g in (history.run or {}).get("gateways") or ()}
    windows = []
    for start, end, label in _fault_intervals(history, horizon):
        kind, _, named = label.partition(" ")
        if named and set(named.split(",")) <= gateways:
            kind += "_gateway"  # a gateway kill is not a node's
        for path in paths:
            window = fault_window(per_path[path], start, end, horizon)
            windows.append(FaultWindow(kind, label, start, end, path, *window))
    return windows


def fault_window(
    acks: Sequence[tuple[float, float]], start: float, end: float, horizon: float
) -> tuple[float | None, float, bool]:
    """(first ack after start, longest gap, recovered) of one fault for acks given as
    (completed, invoked) times sorted by completion (see the module docstring)."""
    first = next((done - start for done, invoked in acks if invoked >= start), None)
    marks = [start]
    recovered = False
    for done, _ in acks:
        if done <= start:
            continue
        marks.append(done)
        if done >= end:
            recovered = True
            break
    if not recovered:
        marks.append(max(horizon, end))
    longest = max((b - a for a, b in itertools.pairwise(marks)), default=0.0)
    return first, longest, recovered


def summarize_kinds(windows: Sequence[FaultWindow]) -> tuple[KindSummary, ...]:
    """Per fault kind: count, first-ack p50 / max, longest gap, worst path (any-path
    figures; the worst path by its longest gap)."""
    kinds = list(dict.fromkeys(w.kind for w in windows))
    result = []
    for kind in kinds:
        anyp = [w for w in windows if w.kind == kind and w.path == "any"]
        firsts = sorted(w.first_ack_s for w in anyp if w.first_ack_s is not None)
        paths = [w for w in windows if w.kind == kind and w.path != "any"]
        worst = max(paths, key=lambda w: w.longest_gap_s, default=None)
        result.append(
            KindSummary(
                kind,
                len(anyp),
                firsts[(len(firsts) - 1) // 2] if firsts else None,
                firsts[-1] if firsts else None,
                max((w.longest_gap_s for w in anyp), default=0.0),
                sum(1 for w in anyp if not w.recovered),
                worst.path if worst is not None else "",
                worst.longest_gap_s if worst is not None else 0.0,
            )
        )
    return tuple(result)


# -- the whole report --------------------------------------------------------------------


def _check_churn(history: _History) -> CheckResult:
    epochs = [int(r["last_epoch"]) for r in history.final_logs if "last_epoch" in r]
    if not epochs:
        return CheckResult("churn", True, "epochs not recorded (an older history)")
    newest = max(epochs)
    records = len(history.faults)
    bound = EPOCHS_PER_FAULT_RECORD_MAX * records + EPOCHS_SLACK
    headline = f"epoch {newest} for {records} fault records"
    if newest > bound:
        return CheckResult(
            "churn",
            False,
            f"churn: {headline} (at most {bound})",
            (
                "the group re-formed far more often than the faults explain: look for a "
                "node re-formed into its group again and again in the coordinators' logs",
            ),
        )
    return CheckResult("churn", True, headline)


def check_records(
    records: Sequence[Record], gap_threshold_s: float = GAP_THRESHOLD_S_DEFAULT
) -> CheckReport:
    """Runs every check over a history's records."""
    if gap_threshold_s <= 0:
        raise ValueError(f"gap_threshold_s must be > 0, not {gap_threshold_s}")
    history = _parse(records)
    logs = _topic_logs(history)
    nodes = _nodes(history)
    for topic in _topics(history, logs):
        logs.setdefault(topic, _TopicLogs(topic, {}, [], []))
    acked = _acked(history)
    checks = (
        _check_history(history),
        _check_lost(history, logs, acked),
        _check_duplicates(history, logs),
        _check_dup_receipts(history, logs),
        _check_outcomes(history, logs),
        _check_order(history, logs, acked),
        _check_delivery(history, logs),
        _check_logs(history, logs, nodes),
        _check_churn(history),
    )
    paths = sorted({str(op.invoke.get("path")) for op in history.publishes})
    path_windows = tuple(w for p in paths for w in _windows(history, gap_threshold_s, p))
    outcome_counts = Counter(op.outcome for op in history.publishes)
    counts = {
        "publishes": len(history.publishes),
        "acked_events": len(acked),
        "ok": outcome_counts["ok"],
        "fail": outcome_counts["fail"],
        "indeterminate": outcome_counts["indeterminate"],
        "deliveries": sum(len(r.get("events") or ()) for r in history.delivers),
        "faults": sum(1 for r in history.faults if r.get("phase") == "start"),
    }
    run = history.run or {}
    seed = run.get("seed")
    notes, info = _run_notes(run)
    return CheckReport(
        fault_windows=tuple(_fault_windows(history)),
        seed=int(seed) if isinstance(seed, int) else None,
        checks=checks,
        windows=tuple(_windows(history, gap_threshold_s, None)),
        path_windows=path_windows,
        counts=counts,
        nodes=tuple(nodes),
        notes=notes,
        info=info,
    )


def check(path: Path, gap_threshold_s: float = GAP_THRESHOLD_S_DEFAULT) -> CheckReport:
    """Reads a history file and checks it (HistoryError for a malformed file)."""
    return check_records(read_history(path), gap_threshold_s)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m chaos check HISTORY [--plot PNG] [--json OUT] [--gap S]`; 0 if it passes."""
    parser = argparse.ArgumentParser(
        prog="python -m chaos check", description="Check a chaos run's history file."
    )
    parser.add_argument("history", type=Path, help="the history file (JSON lines)")
    parser.add_argument("--plot", type=Path, help="write the timeline PNG here")
    parser.add_argument("--json", type=Path, dest="json_out", help="write the report as JSON here")
    parser.add_argument(
        "--gap",
        type=float,
        default=GAP_THRESHOLD_S_DEFAULT,
        help="seconds without a successful publish that count as unavailable (default 1)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="print every check's evidence")
    args = parser.parse_args(argv)
    if args.gap <= 0:
        parser.error(f"--gap must be > 0, not {args.gap}")
    try:
        records = read_history(args.history)
    except (OSError, HistoryError) as exc:
        print(f"chaos check: {exc}", file=sys.stderr)
        return 2
    report = check_records(records, args.gap)
    print(report.describe() if args.verbose or not report.ok else report.summary_line())
    if report.ok and not args.verbose:
        print("\n".join(report.kind_lines()))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot is not None:
        from chaos.timeline import plot_timeline

        plot_timeline(records, args.plot, gap_threshold_s=args.gap)
        print(f"timeline: {args.plot}")
    return 0 if report.ok else 1
