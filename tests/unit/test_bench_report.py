"""The benchmark report's math and assembly on synthetic samples (no cluster, no timing).

The values asserted here are worked out by hand from the samples: a reader of the report
must be able to trust that p50 is the median and that the tables and plots show what the
samples say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import fault_gaps, machine, memory, report, single_node, suite

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- percentiles and CDF


def test_percentile_is_nearest_rank() -> None:
    # The median of five values is the third, not the second (round(2.5) == 2 was a bug).
    assert single_node.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.50) == 3.0
    ten = [float(v) for v in range(1, 11)]
    assert single_node.percentile(ten, 0.10) == 1.0
    assert single_node.percentile(ten, 0.50) == 5.0
    assert single_node.percentile(ten, 0.90) == 9.0
    assert single_node.percentile(ten, 0.99) == 10.0
    assert single_node.percentile(ten, 1.0) == 10.0
    hundred = [float(v) for v in range(1, 101)]
    # 0.07 * 100 is 7.000000000000001 in floating point: still the 7th value.
    assert single_node.percentile(hundred, 0.07) == 7.0
    assert single_node.percentile(hundred, 0.99) == 99.0
    assert single_node.percentile([], 0.5) == 0.0
    assert single_node.percentile([4.0], 0.0) == 4.0


def test_summarize_hand_checked() -> None:
    stats = report.summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert stats == {
        "count": 5,
        "min": 1.0,
        "p50": 3.0,
        "p90": 5.0,  # 0.9 * 5 = 4.5 -> the 5th value
        "p99": 5.0,
        "max": 5.0,
        "mean": 3.0,
    }
    hundred = report.summarize(float(v) for v in range(100, 0, -1))
    assert (hundred["p50"], hundred["p90"], hundred["p99"], hundred["max"]) == (50, 90, 99, 100)
    assert hundred["mean"] == 50.5
    empty = report.summarize([])
    assert empty["count"] == 0 and empty["p50"] is None and empty["max"] is None


def test_cdf_steps() -> None:
    assert report.cdf([4.0, 2.0, 1.0, 2.0]) == ([1.0, 2.0, 4.0], [0.25, 0.75, 1.0])
    assert report.cdf([3.0]) == ([3.0], [1.0])
    assert report.cdf([]) == ([], [])


# --- memory


STATUS = """Name:\tpython
VmPeak:\t  300000 kB
VmHWM:\t   51200 kB
VmRSS:\t   40960 kB
RssAnon:\t   30720 kB
RssFile:\t   10240 kB
RssShmem:\t       0 kB
Threads:\t12
"""


def test_parse_status_reads_rss_and_peak_in_bytes() -> None:
    assert memory.parse_status(STATUS) == {
        "rss_bytes": 40960 * 1024,
        "peak_rss_bytes": 51200 * 1024,
        "rss_anon_bytes": 30720 * 1024,
        "rss_file_bytes": 10240 * 1024,
    }
    # A kernel thread's status has neither field.
    assert memory.parse_status("Name:\tkthreadd\nThreads:\t1\n") == {}


def test_process_memory_of_this_process_and_of_none() -> None:
    mine = memory.process_memory(os.getpid())
    assert mine is not None
    assert 0 < mine["rss_bytes"] <= mine["peak_rss_bytes"]
    # No process can have a pid above pid_max.
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert memory.process_memory(pid_max + 1) is None
    sampled = memory.sample({"me": os.getpid(), "gone": pid_max + 1})
    assert sampled["gone"] is None and sampled["me"] is not None


def test_memory_table_takes_the_larger_peak_and_survives_a_gone_process() -> None:
    table = report.memory_table(
        {
            "idle": {
                "replica-n1": {"rss_bytes": 10, "peak_rss_bytes": 12},
                "gateway-g1": {"rss_bytes": 5, "peak_rss_bytes": 5},
            },
            "after_load": {
                "replica-n1": {"rss_bytes": 20, "peak_rss_bytes": 25},
                "gateway-g1": None,
            },
        }
    )
    assert table["replica-n1"] == {
        "idle_rss_bytes": 10,
        "after_load_rss_bytes": 20,
        "after_load_rss_file_bytes": None,
        "peak_rss_bytes": 25,
    }
    assert table["gateway-g1"] == {
        "idle_rss_bytes": 5,
        "after_load_rss_bytes": None,
        "after_load_rss_file_bytes": None,
        "peak_rss_bytes": 5,
    }


# --- the whole report from a synthetic result set


MIB = 2**20


def _policy(rate: int, latencies_ms: list[float], replica_rss_mib: int) -> dict[str, Any]:
    rss = {
        "rss_bytes": replica_rss_mib * MIB,
        "peak_rss_bytes": (replica_rss_mib + 2) * MIB,
        "rss_file_bytes": 15 * MIB,
    }
    return {
        "durability": {"acks": "majority"},
        "pipelined_publish": {
            "events_per_s": rate,
            "runs_events_per_s": [rate - 100, rate],
            "cpu_pct": {"client": 50.0, "others": 12.4},
        },
        "one_at_a_time": {
            "events_per_s": 200,
            "latency_ms_samples": latencies_ms,
            "hit_deadline": rate < 20_000,
        },
        "subscribe": {"events_per_s": 2 * rate},
        "aio": {
            "pipelined_publish": {"events_per_s": rate // 2},
            "one_at_a_time": {"events_per_s": 250},
        },
        "memory": {
            "idle": {"replica-n1": {"rss_bytes": 40 * MIB, "peak_rss_bytes": 41 * MIB}},
            "after_load": {"replica-n1": rss},
        },
    }


def _synthetic(with_failover: bool = True, gaps: dict[str, Any] | None = None) -> dict[str, Any]:
    described = {
        "cpu_model": "Test CPU",
        "cpu_cores_usable": 2,
        "virtualized": True,
        "memory_bytes": 8 * 2**30,
        "kernel": "Linux 6",
        "python": "CPython 3.11.7",
        "packages": {"grpcio": "1.85.1", "protobuf": "7", "lmdb": "3"},
        "disk": {"kind": "virtual disk", "filesystem": "ext4", "fsync_ms_p50": 0.2},
        "load_average": [1.5, 1.0, 0.5],
        "git": {"commit": "a" * 40, "dirty": False},
    }
    return report.assemble(
        started_at="20261122T080000Z",
        seconds=123.4,
        machine=described,
        load_average_end=[3.25, 2.0, 1.0],
        background_load_pct_of_core=12.0,
        setup={
            "command": "python -m bench.suite",
            "template": "deploy/cluster.example.toml",
            "nodes": 3,
            "event_bytes": 100,
            "batch_events": 500,
            "acks": "majority",
            "sizes": {"pipelined_events": 1000},
        },
        policies={
            # 1..10 ms: p50 5, p90 9, p99 10; 10..100 in steps of 10: p50 50, p99 100.
            "SYNC": _policy(10_000, [float(v) for v in range(10, 0, -1)], 50),
            "NO_SYNC": _policy(30_000, [float(v) for v in range(10, 101, 10)], 60),
        },
        catch_up={
            "events_behind": 300_000,
            "seconds_from_restart": 3.0,
            "events_per_s": 100_000,
            "by_snapshot": False,
            "policy": "SYNC",
        },
        failover={"all_ms": [450.0, 400.0, 900.0, 500.0], "poll_ms": 5.0}
        if with_failover
        else None,
        fault_gaps=gaps,
    )


def test_assemble_summarizes_the_samples() -> None:
    built = _synthetic()
    summary = built["summary"]
    assert summary["pipelined_publish_events_per_s"] == {"SYNC": 10_000, "NO_SYNC": 30_000}
    assert summary["subscribe_events_per_s"] == {"SYNC": 20_000, "NO_SYNC": 60_000}
    # The asyncio client's figures beside the threaded client's, as a ratio.
    assert summary["aio_pipelined_publish_events_per_s"] == {"SYNC": 5_000, "NO_SYNC": 15_000}
    assert summary["aio_over_threaded_pipelined"] == {"SYNC": 0.5, "NO_SYNC": 0.5}
    assert summary["aio_over_threaded_one_at_a_time"] == {"SYNC": 1.25, "NO_SYNC": 1.25}
    sync = summary["publish_latency_ms"]["SYNC"]
    assert (sync["p50"], sync["p90"], sync["p99"], sync["max"], sync["count"]) == (
        5.0,
        9.0,
        10.0,
        10.0,
        10,
    )
    assert summary["publish_latency_ms"]["NO_SYNC"]["p50"] == 50.0
    # Four trials: p50 is the second of 400, 450, 500, 900.
    assert summary["failover_ms"]["p50"] == 450.0
    assert summary["failover_ms"]["max"] == 900.0
    assert summary["catch_up_events_per_s"] == 100_000
    assert summary["memory_bytes"]["NO_SYNC"]["replica-n1"] == {
        "idle_rss_bytes": 40 * MIB,
        "after_load_rss_bytes": 60 * MIB,
        "after_load_rss_file_bytes": 15 * MIB,
        "peak_rss_bytes": 62 * MIB,
    }
    assert built["load_average_start"] == [1.5, 1.0, 0.5]
    assert built["load_average_end"] == [3.25, 2.0, 1.0]


def test_write_produces_json_markdown_and_plots(tmp_path: Path) -> None:
    built = _synthetic()
    paths = report.write(built, tmp_path / "run")
    assert set(paths) == {"json", "markdown", "throughput", "latency_cdf", "failover", "memory"}
    for name in ("throughput", "latency_cdf", "failover", "memory"):
        data = paths[name].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, name
    loaded = json.loads(paths["json"].read_text())
    assert loaded["summary"]["failover_ms"]["p50"] == 450.0
    # The samples the plots were drawn from are kept, so the plots can be redrawn.
    assert loaded["policies"]["SYNC"]["one_at_a_time"]["latency_ms_samples"][0] == 10.0
    text = paths["markdown"].read_text()
    for file in ("throughput.png", "latency_cdf.png", "failover.png", "memory.png"):
        assert f"]({file})" in text
    assert "| pipelined publish (batches of 500, median of runs) | 10,000 (9,900-10,000) |" in text
    assert "| p50 | 5.00 | 50.00 |" in text
    assert "| p99 | 10.00 | 100.0 |" in text
    assert "| 4 | 400.0 | 450.0 | 900.0 | 900.0 |" in text
    assert "**100,000 events/s**" in text
    assert "| replica-n1 | 40.0 | 60.0 | 15.0 | 62.0 |" in text
    assert (
        "| one at a time (each publish waits for its receipt) | 200 (deadline hit) | 200 |" in text
    )
    assert "(% of one core) | 12% | 12% |" in text
    assert "asyncio client `squall.aio` (median of runs; x threaded) | 5,000 (0.50x) |" in text
    assert "| one at a time, asyncio client (x threaded) | 250 (1.25x) | 250 (1.25x) |" in text
    assert "Test CPU (VM)" in text and "`aaaaaaaaaaaa`" in text
    assert "1.50 / 1.00 / 0.50" in text and "3.25 / 2.00 / 1.00" in text
    assert "machine-specific" in text and "make bench" in text


def test_a_run_without_failover_says_so_and_draws_no_failover_plot(tmp_path: Path) -> None:
    paths = report.write(_synthetic(with_failover=False), tmp_path)
    assert "failover" not in paths
    assert not (tmp_path / "failover.png").exists()
    assert "## Failover\n\nNot measured in this run." in paths["markdown"].read_text()


def test_point_latest_replaces_the_pointer(tmp_path: Path) -> None:
    first, second = tmp_path / "20261122T080000Z", tmp_path / "20261122T090000Z"
    first.mkdir()
    second.mkdir()
    (second / "report.md").write_text("second")
    report.point_latest(tmp_path, first)
    link = report.point_latest(tmp_path, second)
    assert os.readlink(link) == "20261122T090000Z"  # relative: the directory can move
    assert (link / "report.md").read_text() == "second"


# --- the machine and the command line


def test_machine_describes_load_and_commit() -> None:
    load = machine.load_average()
    assert load is not None and len(load) == 3 and all(v >= 0 for v in load)
    git = machine.git_commit()
    assert git is not None
    assert len(git["commit"]) == 40 and int(git["commit"], 16) >= 0
    assert machine.git_commit(Path("/")) is None  # not a checkout


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--unary-events", "-1"]])
def test_suite_rejects_bad_sizes_before_starting_anything(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        suite.main([*args, "--results-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "sizes must be >= 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- the publisher-visible gap per fault kind


def _gaps() -> dict[str, Any]:
    """bench.fault_gaps.run's shape: node_kill within the aim on every path; replica_pause
    waiting for the heal on the gateway path and never recovering on the proxy's."""

    def path(first: list[float], longest: list[float], **counts: int) -> dict[str, Any]:
        return {
            "first_ack_ms": first,
            "longest_gap_ms": longest,
            "not_recovered": counts.get("not_recovered", 0),
            "after_heal": counts.get("after_heal", 0),
        }

    return {
        "aim": fault_gaps.AIM,
        "aim_p50_ms": 500.0,
        "aim_max_ms": 1000.0,
        "trials": 3,
        "hold_s": 3.0,
        "recover_s": 20.0,
        "paths": ["gateway", "replicated"],
        "kinds": {
            "node_kill": {
                "trials": 3,
                "paths": {
                    "gateway": path([450.0, 400.0, 480.0], [460.0, 410.0, 900.0]),
                    "replicated": path([500.0, 520.0, 510.0], [500.0, 520.0, 990.0]),
                },
                "error": None,
            },
            "replica_pause": {
                "trials": 3,
                "paths": {
                    "gateway": path([3100.0, 3200.0, 3150.0], [3100.0] * 3, after_heal=3),
                    "replicated": path([3300.0], [3300.0], after_heal=1, not_recovered=2),
                },
                "error": "TimeoutError: publishers not steady",
            },
        },
        "read_back": {"acknowledged": 1234, "lost": 0, "stored_twice": 0, "examples": []},
    }


