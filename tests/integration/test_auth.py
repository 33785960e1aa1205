"""Client authentication and per-topic permissions against real processes (docs/auth.md).

Goal: with [auth] on, nobody publishes, reads or administers without a token that
allows it, at the gateway and at the replicas publisher proxies reach directly; a denial
says no more than it must; a denied call changes nothing; tokens never reach a log or the
status output.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import squall
from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)
from squall_server.common import dev_certs
from squall_server.common.auth import token_sha256
from squall_server.common.config import load_config
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, run_squall, wait_for

pytestmark = pytest.mark.integration

# The tokens are distinctive so a search of the logs cannot miss one.
TOKENS = {
    "ops": "tok-ops-a8d3e61c0b97f245",
    "app": "tok-app-3c9e0f7a21d84b66",
    "reader": "tok-reader-e47b2d19c6a05f38",
    "link": "tok-link-5b0d93e8a1c47f26",
}
PRINCIPALS = [
    {"name": "ops", "token_sha256": token_sha256(TOKENS["ops"]), "admin": True},
    {
        "name": "app",
        "token_sha256": token_sha256(TOKENS["app"]),
        "publish": ["orders.*"],
        "subscribe": ["orders.*"],
    },
    {"name": "reader", "token_sha256": token_sha256(TOKENS["reader"]), "subscribe": ["audit"]},
    # What a cluster's topic links present here (docs/federation.md); the link tests
    # below use this cluster as its own remote, so its own name.
    {
        "name": "link-from-site-a",
        "token_sha256": token_sha256(TOKENS["link"]),
        "publish": ["linked"],
        "subscribe": ["linked"],
        "link_from": ["squall-single"],
    },
]


def auth_overrides(certs: Path) -> dict[str, dict[str, object]]:
    """Every config section the auth tests change: [auth] needs [tls] (tokens never go in clear)."""
    return {
        "auth": {"enabled": True, "principals": PRINCIPALS},
        "tls": {"enabled": True, "ca_file": str(certs / "ca.crt"), "cert_dir": str(certs)},
    }


def _connect(cluster: LocalCluster, token: str | None, timeout_s: float = 10) -> squall.Client:
    """An app's client: TLS with an app certificate (not a member's), and the token."""
    certs = cluster.config.tls.cert_dir
    assert certs is not None and cluster.config.tls.ca_file is not None
    tls = squall.TlsOptions(
        ca_file=cluster.config.tls.ca_file,
        cert_file=certs / "app.crt",
        key_file=certs / "app.key",
    )
    return squall.connect(cluster.gateway_address, token=token, tls=tls, timeout_s=timeout_s)


def _add_remotes(cluster: LocalCluster, token_dir: Path) -> None:
    """[[remotes]] entries naming this cluster's own gateway, reached like another
    cluster's: TLS from its CA, with a token per entry (the link tests below)."""
    (token_dir / "unknown").write_text("tok-nobody-knows-this-one\n")
    ca_file = cluster.config.tls.ca_file
    gateway = cluster.gateway_address
    entries = {
        # The gateway's certificate names g1 and its address, not n1.
        "wrong-id": f'ca_file = "{ca_file}"\nserver_name = "n1"\n',
        "no-token": f'ca_file = "{ca_file}"\n',
        "bad-token": f'ca_file = "{ca_file}"\ntoken_file = "{token_dir / "unknown"}"\n',
        "reader": f'ca_file = "{ca_file}"\ntoken_file = "{token_dir / "reader"}"\n',
        "here": f'ca_file = "{ca_file}"\ntoken_file = "{token_dir / "link"}"\n',
    }
    with cluster.config_path.open("a") as file:
        for name, keys in entries.items():
            file.write(f'\n[[remotes]]\nname = "{name}"\ngateways = ["{gateway}"]\n{keys}')
    cluster.config = load_config(cluster.config_path)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    """One single-node cluster with [auth] on, shared by this module; stopped by PID."""
    run_dir = tmp_path_factory.mktemp("auth")
    token_dir = run_dir / "tokens"
    token_dir.mkdir()
    for name, token in TOKENS.items():
        path = token_dir / name
        path.write_text(token + "\n")
        path.chmod(0o600)
    certs = run_dir / "certs"
    cluster = make_cluster(
        ROOT / "deploy" / "single.toml", run_dir / "cluster", **auth_overrides(certs)
    )
    # The gateway is trusted by its member certificate, so it has no token of its own.
    dev_certs.make_dev_certs(certs, dev_certs.subjects(cluster.config, ["app"]))
    _add_remotes(cluster, token_dir)
    cluster.metadata = (("authorization", f"Bearer {TOKENS['ops']}"),)
    try:
        cluster.start_all()
        with _connect(cluster, TOKENS["ops"]) as ops:
            for name in ("orders.eu", "payroll", "audit", "linked", "orders.source"):
                ops.create_topic(name)
        yield cluster, token_dir
    finally:
        cluster.stop_all()


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SQUALL_TOKEN", raising=False)
    monkeypatch.delenv("SQUALL_TOKEN_FILE", raising=False)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQUALL_TOKEN")}
    return run_squall(*args, env=env)


