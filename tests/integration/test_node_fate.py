"""One fate per node (issue 14: 1, 7): a node is a coordinator and a replica, and the cluster
fails over when either process of the master dies or hangs.

One real three-node cluster (deploy/cluster.example.toml: n1 ranks highest) and its gateway
serve every case in turn, healed between them. In each case an app publishes through the
gateway across the fault; the cluster must elect a new master (bounded generously: a loaded
machine is slow, and speed belongs to the benchmarks), `squall status` must name the cause
while the fault lasts, and after healing every acknowledged event must be readable at the
offset its receipt gave. The faults: kill -9 and SIGSTOP of the master's replica alone
(its coordinator stays up and must take the node out of its group), kill -9 and SIGSTOP of
the master's coordinator alone (its replica drops the role when its lease runs out), and
kill -9 of the whole master node, restarted so that it takes the lead back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, run_squall, wait_for

pytestmark = pytest.mark.integration

TOPIC = "fate"
# Generous bounds for a loaded 2-core machine; the failover itself takes about half a second.
FAILOVER_S = 30.0
ACKS_BEFORE_FAULT = 20
ACKS_AFTER_FAULT = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One running three-node cluster for the whole module, stopped by PID at the end."""
    made = make_cluster(
        ROOT / "deploy" / "cluster.example.toml", tmp_path_factory.mktemp("node-fate")
    )
    try:
        made.start_all()
        with squall.connect(made.gateway_address, timeout_s=10.0) as client:
            client.create_topic(TOPIC)
        yield made
    finally:
        for service in made.services.values():
            # A paused process must run again to stop cleanly.
            if service.process.poll() is None:
                os.kill(service.process.pid, signal.SIGCONT)
        made.stop_all()


class _App(threading.Thread):
    """An app publishing one event per call through the gateway, remembering every receipt."""

    def __init__(self, gateway: str, publisher_id: str) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.publisher_id = publisher_id
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: dict[int, squall.Receipt] = {}
        self.failures = 0
        self.error: BaseException | None = None

    def acked_by(self, master: str) -> int:
        with self.lock:
            return sum(r.master_id == master for r in self.acked.values())

    def run(self) -> None:
        try:
            with squall.connect(self.gateway, timeout_s=10.0) as client:
                publisher = client.topic(TOPIC).publisher(self.publisher_id)
                for sequence in range(1, 100_000):  # bounded; stopped much earlier
                    if self.stop.is_set():
                        break
                    try:
                        receipt = publisher.publish(b"event %d" % sequence)
                    except squall.SquallError:
                        with self.lock:
                            self.failures += 1
                        continue
                    with self.lock:
                        self.acked[sequence] = receipt
                publisher.close()
        except BaseException as exc:  # reported by the test
            self.error = exc


def _master(cluster: LocalCluster) -> str:
    return cluster.wait_for_master(timeout_s=FAILOVER_S)


def _status(cluster: LocalCluster) -> str:
    result = run_squall("status", "--config", str(cluster.config_path))
    return result.stdout + result.stderr


def _row(text: str, node: str) -> str:
    """The status table's row of one node (printed for the reader of `pytest -s`)."""
    row = next((line for line in text.splitlines() if line.startswith(f"{node} ")), "")
    print(f"status row during the fault: {row}")
    return row


def _stored_at(cluster: LocalCluster, node: str) -> dict[int, tuple[str, int]]:
    """Offset -> (publisher id, sequence) of every committed event, read from one replica."""
    stored: dict[int, tuple[str, int]] = {}
    with cluster.dial(cluster.replica_address(node)) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=TOPIC, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=1000
            ),
            timeout=30,
        )
        for response in stream:
            for event in response.events:
                stored[event.offset] = (event.publisher_id, event.sequence)
    return stored


