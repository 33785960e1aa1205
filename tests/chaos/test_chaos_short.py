"""The short chaos run of `make test`: a few seeds of real faults against a real cluster.

Each seed runs what `make chaos` runs (chaos/run.py with chaos.workload.Workload) for
DURATION_S seconds; it fails on any problem of the run, a fault the cluster did not
recover from, namespaces left behind, or any violation the checker (chaos/checker.py)
reports — lost acknowledged publishes, duplicates, order, delivery, diverging logs —
printing the command that reproduces the run.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from chaos.cluster import GATEWAY_IDS
from chaos.faults import PROCESS_FAULTS, TAIL_S
from chaos.history import read_history
from chaos.run import report, run_chaos

# Together they play eleven of the fourteen kinds, every single-process kind among them
# (`faults.schedule` with every kind), every fault but one overlapped by a second:
# partition_coordinator of n3 by pause_replica of the master, kill_coordinator of the
# master by stop_replica, a partition isolating n1 by pause_coordinator of a slave (seed
# 28816); an orderly stop of n2 by stop_coordinator of the master, partition_replica of the
# master by kill_replica, corrupt (21233). Left to longer runs (`make chaos`) and to the
# integration tests: a whole-node kill (the failover tests), a whole-node pause, map_full
# (tests/integration/test_lifecycle.py) and slow_disk (test_stuck_disk.py). Two runs of
# 40 s took 67 s where three of 35 s had taken 97 s: a run's own cost (a cluster, its
# warm-up, the checker) is paid once less.
SEEDS = (28816, 21233)
DURATION_S = 40.0
NODES = 3
# Load after the last fault has healed and the cluster is normal again, before the run
# ends (the schedule's own tail): acknowledgements after every heal, without waiting out
# the time the schedule set aside for slower recoveries (the same faults are played).
QUIET_AFTER_S = TAIL_S


def _namespaces() -> set[str]:
    # Without `ip` there are no namespaces to leave behind: the run leaves partitions out
    # (chaos/run.py) and tests/chaos/test_netns.py says so in one skip line.
    if shutil.which("ip") is None:
        return set()
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in result.stdout.splitlines() if line.strip()}


@pytest.mark.parametrize("seed", SEEDS)
def test_short_chaos_run(seed: int, tmp_path: Path) -> None:
    before = _namespaces()
    result = asyncio.run(
        run_chaos(seed, DURATION_S, NODES, tmp_path / "run", quiet_after_faults_s=QUIET_AFTER_S)
    )
    text = report(result)
    reproduce = result.reproduce()
    assert _namespaces() <= before, f"namespaces left behind\n{text}"
    assert result.completed and not result.problems, f"{text}\n{reproduce}"
    assert all(outcome.recovered for outcome in result.outcomes), f"{text}\n{reproduce}"
    records = read_history(result.history_path)
    starts = [r for r in records if r["type"] == "fault" and r["phase"] == "start"]
    ends = [r for r in records if r["type"] == "fault" and r["phase"] == "end"]
    assert starts and len(starts) == len(ends), f"faults not all ended\n{text}\n{reproduce}"
    single = [r for r in starts if r["fault"] in PROCESS_FAULTS]
    assert single, f"no single-process fault played\n{text}\n{reproduce}"
    # Every fault's unavailability is measured and said in the run's output.
    assert "unavailability per fault kind:" in text
    node_faults = [r for r in starts if r["targets"][0] not in GATEWAY_IDS]
    assert all(f"  {r['fault']} (" in text for r in node_faults), text
    final_logs = [r for r in records if r["type"] == "final_log"]
    assert {r["node"] for r in final_logs} == {f"n{i}" for i in range(1, NODES + 1)}
    acknowledged = [r for r in records if r["type"] == "complete" and r["outcome"] == "ok"]
    assert acknowledged, f"nothing was acknowledged\n{text}\n{reproduce}"
    assert result.checked and result.check_ok, f"{text}\n{reproduce}"
