"""`make bench`'s pipeline end to end at its smallest: a real three-node cluster, one sync
policy, a few publishes, one trial of two fault kinds under three concurrent publishers
(node_kill, which also gives lead_back, and replica_pause), and the report files that
come out of it.

No figure is judged (speed belongs in bench/, not in tests); what is checked is that the
pipeline measures what it says (every event published is consumed, every latency is
kept, every service's memory is read) and writes the report a reader opens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import latency, single_node, suite

pytestmark = pytest.mark.integration

SERVICES = {f"{kind}-n{i}" for kind in ("coordinator", "replica") for i in (1, 2, 3)} | {
    "gateway-g1"
}


def test_tiny_bench_run_writes_the_report(tmp_path: Path) -> None:
    # The cluster's processes are stopped by PID inside the suite (replicated.running's
    # finally), also when a scenario fails.
    status = suite.main(
        [
            "--tiny",
            "--policy",
            "WRITE_NO_SYNC",
            "--pipelined-events",
            "1000",
            "--unary-events",
            "20",
            "--gap-trials",
            "1",
            "--gap-kind",
            "node_kill",
            "--gap-kind",
            "replica_pause",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert status == 0
    latest = tmp_path / "latest"
    run_dir = tmp_path / os.readlink(latest)
    assert run_dir.is_dir() and run_dir.name.endswith("Z")
    for name in (
        "report.json",
        "report.md",
        "throughput.png",
        "latency_cdf.png",
        "memory.png",
        "fault_gaps.png",
    ):
        assert (run_dir / name).stat().st_size > 0, name
    assert not (run_dir / "failover.png").exists()  # --tiny runs no failover

    built = json.loads((run_dir / "report.json").read_text())
    policy = built["policies"]["WRITE_NO_SYNC"]
    assert policy["durability"] == {
        "master_sync": "WRITE_NO_SYNC",
        "replica_sync": "WRITE_NO_SYNC",
        "acks": "majority",
    }
    assert policy["pipelined_publish"]["events"] == 1000
    # The asyncio client ran the same publish scenarios in the same run.
    assert policy["aio"]["pipelined_publish"]["events"] == 1000
    assert policy["aio"]["one_at_a_time"]["events"] > 0
    assert built["summary"]["aio_over_threaded_pipelined"]["WRITE_NO_SYNC"] > 0
    # The consume pass reads the whole pipelined topic: the warm-up and the timed events.
    assert policy["subscribe"]["events"] == 1000 + single_node.WARMUP_EVENTS
    one = policy["one_at_a_time"]
    assert len(one["latency_ms_samples"]) == one["events"] > 0
    assert built["summary"]["publish_latency_ms"]["WRITE_NO_SYNC"]["count"] == one["events"]
    for phase in ("idle", "after_load"):
        sampled = policy["memory"][phase]
        assert set(sampled) == SERVICES, phase
        assert all(m["rss_bytes"] > 0 for m in sampled.values()), phase
    assert len(built["load_average_start"]) == 3 and len(built["load_average_end"]) == 3
    assert built["machine"]["cpu_cores_online"] and built["machine"]["packages"]["grpcio"]
    assert len(built["machine"]["git"]["commit"]) == 40
    assert built["failover"] is None and built["catch_up"] is None

    # The latency scenarios, and the budget joined from the marks of every process on the
    # path (client, gateway, master, a slave): every stage of one publish is measured.
    lat = policy["latency"]
    assert lat["floor"]["stream_ms_p50"] > 0 and lat["one_at_a_time"]["events"] > 0
    assert lat["concurrent_shared"]["16"]["events"] > 0 and lat["delivery"]["events"] > 0
    assert lat["budget"]["requests"] > 0
    assert [r["stage"] for r in lat["budget"]["stages"]] == [
        label for label, _, _ in latency.PUBLISH_STAGES
    ]
    assert lat["delivery_budget"]["events"] > 0
    # A stage of a delivery is part of it: the suite's consume phase, which reads topics
    # published a minute before, is not joined in.
    assert (
        lat["delivery_budget"]["commit_to_sent_us_p50"] <= lat["delivery"]["latency_ms_max"] * 1000
    )
    # A following subscriber's delivery is marked at the gateway and in the client too.
    assert [r["stage"] for r in lat["delivery_budget"]["subscribe_stages"]] == [
        label for label, _, _, _ in latency.SUBSCRIBE_STAGES
    ]
    assert lat["floor"]["concurrent"]["16"]["calls_per_s"] > 0
    assert "SQUALL_STAGE_TIMINGS_DIR" not in os.environ  # the marks are off again

    text = (run_dir / "report.md").read_text()
    assert "| events/s | WRITE_NO_SYNC |" in text
    assert "Where one publish goes" in text
    assert "| WRITE_NO_SYNC | publish -> following subscriber p50 <= 2 ms |" in text
    assert "![Publish latency CDF per sync policy](latency_cdf.png)" in text
    assert "| replica-n1 |" in text and "| gateway-g1 |" in text

    # One trial per kind; every path either recovered (its two figures measured) or is
    # counted not recovered; every acknowledged event read back where its receipt said.
    gaps = built["fault_gaps"]
    assert set(gaps["kinds"]) == {"node_kill", "replica_pause", "lead_back"}
    for kind, figures in gaps["kinds"].items():
        assert figures["trials"] == 1 and figures["error"] is None, (kind, figures)
        assert set(figures["paths"]) == {"gateway", "replicated", "non_replicated"}
        for path, row in figures["paths"].items():
            assert len(row["first_ack_ms"]) == len(row["longest_gap_ms"])
            assert len(row["first_ack_ms"]) + row["not_recovered"] == 1, (kind, path, row)
    # Every publisher rides through a node kill (no speed asserted: that is the bench's).
    assert all(row["not_recovered"] == 0 for row in gaps["kinds"]["node_kill"]["paths"].values())
    assert gaps["read_back"]["acknowledged"] > 0
    assert gaps["read_back"]["lost"] == 0 and gaps["read_back"]["stored_twice"] == 0
    assert set(built["summary"]["fault_gaps"]) == {"node_kill", "replica_pause", "lead_back"}
    assert "## Publisher-visible gap per fault kind" in text
    assert "| node_kill | non_replicated | 1 |" in text and "| lead_back | gateway | 1 |" in text
