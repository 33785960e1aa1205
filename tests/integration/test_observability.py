"""Prometheus metrics from real service processes, as an operator's scraper sees them.

Goal: with `exporter = "prometheus"`, three nodes and a gateway each serve a scrape
endpoint on a port they pick and log; after events are published and read through the
gateway, the master's endpoint reports them (events in and out, commit latency, both
slaves' lag back to 0), the coordinators report one normal group and its election, every
metric the Grafana dashboard queries is served, and log lines carry the node's epoch and
LSN.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import squall
from tests.integration.conftest import LocalCluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
_ENDPOINT = re.compile(r"metrics endpoint http://127\.0\.0\.1:(\d+)/metrics")
_SAMPLE = re.compile(r"^(squall_[a-z0-9_]+)(\{[^}]*\})? (\S+)$")
_METRIC = re.compile(r"\bsquall_[a-z0-9_]+")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def _samples(text: str) -> dict[tuple[str, str], float]:
    """{(name, labels): value} of every squall_ sample in a scrape."""
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return out


def _value(samples: dict[tuple[str, str], float], name: str, **labels: str) -> float | None:
    for (sample, text), value in samples.items():
        if sample == name and all(f'{k}="{v}"' in text for k, v in labels.items()):
            return value
    return None


def test_prometheus_endpoints_serve_the_cluster_metrics_the_dashboard_needs(
    cluster_factory: object,
) -> None:
    cluster = cluster_factory(  # type: ignore[operator]
        "cluster.example.toml", telemetry={"exporter": "prometheus"}
    )
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    master = cluster.wait_for_master()
    ports: dict[tuple[str, str], int] = {}
    for kind, name in cluster.services:
        found = _ENDPOINT.search(cluster.log(kind, name))
        assert found, f"{kind} {name} logged no metrics endpoint"
        ports[(kind, name)] = int(found.group(1))
    assert len(set(ports.values())) == 7

    with squall.connect(cluster.gateway_address) as client:
        client.create_topic("watched")
        topic = client.topic("watched")
        with topic.publisher() as publisher:
            publisher.publish_many([b"event %d" % i for i in range(50)], batch_events=10)
        assert len(list(topic.subscribe(follow=False))) == 50

    replica_port = ports[("replica", master)]
    slaves = sorted(n.id for n in cluster.config.nodes if n.id != master)

    def master_caught_up() -> bool:
        samples = _samples(_scrape(replica_port))
        lags = [
            _value(samples, "squall_replica_replication_lag", node=master, replica=s)
            for s in slaves
        ]
        return _value(samples, "squall_replica_events_in_total", node=master) == 50 and lags == [
            0.0,
            0.0,
        ]

    wait_for(master_caught_up, 15, "the master reports 50 events in and both slaves caught up")
    samples = _samples(_scrape(replica_port))
    assert _value(samples, "squall_replica_events_out_total", node=master) == 50
    assert _value(samples, "squall_replica_commit_latency_milliseconds_count", node=master) == 5
    assert _value(samples, "squall_replica_role", node=master, role="master") == 1
    size = _value(samples, "squall_replica_store_size_bytes", node=master)
    assert size is not None and size > 0

    scraped = ""
    elections = 0.0
    for (kind, name), port in ports.items():
        text = _scrape(port)
        scraped += text
        if kind == "coordinator":
            coordinator = _samples(text)
            assert _value(coordinator, "squall_coordinator_state", node=name, state="normal") == 1
            elections += _value(coordinator, "squall_coordinator_elections_total", node=name) or 0
    # One group formed (more only if a node joined late and the group re-formed).
    assert elections >= 1
    served = {m.group(1) for line in scraped.splitlines() if (m := _SAMPLE.match(line))}
    dashboard = ROOT / "deploy" / "grafana" / "squall-dashboard.json"
    queried = set(_METRIC.findall(dashboard.read_text()))
    assert queried <= served, f"the dashboard queries unserved metrics: {queried - served}"

    serving = next(
        line for line in cluster.log("replica", master).splitlines() if "serving on" in line
    )
    assert re.search(r" role=\w+ epoch=\d+ lsn=\d+$", serving), serving


def test_console_exporter_writes_spans_and_metrics_to_stdout(cluster_factory: object) -> None:
    cluster = cluster_factory(  # type: ignore[operator]
        "single.toml", telemetry={"exporter": "console", "metrics_interval_ms": 200}
    )
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    node = cluster.config.nodes[0].id
    with squall.connect(cluster.gateway_address) as client:
        client.create_topic("printed")
        with client.topic("printed").publisher() as publisher:
            publisher.publish_many([b"a", b"b", b"c"])
    # Spans leave in batches at shutdown at the latest; metrics every 200 ms.
    cluster.stop("replica", node)
    cluster.stop("gateway", cluster.config.gateways[0].id)
    replica_log = cluster.log("replica", node)
    for name in ('"name": "replica.publish"', '"name": "replica.commit_wait"'):
        assert name in replica_log, name
    assert '"name": "squall.replica.events.in"' in replica_log
    assert '"name": "gateway.forward"' in cluster.log("gateway", cluster.config.gateways[0].id)
