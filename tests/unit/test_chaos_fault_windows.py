"""The chaos checker's figures per fault kind and its duplicate-receipt invariant, on
hand-built histories whose windows are worked out by hand.

Per fault: the time from its start to the first acknowledgement of a publish invoked
after it, and the longest interval with no acknowledgement until the first one at or
after its heal; a fault nothing was acknowledged after is "not recovered". A receipt that
says duplicate must point at its event in the topic's committed log.
"""

from __future__ import annotations

from typing import Any

import pytest

from chaos.checker import check_records, fault_window
from tests.unit.test_chaos_checker import NODES, TOPIC

Record = dict[str, Any]


class _History:
    """Publishes that are all stored in order; faults; final logs; end."""

    def __init__(self) -> None:
        self.records: list[Record] = [
            {
                "t": 0.0,
                "type": "run",
                "seed": 3,
                "nodes": list(NODES),
                "gateways": ["g1", "g2"],
                "topics": [TOPIC],
            }
        ]
        self.log: list[str] = []
        self.ids = 0

    def publish(
        self,
        invoked: float,
        done: float,
        path: str = "gateway",
        outcome: str = "ok",
        duplicate_of: int | None = None,
    ) -> str:
        self.ids += 1
        value = f"{path}:{self.ids}"
        self.records.append(
            {
                "t": invoked,
                "type": "invoke",
                "id": self.ids,
                "process": f"pub-{path}",
                "op": "publish",
                "path": path,
                "topic": TOPIC,
                "publisher_id": f"P-{path}",
                "events": [{"seq": self.ids, "value": value}],
            }
        )
        complete: Record = {
            "t": done,
            "type": "complete",
            "id": self.ids,
            "outcome": outcome,
            "error": None,
            "offsets": [],
        }
        if outcome == "ok":
            if duplicate_of is None:
                self.log.append(value)
                complete["offsets"] = [len(self.log) - 1]
            else:
                complete["offsets"] = [duplicate_of]
                complete["duplicates"] = [0]
        self.records.append(complete)
        return value

    def fault(self, start: float, end: float, kind: str, target: str) -> None:
        for t, phase in ((start, "start"), (end, "end")):
            self.records.append(
                {"t": t, "type": "fault", "fault": kind, "phase": phase, "targets": [target]}
            )

    def finish(self, t: float, log: list[str] | None = None) -> list[Record]:
        for node in NODES:
            events = [[o, v] for o, v in enumerate(self.log if log is None else log)]
            self.records.append(
                {"t": t, "type": "final_log", "node": node, "topic": TOPIC, "events": events}
            )
        self.records.append({"t": t + 0.1, "type": "end", "reason": "completed"})
        return sorted(self.records, key=lambda r: float(r["t"]))


def test_fault_window_by_hand() -> None:
    # Acks as (completed, invoked). The fault lasts 2.0-5.0.
    acks = [(1.9, 1.85), (2.05, 1.95), (2.6, 2.5), (4.0, 3.9), (5.4, 5.3), (5.5, 5.45)]
    first, longest, recovered = fault_window(acks, 2.0, 5.0, 10.0)
    # The ack at 2.05 was in flight at the start: the first of a call made after is 2.6.
    assert first == pytest.approx(0.6)
    # Marks 2.0, 2.05, 2.6, 4.0, 5.4 (the first at or after the heal): longest 4.0 -> 5.4.
    assert longest == pytest.approx(1.4) and recovered
    # Nothing after the heal: the gap runs to the horizon, not recovered.
    first, longest, recovered = fault_window(acks[:3], 2.0, 5.0, 10.0)
    assert first == pytest.approx(0.6) and longest == pytest.approx(7.4) and not recovered
    assert fault_window([], 2.0, 5.0, 10.0) == (None, 8.0, False)


def _two_replica_pauses_and_a_gateway_kill() -> list[Record]:
    h = _History()
    # Steady publishing on both paths every 0.1 s except where a fault stops a path.
    outages = {
        # pause_replica n1 2.0-4.0: the gateway path resumes at 2.5, the proxy at 4.3.
        "gateway": [(2.0, 2.5), (6.0, 6.3), (8.0, 9.0)],
        "replicated": [(2.0, 4.3), (6.0, 6.8), (8.0, 8.2)],
    }
    for tenth in range(1, 100):
        t = tenth / 10
        for path, holes in outages.items():
            if not any(a <= t < b for a, b in holes):
                h.publish(t, round(t + 0.02, 3), path)
    h.fault(2.0, 4.0, "pause_replica", "n1")
    h.fault(6.0, 7.0, "pause_replica", "n2")
    h.fault(8.0, 8.5, "kill", "g1")
    return h.finish(10.5)