def _bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"),)


def test_calls_without_a_known_token_are_unauthenticated(
    secured: tuple[LocalCluster, Path],
) -> None:
    cluster, _ = secured
    for token in (None, "tok-nobody-knows-this-one"):
        with _connect(cluster, token) as client:
            with pytest.raises(squall.Unauthenticated, match="missing or unknown token"):
                client.topics()
    # The replica (publisher proxies reach it directly) and the coordinator refuse too.
    replica = cluster.replica_address("n1")
    with cluster.dial(replica) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            broker_pb2_grpc.PublisherStub(channel).Publish(
                broker_pb2.PublishRequest(
                    topic="orders.eu", events=[common_pb2.EventData(payload=b"x")]
                ),
                timeout=5,
            )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with cluster.dial(cluster.config.nodes[0].coordinator_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
                coordinator_pb2.GetStatusRequest(), timeout=5
            )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_publish_needs_the_topic_permission_and_a_denial_changes_nothing(
    secured: tuple[LocalCluster, Path],
) -> None:
    cluster, _ = secured
    with _connect(cluster, TOKENS["app"]) as app:
        # A replicated proxy publishes straight to the replica, with the token.
        with app.topic("orders.eu").publisher(replicated=True) as publisher:
            publisher.publish(b"allowed")
            publisher.flush()
        with pytest.raises(squall.PermissionDenied) as denied:
            app.topic("payroll")
    message = str(denied.value)
    assert "principal 'app' may not look up topic 'payroll'" in message
    for other in ("orders", "audit"):
        assert other not in message
    # Straight to the replica, the same answer; on a stream, requests before the denied one
    # are answered, then the stream ends with the denial.
    requests = [
        broker_pb2.PublishRequest(
            topic=topic, events=[common_pb2.EventData(payload=b"s")], request_id=index
        )
        for index, topic in enumerate(("orders.eu", "payroll", "orders.eu"))
    ]
    for address in (cluster.replica_address("n1"), cluster.gateway_address):
        with cluster.dial(address) as channel:
            stub = broker_pb2_grpc.PublisherStub(channel)
            answered = []
            with pytest.raises(grpc.RpcError) as refused:
                stream = stub.PublishStream(iter(requests), metadata=_bearer("app"), timeout=10)
                for response in stream:
                    answered.append(response.request_id)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, address
            assert answered == [0], address
            assert "payroll" in (refused.value.details() or "")
    with _connect(cluster, TOKENS["ops"]) as ops:
        payroll, orders = ops.topic("payroll").info, ops.topic("orders.eu").info
        assert (payroll.next_offset, payroll.size_bytes) == (0, 0)  # not a byte stored
        assert orders.next_offset == 3 and (orders.size_bytes or 0) > 0


