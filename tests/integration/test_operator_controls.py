"""Operator controls through the `squall cluster` CLI, against real processes.

Goal: an operator can keep a cluster writable when too few nodes remain — a quorum
override for disaster recovery, a designated primary for a two-node cluster — and both
are visible in status, persisted, and refused where they would allow split brain. The
override is recorded (who, when, why) and clears itself once a majority is back. Events
acknowledged by the majority the override left behind are discarded when that majority's
node rejoins: the cluster reports the loss (status, JSON, SQUALL-LOSS-001 in the logs)
until an operator acknowledges it with `squall cluster ack-loss` (issue 20).
"""

from __future__ import annotations

import json
import os
import signal
import tomllib
from pathlib import Path

import grpc

import squall
from deploy import processes
from squall.v1 import common_pb2, replica_pb2, replica_pb2_grpc
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, run_squall, wait_for


def _replica_state(cluster: LocalCluster, node_id: str) -> replica_pb2.ReplicaState | None:
    with cluster.dial(cluster.replica_address(node_id)) as channel:
        try:
            state: replica_pb2.ReplicaState = replica_pb2_grpc.ReplicaControlStub(
                channel
            ).GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=2)
            return state
        except grpc.RpcError:
            return None


def _signal_node(cluster: LocalCluster, node_id: str, sig: signal.Signals) -> None:
    for kind in ("replica", "coordinator"):
        os.kill(cluster.services[(kind, node_id)].pid, sig)


def _publish_while_n3_is_paused(cluster: LocalCluster, count: int) -> None:
    """n1 and n2 acknowledge `count` events of topic `orders` while n3 is paused (SIGSTOP,
    so it stays a joined member: a restart alone would be a cold start), and n2 learns they
    are committed: it then discards acknowledged events when it follows a master that
    lacks them. The caller resumes n3."""
    _signal_node(cluster, "n3", signal.SIGSTOP)
    with squall.connect(cluster.gateway_address, timeout_s=20) as client:
        client.create_topic("orders")
        with client.topic("orders").publisher() as publisher:
            for i in range(count):
                publisher.publish(f"event {i}".encode())

    def n2_knows_committed() -> bool:
        master, slave = _replica_state(cluster, "n1"), _replica_state(cluster, "n2")
        return (
            master is not None
            and slave is not None
            and slave.commit_lsn == master.last_lsn == slave.last_lsn
        )

    wait_for(n2_knows_committed, 20, "n2 knows the events committed")


