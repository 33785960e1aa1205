"""The master's hand-offs per lone publish (issue 16 item 2), over shipped ReplicaNodes.

* A lone submitter's write (nothing else of its caller's in flight, no write waiting for
  its commit) is begun in its turn, not on the writer task's next turn (``Writer.submit``);
  other writes queue and group into one commit batch; what must wait (the flush under
  ``SYNC``) runs in a task of its own that a submitter giving up does not stop, holding
  the commit lock until done.
* A granted batch reaches an idle stream's ``write`` in the turn it was granted
  (``master_driver._Sender``); a stream never has two writes in flight, and what queued
  behind a write goes out in order.

Three nodes run over the simulated replica transport (``tests/sim/replica_transport.py``,
in-memory stores); a recording transport wraps it (the same interface) to see when each
batch is handed to its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.master_parts import bench_config, role_command
from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.replica import commands
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store
from tests.sim.replica_transport import SimReplicaNetwork, SimReplicate, SimReplicaTransport

WAIT_S = 30.0  # generous: the machine is shared
NODES = ("n1", "n2", "n3")


def _publish(sequence: int, publisher: str = "p") -> broker_pb2.PublishRequest:
    return broker_pb2.PublishRequest(
        topic="t",
        publisher_id=publisher,
        events=[common_pb2.EventData(payload=b"x", sequence=sequence)],
    )


async def _until(what: str, check: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


class _CountingStore(Store):
    """An in-memory store counting its appends (one per commit batch) and flushes."""

    appends = 0
    syncs = 0

    def append(self, *args: Any, **kwargs: Any) -> Any:
        self.appends += 1
        return super().append(*args, **kwargs)

    def sync(self) -> None:
        self.syncs += 1
        super().sync()


class _RecordingCall:
    """A replication stream that records each message as its write begins (as gRPC
    takes a message when its write starts) and then waits a loop turn for the write's
    completion, as gRPC's does; it fails the test if two writes are in flight at once."""

    def __init__(self, call: SimReplicate, log: list[tuple[str, int]], dst: str) -> None:
        self._call = call
        self._log = log
        self._dst = dst
        self._writing = False

    async def write(self, request: replica_pb2.ReplicateRequest) -> None:
        assert not self._writing, "two writes in flight on one stream"
        self._writing = True
        try:
            for entry in request.entries.entries:
                self._log.append((self._dst, entry.lsn))
            await self._call.write(request)
            await asyncio.sleep(0)
        finally:
            self._writing = False

    async def read(self) -> replica_pb2.ReplicateResponse | None:
        return await self._call.read()

    def cancel(self) -> None:
        self._call.cancel()


class _RecordingTransport(SimReplicaTransport):
    def __init__(self, network: SimReplicaNetwork, node_id: str, log: list[tuple[str, int]]):
        super().__init__(network, node_id)
        self._log = log

    def replicate(self, node_id: str) -> Any:
        return _RecordingCall(super().replicate(node_id), self._log, node_id)


async def _cluster(
    tmp_path: Path,
    node_ids: tuple[str, ...],
    scenario: Callable[
        [dict[str, ReplicaNode], _CountingStore, list[tuple[str, int]]], Awaitable[None]
    ],
    *,
    master_sync: str = "WRITE_NO_SYNC",
) -> None:
    """Runs scenario over node_ids (the first master, topic "t" created), its master's
    store counting, the master's stream writes recorded as (slave, LSN)."""
    config = bench_config(tmp_path, node_ids, master_sync=master_sync)
    network = SimReplicaNetwork()
    sent: list[tuple[str, int]] = []
    store = _CountingStore.open_memory()
    assert isinstance(store, _CountingStore)
    nodes: dict[str, ReplicaNode] = {}
    for node_id in node_ids:
        nodes[node_id] = build_replica_node(
            config,
            config.node(node_id),
            store if node_id == node_ids[0] else Store.open_memory(),
            transport=(lambda n=node_id: _RecordingTransport(network, n, sent)),
        )
        network.add(nodes[node_id])
        await nodes[node_id].start()
    master = nodes[node_ids[0]]
    try:
        for node_id in node_ids[1:]:
            await nodes[node_id].apply_role(role_command(common_pb2.ROLE_SLAVE, node_ids))
        await master.apply_role(role_command(common_pb2.ROLE_MASTER, node_ids))
        await _until("master", lambda: master.role == common_pb2.ROLE_MASTER)
        await asyncio.wait_for(
            master.write(commands.CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED)), WAIT_S
        )
        await _until(
            "the topic on every node",
            lambda: all(n.last_lsn == master.last_lsn for n in nodes.values()),
        )
        await scenario(nodes, store, sent)
    finally:
        for node in nodes.values():
            await node.stop()


