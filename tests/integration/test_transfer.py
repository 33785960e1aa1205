"""Graceful leadership transfer with real processes (`squall cluster transfer --to N`).

Goal: while an app publishes through the gateway, the operator hands the leadership from
n1 to n3. n3 leads in a newer epoch, the app sees at most a short pause (the gateway and
the library retry the writes the fenced master refused), and every acknowledged event is
stored exactly once on every replica. Bad requests are refused with a message and change
nothing.
"""

from __future__ import annotations

import squall
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_gateway import (
    _AppPublisher,
    _stored_on,
    trio,  # noqa: F401  (the fixture)
)


def test_transfer_moves_the_master_and_loses_no_acknowledged_write(
    trio: LocalCluster,  # noqa: F811
) -> None:
    # n1 ranks first, but a slower start can let n2 lead until it hands over to n1: the
    # operator's transfer starts from the settled cluster.
    wait_for(lambda: trio.wait_for_master() == "n1", 30, "n1, the first in rank, leads")
    old_epoch = trio.statuses()["n1"].epoch
    config = str(trio.config_path)
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        publisher = client.topic("orders").publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        app.start()
        try:
            wait_for(lambda: app.acked_by("n1") >= 30, 20, "30 publishes acknowledged by n1")
            done = run_squall(
                "cluster", "transfer", "--to", "n3", "--reason", "patch n1", "--config", config
            )
            assert done.returncode == 0, done.stderr + done.stdout
            assert "n3 leads in epoch" in done.stdout, done.stdout
            wait_for(lambda: app.acked_by("n3") >= 30, 30, "30 publishes acknowledged by n3")
        finally:
            app.stop.set()
            app.join(30)
        publisher.close()
    assert app.error is None, repr(app.error)
    assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}
    statuses = trio.statuses()
    assert statuses["n3"].coordinator_id == "n3" and statuses["n3"].epoch > old_epoch
    assert statuses["n1"].coordinator_id == "n3"  # the old master is a member now
    assert statuses["n1"].audit[-1].action == "transfer to n3"
    assert statuses["n1"].audit[-1].reason == "patch n1"
    acked = sorted(app.acked)
    for node in ("n1", "n2", "n3"):
        address = trio.replica_address(node)

        def holds_all(address: str = address) -> bool:
            stored = _stored_on(address, "orders")
            return all(stored[("app-1", s)] == 1 for s in acked)

        wait_for(holds_all, 20, f"{node} holds every acknowledged event exactly once")
        stored = _stored_on(address, "orders")
        assert not {k: c for k, c in stored.items() if c > 1}, f"duplicates on {node}"
    # The old master's writes stopped before the hand-over: it logged the fence and n3 was
    # the new group's sync source (nothing to fetch).
    assert "handing epoch" in trio.log("coordinator", "n1")
    assert "sync source n3" in trio.log("coordinator", "n3")


def test_transfer_refusals_change_nothing(trio: LocalCluster) -> None:  # noqa: F811
    # Settled first (see above): a hand-over from n2 to n1 would move the master mid-test.
    wait_for(lambda: trio.wait_for_master() == "n1", 30, "n1, the first in rank, leads")
    master = "n1"
    config = str(trio.config_path)
    before = trio.statuses()[master].epoch
    unknown = run_squall("cluster", "transfer", "--to", "n9", "--config", config)
    assert unknown.returncode == 1 and "n9" in unknown.stderr, unknown.stderr
    same = run_squall("cluster", "transfer", "--to", master, "--config", config)
    assert same.returncode == 0 and "already leads" in same.stdout, same.stdout
    trio.kill_node("n3")
    wait_for(
        lambda: "n3" not in trio.statuses()[master].group, 10, "the master drops n3 from its group"
    )
    epoch = trio.statuses()[master].epoch
    down = run_squall("cluster", "transfer", "--to", "n3", "--config", config)
    assert down.returncode == 1, down.stdout
    assert "FAILED_PRECONDITION" in down.stderr and "not a member" in down.stderr, down.stderr
    after = trio.statuses()[master]
    assert after.coordinator_id == master and after.epoch == epoch >= before
    # The master still takes writes: the refused transfer fenced nothing.
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("after")
        receipt = client.topic("after").publisher("p").publish(b"x")
    assert receipt.master_id == master
