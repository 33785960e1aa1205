"""Operator controls through the `squall cluster` CLI, against real processes.

Goal: an operator can keep a cluster writable when too few nodes remain — a quorum
override for disaster recovery, a designated primary for a two-node cluster — and both
are visible in status, persisted, and refused where they would allow split brain.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from deploy import processes
from squall.v1 import common_pb2
from tests.integration.conftest import ROOT, LocalCluster, make_cluster


def _squall(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_quorum_override_lets_a_lone_survivor_serve_and_shows_in_status(
    cluster_factory: object,
) -> None:
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    cluster.kill_node("n1")
    cluster.kill_node("n2")
    # n3 alone is no majority: it must not become master on its own.
    try:
        cluster.wait_for_master(timeout_s=2)
        raise AssertionError("a lone node became master without an override")
    except TimeoutError:
        pass
    done = _squall(
        "cluster", "quorum-override", "1", "--node", "n3", "--config", str(cluster.config_path)
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "n3: quorum override 1" in done.stdout
    assert cluster.wait_for_master(timeout_s=20) == "n3"
    status = _squall("status", "--config", str(cluster.config_path))
    assert "OVERRIDE 1" in status.stdout, status.stdout
    persisted = (cluster.config.node("n3").data_dir / "coordinator-state.json").read_text()
    assert '"quorum_override": 1' in persisted
    cleared = _squall(
        "cluster", "quorum-override", "0", "--node", "n3", "--config", str(cluster.config_path)
    )
    assert cleared.returncode == 0 and "cleared" in cleared.stdout, cleared.stdout


def _two_node_template(directory: Path) -> Path:
    document = tomllib.loads((ROOT / "deploy" / "cluster.example.toml").read_text())
    document["nodes"] = document["nodes"][:2]
    path = directory / "two-node.toml"
    path.write_text(processes.dump_toml(document))
    return path


def test_designated_primary_runs_alone_and_only_one_node_may_hold_it(tmp_path: Path) -> None:
    cluster = make_cluster(_two_node_template(tmp_path), tmp_path / "run")
    try:
        cluster.start_all()
        assert cluster.wait_for_master() == "n1"
        config = str(cluster.config_path)
        done = _squall("cluster", "designated-primary", "n1", "--config", config)
        assert done.returncode == 0, done.stderr
        refused = _squall("cluster", "designated-primary", "n2", "--config", config)
        assert refused.returncode == 1
        assert "FAILED_PRECONDITION" in refused.stderr, refused.stderr
        cluster.kill_node("n2")
        # n1 keeps (or regains) the master role alone.
        assert cluster.wait_for_master(timeout_s=20) == "n1"
        assert cluster.replica_role("n1") == common_pb2.ROLE_MASTER
        statuses = cluster.statuses()
        assert statuses["n1"].designated_primary
    finally:
        cluster.stop_all()