def _across(
    cluster: LocalCluster,
    publisher_id: str,
    fault: Callable[[str], None],
    during: Callable[[str, str], None],
    heal: Callable[[str], None],
) -> None:
    """Publish across ``fault`` of the master; check ``during`` (old, new master), heal,
    and check that every acknowledged event is stored where its receipt says. Every case
    starts with the highest-ranked node leading (it takes the lead back after each heal)."""
    top = cluster.config.nodes[0].id
    wait_for(lambda: _master(cluster) == top, FAILOVER_S, f"{top} leads before the case")
    old = top
    app = _App(cluster.gateway_address, publisher_id)
    app.start()
    try:
        wait_for(lambda: app.acked_by(old) >= ACKS_BEFORE_FAULT, FAILOVER_S, f"acks by {old}")
        faulted = time.monotonic()
        fault(old)
        new = cluster.wait_for_master(timeout_s=FAILOVER_S, exclude=old)
        # For the reader of `pytest -s`, not asserted: speed belongs to the benchmarks.
        print(f"\n{publisher_id}: {new} leads {time.monotonic() - faulted:.2f} s after the fault")
        wait_for(
            lambda: app.acked_by(new) >= ACKS_AFTER_FAULT, FAILOVER_S, f"acks by new master {new}"
        )
        during(old, new)
        heal(old)
        final = _master(cluster)
        wait_for(lambda: app.acked_by(final) >= 5, FAILOVER_S, f"acks by {final} after healing")
    finally:
        app.stop.set()
        app.join(60)
    assert app.error is None, repr(app.error)
    stored = _stored_at(cluster, _master(cluster))
    wrong = {
        sequence: (receipt.offset, stored.get(receipt.offset))
        for sequence, receipt in app.acked.items()
        if stored.get(receipt.offset) != (publisher_id, sequence)
    }
    assert app.acked, "nothing was acknowledged"
    assert not wrong, f"acknowledged, not at the receipt's offset: {list(wrong.items())[:10]}"


def _pid(cluster: LocalCluster, kind: str, node: str) -> int:
    return cluster.services[(kind, node)].process.pid


def _coordinator_log_says(cluster: LocalCluster, node: str, text: str) -> bool:
    return text in cluster.log("coordinator", node)


def test_kill_of_the_masters_replica_alone_fails_over_and_the_node_rejoins(
    cluster: LocalCluster,
) -> None:
    def during(old: str, new: str) -> None:
        row = _row(_status(cluster), old)
        assert "REPLICA UNREACHABLE" in row and "replica unreachable since" in row, row
        assert _coordinator_log_says(cluster, old, "replica has not answered for")

    def heal(old: str) -> None:
        cluster.start("replica", old)
        wait_for(
            lambda: _coordinator_log_says(cluster, old, "replica answers again"),
            FAILOVER_S,
            f"{old}'s coordinator notices its replica is back",
        )

    _across(cluster, "replica-kill", lambda old: cluster.kill("replica", old), during, heal)


def test_pause_of_the_masters_replica_alone_fails_over(cluster: LocalCluster) -> None:
    def during(old: str, new: str) -> None:
        row = _row(_status(cluster), old)
        assert "replica unreachable since" in row, row

    def heal(old: str) -> None:
        os.kill(_pid(cluster, "replica", old), signal.SIGCONT)

    _across(
        cluster,
        "replica-pause",
        lambda old: os.kill(_pid(cluster, "replica", old), signal.SIGSTOP),
        during,
        heal,
    )


def test_kill_of_the_masters_coordinator_alone_fails_over(cluster: LocalCluster) -> None:
    def during(old: str, new: str) -> None:
        row = _row(_status(cluster), old)
        assert "COORDINATOR UNREACHABLE" in row and "coordinator: UNAVAILABLE" in row, row

    _across(
        cluster,
        "coordinator-kill",
        lambda old: cluster.kill("coordinator", old),
        during,
        lambda old: cluster.start("coordinator", old),
    )


def test_pause_of_the_masters_coordinator_alone_fails_over(cluster: LocalCluster) -> None:
    def during(old: str, new: str) -> None:
        row = _row(_status(cluster), old)
        assert "COORDINATOR UNREACHABLE" in row and "coordinator: DEADLINE_EXCEEDED" in row, row

    def heal(old: str) -> None:
        os.kill(_pid(cluster, "coordinator", old), signal.SIGCONT)

    _across(
        cluster,
        "coordinator-pause",
        lambda old: os.kill(_pid(cluster, "coordinator", old), signal.SIGSTOP),
        during,
        heal,
    )


def test_kill_of_the_whole_master_node_and_its_restart_taking_the_lead_back(
    cluster: LocalCluster,
) -> None:
    top = cluster.config.nodes[0].id  # n1 ranks highest

    def during(old: str, new: str) -> None:
        row = _row(_status(cluster), old)
        assert "unreachable" in row and "coordinator: UNAVAILABLE" in row, row

    def heal(old: str) -> None:
        cluster.start_node(old)

    _across(cluster, "node-kill", cluster.kill_node, during, heal)
    deadline = time.monotonic() + FAILOVER_S
    while _master(cluster) != top and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _master(cluster) == top, "the restarted highest-ranked node did not take the lead back"