def test_the_gap_section_summarizes_every_kind_and_path(tmp_path: Path) -> None:
    built = _synthetic(gaps=_gaps())
    table = built["summary"]["fault_gaps"]
    node = table["node_kill"]["gateway"]
    assert (node["first_ack_ms"]["p50"], node["first_ack_ms"]["max"]) == (450.0, 480.0)
    assert (node["longest_gap_ms"]["p50"], node["longest_gap_ms"]["max"]) == (460.0, 900.0)
    assert node["meets_aim"] and node["trials"] == 3
    # p50 520 > 500: missed although the max is under a second.
    assert not table["node_kill"]["replicated"]["meets_aim"]
    pause = table["replica_pause"]
    assert not pause["gateway"]["meets_aim"] and pause["gateway"]["after_heal"] == 3
    assert pause["replicated"]["not_recovered"] == 2
    paths = report.write(built, tmp_path)
    assert paths["fault_gaps"].read_bytes().startswith(PNG_MAGIC)
    text = paths["markdown"].read_text()
    assert "## Publisher-visible gap per fault kind" in text
    assert "**Aim: p50 <= 500 ms and max <= 1000 ms for every kind and path" in text
    assert (
        "| node_kill | gateway | 3 | 450.0 / 480.0 / 480.0 | 460.0 / 900.0 / 900.0 | 0 | 0 | met |"
        in text
    )
    assert "| replica_pause | replicated | 3 | 3,300.0 / 3,300.0 / 3,300.0 |" in text
    assert "| 1 | 2 | **missed** |" in text
    assert "1,234 acknowledged events, **0 lost**" in text
    assert "- stopped early: replica_pause: TimeoutError: publishers not steady" in text
    assert "](fault_gaps.png)" in text


