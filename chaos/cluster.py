"""The chaos run's cluster: real Squall processes, each node inside its own namespace.

A node is its replica and coordinator, started with ``ip netns exec <its namespace>``
(chaos/netns.py) through deploy.processes, so each is one process found again by PID
(``ip netns exec`` execs the service in place), with its log under ``<run>/logs``. The
config file gives each node its namespace's address, and the gateways the bridge's (host)
address in the root namespace. Without namespaces (not root) every service listens on
127.0.0.1 with its own free port and partitions are left out of the run.

Each replica gets ``SQUALL_FAULT_CONTROL=<run>/control/<node>.json`` (see
services/replica/fault_hooks.py), which the map-full and slow-disk faults write.

Faults hit a whole node (``kill_node``, ``pause_node``) or one of its processes alone
(``kill_process``, ``pause_process``: the replica or the coordinator), and
``start_process`` restarts one killed process while the other keeps running.

Every wait is bounded; ``stop_all`` (SIGCONT to anything paused, then SIGTERM and, after
a grace period, SIGKILL, each by PID) is the finalizer and is safe to call twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from chaos.netns import Topology
from deploy import processes
from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server.common.config import ClusterConfig, load_config
from squall_server.replica.committed import committed_events, gate_from_store
from squall_server.replica.store import Store, StoreError

log = logging.getLogger("chaos")

GATEWAY_IDS = ("g1", "g2")
NODE_PROCESSES = ("replica", "coordinator")
# Inside its own namespace every node has every port to itself.
_NETNS_COORDINATOR_PORT = 7101
_NETNS_REPLICA_PORT = 7201
_CALL_TIMEOUT_S = 2.0
_POLL_S = 0.1
_STOP_GRACE_S = 5.0
_SERVE_TIMEOUT_S = 60.0
_SHUTDOWN_TIMEOUT_S = 30.0
_STORE_HEADROOM_BYTES = 1 << 20

# Settings a chaos cluster runs with; everything else takes Squall's defaults.
DEFAULT_SETTINGS: dict[str, dict[str, Any]] = {
    # A busy 2-core machine stalls processes for a few hundred ms now and then: a member
    # timeout of 1 s keeps failovers to the faults the run injects.
    "timeouts": {
        "heartbeat_interval_ms": 100,
        "member_timeout_ms": 1000,
        # The same allowance for a node's own replica: a stall is not a failed process.
        "replica_timeout_ms": 1000,
        "probe_interval_ms": 200,
        "rpc_timeout_ms": 2000,
        "publish_timeout_ms": 10000,
        "push_deliver_timeout_ms": 3000,
    },
    "limits": {"map_size_bytes": 256 << 20},
    "durability": {"master_sync": "SYNC", "replica_sync": "WRITE_NO_SYNC", "acks": "majority"},
    "telemetry": {"exporter": "none"},
    "logging": {"level": "INFO", "format": "text"},
}


class ClusterError(Exception):
    """The cluster did not do what the harness waited for; the message says what."""


def node_ids(count: int) -> list[str]:
    """The ids of a count-node cluster: n1..nN (n1 has the highest priority)."""
    if count not in (3, 5):
        raise ValueError(f"a chaos cluster has 3 or 5 nodes, not {count}")
    return [f"n{i}" for i in range(1, count + 1)]


@dataclass
class ChaosCluster:
    """The processes of one chaos run (see the module docstring)."""

    run_dir: Path
    node_ids: list[str]
    topology: Topology | None
    config_path: Path
    config: ClusterConfig
    host_address: str
    services: dict[tuple[str, str], processes.Service] = field(default_factory=dict)
    # (process kind, node id) of every process stopped by SIGSTOP now.
    paused: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        run_dir: Path,
        nodes: int,
        topology: Topology | None,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> ChaosCluster:
        """Writes the run's config file (nothing is started)."""
        ids = node_ids(nodes)
        host = topology.host_address if topology is not None else "127.0.0.1"
        ports = iter(processes.free_ports(2 * len(ids) + len(GATEWAY_IDS), host))
        document: dict[str, Any] = {
            "cluster": {"name": "chaos"},
            "nodes": [],
            "gateways": [],
        }
        for rank, node_id in enumerate(ids):
            if topology is not None:
                coordinator = f"{topology.address(node_id)}:{_NETNS_COORDINATOR_PORT}"
                replica = f"{topology.address(node_id, 'replica')}:{_NETNS_REPLICA_PORT}"
                next(ports), next(ports)
            else:
                coordinator, replica = f"{host}:{next(ports)}", f"{host}:{next(ports)}"
            document["nodes"].append(
                {
                    "id": node_id,
                    "priority": len(ids) - rank,
                    "coordinator_address": coordinator,
                    "replica_address": replica,
                    "data_dir": str((run_dir / "data" / node_id).resolve()),
                }
            )
        for gateway_id in GATEWAY_IDS:
            document["gateways"].append({"id": gateway_id, "address": f"{host}:{next(ports)}"})
        for section, values in {**DEFAULT_SETTINGS, **(settings or {})}.items():
            document[section] = dict(values)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "control").mkdir(exist_ok=True)
        config_path = run_dir / "cluster.toml"
        config_path.write_text(processes.dump_toml(document))
        return cls(run_dir, ids, topology, config_path, load_config(config_path), host)

    # --- addresses

    @property
    def gateway_addresses(self) -> list[str]:
        return [gateway.address for gateway in self.config.gateways]

    def data_dir(self, node_id: str) -> Path:
        return self.config.node(node_id).data_dir

    def control_path(self, node_id: str) -> Path:
        return self.run_dir / "control" / f"{node_id}.json"

    def log_path(self, kind: str, name: str) -> Path:
        return self.run_dir / "logs" / f"{kind}-{name}.log"

    # --- processes

    def _start(self, kind: str, name: str) -> processes.Service:
        if kind == "gateway":
            address, prefix, env = self.config.gateway(name).address, [], {}
        else:
            node = self.config.node(name)
            address = node.replica_address if kind == "replica" else node.coordinator_address
            prefix = self.topology.exec_prefix(name) if self.topology is not None else []
            env = (
                {"SQUALL_FAULT_CONTROL": str(self.control_path(name))} if kind == "replica" else {}
            )
        service = processes.start_service(
            kind, self.config_path, name, address, self.log_path(kind, name), env=env, prefix=prefix
        )
        self.services[(kind, name)] = service
        return service

    def start_node(self, node_id: str, timeout_s: float = _SERVE_TIMEOUT_S) -> None:
        """Starts a node's replica, then its coordinator; waits until both serve."""
        for kind in NODE_PROCESSES:
            self.start_process(kind, node_id, timeout_s)

    def start_process(self, kind: str, node_id: str, timeout_s: float = _SERVE_TIMEOUT_S) -> None:
        """Starts one process of a node ("replica" or "coordinator"); waits until it serves."""
        _check_kind(kind)
        self.paused.discard((kind, node_id))
        processes.wait_serving([self._start(kind, node_id)], timeout_s)

    def start_gateway(self, gateway_id: str, timeout_s: float = _SERVE_TIMEOUT_S) -> None:
        processes.wait_serving([self._start("gateway", gateway_id)], timeout_s)

    def start_all(self, timeout_s: float = _SERVE_TIMEOUT_S) -> None:
        """Starts every node and gateway, then waits for a normal cluster: every replica
        at once, then the first node's coordinator, then the other coordinators and the
        gateways at once, each step waiting until its processes serve (as one at a time
        did, each coordinator finds its replica serving and the highest-ranked node is
        there first, in a fraction of the time)."""
        steps = [
            [("replica", node_id) for node_id in self.node_ids],
            [("coordinator", node_id) for node_id in self.node_ids[:1]],
            [("coordinator", node_id) for node_id in self.node_ids[1:]]
            + [("gateway", gateway_id) for gateway_id in GATEWAY_IDS],
        ]
        for step in steps:
            processes.wait_serving([self._start(kind, name) for kind, name in step], timeout_s)
        self.wait_normal(timeout_s)

    def node_services(self, node_id: str) -> list[processes.Service]:
        return [
            service
            for kind in ("coordinator", "replica")
            if (service := self.services.get((kind, node_id))) is not None
        ]

    def kill_node(self, node_id: str) -> None:
        """kill -9 a node's coordinator and replica."""
        for kind in NODE_PROCESSES:
            self.kill_process(kind, node_id)

    def kill_process(self, kind: str, node_id: str) -> None:
        """kill -9 one process of a node; the other keeps running."""
        _check_kind(kind)
        self.paused.discard((kind, node_id))
        service = self.services.get((kind, node_id))
        if service is not None:
            processes.kill_service(service)

    def stop_node(self, node_id: str) -> None:
        """Stops a node's processes by SIGTERM (SIGKILL after the grace period)."""
        self.resume_node(node_id)
        for service in self.node_services(node_id):
            processes.stop_service(service, _STOP_GRACE_S)

    def stop_process(self, kind: str, node_id: str) -> None:
        """SIGTERM one process of a node (SIGKILL after the grace period); the other
        keeps running."""
        _check_kind(kind)
        self.resume_process(kind, node_id)
        service = self.services.get((kind, node_id))
        if service is not None:
            processes.stop_service(service, _STOP_GRACE_S)

    def kill_gateway(self, gateway_id: str) -> None:
        processes.kill_service(self.services[("gateway", gateway_id)])

    def pause_node(self, node_id: str) -> None:
        """SIGSTOP a node's processes (they keep their sockets; nothing answers)."""
        for kind in NODE_PROCESSES:
            self.pause_process(kind, node_id)

    def resume_node(self, node_id: str) -> None:
        """SIGCONT a node's processes."""
        for kind in NODE_PROCESSES:
            self.resume_process(kind, node_id)

    def pause_process(self, kind: str, node_id: str) -> None:
        """SIGSTOP one process of a node; the other keeps running."""
        _check_kind(kind)
        service = self.services.get((kind, node_id))
        if service is not None:
            self.paused.add((kind, node_id))
            _signal(service, signal.SIGSTOP)

    def resume_process(self, kind: str, node_id: str) -> None:
        """SIGCONT one process of a node."""
        self.paused.discard((kind, node_id))
        service = self.services.get((kind, node_id))
        if service is not None:
            _signal(service, signal.SIGCONT)

    def running(self, kind: str, name: str) -> bool:
        service = self.services.get((kind, name))
        return service is not None and service.process.poll() is None

    def stop_all(self) -> None:
        """Every process of the run stopped by PID (the finalizer; safe to call twice)."""
        for kind, node_id in list(self.paused):
            self.resume_process(kind, node_id)
        live = [s for s in self.services.values() if s.process.poll() is None]
        for service in live:
            try:
                service.process.terminate()
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + _STOP_GRACE_S
        for service in live:
            try:
                service.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait(_STOP_GRACE_S)

    # --- fault controls

    def set_fault_control(self, node_id: str, **control: object) -> None:
        """Writes the node's fault-control file (read by its replica within ~100 ms)."""
        path = self.control_path(node_id)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(control))
        os.replace(temporary, path)

    # --- status

    def coordinator_status(self, node_id: str) -> coordinator_pb2.CoordinatorStatus | None:
        if not self.running("coordinator", node_id) or ("coordinator", node_id) in self.paused:
            return None
        with grpc.insecure_channel(self.config.node(node_id).coordinator_address) as channel:
            try:
                status: coordinator_pb2.CoordinatorStatus = coordinator_pb2_grpc.CoordinatorStub(
                    channel
                ).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=_CALL_TIMEOUT_S)
                return status
            except grpc.RpcError:
                return None

    def replica_state(self, node_id: str) -> replica_pb2.ReplicaState | None:
        if not self.running("replica", node_id) or ("replica", node_id) in self.paused:
            return None
        with grpc.insecure_channel(self.config.node(node_id).replica_address) as channel:
            try:
                state: replica_pb2.ReplicaState = replica_pb2_grpc.ReplicaControlStub(
                    channel
                ).GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=_CALL_TIMEOUT_S)
                return state
            except grpc.RpcError:
                return None

    def normal_problem(self) -> str:
        """Why the cluster is not normal, or "" when it is: every node up, in one group
        whose coordinator's replica is master and every other replica a slave, none
        quarantined, every gateway serving."""
        statuses = {node_id: self.coordinator_status(node_id) for node_id in self.node_ids}
        down = [node_id for node_id, status in statuses.items() if status is None]
        if down:
            return f"coordinators not answering: {', '.join(down)}"
        quarantined = [n for n, s in statuses.items() if s is not None and s.HasField("quarantine")]
        if quarantined:
            return f"quarantined: {', '.join(quarantined)}"
        not_normal = [
            n
            for n, s in statuses.items()
            if s is not None and s.state != common_pb2.NODE_STATE_NORMAL
        ]
        if not_normal:
            return f"not normal: {', '.join(not_normal)}"
        leaders = {s.coordinator_id for s in statuses.values() if s is not None}
        if len(leaders) != 1:
            return f"more than one group: coordinators {sorted(leaders)}"
        master = leaders.pop()
        roles = {}
        for node_id in self.node_ids:
            state = self.replica_state(node_id)
            roles[node_id] = None if state is None else state.role
        want = {n: common_pb2.ROLE_MASTER if n == master else common_pb2.ROLE_SLAVE for n in roles}
        if roles != want:
            named = {n: common_pb2.Role.Name(r) if r is not None else "-" for n, r in roles.items()}
            return f"replica roles {named}, master should be {master}"
        for gateway_id in GATEWAY_IDS:
            if not self.running("gateway", gateway_id) or not processes.is_serving(
                self.config.gateway(gateway_id).address
            ):
                return f"gateway {gateway_id} not serving"
        return ""

    def master(self) -> str | None:
        """The node whose coordinator leads a normal group of which it is master, if any."""
        for node_id in self.node_ids:
            status = self.coordinator_status(node_id)
            if (
                status is not None
                and status.state == common_pb2.NODE_STATE_NORMAL
                and status.coordinator_id == node_id
                and status.role == common_pb2.ROLE_MASTER
            ):
                return node_id
        return None

    def wait_normal(self, timeout_s: float, stop: Callable[[], bool] | None = None) -> None:
        """Waits until normal_problem() is ""; ClusterError with the last problem if not."""
        deadline = time.monotonic() + timeout_s
        problem = "not checked"
        while time.monotonic() < deadline:
            problem = self.normal_problem()
            if not problem or (stop is not None and stop()):
                return
            time.sleep(_POLL_S)
        raise ClusterError(f"cluster not normal after {timeout_s:.0f}s: {problem}")

    # --- the end of a run

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> str:
        """`squall cluster shutdown` (from the root namespace), then the gateways stopped;
        returns its output. ClusterError if it fails or a node process outlives it."""
        command = [
            sys.executable,
            "-m",
            "squall_server",
            "cluster",
            "shutdown",
            "--config",
            str(self.config_path),
            "--timeout",
            str(timeout_s),
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout_s + 30, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"`squall cluster shutdown` hung for {timeout_s + 30:.0f}s") from exc
        output = (result.stdout + result.stderr).strip()
        if result.returncode != 0:
            raise ClusterError(f"`squall cluster shutdown` failed ({result.returncode}): {output}")
        deadline = time.monotonic() + timeout_s
        for node_id in self.node_ids:
            for service in self.node_services(node_id):
                try:
                    service.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise ClusterError(
                        f"{service.kind} {node_id} still running after the shutdown:\n"
                        f"{processes.tail(service.log_path)}"
                    ) from None
        for gateway_id in GATEWAY_IDS:
            gateway = self.services.get(("gateway", gateway_id))
            if gateway is not None:
                processes.stop_service(gateway, _STOP_GRACE_S)
        return output

    def final_logs(self, topics: list[str] | None = None) -> list[dict[str, object]]:
        """Per node and topic, the committed events its stopped store holds, read offline
        with the replica's own code (``final_log`` history records without t/type)."""
        records: list[dict[str, object]] = []
        for node_id in self.node_ids:
            records.extend(read_final_log(node_id, self.data_dir(node_id), topics))
        return records