def test_a_publish_to_an_idle_master_is_stored_and_sent_in_the_callers_turn(
    tmp_path: Path,
) -> None:
    """No loop turn between a lone publish's arrival and its batch on both slaves'
    streams: begun by the caller (not on the writer task's next turn), handed to each
    idle stream's write at once (not by a pump task's next turn)."""

    async def scenario(
        nodes: dict[str, ReplicaNode], store: _CountingStore, sent: list[tuple[str, int]]
    ) -> None:
        master = nodes["n1"]
        for sequence in range(1, 4):
            lsn = master.last_lsn + 1
            sent.clear()
            planned = master.begin_publish(_publish(sequence), alone=True)
            # Nothing awaited since: the caller's own turn.
            assert master.last_lsn == lsn
            assert sorted(sent) == [("n2", lsn), ("n3", lsn)]
            plan = await asyncio.wait_for(planned, WAIT_S)
            assert plan.receipt is not None and plan.receipt.first_offset == sequence - 1
        # A submitter that is not alone (a stream with other requests unanswered) queues
        # for the writer task, so its writes group as they did.
        lsn = master.last_lsn
        queued = master.begin_publish(_publish(4))
        assert master.last_lsn == lsn
        plan = await asyncio.wait_for(queued, WAIT_S)
        assert master.last_lsn == lsn + 1 and plan.receipt is not None

    asyncio.run(_cluster(tmp_path, NODES, scenario))


def test_publishes_begun_in_one_turn_after_the_first_share_a_commit_batch(
    tmp_path: Path,
) -> None:
    """Group commit stays: the first of lone writes submitted together is begun at once;
    the others find a write waiting for its commit, wait for the writer task and go as
    one commit batch (one store append)."""

    async def scenario(
        nodes: dict[str, ReplicaNode], store: _CountingStore, sent: list[tuple[str, int]]
    ) -> None:
        master = nodes["n1"]
        appends, lsn = store.appends, master.last_lsn
        futures = [master.begin_publish(_publish(1, f"p{k}"), alone=True) for k in range(4)]
        assert (store.appends, master.last_lsn) == (appends + 1, lsn + 1)
        plans = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
        assert (store.appends, master.last_lsn) == (appends + 2, lsn + 4)
        assert sorted(p.receipt.first_offset for p in plans if p.receipt is not None) == [
            0,
            1,
            2,
            3,
        ]
        # Batches left in LSN order on each stream, never two writes at once.
        for slave in ("n2", "n3"):
            lsns = [got for node_id, got in sent if node_id == slave]
            assert lsns == sorted(lsns) and set(lsns) >= set(range(lsn + 1, lsn + 5))

    asyncio.run(_cluster(tmp_path, NODES, scenario))


def test_a_caller_giving_up_after_its_write_began_does_not_stop_the_write(
    tmp_path: Path,
) -> None:
    """Under SYNC the flush of a write begun at once runs in a task of its own: the
    caller's cancelling does not stop it; the entry is flushed and committed, the commit
    lock freed. A write queued behind a held commit lock and given up before it began is
    not written."""

    async def scenario(
        nodes: dict[str, ReplicaNode], store: _CountingStore, sent: list[tuple[str, int]]
    ) -> None:
        master = nodes["n1"]
        lsn, syncs = master.last_lsn, store.syncs
        planned = master.begin_publish(_publish(1), alone=True)
        assert master.last_lsn == lsn + 1  # begun: appended, flush pending
        assert master.commit_lock.locked()
        planned.cancel()
        await _until("the flush", lambda: store.syncs > syncs)
        await _until("the commit", lambda: master.commit_lsn >= lsn + 1)
        await _until("the lock freed", lambda: not master.commit_lock.locked())

        await master.commit_lock.acquire()
        try:
            queued = master.begin_publish(_publish(2), alone=True)
            assert master.last_lsn == lsn + 1  # not begun: the lock is held
            queued.cancel()
        finally:
            master.commit_lock.release()
        await master.writer.drain()
        after = master.begin_publish(_publish(2), alone=True)
        plan = await asyncio.wait_for(after, WAIT_S)
        # Sequence 2 was never written before: it lands right after sequence 1.
        assert master.last_lsn == lsn + 2
        assert plan.receipt is not None and plan.receipt.first_offset == 1

    asyncio.run(_cluster(tmp_path, NODES, scenario, master_sync="SYNC"))


def test_the_writer_lets_the_loop_run_between_commit_batches(tmp_path: Path) -> None:
    """A queue longer than one commit batch (pipelined publishers) is written batch by
    batch with the event loop free in between: the replica answers its coordinator, reads
    acks and requests meanwhile, instead of holding the loop for the whole queue (under
    load that was long enough for the coordinator to take a healthy node out)."""

    async def scenario(
        nodes: dict[str, ReplicaNode], store: _CountingStore, sent: list[tuple[str, int]]
    ) -> None:
        master = nodes["n1"]
        per_batch = master.config.limits.commit_batch_max_entries
        appends = store.appends
        seen: list[int] = []

        async def watch() -> None:
            while store.appends < appends + 3:
                seen.append(store.appends - appends)
                await asyncio.sleep(0)

        watching = asyncio.create_task(watch())
        await asyncio.sleep(0)
        futures = [master.begin_publish(_publish(1, f"p{k}")) for k in range(2 * per_batch + 10)]
        await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
        await asyncio.wait_for(watching, WAIT_S)
        assert store.appends == appends + 3
        # The watch ran after the first batch and after the second.
        assert 1 in seen and 2 in seen, seen

    asyncio.run(_cluster(tmp_path, NODES, scenario))
