"""A topic link between two real clusters on loopback (issue 19 items 2-3, in progress).

Goal: site-a's topic linked to site-b's through site-b's gateway: while an app publishes
on site-a, site-b's node is killed -9 (the link waits, site-a's publishers do not) and
restarted; while the link catches up site-a's node is killed -9 and restarted (the link
resumes at its replicated cursor): every event site-a holds since the link is on site-b
once, in
site-a's order. A link naming an unknown remote or a missing remote topic is refused,
naming the problem, and creates nothing.
"""

from __future__ import annotations

import threading

import pytest

import squall
from squall_server.common.config import load_config
from tests.integration.conftest import LocalCluster, wait_for

pytestmark = pytest.mark.integration

EVENTS = 60


def _forwarded(client: squall.Client, topic: str) -> list[squall.Message]:
    return [
        m
        for m in client.topic(topic).subscribe(None, follow=False)
        if m.publisher_id.startswith("squall-link/site-a/")
    ]


def test_a_link_to_another_cluster_is_exactly_once_across_kills_of_both_sides(
    cluster_factory: object,
) -> None:
    site_b = cluster_factory(cluster={"name": "site-b"})  # type: ignore[operator]
    assert isinstance(site_b, LocalCluster)
    site_b.start_all()
    site_a = cluster_factory(cluster={"name": "site-a"})  # type: ignore[operator]
    assert isinstance(site_a, LocalCluster)
    with site_a.config_path.open("a") as file:
        file.write(f'\n[[remotes]]\nname = "site-b"\ngateways = ["{site_b.gateway_address}"]\n')
    site_a.config = load_config(site_a.config_path)
    site_a.start_all()

    with (
        squall.connect(site_a.gateway_address, timeout_s=5.0) as a,
        squall.connect(site_b.gateway_address, timeout_s=5.0) as b,
    ):
        a.create_topic("orders")
        with pytest.raises(squall.InvalidArgument, match="no \\[\\[remotes\\]\\] entry named"):
            a.topic("orders").link("orders", cluster="nowhere")
        with pytest.raises(squall.NotFound, match="orders@site-b"):
            a.topic("orders").link("orders", cluster="site-b")
        assert a.topic("orders").links() == []
        b.create_topic("orders")
        link = a.topic("orders").link("orders", cluster="site-b")
        assert (link.to_cluster, link.publisher_id) == (
            "site-b",
            f"squall-link/site-a/{link.created_lsn}",
        )

        acked: list[int] = []
        errors: list[BaseException] = []

        def publish() -> None:
            try:
                with a.topic("orders").publisher("app") as publisher:
                    for i in range(EVENTS):  # bounded
                        acked.append(publisher.publish(b"o%d" % i).offset)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        wait_for(lambda: len(_forwarded(b, "orders")) >= 5 or errors, 20, "forwarding")
        site_b.kill_node("n1")  # the destination's master: site-a's publishers go on
        thread.join(60)
        assert not errors, repr(errors[0])
        assert len(acked) == EVENTS, "site-a's publishers were held up by the link"
        site_b.start_node("n1")
        site_b.wait_for_master()
        # The link is catching up (or still backing off): kill -9 the source mid-stream.
        site_a.kill_node("n1")
        site_a.start_node("n1")
        site_a.wait_for_master()

        source = [m for m in a.topic("orders").subscribe(None, follow=False)]
        assert set(acked) <= {m.offset for m in source}
        wait_for(lambda: len(_forwarded(b, "orders")) >= len(source), 30, "site-b caught up")
        on_b = _forwarded(b, "orders")
        assert [(m.payload, m.sequence) for m in on_b] == [
            (m.payload, m.offset + 1) for m in source
        ], "site-b does not hold site-a's events once each, in order"
        (info,) = a.topic("orders").links()
        assert info.next_offset == len(source) and info.lag_events == 0
