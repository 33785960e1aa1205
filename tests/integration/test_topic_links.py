"""Topic links on real processes: within a three-node cluster and to a second, one-node
cluster on loopback, across kill -9 of either side's master (issue 19 items 1-3).

Goal: site-a's topic a is linked to b (cost 0) and c (cost 2) in site-a and to orders on
site-b. While an app publishes on a, site-a's master is killed -9 (another node takes
over and resumes every link), then site-b's node is killed -9 (site-a's publishers go
on; the link waits) and restarted: every event a holds since the links is on b once in
a's order, on c exactly those of cost at most 2, and on site-b's orders once in a's
order. The links survive the failover and show in `topic links`, `topic info` and
`status`; bad links (itself, a negative cost, a missing topic, an unknown remote, a topic
missing on the remote) are refused naming the problem, and create nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

import squall
from squall.v1 import common_pb2
from squall_server.common.config import load_config
from tests.integration.conftest import LocalCluster, run_squall, wait_for

pytestmark = pytest.mark.integration

EVENTS = 80


@dataclass(frozen=True)
class _Costly:
    """An event with a cost, as publish_many takes it."""

    payload: bytes
    cost: int


def _forwarded(
    client: squall.Client, topic: str, prefix: str = "squall-link/"
) -> list[squall.Message]:
    return [
        m
        for m in client.topic(topic).subscribe(None, follow=False)
        if m.publisher_id.startswith(prefix)
    ]


def _settled(cluster: LocalCluster) -> bool:
    """Every node NORMAL in one group under the highest-ranked node, whose replica leads
    (a start under load may form smaller groups first and merge them)."""
    statuses = cluster.statuses()
    return (
        len(statuses) == len(cluster.config.nodes)
        and {s.coordinator_id for s in statuses.values()} == {"n1"}
        and all(s.state == common_pb2.NODE_STATE_NORMAL for s in statuses.values())
        and cluster.replica_role("n1") == common_pb2.ROLE_MASTER
    )


def test_links_forward_each_event_once_in_order_across_kills_of_either_side(
    cluster_factory: object,
) -> None:
    site_b = cluster_factory(cluster={"name": "site-b"})  # type: ignore[operator]
    assert isinstance(site_b, LocalCluster)
    site_b.start_all()
    site_a = cluster_factory("cluster.example.toml", cluster={"name": "site-a"})  # type: ignore[operator]
    assert isinstance(site_a, LocalCluster)
    with site_a.config_path.open("a") as file:
        file.write(f'\n[[remotes]]\nname = "site-b"\ngateways = ["{site_b.gateway_address}"]\n')
    site_a.config = load_config(site_a.config_path)
    site_a.start_all()
    wait_for(lambda: _settled(site_a), 30, "site-a's three nodes in one group led by n1")
    gateway = site_a.gateway_address

    with (
        squall.connect(gateway, timeout_s=5.0) as client,
        squall.connect(site_b.gateway_address, timeout_s=5.0) as remote,
    ):
        for name in ("a", "b", "c"):
            client.create_topic(name)
        with client.topic("a").publisher("early") as early:
            early.publish(b"before the links")
        refused = run_squall("topic", "link", "a", "a", "--gateway", gateway)
        assert refused.returncode != 0, refused.stderr
        assert "cannot be linked to itself" in refused.stderr, refused.stderr
        a = client.topic("a")
        for kwargs, error, words in [
            ({"to": "b", "cost": -1}, squall.InvalidArgument, "is negative"),
            ({"to": "nope"}, squall.NotFound, "topic 'nope' does not exist"),
            ({"to": "x", "cluster": "nowhere"}, squall.InvalidArgument, "entry named 'nowhere'"),
            ({"to": "orders", "cluster": "site-b"}, squall.NotFound, "'orders@site-b' does not"),
        ]:
            with pytest.raises(error, match=words):
                a.link(**kwargs)  # type: ignore[arg-type]
        assert client.links() == []
        made = run_squall("topic", "link", "a", "b", "--gateway", gateway)
        assert made.returncode == 0, made.stderr
        assert "linked topic a to b with cost 0 (forwarding from offset 1" in made.stdout
        client.topic("a").link("c", cost=2)
        with pytest.raises(squall.AlreadyExists):
            client.topic("a").link("b")
        remote.create_topic("orders")
        far = client.topic("a").link("orders", cluster="site-b")
        assert far.publisher_id == f"squall-link/site-a/{far.created_lsn}"

        acked: list[int] = []  # a's offsets the app saw acknowledged
        errors: list[BaseException] = []

        def publish() -> None:
            try:
                with client.topic("a").publisher("app") as publisher:
                    for i in range(EVENTS):  # bounded
                        event = _Costly(b"e%d" % i, 0 if i % 2 else 5)
                        try:
                            (receipt,) = publisher.publish_many([event])
                        except squall.SquallError:
                            continue  # not acknowledged: may or may not be on a
                        acked.append(receipt.offset)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        wait_for(lambda: len(_forwarded(client, "b")) >= 15 or errors, 20, "forwarding to b")
        old = site_a.wait_for_master()
        site_a.kill_node(old)  # the source's master, mid-stream
        site_a.wait_for_master(exclude=old)
        wait_for(lambda: len(acked) >= EVENTS // 2 or errors, 30, "publishing after the kill")
        site_b.kill_node("n1")  # the destination cluster's master: a's publishers go on
        thread.join(60)
        assert not errors, repr(errors[0])
        assert len(acked) >= EVENTS - 5, "a's publishers were held up"
        site_b.start_node("n1")
        site_b.wait_for_master()

        source = list(client.topic("a").subscribe(None, follow=False))[1:]  # since the links
        assert set(acked) <= {m.offset for m in source}
        expected = [(m.payload, m.offset + 1) for m in source]
        wait_for(lambda: len(_forwarded(client, "b")) >= len(source), 30, "b caught up")
        on_b = _forwarded(client, "b")
        assert [(m.payload, m.sequence) for m in on_b] == expected, "b: not once each in order"
        cheap = [m.payload for m in source if m.cost <= 2]
        wait_for(lambda: len(_forwarded(client, "c")) >= len(cheap), 30, "c caught up")
        assert [m.payload for m in _forwarded(client, "c")] == cheap
        wait_for(lambda: len(_forwarded(remote, "orders")) >= len(source), 30, "site-b caught up")
        on_site_b = _forwarded(remote, "orders", "squall-link/site-a/")
        assert [(m.payload, m.sequence) for m in on_site_b] == expected, "site-b: not once in order"

        links = {link.to_topic: link for link in client.topic("a").links()}
        assert links["b"].cost == 0 and links["c"].cost == 2 and links["orders"].to_cluster
        wait_for(lambda: all(x.lag_events == 0 for x in client.links()), 10, "no lag left")
        client.topic("a").unlink("b")
    status = run_squall("status", "--gateway", gateway)
    assert "topic links:" in status.stdout and "a -> c\tcost=2" in status.stdout, status.stdout
    assert "a -> orders@site-b\tcost=0" in status.stdout, status.stdout
    assert "a -> b\t" not in status.stdout, status.stdout
