"""The Grafana dashboard in deploy/grafana is well formed and queries only metrics Squall
exports, under the names the Prometheus exporter gives them; and every exported metric is
documented in docs/observability.md.

The exported names come from the real instrument sets (replica, coordinator, gateway)
read through the real PrometheusMetricReader, so a renamed instrument or a changed unit
breaks this test rather than a dashboard panel in production.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest

from squall.v1 import common_pb2
from squall_server.common import telemetry
from squall_server.coordinator.messages import ElectionStatus, NodeState, Role
from squall_server.coordinator.telemetry import CoordinatorInstruments
from squall_server.gateway.shared_publish import Backlog
from squall_server.gateway.telemetry import instruments as gateway_instruments
from squall_server.replica.telemetry import instruments as replica_instruments

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "squall-dashboard.json"
DOC = ROOT / "docs" / "observability.md"
_METRIC = re.compile(r"\bsquall_[a-z0-9_]+")


@dataclass
class _Progress:
    node_id: str = "n2"
    state: Any = field(default_factory=lambda: type("S", (), {"value": "streaming"})())


@dataclass
class _Slave:
    progress: _Progress = field(default_factory=_Progress)
    lag_entries: int = 5


class _Store:
    def size_bytes(self) -> int:
        return 4096


class _ReplicaNode:
    """What the replica gauges read of a node."""

    node = type("N", (), {"id": "n1"})()
    role = common_pb2.ROLE_MASTER
    epoch = 3
    last_lsn = 10
    commit_lsn = 9
    store = _Store()

    links = type("L", (), {"lags": staticmethod(lambda: [("a", "b@site-b", 3, 1200)])})()

    def slave_status(self) -> list[_Slave]:
        return [_Slave()]


class _CoordinatorNode:
    """What the coordinator gauges read of a node."""

    def status(self) -> ElectionStatus:
        return ElectionStatus(
            node_id="n1",
            coordinator_id="n1",
            group_name="g",
            state=NodeState.NORMAL,
            group=("n2",),
            max_seen=2,
            epoch=3,
            role=Role.MASTER,
            last_change_reason="test",
            priority=2,
            designated_primary=False,
            quorum_override=0,
            quorum_required=2,
            members=("n1", "n2"),
        )


def exported_names() -> set[str]:
    """Every Prometheus sample name Squall's instruments produce."""
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)
    provider = MeterProvider(metric_readers=[reader])
    observed = telemetry.install(None, provider)
    replica_node, coordinator_node = _ReplicaNode(), _CoordinatorNode()
    try:
        replica = replica_instruments(observed)
        replica.commit_latency.record(1.0, {"node": "n1"})
        replica.events_in.add(1, {"node": "n1"})
        replica.events_out.add(1, {"node": "n1"})
        replica.role_changes.add(1, {"node": "n1", "role": "master"})
        coordinator = observed.instruments("coordinator", CoordinatorInstruments)
        coordinator.state_changes.add(1, {"node": "n1", "state": "normal"})
        coordinator.elections.add(1, {"node": "n1"})
        gateway = gateway_instruments(observed)
        gateway.calls.add(1, {"node": "g1", "method": "Publish", "code": "OK"})
        gateway.retries.add(1, {"node": "g1", "method": "Publish"})

        async def scrape() -> str:
            replica.watch(replica_node)  # type: ignore[arg-type]
            coordinator.watch(coordinator_node)  # type: ignore[arg-type]
            gateway.watch("g1", lambda: Backlog(waiting=2, unanswered=2, in_flight=9))
            return generate_latest(registry).decode()

        text = asyncio.run(scrape())
    finally:
        telemetry.uninstall()
        provider.shutdown()
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("squall_")
    }


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def test_dashboard_is_well_formed_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for row in range(grid["y"], grid["y"] + grid["h"]):
            for column in range(grid["x"], grid["x"] + grid["w"]):
                other = cells.setdefault((row, column), panel["title"])
                assert other == panel["title"], f"{panel['title']} overlaps {other}"
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert _METRIC.search(target["expr"]), f"{panel['title']}: {target['expr']}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = exported_names()
    text = DASHBOARD.read_text()
    queried = set(_METRIC.findall(text))
    # What the issue asks the dashboard to show: state, master, latency, lag, elections.
    assert {
        "squall_coordinator_state",
        "squall_replica_role",
        "squall_replica_commit_latency_milliseconds_bucket",
        "squall_replica_replication_lag",
        "squall_coordinator_elections_total",
    } <= queried
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_every_exported_metric_is_documented() -> None:
    documented = set(_METRIC.findall(DOC.read_text()))
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in exported_names()}
    missing = {name for name in families if name not in documented}
    assert not missing, f"add to docs/observability.md: {sorted(missing)}"
