"""Joined entries on real processes, across a node that is away.

The master stores a joined request's parts (a client's concurrent publishers) as one log
entry only while every node of the node set has said, on its stream in this epoch, that it
reads such entries (``ReplicationPosition.reads_joined_publishes``, docs/replication.md,
*Joined publishes*): a node that is away may be of an older release when it comes back.
An app sees which from its receipts: the parts of one joined entry share its LSN.

Sixteen publishers of one client publish one event at a time, throughout: with every node
up their parts share entries; n3 is killed (both processes, or its replica alone) and the
leadership moves to n2
(a new epoch, in which n3 has said nothing), and from then until n3 is started again no
two receipts of that epoch share an LSN; once n3 is back and streaming, parts share
entries again. Every acknowledged event is stored once on every replica, n3 included, at
the offset its receipt names.
"""

from __future__ import annotations

import collections
import threading

import pytest

import squall
from squall.v1 import common_pb2, coordinator_pb2
from tests.integration.conftest import LocalCluster, run_squall, stored_events, wait_for
from tests.integration.test_gateway import trio  # noqa: F401  (the fixture)

PUBLISHERS = 16
TOPIC = "orders"
_NOT_UP = coordinator_pb2.CoordinatorStatus()  # a node that does not answer yet


class _Load:
    """PUBLISHERS threads, each with a publisher of its own on one client, publishing one
    event at a time until stopped; every receipt kept with its payload, in arrival order."""

    def __init__(self, client: squall.Client) -> None:
        self._client = client
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: list[tuple[bytes, squall.Receipt]] = []
        self.failed: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(f"app-{i}",), daemon=True)
            for i in range(PUBLISHERS)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, publisher_id: str) -> None:
        publisher = self._client.topic(TOPIC).publisher(publisher_id)
        try:
            for n in range(100_000):  # bounded; the test stops it much earlier
                if self.stop.is_set():
                    return
                payload = f"{publisher_id}:{n}".encode()
                try:
                    receipt = publisher.publish(payload)
                except squall.SquallError as exc:
                    with self.lock:
                        self.failed.append(exc)
                    continue
                with self.lock:
                    self.acked.append((payload, receipt))
        finally:
            publisher.close()

    def receipts(self) -> list[squall.Receipt]:
        with self.lock:
            return [receipt for _, receipt in self.acked]


def _shared(receipts: list[squall.Receipt], epoch: int) -> int:
    """How many of epoch's LSNs name more than one receipt: joined entries seen."""
    lsns = collections.Counter(r.lsn for r in receipts if r.epoch == epoch and not r.duplicate)
    return sum(count > 1 for count in lsns.values())


def _in_epoch(receipts: list[squall.Receipt], epoch: int) -> int:
    return sum(r.epoch == epoch for r in receipts)


@pytest.mark.parametrize("killed", ["node", "replica"])
def test_parts_share_an_entry_only_while_every_node_has_said_it_reads_them(
    trio: LocalCluster,  # noqa: F811
    killed: str,
) -> None:
    # The node's replica is what streams and says it reads joined entries: killed alone
    # (its coordinator then leaves the group) it holds joining off as the whole node does.
    wait_for(lambda: trio.wait_for_master() == "n1", 30, "n1, the first in rank, leads")
    first_epoch = trio.statuses()["n1"].epoch
    config = str(trio.config_path)
    with squall.connect(trio.gateway_address, timeout_s=10.0) as client:
        client.create_topic(TOPIC)
        load = _Load(client)
        load.start()
        try:
            wait_for(
                lambda: _shared(load.receipts(), first_epoch) > 0,
                30,
                "parts sharing an entry with every node up",
            )
            if killed == "node":
                trio.kill_node("n3")
            else:
                trio.kill("replica", "n3")
            wait_for(lambda: "n3" not in trio.statuses()["n1"].group, 20, "n1 drops n3")
            moved = run_squall(
                "cluster", "transfer", "--to", "n2", "--reason", "test", "--config", config
            )
            assert moved.returncode == 0, moved.stderr + moved.stdout
            epoch = trio.statuses()["n2"].epoch
            assert epoch > first_epoch
            wait_for(
                lambda: _in_epoch(load.receipts(), epoch) >= 300,
                30,
                "300 publishes acknowledged in n2's epoch while n3 is away",
            )
            away = load.receipts()
            if killed == "node":
                trio.start_node("n3")
            else:
                trio.start("replica", "n3")
            # Back in a normal group: n2's, or a merged one under a newer epoch.
            wait_for(
                lambda: trio.statuses().get("n3", _NOT_UP).state == common_pb2.NODE_STATE_NORMAL,
                30,
                "n3 back in a normal group",
            )
            # n3's return may merge the groups into a newer epoch: any epoch from n2's on.
            wait_for(
                lambda: any(
                    _shared(load.receipts(), e)
                    for e in {r.epoch for r in load.receipts()}
                    if e >= epoch
                ),
                30,
                "parts sharing an entry again once n3 is back and reads them",
            )
        finally:
            load.join()
    assert not load.failed, [repr(e) for e in load.failed[:5]]
    # Not one joined entry in the epoch while n3, which had not spoken in it, was away.
    assert _shared(away, epoch) == 0, collections.Counter(r.lsn for r in away if r.epoch == epoch)
    for node in ("n1", "n2", "n3"):

        def holds_all(node: str = node) -> bool:
            return len(stored_events(trio, node, TOPIC)) >= len(load.acked)

        wait_for(holds_all, 30, f"{node} holds every acknowledged event")
        events = stored_events(trio, node, TOPIC)
        payloads = [event.payload for event in events]
        assert len(set(payloads)) == len(payloads), f"an event stored twice on {node}"
        for payload, receipt in load.acked:
            assert events[receipt.offset].payload == payload, (node, receipt)
