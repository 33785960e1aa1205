"""TLS on every link, with real processes and real certificates (`squall certs dev`).

Goal: a cluster with `[tls] enabled = true` elects a master and replicates over mutual
TLS, apps publish and subscribe through the library with TLS, push deliveries reach an
app's endpoint over mutual TLS; whatever cannot prove who it is gets nothing: a
plaintext client, a client dialling a node under the wrong name, a node whose
certificate names another node or comes from another CA, and a peer whose certificate
does not match the sender id it claims.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import squall
from deploy import processes
from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    push_pb2,
    push_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server import cli
from squall_server.common import dev_certs
from squall_server.common.config import ClusterConfig
from squall_server.common.tls import Transport
from tests.integration.conftest import LocalCluster, wait_for

pytestmark = pytest.mark.integration


def _certify(cluster: LocalCluster, directory: Path) -> None:
    dev_certs.make_dev_certs(directory, dev_certs.subjects(cluster.config, ["app"]))


def _tls_cluster(cluster_factory: object, certs: Path, template: str) -> LocalCluster:
    """A TLS cluster from a deploy/ template (not started), its certificates in certs."""
    cluster = cluster_factory(  # type: ignore[operator]
        template, tls={"enabled": True, "ca_file": str(certs / "ca.crt"), "cert_dir": str(certs)}
    )
    assert isinstance(cluster, LocalCluster)
    _certify(cluster, certs)
    return cluster


@pytest.fixture
def tls_trio(cluster_factory: object, tmp_path: Path) -> Iterator[LocalCluster]:
    """A three-node TLS cluster (not started) whose certificates are in tmp_path/certs."""
    yield _tls_cluster(cluster_factory, tmp_path / "certs", "cluster.example.toml")


def _app_tls(cluster: LocalCluster, *, client_cert: bool = True) -> squall.TlsOptions:
    tls = cluster.config.tls
    assert tls.cert_dir is not None and tls.ca_file is not None
    if not client_cert:
        return squall.TlsOptions(ca_file=tls.ca_file)
    return squall.TlsOptions(
        ca_file=tls.ca_file, cert_file=tls.cert_dir / "app.crt", key_file=tls.cert_dir / "app.key"
    )


def _state(cluster: LocalCluster, node_id: str) -> replica_pb2.ReplicaState:
    with cluster.dial(cluster.replica_address(node_id)) as channel:
        state: replica_pb2.ReplicaState = replica_pb2_grpc.ReplicaControlStub(
            channel
        ).GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=2)
        return state


def test_a_tls_cluster_elects_replicates_and_serves_the_library_and_the_cli(
    tls_trio: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    tls_trio.start_all()
    master = tls_trio.wait_for_master()
    with squall.connect(tls_trio.gateway_address, timeout_s=10, tls=_app_tls(tls_trio)) as app:
        app.create_topic("secure")
        topic = app.topic("secure")
        # Replicated proxy: the app's own certificate, straight to the replicas.
        publisher = topic.publisher("app-1")
        receipts = [publisher.publish(b"event %d" % i) for i in range(5)]
        assert [r.offset for r in receipts] == [0, 1, 2, 3, 4]
        got = [m.payload for m in topic.subscribe(start="earliest", follow=False)]
    assert got == [b"event %d" % i for i in range(5)]
    # Replication ran over mutual TLS: every slave holds the master's log.
    end = _state(tls_trio, master)
    wait_for(
        lambda: all(
            (_state(tls_trio, n.id).last_epoch, _state(tls_trio, n.id).last_lsn)
            == (end.last_epoch, end.last_lsn)
            for n in tls_trio.config.nodes
        ),
        10,
        "every replica holds the master's log",
    )
    # The gateway reached every replica and coordinator over mTLS for the status table.
    with squall.connect(tls_trio.gateway_address, tls=_app_tls(tls_trio, client_cert=False)) as app:
        rows = app.status().nodes
    assert {row.node_id for row in rows} == {"n1", "n2", "n3"}
    assert all(row.reachable for row in rows), rows

    # A plaintext client to the TLS gateway fails, and the library says it is unavailable.
    with squall.connect(tls_trio.gateway_address, timeout_s=2, retry_attempts_max=1) as plain:
        with pytest.raises(squall.Unavailable):
            plain.topics()
    # An app without a client certificate reaches the gateway but not a replica.
    with grpc.secure_channel(
        tls_trio.replica_address(master),
        grpc.ssl_channel_credentials(Path(str(tls_trio.config.tls.ca_file)).read_bytes()),
        options=[("grpc.ssl_target_name_override", master)],
    ) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            replica_pb2_grpc.ReplicaControlStub(channel).GetReplicaState(
                replica_pb2.GetReplicaStateRequest(), timeout=2
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # The command line, as admin over TLS with --config.
    config = str(tls_trio.config_path)
    coordinator = tls_trio.config.node("n2").coordinator_address
    assert cli.main(["health", coordinator, "--config", config]) == 0
    assert cli.main(["topic", "create", "cli-secure", "--config", config]) == 0
    assert cli.main(["status", "--config", config]) == 0
    assert f"master: {master}" in capsys.readouterr().out
    # Without --config the command speaks plaintext and is told why it failed.
    assert cli.main(["topic", "list", "--gateway", tls_trio.gateway_address]) == 1
    assert "give --config FILE so this command connects with TLS" in capsys.readouterr().err
    assert cli.main(["health", coordinator]) == 1
    # The clean shutdown freezes and finishes every replica with the admin certificate.
    assert cli.main(["cluster", "shutdown", "--config", config]) == 0
    out = capsys.readouterr().out
    assert all(f"{node}: clean" in out for node in ("n1", "n2", "n3")), out


def test_a_client_dialling_a_node_under_another_name_is_refused(tls_trio: LocalCluster) -> None:
    tls_trio.start_node("n1")
    links = Transport(tls_trio.config, "admin")
    address = tls_trio.config.node("n1").coordinator_address
    # The right name works; n2's name on n1's address fails the handshake.
    with links.channel(address, target="n1") as channel:
        coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
            coordinator_pb2.GetStatusRequest(), timeout=2
        )
    with links.channel(address, target="n2") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
                coordinator_pb2.GetStatusRequest(), timeout=2
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # The library: a gateway expected under another name is refused too.
    tls_trio.start("gateway", "g1")
    options = squall.TlsOptions(ca_file=str(tls_trio.config.tls.ca_file), server_name="n1")
    with squall.connect(
        tls_trio.gateway_address, timeout_s=2, retry_attempts_max=1, tls=options
    ) as app:
        with pytest.raises(squall.Unavailable):
            app.topics()


def test_a_node_holding_another_nodes_certificate_does_not_start(
    tls_trio: LocalCluster, tmp_path: Path
) -> None:
    certs = tls_trio.config.tls.cert_dir
    assert certs is not None
    # n3's files are n2's: a copy of the configuration points n3 at them.
    stolen = tmp_path / "stolen"
    shutil.copytree(certs, stolen)
    shutil.copy(certs / "n2.crt", stolen / "n3.crt")
    shutil.copy(certs / "n2.key", stolen / "n3.key")
    config_path = _config_copy(tls_trio, tmp_path / "n3.toml", stolen / "ca.crt", stolen)
    service = processes.start_service(
        "coordinator",
        config_path,
        "n3",
        tls_trio.config.node("n3").coordinator_address,
        tmp_path / "n3.log",
    )
    try:
        assert service.process.wait(timeout=30) == 2
    finally:
        processes.stop_service(service)
    log = (tmp_path / "n3.log").read_text()
    assert "names" in log and "'n3'" in log and "n2" in log, log


def test_a_node_with_a_certificate_from_another_ca_never_joins(
    tls_trio: LocalCluster, tmp_path: Path
) -> None:
    # n3 runs with a CA of its own (a consistent but foreign identity).
    foreign = tmp_path / "foreign"
    dev_certs.make_dev_certs(foreign, [dev_certs.Subject("n3"), dev_certs.Subject("admin")])
    config_path = _config_copy(tls_trio, tmp_path / "foreign.toml", foreign / "ca.crt", foreign)
    tls_trio.start_all()
    master = tls_trio.wait_for_master()
    # The impostor takes n3's place (same addresses, same store).
    tls_trio.kill_node("n3")
    rogue = [
        processes.start_service(
            kind,
            config_path,
            "n3",
            address,
            tls_trio.run_dir / "logs" / f"{kind}-n3.log",
        )
        for kind, address in (
            ("replica", tls_trio.config.node("n3").replica_address),
            ("coordinator", tls_trio.config.node("n3").coordinator_address),
        )
    ]
    for service in rogue:
        tls_trio.services[(service.kind, "n3-foreign")] = service
    foreign_links = Transport(_load(config_path), "admin")
    processes.wait_serving(rogue, links=foreign_links)
    # The members log the refused handshake, naming the peer...
    wait_for(
        lambda: "TLS handshake with n3 failed" in tls_trio.log("coordinator", master),
        15,
        f"{master} logs that n3's certificate was refused",
    )
    # ...and n3 is not in the group, while n1 and n2 go on as before.
    status = tls_trio.statuses()[master]
    assert status.state == common_pb2.NODE_STATE_NORMAL
    assert "n3" not in status.group, status
    assert tls_trio.wait_for_master() == master


def test_a_peer_claiming_another_nodes_id_is_refused(
    tls_trio: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    tls_trio.start_node("n1")  # alone: it waits for the others, inactive
    n1 = tls_trio.config.node("n1")
    as_n2 = Transport(tls_trio.config, "n2")
    hello = coordinator_pb2.PeerMessage(
        from_node="n3", to_node="n1", are_you_there=coordinator_pb2.AreYouThere()
    )
    with as_n2.channel(n1.coordinator_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            coordinator_pb2_grpc.CoordinatorStub(channel).Deliver(hello, timeout=2)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "names node n2" in (refused.value.details() or "")
    wait_for(
        lambda: (
            "certificate names node n2 but the message's sender is 'n3'"
            in tls_trio.log("coordinator", "n1")
        ),
        5,
        "n1 logs the mismatch",
    )
    # A gateway's certificate may read replica state but not open a replication stream,
    # and the admin certificate may not command a replica's role.
    as_gateway = Transport(tls_trio.config, "g1")
    with as_gateway.channel(n1.replica_address) as channel:
        replica_pb2_grpc.ReplicaControlStub(channel).GetReplicaState(
            replica_pb2.GetReplicaStateRequest(), timeout=2
        )
        stream = replica_pb2_grpc.ReplicationStub(channel).Replicate(
            iter(
                [
                    replica_pb2.ReplicateRequest(
                        hello=replica_pb2.ReplicationHello(master_id="g1", epoch=99)
                    )
                ]
            ),
            timeout=2,
        )
        with pytest.raises(grpc.RpcError) as stream_refused:
            list(stream)
    assert stream_refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with Transport(tls_trio.config, "admin").channel(n1.replica_address) as channel:
        with pytest.raises(grpc.RpcError) as role_refused:
            replica_pb2_grpc.ReplicaControlStub(channel).SetRole(
                replica_pb2.RoleCommand(), timeout=2
            )
    assert role_refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only from node n1's own coordinator" in (role_refused.value.details() or "")
    assert tls_trio.replica_role("n1") == common_pb2.ROLE_INACTIVE
    # An operator without the admin certificate cannot connect to a coordinator at all.
    cert_dir = tls_trio.config.tls.cert_dir
    assert cert_dir is not None
    (cert_dir / "admin.crt").unlink()
    config = str(tls_trio.config_path)
    assert cli.main(["cluster", "designated-primary", "n1", "--config", config]) == 1
    assert "no admin.crt and admin.key in tls.cert_dir" in capsys.readouterr().err
    assert not tls_trio.statuses()  # nor can the harness, for the same reason


def _config_copy(cluster: LocalCluster, path: Path, ca_file: Path, cert_dir: Path) -> Path:
    """The cluster's file with [tls] pointing at other certificates."""
    import tomllib

    document = tomllib.loads(cluster.config_path.read_text())
    document["tls"] = {"enabled": True, "ca_file": str(ca_file), "cert_dir": str(cert_dir)}
    path.write_text(processes.dump_toml(document))
    return path


