"""A master deposed while a joined request is committing, over the simulated replica
transport, with each part stored as an entry of its own and with all of them as one.

A joined request (``PublishRequest.parts``) is begun as one write that waits for its last
part's LSN (``PublishParts``). While every member slave reads ``PublishPartsOp`` (its
Position says ``reads_joined_publishes``), the parts are one entry: they commit, or fail
as indeterminate, together. With a slave of an older release among the members, each
part is an entry of its own and they commit one by one: the parts committed before the
master was deposed keep their receipts, the others fail alone. Three shipped
ReplicaNodes (``tests/sim/replica_transport.py``, in-memory stores), each slave sent one
entry per batch and its acks held on the way back. Every part answered ok must be
readable on the next master at its receipt's offset; every other part is answered with
the indeterminate error a write of its own gets (``MasterDriver._fail``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from deploy.processes import free_ports
from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.common.errors import INLINE_ERRORS, PUBLISH_ERRORS_KEY
from squall_server.replica import commands, server
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.node import ReplicaNode
from tests.sim.replica_transport import SimReplicaNetwork

CLUSTER_ID = "c-sim-parts"
WAIT_S = 30.0  # generous: the machine is shared
PARTS = 12
# Each slave's acks are held this long on the way back: the test cuts the master off
# between two commits (a bound on a wait, never asserted on).
ACK_DELAY_S = 0.05
NODES = ("n1", "n2", "n3")


def _config(tmp_path: Path) -> ClusterConfig:
    # Picked together: ports picked one by one may repeat (a CI run's did).
    ports = iter(free_ports(2 * len(NODES) + 1))
    text = '[cluster]\nname = "t"\n'
    for priority, node_id in enumerate(NODES, 1):
        text += (
            f'\n[[nodes]]\nid = "{node_id}"\npriority = {priority}\n'
            f'coordinator_address = "127.0.0.1:{next(ports)}"\n'
            f'replica_address = "127.0.0.1:{next(ports)}"\ndata_dir = "{node_id}"\n'
        )
    text += f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
    # A slave's window of one byte: one entry per batch, so the parts commit one by one.
    text += "\n[limits]\nreplication_inflight_bytes_max = 1\n"
    return parse_config(text, tmp_path / "cluster.toml")


def _endpoint(node_id: str) -> common_pb2.NodeEndpoint:
    return common_pb2.NodeEndpoint(node_id=node_id)


def _role(
    role: int, epoch: int, master: str, members: list[str], source: str = ""
) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        seq=epoch,
        epoch=epoch,
        role=role,  # type: ignore[arg-type]
        master=_endpoint(master),
        members=[_endpoint(m) for m in members],
        sync_source_id=source,
        lease_ms=60_000,
        cluster_id=CLUSTER_ID,
    )


class _Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((PUBLISH_ERRORS_KEY, INLINE_ERRORS),)

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"the stream was aborted: {code} {details}")


async def _until(what: str, check: Any) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def _answer(node: ReplicaNode, request: broker_pb2.PublishRequest) -> Any:
    async def incoming() -> AsyncIterator[broker_pb2.PublishRequest]:
        yield request

    stream = server.Publisher(node).PublishStream(incoming(), _Context())  # type: ignore[arg-type]
    return [response async for response in stream]


@pytest.fixture
def older_slaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slave answers the Hello as a release that predates ``PublishPartsOp``."""
    hello = ReplicaDriver.hello

    def older(
        self: ReplicaDriver, message: replica_pb2.ReplicationHello
    ) -> tuple[int, replica_pb2.ReplicationPosition]:
        stream, position = hello(self, message)
        position.ClearField("reads_joined_publishes")
        return stream, position

    monkeypatch.setattr(ReplicaDriver, "hello", older)


def _joined(first_sequence: int) -> broker_pb2.PublishRequest:
    """A joined request of PARTS one-event parts, each of a publisher of its own."""
    joined = broker_pb2.PublishRequest(topic="orders", request_id=first_sequence)
    for k in range(PARTS):
        part = joined.parts.add(
            topic="orders",
            publisher_id=f"p{k}",
            session_token=f"p{k}/s1",
            compact_receipts=True,
            request_id=k + 1,
        )
        part.events.add(payload=b"e%d-%d" % (k, first_sequence), sequence=first_sequence)
    return joined


async def _started(tmp_path: Path) -> tuple[SimReplicaNetwork, dict[str, ReplicaNode]]:
    """n1 master of n2 and n3 in epoch 1, with the topic "orders"."""
    config = _config(tmp_path)
    network = SimReplicaNetwork()
    nodes = await network.start_replicas(config, NODES)
    n1, n2, n3 = (nodes[n] for n in NODES)
    for slave in (n2, n3):
        await slave.apply_role(_role(common_pb2.ROLE_SLAVE, 1, "n1", []))
    await n1.apply_role(_role(common_pb2.ROLE_MASTER, 1, "n1", list(NODES), "n1"))
    await _until("n1 master", lambda: n1.role == common_pb2.ROLE_MASTER)
    await asyncio.wait_for(
        n1.write(commands.CreateTopic("orders", common_pb2.TOPIC_KIND_REPLICATED)), WAIT_S
    )
    return network, nodes


async def _depose_n1(network: SimReplicaNetwork, nodes: dict[str, ReplicaNode]) -> None:
    """n1 cut off from its slaves and deposed."""
    network.cut("n1", "n2", both=True)
    network.cut("n1", "n3", both=True)
    await nodes["n1"].apply_role(_role(common_pb2.ROLE_SLAVE, 2, "n2", []))