def test_a_subscribe_only_principal_reads_but_cannot_publish(
    secured: tuple[LocalCluster, Path],
) -> None:
    cluster, _ = secured
    with _connect(cluster, TOKENS["reader"]) as reader:
        with pytest.raises(squall.PermissionDenied, match="may not publish to topic 'audit'"):
            reader.topic("audit").publisher(replicated=True)
        events = list(reader.topic("audit").subscribe(follow=False))
        assert events == []
    with cluster.dial(cluster.gateway_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(
                broker_pb2_grpc.SubscriberStub(channel).Subscribe(
                    broker_pb2.SubscribeRequest(topic="orders.eu"),
                    metadata=_bearer("reader"),
                    timeout=5,
                )
            )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == "principal 'reader' may not subscribe to topic 'orders.eu'"


def test_topics_are_listed_only_where_the_principal_may_see_them(
    secured: tuple[LocalCluster, Path],
) -> None:
    cluster, _ = secured
    seen = {}
    for name in ("app", "reader", "ops"):
        with _connect(cluster, TOKENS[name]) as client:
            seen[name] = sorted(t.name for t in client.topics())
    assert seen["app"] == ["orders.eu", "orders.source"]
    assert seen["reader"] == ["audit"]
    assert {"audit", "orders.eu", "payroll", "linked"} <= set(seen["ops"])


def test_topic_admin_and_cluster_commands_need_admin(
    secured: tuple[LocalCluster, Path],
) -> None:
    cluster, token_dir = secured
    with _connect(cluster, TOKENS["app"]) as app:
        only_admin = r"may not create topic 'orders.new' \(admin only\)"
        with pytest.raises(squall.PermissionDenied, match=only_admin):
            app.create_topic("orders.new")
        with pytest.raises(squall.PermissionDenied, match="may not destroy topic"):
            app.destroy_topic("orders.eu")
        with pytest.raises(squall.PermissionDenied, match="cluster status"):
            app.status()
    with _connect(cluster, TOKENS["ops"]) as ops:
        names = {t.name for t in ops.topics()}
        assert "orders.new" not in names and "orders.eu" in names
    config = ["--config", str(cluster.config_path)]
    override = ("cluster", "quorum-override", "0", *config)
    refused = _cli(*override, "--token-file", str(token_dir / "app"))
    assert refused.returncode == 1
    said = refused.stdout + refused.stderr
    assert "PERMISSION_DENIED: principal 'app' may not run cluster commands (admin only)" in said
    missing = _cli(*override)
    assert missing.returncode == 1 and "UNAUTHENTICATED" in missing.stdout + missing.stderr
    allowed = _cli(*override, "--token-file", str(token_dir / "ops"))
    assert allowed.returncode == 0, allowed.stderr
    created = _cli("topic", "create", "ops-made", *config, "--token-file", str(token_dir / "ops"))
    assert created.returncode == 0, created.stderr


def test_tokens_never_reach_logs_or_status_output(secured: tuple[LocalCluster, Path]) -> None:
    cluster, token_dir = secured
    status = _cli(
        "status",
        "--json",
        "--config",
        str(cluster.config_path),
        "--token-file",
        str(token_dir / "ops"),
    )
    assert status.returncode == 0, status.stderr
    assert '"n1"' in status.stdout
    # Make sure every service has logged a refusal naming a principal by now.
    with _connect(cluster, TOKENS["reader"]) as reader:
        with pytest.raises(squall.PermissionDenied):
            reader.create_topic("never")
    logs = {p.name: p.read_text(errors="replace") for p in (cluster.run_dir / "logs").iterdir()}
    assert "principal reader" in logs["gateway-g1.log"]
    for token in TOKENS.values():
        assert token not in status.stdout + status.stderr
        for name, text in logs.items():
            assert token not in text, f"a token is in {name}"


def test_a_link_to_a_remote_needs_its_tls_identity_a_known_token_and_a_link_principal(
    secured: tuple[LocalCluster, Path],
) -> None:
    """Issue 19 items 2 and 6 with real processes. The remote is this TLS + auth cluster's
    own gateway, named in [[remotes]] (`_add_remotes`) and reached exactly as another
    cluster's would be: a gateway presenting the wrong TLS identity, no token, a token it
    does not know, or a token whose principal may not see the topic: LinkTopic fails naming
    the problem and nothing is created. With the link principal's token the link forwards
    through the public Publish; an app may not publish under the link's publisher id."""
    cluster, token_dir = secured
    gateway = cluster.gateway_address
    ca_file = cluster.config.tls.ca_file
    with _connect(cluster, TOKENS["ops"]) as ops:
        source = ops.topic("orders.source")
        handshake = "the TLS handshake failed: its gateways must present a certificate for n1"
        for remote, said in [
            ("wrong-id", [handshake, f"from the CA in {ca_file}"]),
            ("no-token", ["refused find topic 'linked': no token is configured"]),
            ("bad-token", [f"the token in {token_dir / 'unknown'} was refused (UNAUTHENTICATED"]),
            ("reader", ["refused find topic 'linked'", "may not look up topic 'linked'"]),
        ]:
            with pytest.raises(squall.FailedPrecondition) as refused:
                source.link("linked", cluster=remote)
            for words in [f"remote cluster '{remote}' at {gateway}", *said]:
                assert words in str(refused.value), str(refused.value)
            assert ops.links() == [], f"{remote}: a refused link left an entry behind"
        made = source.link("linked", cluster="here")
        assert made.publisher_id == f"squall-link/squall-single/{made.created_lsn}"
        assert [x.to_cluster for x in ops.links()] == ["here"]
    with _connect(cluster, TOKENS["app"]) as app:
        # The app may publish on orders.*, but not as a link.
        with pytest.raises(squall.PermissionDenied, match="the prefix 'squall-link/' is reserved"):
            with app.topic("orders.eu").publisher(made.publisher_id) as forger:
                forger.publish(b"forged")
        with app.topic("orders.source").publisher("app") as publisher:
            publisher.publish(b"over the link")
    with _connect(cluster, TOKENS["link"]) as reader:
        forwarded: list[squall.Message] = []

        def arrived() -> bool:
            forwarded[:] = list(reader.topic("linked").subscribe(None, follow=False))
            return bool(forwarded)

        wait_for(arrived, 20, "the event forwarded through the gateway with the link's token")
    with _connect(cluster, TOKENS["ops"]) as ops:
        ops.topic("orders.source").unlink("linked", cluster="here")
    assert [(m.payload, m.publisher_id, m.sequence) for m in forwarded] == [
        (b"over the link", made.publisher_id, 1)
    ]