def test_quorum_override_lets_a_lone_survivor_serve_audited_and_reverting(
    cluster_factory: object,
) -> None:
    """Also `squall status --explain`: why n1 leads and who would lead if each node failed,
    with all three up, then with n3 alone."""
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    config = str(cluster.config_path)
    explained = run_squall("status", "--explain", "--config", config)
    assert explained.returncode == 0, explained.stderr
    text = explained.stdout
    assert "n1 leads group" in text, text
    assert "n1 (3) > n2 (2) > n3 (1)" in text
    assert "log (epoch/lsn)" in text
    assert "n1 fails -> n2 would lead" in text
    assert "n2 fails -> n1 would lead: n1 keeps leading" in text
    assert "n3 fails -> n1 would lead" in text

    try:
        _publish_while_n3_is_paused(cluster, 5)
        cluster.kill_node("n1")
        cluster.kill_node("n2")
    finally:
        _signal_node(cluster, "n3", signal.SIGCONT)
    # n3 alone is no majority: it must not become master on its own.
    try:
        cluster.wait_for_master(timeout_s=2)
        raise AssertionError("a lone node became master without an override")
    except TimeoutError:
        pass
    alone = run_squall("status", "--explain", "--config", config).stdout
    assert "No master now." in alone and "1 of 3 nodes left, 2 required" in alone, alone
    done = run_squall(
        "cluster",
        "quorum-override",
        "1",
        "--node",
        "n3",
        "--reason",
        "site A lost",
        "--config",
        config,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "n3: quorum override 1" in done.stdout
    assert cluster.wait_for_master(timeout_s=20) == "n3"
    status = run_squall("status", "--config", config)
    assert "OVERRIDE 1" in status.stdout, status.stdout
    assert "n3: QUORUM OVERRIDE 1 set by " in status.stdout
    assert ": site A lost (clears itself once a majority is back)" in status.stdout
    state_file = cluster.config.node("n3").data_dir / "coordinator-state.json"
    persisted = json.loads(state_file.read_text())
    assert persisted["quorum_override"] == 1
    assert persisted["quorum_override_record"]["reason"] == "site A lost"

    # n2 returns: a group of two is a majority, so n3 clears its override itself.
    cluster.start_node("n2")

    def reverted() -> bool:
        status = cluster.statuses().get("n3")
        return status is not None and status.quorum_override == 0

    wait_for(reverted, 30, "n3's override cleared once n2 is back")

    def n2_leads() -> bool:
        # n2 ranks above n3: it rejoins as n3's slave, catches up, and is handed the group.
        status = cluster.statuses().get("n2")
        return (
            status is not None
            and status.state == common_pb2.NODE_STATE_NORMAL
            and status.coordinator_id == "n2"
            and cluster.replica_role("n2") == common_pb2.ROLE_MASTER
        )

    wait_for(n2_leads, 30, "n2 leads once caught up")
    # n2 followed n3, whose log lacks the 5 events n1 and n2 had acknowledged: n2 truncated
    # them, and the cluster says so until an operator acknowledges it.
    shown = run_squall("status", "--config", config).stdout
    assert "n2: LOSS loss-" in shown and ": truncation;" in shown, shown
    assert "5 acknowledged events discarded (orders=5)" in shown, shown
    assert "allowed by a quorum override or a designated primary" in shown
    document = json.loads(run_squall("status", "--json", "--config", config).stdout)
    [n2_row] = [n for n in document["nodes"] if n["node_id"] == "n2"]
    [loss] = n2_row["losses"]
    assert loss["cause"] == "truncation" and loss["topics"] == [["orders", 5]], loss
    assert loss["first_lsn"] > 0 and loss["last_lsn"] - loss["first_lsn"] >= 4, loss
    assert "SQUALL-LOSS-001 acknowledged events discarded" in cluster.log("replica", "n2")
    assert loss["loss_id"] in cluster.log("coordinator", "n2")
    # An unknown id: a clear error, nothing changed.
    wrong = run_squall("cluster", "ack-loss", "loss-nope", "--config", config)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "no unacknowledged loss report 'loss-nope'" in wrong.stderr, wrong.stderr
    assert f"n2:{loss['loss_id']}" in wrong.stderr
    still = cluster.statuses()["n2"]
    assert [held.loss_id for held in still.losses] == [loss["loss_id"]]
    acked = run_squall(
        "cluster", "ack-loss", loss["loss_id"], "--reason", "replayed", "--config", config
    )
    assert acked.returncode == 0, acked.stderr
    assert f"n2: loss report {loss['loss_id']} acknowledged" in acked.stdout
    cleared = run_squall("status", "--explain", "--config", config).stdout
    assert "LOSS" not in cleared, cleared
    assert f"ack-loss {loss['loss_id']}: replayed" in cleared, cleared
    assert "cleared automatically" in cluster.log("coordinator", "n3")
    persisted = json.loads(state_file.read_text())
    assert persisted["quorum_override"] == 0 and persisted["quorum_override_record"] is None
    assert [r["operator"] for r in persisted["audit"]][-2:][1] == "auto"
    after = run_squall("status", "--explain", "--config", config).stdout
    assert "QUORUM OVERRIDE" not in after
    assert "auto: quorum-override cleared" in after, after


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
        done = run_squall("cluster", "designated-primary", "n1", "--config", config)
        assert done.returncode == 0, done.stderr
        refused = run_squall("cluster", "designated-primary", "n2", "--config", config)
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
