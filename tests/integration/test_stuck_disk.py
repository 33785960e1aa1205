"""One fate per node, a stuck disk (issue 14: 1): a master whose replica still answers
but whose store cannot complete a write (its fsync hangs) must not hold the group hostage.

A real three-node cluster whose replicas read the fault-control file
(services/replica/fault_hooks.py), one file per node. The master's fsyncs are made to take
FSYNC_DELAY_MS_MAX (10 s) each while an app publishes through the gateway: its coordinator
must take the node out of its group once the stall passes store_stall_timeout_ms, the
others elect a new master, `squall status` names the stalled store; once the delay is
removed the node rejoins, and every acknowledged event is readable at its receipt's offset.
Recovery is asserted, not speed (bounds are generous for a loaded machine).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import squall
from deploy import processes
from squall.v1 import common_pb2
from squall_server.replica import fault_hooks
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, wait_for
from tests.integration.test_node_fate import (
    ACKS_AFTER_FAULT,
    ACKS_BEFORE_FAULT,
    FAILOVER_S,
    TOPIC,
    _App,
    _row,
    _status,
    _stored_at,
)

pytestmark = pytest.mark.integration


class _FaultControlledCluster(LocalCluster):
    """A cluster whose every replica reads its own node's fault-control file."""

    @classmethod
    def three_nodes(cls, run_dir: Path, **overrides: dict[str, object]) -> _FaultControlledCluster:
        """The example cluster's three nodes, localized under run_dir (not started), with
        section overrides."""
        made = make_cluster(ROOT / "deploy" / "cluster.example.toml", run_dir, **overrides)
        return cls(made.config_path, made.config, made.run_dir)

    def control_path(self, node_id: str) -> Path:
        return self.run_dir / "control" / f"{node_id}.json"

    def spawn(self, kind: str, name: str, config_path: Path | None = None) -> processes.Service:
        # Every start goes through spawn (start_all's too): each replica gets its file.
        self.env = {fault_hooks.ENV_VAR: str(self.control_path(name))} if kind == "replica" else {}
        return super().spawn(kind, name, config_path)

    def set_fault_control(self, node_id: str, **control: object) -> None:
        path = self.control_path(node_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps(control))
        os.replace(staged, path)  # the replica never reads half a file


def _one_group_of_all(cluster: LocalCluster) -> bool:
    """Every node is a normal member of one group, none held out for its replica."""
    statuses = cluster.statuses()
    return (
        len(statuses) == len(cluster.config.nodes)
        and len({s.group_name for s in statuses.values()}) == 1
        and all(s.state == common_pb2.NODE_STATE_NORMAL for s in statuses.values())
        and not any(s.replica_unreachable_since_ms for s in statuses.values())
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[_FaultControlledCluster]:
    controlled = _FaultControlledCluster.three_nodes(tmp_path)
    try:
        controlled.start_all()
        with squall.connect(controlled.gateway_address, timeout_s=10.0) as client:
            client.create_topic(TOPIC)
        yield controlled
    finally:
        for service in controlled.services.values():
            if service.process.poll() is None:
                os.kill(service.process.pid, signal.SIGCONT)
        controlled.stop_all()


def test_a_master_whose_disk_hangs_is_replaced_and_rejoins_once_writes_complete(
    cluster: _FaultControlledCluster,
) -> None:
    top = cluster.config.nodes[0].id  # n1 ranks highest
    wait_for(lambda: cluster.wait_for_master(timeout_s=FAILOVER_S) == top, FAILOVER_S, "n1 leads")
    app = _App(cluster.gateway_address, "stuck-disk")
    app.start()
    try:
        wait_for(lambda: app.acked_by(top) >= ACKS_BEFORE_FAULT, FAILOVER_S, f"acks by {top}")
        stuck = time.monotonic()
        cluster.set_fault_control(top, fsync_delay_ms=fault_hooks.FSYNC_DELAY_MS_MAX)
        new = cluster.wait_for_master(timeout_s=FAILOVER_S, exclude=top)
        # For the reader of `pytest -s`, not asserted: speed belongs to the benchmarks.
        print(f"\n{new} leads {time.monotonic() - stuck:.2f} s after {top}'s disk got stuck")
        wait_for(
            lambda: app.acked_by(new) >= ACKS_AFTER_FAULT, FAILOVER_S, f"acks by new master {new}"
        )
        row = _row(_status(cluster), top)
        assert "replica store stalled" in row, row
        assert "replica store stalled" in cluster.log("coordinator", top)
        cluster.set_fault_control(top)  # the disk is back
        wait_for(
            lambda: "replica store writes complete again" in cluster.log("coordinator", top),
            FAILOVER_S,
            f"{top}'s coordinator sees its store write again",
        )
        wait_for(lambda: _one_group_of_all(cluster), FAILOVER_S, f"{top} back in the group")
        final = cluster.wait_for_master(timeout_s=FAILOVER_S)
        wait_for(lambda: app.acked_by(final) >= 5, FAILOVER_S, f"acks by {final} after healing")
    finally:
        app.stop.set()
        app.join(60)
    assert app.error is None, repr(app.error)
    stored = _stored_at(cluster, cluster.wait_for_master(timeout_s=FAILOVER_S))
    wrong = {
        sequence: (receipt.offset, stored.get(receipt.offset))
        for sequence, receipt in app.acked.items()
        if stored.get(receipt.offset) != ("stuck-disk", sequence)
    }
    assert app.acked, "nothing was acknowledged"
    assert not wrong, f"acknowledged, not at the receipt's offset: {list(wrong.items())[:10]}"
