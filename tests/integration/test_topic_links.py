"""Topic links within one real three-node cluster, across a kill -9 of the master (issue
19 item 1).

Goal: with a -> b (cost 0) and a -> c (cost 2), an app publishes on a while the master is
killed: every event a holds since the link (every acknowledged one among them) is on b
once, in a's order, and on c exactly those of cost at most 2; the links survive the
failover and show in `topic links`, `topic info` and `status`; bad links are refused by
the CLI naming the problem, and create nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

import squall
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_gateway import trio  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration

EVENTS = 120


@dataclass(frozen=True)
class _Costly:
    """An event with a cost, as publish_many takes it."""

    payload: bytes
    cost: int


def _forwarded(client: squall.Client, topic: str) -> list[squall.Message]:
    return [
        m
        for m in client.topic(topic).subscribe(None, follow=False)
        if m.publisher_id.startswith("squall-link/")
    ]


def test_links_forward_each_event_once_in_order_across_a_master_kill(
    trio: LocalCluster,  # noqa: F811
) -> None:
    gateway = trio.gateway_address
    with squall.connect(gateway, timeout_s=5.0) as client:
        for name in ("a", "b", "c"):
            client.create_topic(name)
        with client.topic("a").publisher("early") as early:
            early.publish(b"before the link")
        for argv, words in [
            (("a", "a"), "cannot be linked to itself"),
            (("a", "b", "--cost", "-1"), "is negative"),
            (("a", "nope"), "topic 'nope' does not exist"),
        ]:
            refused = run_squall("topic", "link", *argv, "--gateway", gateway)
            assert refused.returncode != 0 and words in refused.stderr, refused.stderr
        assert client.topic("a").links() == []
        made = run_squall("topic", "link", "a", "b", "--gateway", gateway)
        assert made.returncode == 0, made.stderr
        assert "linked topic a to b with cost 0 (forwarding from offset 1" in made.stdout
        client.topic("a").link("c", cost=2)
        with pytest.raises(squall.AlreadyExists):
            client.topic("a").link("b")

        acked: list[int] = []  # a's offsets the app saw acknowledged
        errors: list[BaseException] = []
        stop = threading.Event()

        def publish() -> None:
            try:
                with client.topic("a").publisher("app") as publisher:
                    for i in range(EVENTS):  # bounded
                        if stop.is_set():
                            return
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
        wait_for(lambda: len(_forwarded(client, "b")) >= 20 or errors, 20, "forwarding to b")
        old = trio.wait_for_master()
        trio.kill_node(old)
        trio.wait_for_master(exclude=old)
        thread.join(60)
        stop.set()
        assert not errors, repr(errors[0])
        assert len(acked) >= EVENTS // 2

        source = list(client.topic("a").subscribe(None, follow=False))[1:]  # since the link
        assert set(acked) <= {m.offset for m in source}
        wait_for(lambda: len(_forwarded(client, "b")) >= len(source), 30, "b caught up")
        on_b = _forwarded(client, "b")
        assert [(m.payload, m.sequence) for m in on_b] == [
            (m.payload, m.offset + 1) for m in source
        ], "b does not hold a's events once each, in a's order"
        cheap = [m for m in source if m.cost <= 2]
        wait_for(lambda: len(_forwarded(client, "c")) >= len(cheap), 30, "c caught up")
        assert [m.payload for m in _forwarded(client, "c")] == [m.payload for m in cheap]

        links = {link.to_topic: link for link in client.topic("a").links()}
        assert links["b"].cost == 0 and links["c"].cost == 2
        assert links["b"].next_offset == source[-1].offset + 1 and links["b"].lag_events == 0
    info = run_squall("topic", "info", "a", "--gateway", gateway)
    assert info.returncode == 0 and "links=2" in info.stdout, info.stderr
    status = run_squall("status", "--gateway", gateway)
    assert "topic links:" in status.stdout and "a -> c\tcost=2" in status.stdout, status.stdout
    gone = run_squall("topic", "unlink", "a", "b", "--gateway", gateway)
    assert gone.returncode == 0, gone.stderr
    listed = run_squall("topic", "links", "a", "--gateway", gateway)
    assert listed.stdout.startswith("a -> c\t") and "a -> b" not in listed.stdout