async def _elect_n2(network: SimReplicaNetwork, nodes: dict[str, ReplicaNode]) -> None:
    """n2 masters n3 in epoch 2, synced from whichever holds more of epoch 1, and commits
    an entry of its own."""
    n2, n3 = nodes["n2"], nodes["n3"]
    network.delay_s = 0.0
    source = "n2" if n2.last_lsn >= n3.last_lsn else "n3"
    await n3.apply_role(_role(common_pb2.ROLE_SLAVE, 2, "n2", []))
    await n2.apply_role(_role(common_pb2.ROLE_MASTER, 2, "n2", ["n2", "n3"], source))
    await _until("n2 master", lambda: n2.role == common_pb2.ROLE_MASTER)
    await asyncio.wait_for(
        n2.write(commands.CreateTopic("after", common_pb2.TOPIC_KIND_REPLICATED)), WAIT_S
    )


def test_a_joined_request_is_one_entry_committed_or_failed_as_a_whole(tmp_path: Path) -> None:
    async def scenario() -> None:
        network, nodes = await _started(tmp_path)
        n1, n2, n3 = (nodes[n] for n in NODES)
        try:
            first_lsn = n1.last_lsn + 1
            (whole,) = await asyncio.wait_for(_answer(n1, _joined(1)), WAIT_S)
            assert n1.last_lsn == first_lsn, "the parts were not stored as one entry"
            await _until("both slaves hold it", lambda: min(n2.last_lsn, n3.last_lsn) >= first_lsn)
            on_slaves = [
                {e.offset: e for e in s.store.read_events("orders", 0, 100)} for s in (n2, n3)
            ]

            lost_lsn = n1.last_lsn + 1
            network.delay_s = ACK_DELAY_S
            answering = asyncio.create_task(_answer(n1, _joined(2)))
            await _until("the second joined entry stored on n1", lambda: n1.last_lsn >= lost_lsn)
            assert n1.commit_lsn < lost_lsn
            await _depose_n1(network, nodes)
            (lost,) = await asyncio.wait_for(answering, WAIT_S)
            await _elect_n2(network, nodes)
            stored = n2.store.read_events("orders", 0, 100)
        finally:
            for node in nodes.values():
                await node.stop()

        assert [a.request_id for a in whole.parts] == list(range(1, PARTS + 1))
        assert all(a.HasField("batch") for a in whole.parts)
        # One entry: every receipt names its LSN, and the offsets follow the parts' order.
        assert {a.batch.lsn for a in whole.parts} == {first_lsn}
        assert [a.batch.first_offset for a in whole.parts] == list(range(PARTS))
        for events in on_slaves:
            for k, answer in enumerate(whole.parts):
                event = events[answer.batch.first_offset]
                assert (event.publisher_id, event.sequence, event.payload) == (
                    f"p{k}",
                    1,
                    b"e%d-1" % k,
                )
        # Deposed before the entry committed: every part is indeterminate, and the next
        # master holds all of its events or none, never some.
        assert [a.request_id for a in lost.parts] == list(range(1, PARTS + 1))
        for answer in lost.parts:
            assert answer.error.code == "UNKNOWN"
            assert f"deposed before LSN {lost_lsn}" in answer.error.message
        second = [e for e in stored if e.sequence == 2]
        assert len(second) in (0, PARTS)
        assert [(e.offset, e.publisher_id, e.payload) for e in second] == [
            (PARTS + k, f"p{k}", b"e%d-2" % k) for k in range(len(second))
        ]

    asyncio.run(scenario())


def test_a_master_deposed_mid_request_answers_committed_parts_and_fails_the_rest(
    tmp_path: Path, older_slaves: None
) -> None:
    async def scenario() -> None:
        network, nodes = await _started(tmp_path)
        n1, n2 = (nodes[n] for n in NODES[:2])
        try:
            first_lsn = n1.last_lsn + 1
            joined = _joined(1)
            network.delay_s = ACK_DELAY_S
            answering = asyncio.create_task(_answer(n1, joined))
            # Some parts committed, not all: n1 is cut off from its slaves and deposed.
            await _until("two parts committed", lambda: n1.commit_lsn >= first_lsn + 1)
            assert n1.commit_lsn < first_lsn + PARTS - 1
            await _depose_n1(network, nodes)
            (response,) = await asyncio.wait_for(answering, WAIT_S)
            await _elect_n2(network, nodes)
            stored = {e.offset: e for e in n2.store.read_events("orders", 0, 100)}
        finally:
            for node in nodes.values():
                await node.stop()

        assert len(response.parts) == PARTS
        ok = [(k, a) for k, a in enumerate(response.parts) if a.HasField("batch")]
        failed = [(k, a) for k, a in enumerate(response.parts) if a.HasField("error")]
        assert len(ok) + len(failed) == PARTS
        # Parts commit in order: the committed ones are a prefix, two at least.
        assert [k for k, _ in ok] == list(range(len(ok))) and len(ok) >= 2
        assert failed, "every part committed: the master was not deposed mid-request"
        for k, answer in ok:
            assert answer.request_id == k + 1 and answer.batch.master_id == "n1"
            assert any(h.node_id != "n1" for h in answer.batch.holders)
            event = stored[answer.batch.first_offset]
            assert (event.publisher_id, event.sequence, event.payload) == (
                f"p{k}",
                1,
                b"e%d-1" % k,
            )
        for k, answer in failed:
            assert answer.request_id == k + 1
            assert answer.error.code == "UNKNOWN"
            assert "deposed before LSN" in answer.error.message
            assert "indeterminate" in answer.error.message

    asyncio.run(scenario())
