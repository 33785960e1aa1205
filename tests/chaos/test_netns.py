"""The chaos run's network (chaos/netns.py): namespaces that reach each other and the host,
partitions that cut exactly the links asked for, and a teardown that leaves nothing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from chaos.netns import Topology, can_create, ip
from tests.requirements import netns_missing

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))

PORT = 7999
# Listens on PORT in its namespace until killed; prints "ready" once it does.
LISTENER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT})); s.listen(16); print('ready', flush=True)\n"
    "while True: s.accept()[0].close()\n"
)
CONNECT = (
    "import socket,sys\n"
    "try:\n"
    f"    socket.create_connection((sys.argv[1], {PORT}), timeout=1).close(); print('ok')\n"
    "except OSError as e:\n"
    "    print('fail', e)\n"
)


@pytest.fixture
def topology() -> Iterator[Topology]:
    topo = Topology.plan(["n1", "n2", "n3"])
    topo.create()
    listeners: list[subprocess.Popen[str]] = []
    try:
        for node_id in topo.node_ids:
            listener = subprocess.Popen(
                [*topo.exec_prefix(node_id), sys.executable, "-c", LISTENER],
                stdout=subprocess.PIPE,
                text=True,
            )
            listeners.append(listener)
            assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        yield topo
    finally:
        for listener in listeners:
            listener.kill()
            listener.wait(10)
        topo.teardown()


def reaches(topo: Topology, source: str | None, address: str) -> bool:
    """Whether a TCP connection from source's namespace (None: the root) to address works."""
    prefix = topo.exec_prefix(source) if source is not None else []
    result = subprocess.run(
        [*prefix, sys.executable, "-c", CONNECT, address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout.startswith("ok")


def test_can_create_as_root() -> None:
    assert can_create() == (True, "")


def test_nodes_reach_each_other_and_the_host_reaches_every_node(topology: Topology) -> None:
    for source in topology.node_ids:
        for target in topology.node_ids:
            for address in topology.addresses(target):
                assert reaches(topology, source, address), (source, target, address)
    for target in topology.node_ids:
        for address in topology.addresses(target):
            assert reaches(topology, None, address)


def test_every_node_reaches_the_host_address(topology: Topology) -> None:
    """Push subscribers listen on the host address: the master must reach it."""
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTENER.replace("0.0.0.0", topology.host_address)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        for node_id in topology.node_ids:
            assert reaches(topology, node_id, topology.host_address), node_id
        topology.partition([["n1"], ["n2", "n3"]])
        assert reaches(topology, "n1", topology.host_address)
    finally:
        listener.kill()
        listener.wait(10)


def test_a_partition_cuts_only_the_links_between_the_sides_and_heal_restores_them(
    topology: Topology,
) -> None:
    topology.partition([["n1"], ["n2", "n3"]])
    for process in ("coordinator", "replica"):
        assert not reaches(topology, "n1", topology.address("n2", process))
        assert not reaches(topology, "n2", topology.address("n1", process))
        assert not reaches(topology, "n3", topology.address("n1", process))
        assert reaches(topology, "n2", topology.address("n3", process))
    # The gateways' side (the root namespace) still reaches every node.
    assert reaches(topology, None, topology.address("n1"))
    topology.heal()
    assert not topology.partitioned
    assert reaches(topology, "n1", topology.address("n2"))
    assert reaches(topology, "n3", topology.address("n1"))


def test_a_process_partition_cuts_that_process_links_alone_and_heal_restores_them(
    topology: Topology,
) -> None:
    """A node's replica cut off alone: no replica link to or from it, while its
    coordinator keeps every link; then its coordinator alone, the other way round. A
    connection leaves from its process's address (else the coordinator's cut would take
    the replica links with it: the answers would go to a blackholed address)."""
    replica, coordinator = "replica", "coordinator"
    topology.partition_process("n1", replica)
    assert not reaches(topology, "n1", topology.address("n2", replica))
    assert not reaches(topology, "n2", topology.address("n1", replica))
    assert not reaches(topology, "n3", topology.address("n1", replica))
    assert reaches(topology, "n2", topology.address("n3", replica))
    assert reaches(topology, "n1", topology.address("n2", coordinator))
    assert reaches(topology, "n3", topology.address("n1", coordinator))
    assert reaches(topology, None, topology.address("n1", replica))
    topology.heal()
    topology.partition_process("n1", coordinator)
    assert not reaches(topology, "n1", topology.address("n3", coordinator))
    assert not reaches(topology, "n2", topology.address("n1", coordinator))
    assert reaches(topology, "n1", topology.address("n2", replica))
    assert reaches(topology, "n3", topology.address("n1", replica))
    assert reaches(topology, None, topology.address("n1", coordinator))
    topology.heal()
    assert reaches(topology, "n2", topology.address("n1", coordinator))
    assert reaches(topology, "n1", topology.address("n2", replica))


def test_two_topologies_get_different_names_and_subnets_and_teardown_leaves_nothing() -> None:
    first = Topology.plan(["n1", "n2"])
    first.create()
    try:
        second = Topology.plan(["n1", "n2"])
        assert second.tag != first.tag and not second.subnet.overlaps(first.subnet)
    finally:
        assert first.teardown() == []
    namespaces = ip("netns", "list").stdout
    assert first.netns("n1") not in namespaces and first.netns("n2") not in namespaces
    assert ip("link", "show", first.bridge, check=False).returncode != 0
    assert ip("link", "show", first.veth("n1"), check=False).returncode != 0
    assert first.teardown() == []  # twice is fine


def test_a_failed_create_tears_down_what_it_made() -> None:
    topo = Topology.plan(["n1", "n2"])
    ip("netns", "add", topo.netns("n2"))  # in the way: creating n2's namespace fails
    try:
        with pytest.raises(Exception, match="netns add"):
            topo.create()
        assert ip("link", "show", topo.bridge, check=False).returncode != 0
        assert topo.netns("n1") not in ip("netns", "list").stdout
    finally:
        ip("netns", "del", topo.netns("n2"), check=False)
