"""The chaos history checker on hand-built histories.

Goal: a clean run passes with the figures a reader expects, and a history that breaks
exactly one property (an acknowledged event lost, an idempotent event stored twice, a
subscriber seeing a publisher's events out of order, a committed event never delivered,
a replica whose log differs, a run cut short, a "failed" event that was stored) fails
naming that property. The timeline of a run is drawn into a PNG.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chaos.checker import (
    EPOCHS_PER_FAULT_RECORD_MAX,
    EPOCHS_SLACK,
    check,
    check_records,
    main,
    unavailability_windows,
)
from chaos.timeline import plot_timeline

NODES = ("n1", "n2", "n3")
TOPIC = "t"

Record = dict[str, Any]


class _Run:
    """Builds a consistent history: sequential publishers, a committed log, subscribers."""

    def __init__(self) -> None:
        self.records: list[Record] = [
            {
                "t": 0.0,
                "type": "run",
                "seed": 7,
                "duration_s": 10,
                "nodes": list(NODES),
                "gateways": ["g1"],
                "faults": ["kill"],
                "topics": [TOPIC],
                "started_at": "2026-11-22T07:00:00Z",
            }
        ]
        self.next_id = 0
        self.log: list[str] = []
        self.acked_offsets: dict[str, int] = {}

    def publish(
        self,
        t: float,
        process: str,
        values: list[str],
        outcome: str = "ok",
        *,
        path: str = "gateway",
        publisher_id: str | None = None,
        first_seq: int = 1,
        stored: bool | None = None,
    ) -> None:
        self.next_id += 1
        events = [
            {"seq": first_seq + i if publisher_id else None, "value": v}
            for i, v in enumerate(values)
        ]
        self.records.append(
            {
                "t": t,
                "type": "invoke",
                "id": self.next_id,
                "process": process,
                "op": "publish",
                "path": path,
                "topic": TOPIC,
                "publisher_id": publisher_id,
                "events": events,
            }
        )
        offsets = []
        if stored if stored is not None else outcome == "ok":
            for value in values:
                if value not in self.log:
                    self.log.append(value)
                offsets.append(self.log.index(value))
        self.records.append(
            {
                "t": t + 0.05,
                "type": "complete",
                "id": self.next_id,
                "outcome": outcome,
                "error": None if outcome == "ok" else "UNAVAILABLE: gone",
                "offsets": offsets if outcome == "ok" else [],
            }
        )

    def subscribe(self, t: float, process: str, mode: str, name: str) -> None:
        self.next_id += 1
        self.records.append(
            {
                "t": t,
                "type": "invoke",
                "id": self.next_id,
                "process": process,
                "op": "subscribe",
                "mode": mode,
                "topic": TOPIC,
                "subscription": name,
                "start_offset": 0,
            }
        )
        self.records.append(
            {"t": t + 0.01, "type": "complete", "id": self.next_id, "outcome": "ok"}
        )

    def deliver(
        self,
        t: float,
        process: str,
        mode: str,
        name: str,
        offsets: list[int],
        log: list[str] | None = None,
    ) -> None:
        log = self.log if log is None else log
        self.records.append(
            {
                "t": t,
                "type": "deliver",
                "process": process,
                "mode": mode,
                "topic": TOPIC,
                "subscription": name,
                "events": [{"offset": o, "value": log[o]} for o in offsets],
            }
        )

    def fault(self, t: float, kind: str, phase: str, targets: list[str]) -> None:
        self.records.append(
            {
                "t": t,
                "type": "fault",
                "fault": kind,
                "phase": phase,
                "targets": targets,
                "detail": "",
            }
        )

    def final(
        self, t: float, logs: dict[str, list[str]] | None = None, last_epoch: int | None = 2
    ) -> None:
        """Subscribers get the committed log (n1's), then the final logs (each store's
        newest epoch ``last_epoch``; None: not recorded, as in older histories) and the
        end."""
        delivered = (logs or {}).get("n1", self.log)
        self.log = delivered if len(delivered) >= len(self.log) else self.log
        everything = list(range(len(delivered)))
        if any(r.get("op") == "subscribe" for r in self.records):
            self.deliver(t - 1, "sub-1", "stream", "s1", everything[:5], delivered)
            # A reconnect: the durable cursor was at 3, so 3 and 4 come again.
            self.deliver(t - 0.8, "sub-1", "stream", "s1", everything[3:], delivered)
            self.deliver(t - 1, "sub-2", "push", "p1", everything, delivered)
        for node in NODES:
            values = (logs or {}).get(node, self.log)
            self.records.append(
                {
                    "t": t,
                    "type": "final_log",
                    "node": node,
                    "topic": TOPIC,
                    "commit_lsn": 100,
                    "events": [[o, v] for o, v in enumerate(values)],
                    **({} if last_epoch is None else {"last_epoch": last_epoch}),
                }
            )
        self.records.append({"t": t + 0.1, "type": "end", "reason": "completed"})


def _clean() -> _Run:
    """Two publishers (idempotent via the gateway, plain via a replicated proxy), a kill
    with a 2 s gap, an indeterminate publish that was stored, two subscribers."""
    run = _Run()
    run.subscribe(0.1, "sub-1", "stream", "s1")
    run.subscribe(0.1, "sub-2", "push", "p1")
    t = 0.2
    for i in range(1, 6):
        run.publish(
            t,
            "pub-1",
            [f"pub-1:{2 * i - 1}", f"pub-1:{2 * i}"],
            publisher_id="P1",
            first_seq=2 * i - 1,
        )
        run.publish(t + 0.1, "pub-2", [f"pub-2:{i}"], path="replicated")
        t += 0.2
    run.fault(t, "kill", "start", ["n1"])
    run.publish(t + 0.1, "pub-2", ["pub-2:6"], "indeterminate", path="replicated", stored=True)
    run.publish(t + 0.2, "pub-1", ["pub-1:11"], "fail", publisher_id="P1", first_seq=11)
    t += 2.0
    run.publish(t, "pub-1", ["pub-1:11", "pub-1:12"], publisher_id="P1", first_seq=11)
    run.fault(t + 0.5, "kill", "end", ["n1"])
    run.publish(t + 0.6, "pub-2", ["pub-2:7"], path="replicated")
    return run


def _write(tmp_path: Path, records: list[Record]) -> Path:
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_clean_history_passes_with_its_figures(tmp_path: Path) -> None:
    run = _clean()
    run.final(9.0)
    report = check(_write(tmp_path, run.records))
    assert report.ok, report.describe()
    line = report.summary_line()
    assert line.startswith("chaos seed=7 ok: ")
    assert "18 acked, 0 lost" in line
    assert "0 duplicates" in line and "order ok" in line
    assert "delivery ok (2 subscribers)" in line
    assert "logs identical (3 nodes)" in line
    # The indeterminate publish was stored; the failed one (pub-1:11) was not, until its
    # idempotent retry succeeded.
    assert "1 indeterminate (1 of 1 events stored), 1 failed" in line
    assert "1 unavailability window (max 2.1 s)" in line
    assert "epoch 2 for 2 fault records" in line
    (window,) = report.windows
    assert window.causes == ("kill n1",)


def test_a_group_reformed_far_more_often_than_the_faults_explain_fails_churn() -> None:
    """Two fault records allow 2 * 2 + 25 epochs; a store at epoch 400 means the group
    re-formed again and again (a node whose replica refused every slave role, say)."""
    run = _clean()
    run.final(9.0, last_epoch=EPOCHS_PER_FAULT_RECORD_MAX * 2 + EPOCHS_SLACK + 1)
    details = _fails_only(run.records, "churn")
    assert "re-formed far more often than the faults explain" in details
    run = _clean()
    run.final(9.0, last_epoch=EPOCHS_PER_FAULT_RECORD_MAX * 2 + EPOCHS_SLACK)
    assert check_records(run.records).ok


def test_an_older_history_without_epochs_passes_churn_saying_so() -> None:
    run = _clean()
    run.final(9.0, last_epoch=None)
    report = check_records(run.records)
    assert report.ok, report.describe()
    assert report.result("churn").headline == "epochs not recorded (an older history)"


def _fails_only(records: list[Record], name: str) -> str:
    report = check_records(records)
    assert not report.ok
    assert report.failed == (name,), report.describe()
    assert f"FAILED ({name})" in report.summary_line()
    return "\n".join(report.result(name).details)


def test_a_lost_acknowledged_publish_fails_lost() -> None:
    run = _clean()
    lost = run.log[-1]
    run.log.pop()
    run.final(9.0)
    # Subscribers saw what the log holds; the acknowledged event is simply gone.
    details = _fails_only(run.records, "lost")
    assert f"'{lost}'" in details and "is in no final log" in details
    assert "1 lost" in check_records(run.records).summary_line()


def test_an_idempotent_event_stored_twice_fails_duplicates() -> None:
    run = _clean()
    # Subscribers get the copy too (offset 19): still in order, nothing missing.
    run.final(9.0, {n: [*run.log, "pub-1:3"] for n in NODES})
    details = _fails_only(run.records, "duplicates")
    assert "publisher P1 sequence 3 ('pub-1:3') is stored 2 times, at offsets [3, 19]" in details


def test_a_non_idempotent_repeat_is_counted_not_failed() -> None:
    run = _clean()
    run.final(9.0, {n: [*run.log, "pub-2:1"] for n in NODES})
    report = check_records(run.records)
    assert report.ok, report.describe()
    assert any("1 repeats of non-idempotent" in d for d in report.result("duplicates").details)


def test_a_subscriber_seeing_a_publishers_events_out_of_order_fails_order() -> None:
    run = _clean()
    run.final(9.0)
    push = next(r for r in run.records if r.get("subscription") == "p1" and r["type"] == "deliver")
    events = push["events"]
    # pub-1:1 (offset 0) and pub-1:3 (offset 3, a later publish) swapped in delivery.
    events[0], events[3] = events[3], events[0]
    details = _fails_only(run.records, "order")
    assert (
        "subscriber sub-2 ('p1'), binding pub-1: 'pub-1:2' (op 3) came after 'pub-1:3' (op 5)"
        in details
    )


def test_an_event_sent_again_is_ordered_from_its_first_send() -> None:
    # gateway_unary: a batch's calls run at once, each its own operation. The call of
    # pub-5:1 was indeterminate but stored; its neighbour pub-5:2 was acknowledged, and
    # only then was pub-5:1 sent again (acknowledged as stored, before pub-5:2).
    run = _Run()
    pid = "chaos-7-pub-5"
    unary = {"path": "gateway_unary", "publisher_id": pid}
    run.publish(1.0, "pub-5", ["pub-5:1"], "indeterminate", stored=True, **unary)  # type: ignore[arg-type]
    run.publish(1.01, "pub-5", ["pub-5:2"], first_seq=2, **unary)  # type: ignore[arg-type]
    run.publish(1.2, "pub-5", ["pub-5:1"], **unary)  # type: ignore[arg-type]
    run.publish(1.5, "pub-5", ["pub-5:3"], first_seq=3, **unary)  # type: ignore[arg-type]
    run.final(9.0)
    report = check_records(run.records)
    assert report.ok, report.describe()
    assert "order ok" in report.result("order").headline


def test_a_redelivered_earlier_event_is_not_a_reorder() -> None:
    run = _clean()
    run.final(9.0)
    run.deliver(8.5, "sub-2", "push", "p1", [0, 1, 2])
    assert check_records(run.records).ok


def test_a_committed_event_never_delivered_fails_delivery() -> None:
    run = _clean()
    run.final(9.0)
    push = next(r for r in run.records if r.get("subscription") == "p1" and r["type"] == "deliver")
    del push["events"][4]
    details = _fails_only(run.records, "delivery")
    assert "sub-2 (push 'p1' on 't') never got 1 committed events, offsets 4" in details


def test_a_subscriber_that_never_received_anything_fails_delivery() -> None:
    run = _clean()
    run.subscribe(0.1, "sub-3", "stream", "s3")
    run.final(9.0)
    details = _fails_only(run.records, "delivery")
    assert f"sub-3 (stream 's3' on 't') never got {len(run.log)} committed events" in details


def test_a_push_subscriber_removed_by_the_cluster_is_not_expected_to_get_everything() -> None:
    run = _clean()
    run.subscribe(0.1, "sub-3", "push", "p3")
    run.next_id += 1
    run.records += [
        {
            "t": 8.8,
            "type": "invoke",
            "id": run.next_id,
            "process": "workload",
            "op": "list_push_subscribers",
            "topic": TOPIC,
        },
        {
            "t": 8.9,
            "type": "complete",
            "id": run.next_id,
            "outcome": "ok",
            "subscriber_ids": ["p1"],
        },
    ]
    run.final(9.0)
    report = check_records(run.records)
    assert report.ok, report.describe()
    assert any("removed by the cluster" in d for d in report.result("delivery").details)


def test_delivering_an_event_that_is_not_committed_fails_delivery() -> None:
    run = _clean()
    run.final(9.0)
    stream = next(
        r for r in run.records if r.get("subscription") == "s1" and r["type"] == "deliver"
    )
    stream["events"][1]["value"] = "pub-9:1"
    details = _fails_only(run.records, "delivery")
    assert "got offset 1 = 'pub-9:1', committed is 'pub-1:2'" in details


def test_a_replica_whose_log_differs_fails_logs() -> None:
    run = _clean()
    divergent = list(run.log)
    divergent[5] = "pub-2:99"
    run.final(9.0, {"n3": divergent})
    details = _fails_only(run.records, "logs")
    assert "node n3 diverges from n1,n2 on 't': at entry 5" in details


def test_a_replica_holding_a_prefix_fails_logs_unless_it_is_known_to_lag() -> None:
    run = _clean()
    run.final(9.0, {"n2": run.log[:-2]})
    details = _fails_only(run.records, "logs")
    assert "node n2 holds only 17 of 19 committed events" in details and "no reason" in details
    for record in run.records:
        if record["type"] == "final_log" and record["node"] == "n2":
            record["lagging"] = "stopped by the run before the end"
    report = check_records(run.records)
    assert report.ok, report.describe()
    assert "logs identical (3 nodes, 1 lagging by record)" in report.summary_line()
    # Marked lagging, a node still may not hold anything the others do not.
    for record in run.records:
        if record["type"] == "final_log" and record["node"] == "n2":
            record["events"][3][1] = "pub-2:99"
    assert check_records(run.records).failed == ("logs",)


def test_a_node_without_a_final_log_fails_logs_naming_it() -> None:
    run = _clean()
    run.final(9.0)
    records = [r for r in run.records if not (r["type"] == "final_log" and r["node"] == "n2")]
    details = _fails_only(records, "logs")
    assert "node n2: no final_log of 't'" in details


def test_a_history_cut_short_fails_history(tmp_path: Path) -> None:
    run = _clean()
    run.final(9.0)
    lines = [json.dumps(r) for r in run.records[:-1]]
    path = tmp_path / "history.jsonl"
    # The harness died mid-line: the partial record is dropped, and the end is missing.
    path.write_text("\n".join(lines) + '\n{"t": 9.2, "type": "en')
    report = check(path)
    assert report.failed == ("history",), report.describe()
    assert "the run was cut short" in "\n".join(report.result("history").details)
    assert report.summary_line().startswith("chaos seed=7 FAILED (history): history incomplete")


def test_an_event_reported_failed_but_stored_fails_outcomes() -> None:
    run = _Run()
    run.publish(0.1, "pub-2", ["pub-2:1"], "fail", stored=True)
    run.publish(0.2, "pub-2", ["pub-2:2"])
    run.final(1.0)
    details = _fails_only(run.records, "outcomes")
    assert "'pub-2:1' on 't' was reported failed (definitely not stored) but is stored" in details


def test_an_event_nobody_published_fails_lost() -> None:
    run = _clean()
    run.final(9.0, {n: [*run.log, "ghost"] for n in NODES})
    details = _fails_only(run.records, "lost")
    assert "offset 19 holds 'ghost', which no one published" in details


def test_unavailability_windows_name_the_overlapping_faults_or_none() -> None:
    run = _clean()
    run.publish(20.0, "pub-2", ["pub-2:8"], path="replicated")
    run.final(21.0)
    windows = unavailability_windows(run.records, threshold_s=1.0)
    assert [w.causes for w in windows] == [("kill n1",), ("no fault recorded",)]
    assert windows[1].start == pytest.approx(3.85) and windows[1].end == pytest.approx(20.05)
    # A higher threshold hides the 2 s failover gap.
    assert len(unavailability_windows(run.records, threshold_s=3.0)) == 1


def test_the_command_line_prints_the_summary_writes_json_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _clean()
    run.final(9.0)
    history = _write(tmp_path, run.records)
    out_json, png = tmp_path / "report.json", tmp_path / "timeline.png"
    assert main([str(history), "--json", str(out_json), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("chaos seed=7 ok: 18 acked, 0 lost")
    report = json.loads(out_json.read_text())
    assert report["ok"] is True and report["counts"]["acked_events"] == 18
    assert report["unavailable"][0]["type"] == "unavailable"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_exits_1_on_a_violation_and_2_on_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _clean()
    run.log.pop()
    run.final(9.0)
    assert main([_write(tmp_path, run.records).as_posix()]) == 1
    assert "FAILED (lost)" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "type": "run"}\nnot json\n{"t": 1, "type": "end"}\n')
    assert main([str(bad)]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("make", [_clean, _Run])
def test_the_timeline_writes_a_png(tmp_path: Path, make: Callable[[], _Run]) -> None:
    run = make()
    run.final(9.0)
    png = plot_timeline(run.records, tmp_path / "out" / "timeline.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_subscriber_is_owed_events_only_from_where_it_started() -> None:
    run = _clean()
    run.next_id += 1
    run.records += [
        {
            "t": 5.0,
            "type": "invoke",
            "id": run.next_id,
            "process": "push-2",
            "op": "subscribe",
            "mode": "push",
            "topic": TOPIC,
            "subscription": "late",
            "start_offset": 0,
        },
        # The cluster answered with the cursor it starts from (a "latest" subscribe).
        {"t": 5.1, "type": "complete", "id": run.next_id, "outcome": "ok", "start_offset": 15},
    ]
    run.deliver(8.0, "push-2", "push", "late", [15, 16, 17, 18])
    run.final(9.0)
    assert check_records(run.records).ok
    run.records = [
        r for r in run.records if not (r.get("process") == "push-2" and r["type"] == "deliver")
    ]
    run.deliver(8.0, "push-2", "push", "late", [15, 16, 18])
    details = _fails_only(run.records, "delivery")
    assert "push-2 (push 'late' on 't') never got 1 committed events, offsets 17" in details


def test_an_unreadable_store_fails_logs_with_its_error() -> None:
    run = _clean()
    run.final(9.0)
    records = [r for r in run.records if not (r["type"] == "final_log" and r["node"] == "n3")]
    records.insert(
        -1,
        {
            "t": 9.0,
            "type": "final_log",
            "node": "n3",
            "topic": "",
            "commit_lsn": 0,
            "events": [],
            "error": "no store",
        },
    )
    details = _fails_only(records, "logs")
    assert details.splitlines() == ["node n3: its store could not be read: no store"]


def test_a_full_log_is_the_reference_even_when_lagging_nodes_outnumber_it() -> None:
    run = _clean()
    run.final(9.0, {"n2": run.log[:-3], "n3": run.log[:-3]})
    for record in run.records:
        if record["type"] == "final_log" and record["node"] in ("n2", "n3"):
            record["lagging"] = "killed and not restarted"
    report = check_records(run.records)
    assert report.ok, report.describe()
    assert "logs identical (3 nodes, 2 lagging by record)" in report.summary_line()


def test_a_fault_kind_left_out_is_said_in_the_summary() -> None:
    run = _clean()
    run.records[0]["faults_skipped"] = {
        "partition": "left out: network namespaces need root",
        "clock_jump": "not applicable: every timeout uses the monotonic clock",
    }
    run.final(9.0)
    report = check_records(run.records)
    assert report.summary_line().endswith("partition left out: network namespaces need root"), (
        report.summary_line()
    )
    assert "clock_jump not applicable" not in report.summary_line()
    assert "note: clock_jump not applicable" in report.describe()