def test_a_run_without_fault_gaps_says_so(tmp_path: Path) -> None:
    text = report.write(_synthetic(), tmp_path)["markdown"].read_text()
    assert "## Publisher-visible gap per fault kind\n\nNot measured in this run." in text
    assert not (tmp_path / "fault_gaps.png").exists()


def _ack(invoked: float, acked: float, master: str = "n1") -> fault_gaps.Ack:
    return fault_gaps.Ack(invoked, acked, master, 0, b"", False)


def test_fault_gap_windows_by_hand() -> None:
    # Fault at 10.0, healed at 13.0. The call sent at 9.99 is answered by the dying master
    # at 10.01: not the first ack. The next call (10.02) is answered at 10.45.
    acks = [_ack(9.9, 9.95), _ack(9.99, 10.01), _ack(10.02, 10.45, "n2"), _ack(10.5, 10.6, "n2")]
    acks += [_ack(12.9, 13.2, "n2")]
    one = fault_gaps.window(acks, 10.0, 13.0, 20.0)
    assert one["first_ack_ms"] == 450.0 and not one["after_heal"]
    # Marks 10.0, 10.01, 10.45, 10.6, 13.2 (the first at or after the heal): 12.9 -> 13.2
    # is no gap; the longest is 10.6 -> 13.2.
    assert one["longest_gap_ms"] == 2600.0
    # Nothing until after the heal: the gap lasts as long as the fault was held.
    held = fault_gaps.window([_ack(9.9, 9.95), _ack(13.1, 13.15)], 10.0, 13.0, 20.0)
    assert held == {"first_ack_ms": 3150.0, "longest_gap_ms": 3150.0, "after_heal": True}
    never = fault_gaps.window([_ack(9.9, 9.95)], 10.0, 13.0, 20.0)
    assert never["first_ack_ms"] is None and never["longest_gap_ms"] is None


def test_lead_back_window_by_hand() -> None:
    # n1 restarted at 20.0; n2 acknowledges until 21.0, then nothing until n1 at 21.6.
    acks = [_ack(t / 10, t / 10 + 0.01, "n2") for t in range(195, 215, 5)]
    acks += [_ack(21.05, 21.6, "n1"), _ack(21.6, 21.61, "n1")]
    one = fault_gaps.lead_back_window(acks, 20.0, "n1")
    assert one["first_ack_ms"] == 590.0  # 21.01 -> 21.6
    assert one["longest_gap_ms"] == 590.0
    assert fault_gaps.lead_back_window(acks[:3], 20.0, "n1")["first_ack_ms"] is None
