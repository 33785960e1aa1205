"""Topic links on real processes: within a three-node cluster and to a second three-node
cluster on loopback, across faults of either side and of the network between them
(issue 19 items 1-3).

Goal: site-a's topic a is linked to b (cost 0) and c (cost 2) in site-a and to orders on
site-b, reached through a TCP proxy the test can partition (`tests/integration/tcp_proxy.py`).
While an app publishes on a: site-a's master loses its replica process alone (its
coordinator stays up; another node takes over and resumes every link), the link between
the sites is partitioned for a while and healed (site-a's publishers keep being
acknowledged meanwhile), site-b's master is killed -9 (site-b elects another), then
site-a's master node is killed -9. Every event a holds since the links is on b once in
a's order, on c exactly those of cost at most 2, and on site-b's orders once in a's
order. The links survive the failovers and show in `topic links`, `topic info` and
`status`; bad links (itself, a negative cost, a missing topic, an unknown remote, a topic
missing on the remote) are refused naming the problem, and create nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

import squall
from squall.v1 import common_pb2
from squall_server.common.config import load_config
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

# The app publishes until the faults are over; this only bounds its loop.
EVENTS_MAX = 5000
# Acknowledgements the app must get while each fault lasts (its publishers not held up).
ACKS_PER_FAULT = 10
# How long the link between the sites stays partitioned, at least.
PARTITION_S = 2.0


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


def _replica_back(cluster: LocalCluster, node_id: str) -> bool:
    return "replica answers again" in cluster.log("coordinator", node_id)


def test_links_forward_each_event_once_in_order_across_faults_of_either_side_and_the_link(
    cluster_factory: object,
) -> None:
    site_b = cluster_factory("cluster.example.toml", cluster={"name": "site-b"})  # type: ignore[operator]
    assert isinstance(site_b, LocalCluster)
    site_b.start_all()
    proxy = TcpProxy(site_b.gateway_address)  # site-a reaches site-b only through it
    try:
        _run(cluster_factory, site_b, proxy)
    finally:
        proxy.stop()


def _run(cluster_factory: object, site_b: LocalCluster, proxy: TcpProxy) -> None:
    site_a = cluster_factory("cluster.example.toml", cluster={"name": "site-a"})  # type: ignore[operator]
    assert isinstance(site_a, LocalCluster)
    with site_a.config_path.open("a") as file:
        file.write(f'\n[[remotes]]\nname = "site-b"\ngateways = ["{proxy.address}"]\n')
    site_a.config = load_config(site_a.config_path)
    site_a.start_all()
    wait_for(lambda: _settled(site_a), 60, "site-a's three nodes in one group led by n1")
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
        done = threading.Event()

        def publish() -> None:
            try:
                with client.topic("a").publisher("app") as publisher:
                    for i in range(EVENTS_MAX):  # bounded; ends when the faults are over
                        if done.is_set():
                            return
                        event = _Costly(b"e%d" % i, 0 if i % 2 else 5)
                        try:
                            (receipt,) = publisher.publish_many([event])
                        except squall.SquallError:
                            continue  # not acknowledged: may or may not be on a
                        acked.append(receipt.offset)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        def acks_go_on(what: str) -> None:
            target = len(acked) + ACKS_PER_FAULT
            wait_for(lambda: len(acked) >= target or errors, 30, f"a's publishes acked {what}")
            assert not errors, repr(errors[0])

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        try:
            wait_for(lambda: len(_forwarded(client, "b")) >= 15 or errors, 20, "forwarding to b")
            # 1. site-a's master loses its replica process alone; its coordinator stays up.
            old = site_a.wait_for_master()
            site_a.kill("replica", old)
            site_a.wait_for_master(60, exclude=old)
            acks_go_on("after the source master's replica was killed")
            site_a.start("replica", old)  # so site-a keeps a majority of replicas for 4.
            # 2. The link between the sites is partitioned: the link waits, a's
            # publishers do not.
            proxy.cut()
            cut_at = time.monotonic()
            acks_go_on("while the link is partitioned")
            wait_for(
                lambda: any(x.to_cluster and x.lag_events > 0 for x in client.links()),
                30,
                "the partitioned link's lag shown",
            )
            reached = len(_forwarded(remote, "orders"))  # a batch sent before the cut is in
            time.sleep(max(0.5, PARTITION_S - (time.monotonic() - cut_at)))
            assert len(_forwarded(remote, "orders")) == reached, "events crossed the partition"
            proxy.restore()
            wait_for(
                lambda: len(_forwarded(remote, "orders")) > reached, 30, "the link after healing"
            )
            # 3. site-b's master is killed -9: site-b elects another, a's publishers go on.
            far_master = site_b.wait_for_master()
            site_b.kill_node(far_master)
            acks_go_on("while site-b has no master")
            site_b.wait_for_master(60, exclude=far_master)
            # 4. site-a's master node is killed -9 mid-stream.
            wait_for(lambda: _replica_back(site_a, old), 30, f"site-a's {old} replica rejoined")
            master = site_a.wait_for_master()
            site_a.kill_node(master)
            site_a.wait_for_master(60, exclude=master)
            acks_go_on("after the source master was killed")
        finally:
            done.set()
            thread.join(60)
        assert not errors, repr(errors[0])

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
        wait_for(lambda: all(x.lag_events == 0 for x in client.links()), 30, "no lag left")
        client.topic("a").unlink("b")
    status = run_squall("status", "--gateway", gateway)
    assert "topic links:" in status.stdout and "a -> c\tcost=2" in status.stdout, status.stdout
    assert "a -> orders@site-b\tcost=0" in status.stdout, status.stdout
    assert "a -> b\t" not in status.stdout, status.stdout


def test_a_link_stopped_by_a_refusal_forwards_again_after_retry_link_once_each_in_order(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A link to another cluster stops when the remote refuses a batch for good (here its
    destination topic was destroyed). Once the operator has made the topic again,
    `squall topic retry-link` forwards from the refused batch on: every event the source
    acknowledged meanwhile reaches the new topic once, in order, also across a kill -9 of
    the source's replica right after the retry. The remote is this one-node cluster's
    own gateway, named in [[remotes]] and reached as another cluster's would be."""
    cluster = cluster_factory("single.toml")
    gateway = cluster.gateway_address
    with cluster.config_path.open("a") as file:
        file.write(f'\n[[remotes]]\nname = "mirror"\ngateways = ["{gateway}"]\n')
    cluster.config = load_config(cluster.config_path)
    cluster.start_all()

    def squall_cli(*args: str) -> str:
        done = run_squall(*args, "--gateway", gateway)
        assert done.returncode == 0, done.stderr
        return done.stdout

    with squall.connect(gateway) as client:
        client.create_topic("src")
        client.create_topic("dst")
        source = client.topic("src")
        source.link("dst", cluster="mirror")
        with source.publisher("app") as publisher:
            acked = [publisher.publish(b"before").offset]
            wait_for(lambda: len(_forwarded(client, "dst")) == 1, 30, "the first event forwarded")
            client.destroy_topic("dst")
            acked += [publisher.publish(b"refused-%d" % n).offset for n in range(2)]
            wait_for(
                lambda: "STOPPED: stopped at offset 1" in squall_cli("topic", "links", "src"),
                30,
                "the link stopped on the missing topic",
            )
            (link,) = source.links()
            assert "refused for good" in link.stopped_reason and "retry-link" in link.stopped_reason
            assert link.next_offset == 1, "the cursor passed a batch the remote never took"

            client.create_topic("dst")
            said = squall_cli("topic", "retry-link", "src", "dst", "--cluster", "mirror")
            assert said.strip() == "link src -> dst@mirror: forwarding again from offset 1", said
            assert "forwarding again from offset 1 at the operator's request" in cluster.log(
                "replica", "n1"
            )
            acked.append(publisher.publish(b"after the retry").offset)
            wait_for(lambda: len(_forwarded(client, "dst")) == 3, 30, "the retried link")
            # The retried link's cursor is the log's: a crash resumes it without repeats.
            cluster.kill("replica", "n1")
            cluster.start("replica", "n1")
            cluster.wait_for_master(60)
            acked.append(publisher.publish(b"after the crash").offset)
        expected = [m.payload for m in source.subscribe(None, follow=False)][1:]
        assert expected == [b"refused-0", b"refused-1", b"after the retry", b"after the crash"]
        wait_for(lambda: len(_forwarded(client, "dst")) >= 4, 30, "the link after the crash")
        on_dst = _forwarded(client, "dst")
        assert [(m.payload, m.sequence) for m in on_dst] == [
            (payload, offset + 1) for payload, offset in zip(expected, acked[1:], strict=True)
        ], "not once each in the source's order"
        assert not source.links()[0].stopped_reason

    again = squall_cli("topic", "retry-link", "src", "dst", "--cluster", "mirror")
    assert again.strip() == "link src -> dst@mirror: was not stopped; it forwards from offset 5"
    missing = run_squall("topic", "retry-link", "src", "nowhere", "--gateway", gateway)
    assert missing.returncode != 0
    assert "topic 'src' is not linked to 'nowhere'" in missing.stderr, missing.stderr
