"""Failover time: from kill -9 of the master node to a normal group with a new master.

Three nodes from deploy/cluster.example.toml run as real processes on loopback with the
default timeouts. Each trial waits for a stable master, kills both of its processes
with SIGKILL, and polls every coordinator (every `POLL_S`) until another node is NORMAL
as coordinator *and* its replica reports the master role; the killed node is then
restarted and the cluster settles before the next trial. Polling adds at most `POLL_S`
to each figure.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from deploy import processes
from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server.common.config import ClusterConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.005
SETTLE_TIMEOUT_S = 30.0


class _Cluster:
    def __init__(self, config_path: Path, run_dir: Path) -> None:
        self.config_path = config_path
        self.config: ClusterConfig = load_config(config_path)
        self.run_dir = run_dir
        self.services: dict[tuple[str, str], processes.Service] = {}
        self._coordinators = {
            n.id: coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(n.coordinator_address))
            for n in self.config.nodes
        }
        self._replicas = {
            n.id: replica_pb2_grpc.ReplicaControlStub(grpc.insecure_channel(n.replica_address))
            for n in self.config.nodes
        }

    def start_node(self, node_id: str) -> None:
        node = self.config.node(node_id)
        started = []
        for kind, address in (
            ("replica", node.replica_address),
            ("coordinator", node.coordinator_address),
        ):
            log = self.run_dir / "logs" / f"{kind}-{node_id}.log"
            service = processes.start_service(kind, self.config_path, node_id, address, log)
            self.services[(kind, node_id)] = service
            started.append(service)
        processes.wait_serving(started)

    def kill_node(self, node_id: str) -> None:
        for kind in ("coordinator", "replica"):
            processes.kill_service(self.services[(kind, node_id)])

    def stop_all(self) -> None:
        """SIGTERM to every process at once, then waits for each (stopped one after the
        other, each coordinator waited out its server's grace for its peers' streams)."""
        running = [s for s in self.services.values() if s.process.poll() is None]
        for service in running:
            service.process.terminate()
        for service in self.services.values():
            processes.stop_service(service)

    def master(self, exclude: str = "") -> str | None:
        """A node that is NORMAL as its group's coordinator with its replica master."""
        for node_id, stub in self._coordinators.items():
            if node_id == exclude:
                continue
            try:
                status = stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=0.2)
            except grpc.RpcError:
                continue
            if status.state != common_pb2.NODE_STATE_NORMAL or status.coordinator_id != node_id:
                continue
            try:
                state = self._replicas[node_id].GetReplicaState(
                    replica_pb2.GetReplicaStateRequest(), timeout=0.2
                )
            except grpc.RpcError:
                continue
            if state.role == common_pb2.ROLE_MASTER and state.epoch == status.epoch:
                return node_id
        return None

    def settled(self) -> str:
        """Waits until every node is in one normal group; returns its master."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            master = self.master()
            if master is not None:
                try:
                    status = self._coordinators[master].GetStatus(
                        coordinator_pb2.GetStatusRequest(), timeout=0.5
                    )
                except grpc.RpcError:
                    status = None
                if status is not None and len(status.group) == len(self.config.nodes) - 1:
                    return master
            time.sleep(0.02)
        raise TimeoutError("the cluster did not settle into one normal group")


def run(trials: int) -> dict[str, Any]:
    """Measures `trials` failovers; returns the figures (milliseconds)."""
    with tempfile.TemporaryDirectory(prefix="squall-failover-") as temp:
        run_dir = Path(temp)
        config_path = processes.localize_config(ROOT / "deploy" / "cluster.example.toml", run_dir)
        cluster = _Cluster(config_path, run_dir)
        gaps_ms: list[float] = []
        try:
            for node in cluster.config.nodes:
                cluster.start_node(node.id)
            for _ in range(trials):
                victim = cluster.settled()
                time.sleep(0.3)  # let heartbeats run steadily before the crash
                killed_at = time.monotonic()
                cluster.kill_node(victim)
                deadline = killed_at + SETTLE_TIMEOUT_S
                while cluster.master(exclude=victim) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no new master after killing {victim}")
                    time.sleep(POLL_S)
                gaps_ms.append((time.monotonic() - killed_at) * 1000)
                cluster.start_node(victim)
        finally:
            cluster.stop_all()
    gaps_ms.sort()
    return {
        "trials": trials,
        "p50_ms": round(statistics.median(gaps_ms), 1),
        "max_ms": round(max(gaps_ms), 1),
        "min_ms": round(min(gaps_ms), 1),
        "all_ms": [round(g, 1) for g in gaps_ms],
        "poll_ms": POLL_S * 1000,
        "aim": "p50 <= 500 ms, max <= 1000 ms (default timeouts, loopback)",
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 10), indent=2))
