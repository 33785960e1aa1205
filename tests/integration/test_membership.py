"""Runtime membership changes with real processes (issue 20, item 1).

Goal: while an app publishes through the gateway, the operator grows the three-node
cluster to five (`squall cluster add-node n4`, then `n5`): each is a learner (`n4:1L` in
`squall status`) until it has caught up. They are started from the exported running set
(`squall cluster config export`); n4's replica alone is killed while it catches up and
restarted, and it still finishes catching up; both are promoted to voter. The gateway,
started from the three-node file, follows the running set: `squall status` lists n4, and
when `set-priority n4 9` hands n4 the lead, publishes go on through the gateway to the
master on the added node. Then the cluster shrinks back to three under publishing, one
node at a time (`remove-node n1`, the old master, then `remove-node n5`): every
acknowledged event is stored exactly once, in publishing order, on the three nodes left,
and the gateway's `squall status` no longer lists the removed nodes (without a restart).
Removing the master's own node is refused. Last, n2's machine dies
and `replace-node n2` gives its id to a new machine (new addresses, an empty store) that
comes in as a learner, catches up and is promoted. (The other refusals are the
transcripts' and tests/unit/test_membership.py's.)
"""

from __future__ import annotations

import re

import grpc

import squall
from deploy import processes
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2, coordinator_pb2
from squall_server.common.config import load_config
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_gateway import (
    _AppPublisher,
    _stored_on,
    trio,  # noqa: F401  (the fixture)
)


def _member(status: coordinator_pb2.CoordinatorStatus, node_id: str) -> coordinator_pb2.MemberSpec:
    return next(m for m in status.membership.members if m.node_id == node_id)


def _voter(cluster: LocalCluster, leader: str, node_id: str) -> bool:
    """Has the leader's node set made ``node_id`` a voter (promoted from learner)?"""
    status = cluster.statuses().get(leader)
    if status is None or not any(m.node_id == node_id for m in status.membership.members):
        return False
    return not _member(status, node_id).learner


def _holds(address: str, acked: list[int]) -> bool:
    try:
        stored = _stored_on(address, "orders")
    except grpc.RpcError:  # the topic is not there yet: still fetching
        return False
    return all(stored[("app-1", s)] == 1 for s in acked)


def _in_order(address: str) -> list[int]:
    """app-1's sequences in the order one replica's log holds them."""
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic="orders", start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=20,
        )
        return [e.sequence for r in stream for e in r.events if e.publisher_id == "app-1"]


def _status_rows(gateway_address: str) -> set[str]:
    """The node ids that head a row of `squall status`'s node table via the gateway."""
    shown = run_squall("status", "--gateway", gateway_address).stdout
    table = shown.split("\nmaster:")[0].splitlines()[1:]  # below the header
    return {line.split()[0] for line in table if line.strip()}


