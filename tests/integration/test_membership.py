"""Runtime membership changes with real processes (issue 20, item 1).

Goal: while an app publishes through the gateway, the operator grows the three-node
cluster to four (`squall cluster add-node n4`), writes the running node set out
(`squall cluster config export`) and starts n4 from that file; n4 catches up and joins the
group, and every acknowledged event is stored exactly once on all four replicas. Then n4
is removed again (`squall cluster remove-node n4`): the group re-forms without it, and
`squall status` shows the running node set; raising n3's priority moves the lead to it;
n2's machine dies and `squall cluster replace-node n2` gives its id to a new machine (new
addresses, an empty store) that catches up.
Removing the master's own node is refused with the reason and changes nothing (the other
refusals are the transcripts' and tests/unit/test_membership.py's).
"""

from __future__ import annotations

import grpc

import squall
from deploy import processes
from squall.v1 import common_pb2
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_gateway import (
    _AppPublisher,
    _stored_on,
    trio,  # noqa: F401  (the fixture)
)


def test_grow_remove_reprioritize_and_replace(trio: LocalCluster) -> None:  # noqa: F811
    master = trio.wait_for_master()
    config = str(trio.config_path)
    coordinator_port, replica_port = processes.free_ports(2)
    coordinator_address = f"127.0.0.1:{coordinator_port}"
    replica_address = f"127.0.0.1:{replica_port}"
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        publisher = client.topic("orders").publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        app.start()
        try:
            wait_for(lambda: app.acked_by(master) >= 20, 20, "20 publishes acknowledged")
            added = run_squall(
                "cluster", "add-node", "n4", "--coordinator-address", coordinator_address,
                "--replica-address", replica_address, "--priority", "1",
                "--reason", "grow", "--config", config,
            )  # fmt: skip
            assert added.returncode == 0, added.stderr + added.stdout
            assert "add-node n4" in added.stdout and "done in epoch" in added.stdout
            exported = trio.run_dir / "exported.toml"
            export = run_squall(
                "cluster", "config", "export", "--config", config, "--out", str(exported),
                "--data-dir", f"n4={trio.run_dir / 'data-n4'}",
            )  # fmt: skip
            assert export.returncode == 0, export.stderr
            n4 = (("replica", replica_address), ("coordinator", coordinator_address))
            for kind, address in n4:
                service = processes.start_service(
                    kind, exported, "n4", address, trio.run_dir / "logs" / f"{kind}-n4.log",
                    env=trio.env,
                )  # fmt: skip
                trio.services[(kind, "n4")] = service
                processes.wait_serving([service], links=trio.links)
            wait_for(
                lambda: "n4" in trio.statuses()[master].group, 20, "n4 joins the master's group"
            )
            before = app.acked_by(master)
            wait_for(lambda: app.acked_by(master) >= before + 20, 20, "20 more acknowledged")
        finally:
            app.stop.set()
            app.join(30)
        publisher.close()
    assert app.error is None, repr(app.error)
    assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}
    acked = sorted(app.acked)
    for address in [trio.replica_address(n) for n in ("n1", "n2", "n3")] + [replica_address]:

        def holds_all(address: str = address) -> bool:
            stored = _stored_on(address, "orders")
            return all(stored[("app-1", s)] == 1 for s in acked)

        wait_for(holds_all, 20, f"{address} holds every acknowledged event exactly once")
    status = trio.statuses()[master]
    assert [m.node_id for m in status.membership.members] == ["n1", "n2", "n3", "n4"]
    shown = run_squall("status", "--gateway", trio.gateway_address)
    assert "node set: v1" in shown.stdout and "n4:1" in shown.stdout, shown.stdout
    # Removing the master's own node is refused; removing n4 re-forms the group without it.
    own = run_squall("cluster", "remove-node", master, "--config", config)
    assert own.returncode == 1 and "hand the leadership" in own.stderr, own.stderr
    removed = run_squall("cluster", "remove-node", "n4", "--reason", "shrink", "--config", config)
    assert removed.returncode == 0, removed.stderr + removed.stdout
    assert "remove-node n4: done" in removed.stdout, removed.stdout
    status = trio.statuses()[master]
    assert status.state == common_pb2.NODE_STATE_NORMAL and "n4" not in status.group
    assert [m.node_id for m in status.membership.members] == ["n1", "n2", "n3"]
    assert status.audit[-1].action == "membership remove-node n4"
    # Priority decides who leads: raising n3 above the master hands the lead to n3 once it
    # is caught up (it is: it took every write above).
    raised = run_squall("cluster", "set-priority", "n3", "9", "--config", config)
    assert raised.returncode == 0 and "set-priority n3 9: done" in raised.stdout, raised.stdout
    wait_for(lambda: trio.wait_for_master(timeout_s=10) == "n3", 20, "n3 leads")
    # n2's machine dies for good: its id moves to a new machine (new addresses, an empty
    # store) started from the exported file; the master brings it up to date.
    trio.kill_node("n2")
    wait_for(lambda: "n2" not in trio.statuses()["n3"].group, 20, "n3 drops n2")
    coordinator_port, replica_port = processes.free_ports(2)
    new_coordinator, new_replica = f"127.0.0.1:{coordinator_port}", f"127.0.0.1:{replica_port}"
    replaced = run_squall(
        "cluster", "replace-node", "n2", "--coordinator-address", new_coordinator,
        "--replica-address", new_replica, "--config", config,
    )  # fmt: skip
    assert replaced.returncode == 0 and "replace-node n2" in replaced.stdout, replaced.stdout
    exported = trio.run_dir / "exported-2.toml"
    export = run_squall(
        "cluster", "config", "export", "--config", config, "--out", str(exported),
        "--data-dir", f"n2={trio.run_dir / 'data-n2-new'}",
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    for kind, address in (("replica", new_replica), ("coordinator", new_coordinator)):
        service = processes.start_service(
            kind, exported, "n2", address, trio.run_dir / "logs" / f"{kind}-n2-new.log",
            env=trio.env,
        )  # fmt: skip
        trio.services[(kind, "n2-new")] = service
        processes.wait_serving([service], links=trio.links)
    wait_for(lambda: "n2" in trio.statuses()["n3"].group, 20, "the new n2 joins n3's group")

    def caught_up() -> bool:
        try:
            stored = _stored_on(new_replica, "orders")
        except grpc.RpcError:  # the topic is not there yet: still fetching
            return False
        return all(stored[("app-1", s)] == 1 for s in acked)

    wait_for(caught_up, 20, "the new n2 holds every acknowledged event exactly once")
    member = next(m for m in trio.statuses()["n3"].membership.members if m.node_id == "n2")
    assert member.replica_address == new_replica