def test_windows_per_fault_kind_and_path() -> None:
    report = check_records(_two_replica_pauses_and_a_gateway_kill())
    assert report.ok, report.describe()
    windows = {(w.label, w.path): w for w in report.fault_windows}
    first = windows[("pause_replica n1", "any")]
    # The gateway path acks the publish invoked at 2.5 at 2.52.
    assert first.first_ack_s == pytest.approx(0.52) and first.recovered
    assert first.longest_gap_s == pytest.approx(0.52, abs=0.01)
    proxy = windows[("pause_replica n1", "replicated")]
    assert proxy.first_ack_s == pytest.approx(2.32, abs=0.01)
    # Its last ack before the pause was at 1.92 (invoked 1.9): longest 2.0 -> 4.32.
    assert proxy.longest_gap_s == pytest.approx(2.32, abs=0.01)
    kinds = {k.kind: k for k in report.kind_summary()}
    assert list(kinds) == ["pause_replica", "kill_gateway"]
    pauses = kinds["pause_replica"]
    assert pauses.faults == 2 and pauses.not_recovered == 0
    # Any path: 0.52 (n1) and 0.32 (n2, the gateway path back at 6.3); nearest-rank p50.
    assert pauses.first_ack_p50_s == pytest.approx(0.32, abs=0.01)
    assert pauses.first_ack_max_s == pytest.approx(0.52, abs=0.01)
    assert pauses.worst_path == "replicated"
    assert pauses.worst_path_gap_s == pytest.approx(2.32, abs=0.01)
    lines = "\n".join(report.kind_lines())
    assert "pause_replica (2): first ack after start p50 0.32 s, max 0.52 s" in lines
    assert "worst path replicated: 2.32 s" in lines
    assert "kill_gateway (1)" in lines
    as_json = report.to_json()
    assert as_json["per_kind"]["pause_replica"]["faults"] == 2
    assert len(as_json["fault_windows"]) == 3 * 3  # three faults x (any, two paths)


def test_a_fault_nothing_was_acknowledged_after_is_not_recovered() -> None:
    h = _History()
    for i in range(10):
        h.publish(0.1 * i, 0.1 * i + 0.02)
    h.fault(1.0, 2.0, "kill_replica", "n1")
    h.publish(1.5, 3.0, outcome="indeterminate")
    records = h.finish(4.0)
    report = check_records(records)
    (summary,) = report.kind_summary()
    assert summary.not_recovered == 1 and summary.first_ack_p50_s is None
    assert "kill_replica (1): no ack after start" in report.kind_lines()[1]
    assert "1 NOT recovered" in report.kind_lines()[1]


def test_duplicate_receipts_pointing_at_their_event_pass() -> None:
    dup = _History()
    dup.publish(0.1, 0.2)
    value = dup.publish(0.3, 0.4)
    dup.ids -= 1
    # A retry the master recognised (the same value and sequence, a new op), answered
    # duplicate at offset 1, where the first copy is stored.
    again = dup.publish(0.5, 0.6, duplicate_of=1)
    assert again == value
    report = check_records(dup.finish(2.0))
    assert report.ok, report.describe()
    assert report.result("dup_receipts").headline == "1 duplicate receipts"
    assert "1 duplicate receipts" in report.summary_line()


def test_a_duplicate_receipt_for_an_event_stored_nowhere_is_a_finding() -> None:
    # The topic was destroyed and created again: the publisher's old dedupe state answers
    # "duplicate at offset 0" for a new event, and nothing is stored.
    h = _History()
    value = h.publish(0.1, 0.2, duplicate_of=0)
    report = check_records(h.finish(2.0))
    assert "dup_receipts" in report.failed
    (detail,) = report.result("dup_receipts").details
    assert f"the receipt of {value!r} says duplicate at offset 0 of '{TOPIC}'" in detail
    assert detail.endswith("which holds nothing")
    assert "1 pointing at no such event" in report.summary_line()


def test_a_duplicate_receipt_pointing_at_another_event_is_a_finding() -> None:
    h = _History()
    other = h.publish(0.1, 0.2)
    value = h.publish(0.3, 0.4)
    h.ids -= 1
    h.publish(0.5, 0.6, duplicate_of=0)  # value's retry, answered with other's offset
    report = check_records(h.finish(2.0))
    assert "dup_receipts" in report.failed
    (detail,) = report.result("dup_receipts").details
    assert f"{value!r} says duplicate at offset 0" in detail and f"holds {other!r}" in detail