def test_grow_remove_reprioritize_and_replace(trio: LocalCluster) -> None:  # noqa: F811
    master = trio.wait_for_master()
    assert master == "n1"
    config = str(trio.config_path)
    coordinator_address, replica_address, n5_coordinator, n5_replica = (
        f"127.0.0.1:{port}" for port in processes.free_ports(4)
    )
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        publisher = client.topic("orders").publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        app.start()
        try:
            wait_for(lambda: app.acked_by(master) >= 20, 20, "20 publishes acknowledged")
            # Grow to five: both come in as learners (not started yet: no majority changes).
            for node_id, (coordinator, replica) in (
                ("n4", (coordinator_address, replica_address)),
                ("n5", (n5_coordinator, n5_replica)),
            ):
                added = run_squall(
                    "cluster", "add-node", node_id, "--coordinator-address", coordinator,
                    "--replica-address", replica, "--priority", "1",
                    "--reason", "grow", "--config", config,
                )  # fmt: skip
                assert added.returncode == 0, added.stderr + added.stdout
                assert f"add-node {node_id}" in added.stdout and "done in epoch" in added.stdout
            shown = run_squall("status", "--gateway", trio.gateway_address)
            assert "n4:1L" in shown.stdout and "n5:1L" in shown.stdout, shown.stdout
            assert "learners (L): n4,n5" in shown.stdout, shown.stdout
            exported = trio.run_dir / "exported.toml"
            export = run_squall(
                "cluster", "config", "export", "--config", config, "--out", str(exported),
                "--data-dir", f"n4={trio.run_dir / 'data-n4'}",
                "--data-dir", f"n5={trio.run_dir / 'data-n5'}",
            )  # fmt: skip
            assert export.returncode == 0, export.stderr
            assert "learner = true" in exported.read_text()
            # The operator's file is brought up to date (the test's view of the nodes too).
            config = str(exported)
            trio.config = load_config(exported)
            # Both nodes' services start at once (each waits for its peers on its own).
            started = []
            for node_id, replica, coordinator in (
                ("n4", replica_address, coordinator_address),
                ("n5", n5_replica, n5_coordinator),
            ):
                for kind, address in (("replica", replica), ("coordinator", coordinator)):
                    service = processes.start_service(
                        kind, exported, node_id, address,
                        trio.run_dir / "logs" / f"{kind}-{node_id}.log", env=trio.env,
                    )  # fmt: skip
                    trio.services[(kind, node_id)] = service
                    started.append(service)
            processes.wait_serving(started, links=trio.links)
            # n4's replica alone dies while it catches up, and comes back on its store.
            wait_for(lambda: "n4" in trio.statuses()[master].group, 20, "n4 joins as learner")
            trio.kill("replica", "n4")
            service = processes.start_service(
                "replica", exported, "n4", replica_address,
                trio.run_dir / "logs" / "replica-n4-again.log", env=trio.env,
            )  # fmt: skip
            trio.services[("replica", "n4-again")] = service
            processes.wait_serving([service], links=trio.links)
            wait_for(lambda: _voter(trio, master, "n5"), 30, "n5 caught up and promoted")
            wait_for(lambda: _voter(trio, master, "n4"), 30, "n4 caught up and promoted")
            before = app.acked_by(master)
            wait_for(lambda: app.acked_by(master) >= before + 20, 20, "20 more acknowledged")

            # The gateway follows the running set: it lists n4, and reaches a master on it.
            def lists_n4_as_voter() -> bool:
                shown = run_squall("status", "--gateway", trio.gateway_address).stdout
                rows = [line.split()[0] for line in shown.splitlines() if line.strip()]
                return "n4" in rows and re.search(r"\bn4:1(?![L0-9])", shown) is not None

            wait_for(lists_n4_as_voter, 10, "squall status lists n4 as a voter")
            raised = run_squall("cluster", "set-priority", "n4", "9", "--config", config)
            assert raised.returncode == 0, raised.stderr + raised.stdout
            assert "set-priority n4 9: done" in raised.stdout, raised.stdout
            wait_for(lambda: trio.wait_for_master(timeout_s=10) == "n4", 20, "n4 leads")
            wait_for(lambda: app.acked_by("n4") >= 20, 20, "20 acknowledged by the master n4")
            # Shrink back to three under publishing, one node at a time: the old master
            # leaves, then n5.
            for node_id in ("n1", "n5"):
                removed = run_squall(
                    "cluster", "remove-node", node_id, "--reason", "shrink", "--config", config
                )
                assert removed.returncode == 0, removed.stderr + removed.stdout
                assert f"remove-node {node_id}: done" in removed.stdout, removed.stdout
                trio.kill_node(node_id)
                after = app.acked_by("n4") + 20
                wait_for(
                    lambda after=after: app.acked_by("n4") >= after,  # type: ignore[misc]
                    20,
                    f"20 acknowledged after {node_id} left",
                )
        finally:
            app.stop.set()
            app.join(30)
        publisher.close()
    assert app.error is None, repr(app.error)
    assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}
    acked = sorted(app.acked)
    for address in [trio.replica_address(n) for n in ("n2", "n3")] + [replica_address]:
        wait_for(
            lambda address=address: _holds(address, acked),  # type: ignore[misc]
            20,
            f"{address} holds every acknowledged event exactly once",
        )
    status = trio.statuses()["n4"]
    assert status.state == common_pb2.NODE_STATE_NORMAL and "n1" not in status.group
    assert [m.node_id for m in status.membership.members] == ["n2", "n3", "n4"]
    assert status.audit[-1].action == "membership remove-node n5"
    for address in [trio.replica_address(n) for n in ("n2", "n3")] + [replica_address]:
        assert _in_order(address) == acked, f"{address} holds app-1's events out of order"
    # The gateway (started from the three-node file) drops the removed nodes' rows.
    wait_for(
        lambda: _status_rows(trio.gateway_address) == {"n2", "n3", "n4"},
        10,
        "squall status via the gateway lists n2, n3, n4 only",
    )
    # Removing the master's own node is refused and changes nothing.
    own = run_squall("cluster", "remove-node", "n4", "--config", config)
    assert own.returncode == 1 and "hand the leadership" in own.stderr, own.stderr
    # n2's machine dies for good: its id moves to a new machine (new addresses, an empty
    # store) started from the exported file; it learns, then votes.
    trio.kill_node("n2")
    wait_for(lambda: "n2" not in trio.statuses()["n4"].group, 20, "n4 drops n2")
    coordinator_port, replica_port = processes.free_ports(2)
    new_coordinator, new_replica = f"127.0.0.1:{coordinator_port}", f"127.0.0.1:{replica_port}"
    replaced = run_squall(
        "cluster", "replace-node", "n2", "--coordinator-address", new_coordinator,
        "--replica-address", new_replica, "--config", config,
    )  # fmt: skip
    assert replaced.returncode == 0 and "replace-node n2" in replaced.stdout, replaced.stdout
    assert _member(trio.statuses()["n4"], "n2").learner
    exported = trio.run_dir / "exported-2.toml"
    export = run_squall(
        "cluster", "config", "export", "--config", config, "--out", str(exported),
        "--data-dir", f"n2={trio.run_dir / 'data-n2-new'}",
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    trio.config = load_config(exported)
    for kind, address in (("replica", new_replica), ("coordinator", new_coordinator)):
        service = processes.start_service(
            kind, exported, "n2", address, trio.run_dir / "logs" / f"{kind}-n2-new.log",
            env=trio.env,
        )  # fmt: skip
        trio.services[(kind, "n2-new")] = service
        processes.wait_serving([service], links=trio.links)
    wait_for(lambda: _holds(new_replica, acked), 30, "the new n2 holds every acked event")
    wait_for(lambda: _voter(trio, "n4", "n2"), 30, "the new n2 is promoted to voter")
    assert _member(trio.statuses()["n4"], "n2").replica_address == new_replica
