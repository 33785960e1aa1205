"""Start-up permission checks and secrets, with real service processes (issue 9, item 5).

* A replica whose data directory is world-writable starts, serves, and says so in its log
  as a WARNING naming the directory, its mode and the `chmod` that fixes it.
* With TLS on, a service whose private key others can read starts and warns, naming the
  key file and `chmod 600`; a replica told to push to apps in plaintext warns too.
* A distinctive fake secret sent every way one reaches a service — call metadata
  (`authorization: Bearer ...`, `x-api-key`) on good and refused calls, through the gateway
  and straight to the replica, and the configuration (an OTLP endpoint with a password in
  its user info, which the exporter logs when it cannot reach it) — appears in no log of
  any service and not in `squall status` output, while the lines around it do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from deploy.processes import free_port
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall_server.common import dev_certs
from tests.integration.conftest import ROOT, LocalCluster, wait_for

SECRET = "sq-FAKE-SECRET-3c9e71d05ab2"
_KINDS = ("coordinator", "replica", "gateway")


def _logs(cluster: LocalCluster) -> dict[str, str]:
    return {
        f"{kind}-{name}": cluster.log(kind, name)
        for kind, name in cluster.services
        if kind in _KINDS
    }


def test_a_replica_with_a_world_writable_data_dir_starts_and_warns(
    cluster_factory: object,
) -> None:
    cluster = cluster_factory()  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    data_dir = cluster.config.node("n1").data_dir
    data_dir.mkdir(parents=True)
    os.chmod(data_dir, 0o777)
    cluster.start_all()
    log = cluster.log("replica", "n1")
    [line] = [line for line in log.splitlines() if "start-up check" in line]
    assert " WARNING " in line
    assert str(data_dir) in line and "world-writable" in line and "0777" in line
    assert f"chmod 700 {data_dir}" in line
    # Warned, not refused: the node serves.
    stub = broker_pb2_grpc.TopicManagerStub(cluster.channel())
    stub.CreateTopic(broker_pb2.CreateTopicRequest(name="after-warning"), timeout=10)
    # The coordinator shares the directory and checks it too.
    assert "world-writable" in cluster.log("coordinator", "n1")


def test_a_tls_service_whose_key_others_can_read_starts_and_warns(
    cluster_factory: object, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    cluster = cluster_factory(  # type: ignore[operator]
        tls={"enabled": True, "ca_file": str(certs / "ca.crt"), "cert_dir": str(certs)}
    )
    assert isinstance(cluster, LocalCluster)
    dev_certs.make_dev_certs(certs, dev_certs.subjects(cluster.config, []))
    os.chmod(certs / "n1.key", 0o644)
    cluster.start_all()
    for kind in ("replica", "coordinator"):
        [line] = [line for line in cluster.log(kind, "n1").splitlines() if "n1.key" in line]
        assert " WARNING " in line and "0644" in line, line
        assert f"chmod 600 {certs / 'n1.key'}" in line, line
    # The gateway's own key is private: no warning there.
    assert "start-up check" not in cluster.log("gateway", "g1")
    # Warned, not refused: the cluster serves over TLS.
    stub = broker_pb2_grpc.TopicManagerStub(cluster.channel())
    stub.CreateTopic(broker_pb2.CreateTopicRequest(name="after-key-warning"), timeout=10)


def test_a_tls_cluster_with_plaintext_push_deliveries_says_so_at_start_up(
    cluster_factory: object, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    tls = {"enabled": True, "ca_file": str(certs / "ca.crt"), "cert_dir": str(certs)}
    cluster = cluster_factory(tls={**tls, "push": "plaintext"})  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    dev_certs.make_dev_certs(certs, dev_certs.subjects(cluster.config, []))
    cluster.start_all()
    [line] = [line for line in cluster.log("replica", "n1").splitlines() if "plaintext" in line]
    assert " WARNING " in line and 'tls.push = "plaintext"' in line, line


def _calls_with_the_secret(address: str) -> None:
    """Good and refused calls carrying the secret in their metadata."""
    metadata = (("authorization", f"Bearer {SECRET}"), ("x-api-key", SECRET))
    with grpc.insecure_channel(address) as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        subscriber = broker_pb2_grpc.SubscriberStub(channel)
        name = f"secret-{free_port()}"
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name=name), metadata=metadata, timeout=10)
        publisher.Publish(
            broker_pb2.PublishRequest(topic=name, events=[common_pb2.EventData(payload=b"x")]),
            metadata=metadata,
            timeout=10,
        )
        list(
            subscriber.Subscribe(
                broker_pb2.SubscribeRequest(topic=name, follow=False),
                metadata=metadata,
                timeout=10,
            )
        )
        for refused in (
            lambda: topics.RetrieveTopic(
                broker_pb2.RetrieveTopicRequest(name="no-such-topic"), metadata=metadata, timeout=10
            ),
            lambda: publisher.Publish(
                broker_pb2.PublishRequest(topic="bad name!"), metadata=metadata, timeout=10
            ),
        ):
            try:
                refused()
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
            else:
                raise AssertionError("a refused call was answered")


def test_a_secret_never_reaches_a_log_or_the_status_output(cluster_factory: object) -> None:
    collector = f"127.0.0.1:{free_port()}"  # nothing listens: the exporter logs its failures
    cluster = cluster_factory(  # type: ignore[operator]
        telemetry={
            "exporter": "prometheus",
            "otlp_endpoint": f"http://squall:{SECRET}@{collector}",
            "trace_sample_ratio": 1.0,
        },
        logging={"level": "DEBUG"},
    )
    assert isinstance(cluster, LocalCluster)
    assert SECRET in cluster.config_path.read_text()
    cluster.start_all()
    _calls_with_the_secret(cluster.gateway_address)
    _calls_with_the_secret(cluster.replica_address("n1"))
    # The span exporter has tried the endpoint and logged it (with its password masked).
    wait_for(
        lambda: any(collector in log for log in _logs(cluster).values()),
        30,
        "a service logs its failing trace export",
    )
    status = [
        subprocess.run(
            [
                sys.executable,
                "-m",
                "squall_server",
                "status",
                "--gateway",
                cluster.gateway_address,
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        for extra in ((), ("--json",))
    ]
    assert all(result.returncode == 0 for result in status), [r.stderr for r in status]
    assert "n1" in status[0].stdout
    # kill -9, not a clean stop: a clean stop waits out the exporter's retries (seconds), and
    # every line so far is already in the logs.
    for kind, name in list(cluster.services):
        cluster.kill(kind, name)
    logs = _logs(cluster)
    assert set(logs) == {"coordinator-n1", "replica-n1", "gateway-g1"}
    leaked = [name for name, text in logs.items() if SECRET in text]
    assert not leaked, f"the secret is in the log of {leaked}"
    assert any("[REDACTED]" in text for text in logs.values())
    for result in status:
        assert SECRET not in result.stdout and SECRET not in result.stderr