def _load(path: Path) -> ClusterConfig:
    from squall_server.common.config import load_config

    return load_config(path)


def test_push_deliveries_run_over_mutual_tls_to_an_endpoint_that_proves_its_host(
    cluster_factory: object, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    cluster = _tls_cluster(cluster_factory, certs, "single.toml")
    cluster.start_all()
    cluster.wait_for_master()
    app_tls = _app_tls(cluster)
    received: list[bytes] = []
    with squall.connect(cluster.gateway_address, timeout_s=10, tls=app_tls) as app:
        app.create_topic("pushed")
        topic = app.topic("pushed")
        with squall.PushEndpoint(tls=app_tls) as endpoint:
            topic.subscribe_push(
                "billing",
                endpoint,
                reliability="ordered",
                retry_count=-1,
                start="earliest",
                on_delivery=lambda d: received.extend(m.payload for m in d.messages),
            )
            publisher = topic.publisher("pusher")
            for i in range(5):
                publisher.publish(b"event %d" % i)
            wait_for(lambda: len(received) >= 5, 20, "five events pushed over TLS")
            # Only the cluster gets in: a caller without a certificate from its CA is refused
            # in the handshake, before any callback runs.
            ca = Path(str(cluster.config.tls.ca_file)).read_bytes()
            with grpc.secure_channel(endpoint.address, grpc.ssl_channel_credentials(ca)) as ch:
                with pytest.raises(grpc.RpcError) as stranger:
                    push_pb2_grpc.PushSubscriberStub(ch).Deliver(
                        push_pb2.PushDeliverRequest(topic="pushed", subscriber_id="billing"),
                        timeout=5,
                    )
            assert stranger.value.code() == grpc.StatusCode.UNAVAILABLE
        assert received[:5] == [b"event %d" % i for i in range(5)]

        # A plaintext endpoint is refused at subscribe, saying what it must serve.
        with squall.PushEndpoint() as plain, pytest.raises(squall.FailedPrecondition) as refused:
            topic.subscribe_push("plain", plain, on_delivery=lambda d: None)
        assert 'tls.push = "tls"' in str(refused.value), refused.value
        # So is an endpoint whose certificate the cluster's CA did not sign.
        other = tmp_path / "other-ca"
        dev_certs.make_dev_certs(other, dev_certs.subjects(None, ["app"]))
        forged = squall.TlsOptions(
            ca_file=certs / "ca.crt", cert_file=other / "app.crt", key_file=other / "app.key"
        )
        with squall.PushEndpoint(tls=forged) as impostor:
            with pytest.raises(squall.FailedPrecondition):
                topic.subscribe_push("impostor", impostor, on_delivery=lambda d: None)
        assert [s.subscriber_id for s in topic.push_subscribers()] == ["billing"]