def read_final_log(
    node_id: str, data_dir: Path, topics: list[str] | None = None
) -> list[dict[str, object]]:
    """The ``final_log`` fields of one stopped node's store, per topic (all topics the
    store holds, or those named). An unreadable store is one record with ``error``."""
    if not (data_dir / "data.mdb").is_file():
        return [{"node": node_id, "topic": "", "commit_lsn": 0, "events": [], "error": "no store"}]
    size = (data_dir / "data.mdb").stat().st_size + _STORE_HEADROOM_BYTES
    try:
        store = Store.open_lmdb(data_dir, size, readonly=True, lock=False)
    except StoreError as exc:
        return [{"node": node_id, "topic": "", "commit_lsn": 0, "events": [], "error": str(exc)}]
    records: list[dict[str, object]] = []
    try:
        gate = gate_from_store(store)
        last_epoch = store.meta().last_epoch
        names = [t.name for t in store.list_topics()] if topics is None else topics
        for topic in names:
            record: dict[str, object] = {
                "node": node_id,
                "topic": topic,
                "commit_lsn": gate.commit_lsn,
                # The epoch of its newest log entry (the checker's churn bound).
                "last_epoch": last_epoch,
            }
            try:
                events = committed_events(store, gate, topic)
            except StoreError as exc:
                record.update(events=[], error=f"{type(exc).__name__}: {exc}")
            else:
                record["events"] = [
                    [event.offset, event.payload.decode("utf-8", "replace")] for event in events
                ]
            records.append(record)
    except StoreError as exc:
        records.append(
            {"node": node_id, "topic": "", "commit_lsn": 0, "events": [], "error": str(exc)}
        )
    finally:
        store.close()
    return records


def _check_kind(kind: str) -> None:
    if kind not in NODE_PROCESSES:
        raise ValueError(f"a node's process is one of {NODE_PROCESSES}, not {kind!r}")


def _signal(service: processes.Service, signum: signal.Signals) -> None:
    if service.process.poll() is None:
        try:
            os.kill(service.pid, signum)
        except ProcessLookupError:
            pass
