"""A new master's reorganization sync outlives the SetRole call, in one process.

Real ReplicaNodes over in-memory stores; the sync source serves FetchLog over gRPC on a
free loopback port and waits before each snapshot chunk (``snapshot_chunk_delay_ms``),
so the sync takes several SetRole answers. What a coordinator sees: SetRole answers at
once with the progress and role INACTIVE; the same command repeated joins the sync;
another command cancels it; a failed sync is reported once and the next repetition tries
again; writes are refused as UNAVAILABLE until the role is taken. Also: a replica started
over a store with entries above its recorded commit LSN hides them from reads (a topic
hidden from offset 0 too).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from deploy.processes import free_ports
from squall.v1 import broker_pb2, common_pb2, replica_pb2, replica_pb2_grpc
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.common.errors import Code, ServiceError
from squall_server.common.grpc_server import ServiceServer
from squall_server.replica import replication_server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.server import Subscriber
from squall_server.replica.store import Store, make_entry

_DELAY_MS = 150
_BOUND_S = 30.0


def _config(tmp_path: Path) -> ClusterConfig:
    ports = iter(free_ports(7))  # together: ports picked one by one may repeat
    nodes = "".join(
        f"""
[[nodes]]
id = "n{i}"
priority = {4 - i}
coordinator_address = "127.0.0.1:{next(ports)}"
replica_address = "127.0.0.1:{next(ports)}"
data_dir = "data/n{i}"
"""
        for i in (1, 2, 3)
    )
    text = f"""
[cluster]
name = "t"
{nodes}
[[gateways]]
id = "g1"
address = "127.0.0.1:{next(ports)}"

[timeouts]
rpc_timeout_ms = 1000
snapshot_chunk_delay_ms = {_DELAY_MS}

[limits]
# Snapshot chunks are at most half a message: 32 KiB here, so the snapshot has several.
max_message_bytes = 65536
max_batch_bytes = 32768
max_event_bytes = 4096
replication_inflight_bytes_max = 32768
push_batch_max_bytes = 32768
log_retention_entries = 16
commit_batch_max_entries = 8
"""
    return parse_config(text, tmp_path / "cluster.toml")


def _op(**fields: object) -> replica_pb2.Operation:
    return replica_pb2.Operation(**fields)  # type: ignore[arg-type]


def _publish(
    lsn: int, offset: int, count: int, size: int = 1000, epoch: int = 1
) -> replica_pb2.LogEntry:
    events = [common_pb2.EventData(payload=bytes([65 + i % 26]) * size) for i in range(count)]
    op = _op(publish=replica_pb2.PublishOp(topic="t", first_offset=offset, events=events))
    return make_entry(lsn, epoch, op)


def _source_store(*, epoch: int = 1, commit_lsn: int = 42) -> Store:
    """A topic and 200 KB of events in 40 entries (LSNs 3..42) of one epoch, the log
    compacted to LSN 30: a new master with an empty log needs a snapshot."""
    store = Store.open_memory()
    start = _op(epoch_start=replica_pb2.EpochStartOp(epoch=epoch, master_id="n2"))
    create = _op(create_topic=replica_pb2.CreateTopicOp(name="t"))
    entries = [make_entry(1, epoch, start), make_entry(2, epoch, create)]
    entries += [_publish(3 + i, 5 * i, 5, epoch=epoch) for i in range(40)]
    store.append(entries, sync=False, commit_lsn=commit_lsn)
    store.set_cluster_id("cluster-1")
    store.set_epoch(epoch)
    store.compact_log(30)
    return store


def _command(
    role: int,
    epoch: int,
    seq: int,
    *,
    master: str = "",
    source: str = "",
    others: tuple[str, ...] = (),
) -> replica_pb2.RoleCommand:
    command = replica_pb2.RoleCommand(
        role=role, epoch=epoch, sync_source_id=source, seq=seq, reason="test"
    )
    if master:
        command.master.node_id = master
        for member in (master, *others):
            command.members.add(node_id=member)
    return command


async def _serve(config: ClusterConfig, node: ReplicaNode) -> ServiceServer:
    server = ServiceServer(
        node.node.replica_address,
        [replica_pb2.DESCRIPTOR.services_by_name["Replication"].full_name],
        config.limits.max_message_bytes,
    )
    replica_pb2_grpc.add_ReplicationServicer_to_server(
        replication_server.Replication(node), server.server
    )
    await server.start()
    return server


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + _BOUND_S
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {_BOUND_S}s: {what}")
        await asyncio.sleep(0.02)


def _run(test: Callable[[ClusterConfig], Awaitable[None]], tmp_path: Path) -> None:
    asyncio.run(test(_config(tmp_path)))


def test_a_long_sync_is_answered_at_once_joined_by_repeats_and_completes(tmp_path: Path) -> None:
    async def test(config: ClusterConfig) -> None:
        source = build_replica_node(config, config.node("n2"), _source_store())
        await source.start()
        server = await _serve(config, source)
        node = build_replica_node(config, config.node("n1"), Store.open_memory())
        await node.start()
        try:
            take = _command(common_pb2.ROLE_MASTER, 2, 1, master="n1", source="n2")
            await node.apply_role(take)
            first = node.reorganization_progress()
            assert first is not None, "the sync was expected to outlast the first answer"
            assert node.role == common_pb2.ROLE_INACTIVE
            assert (first.epoch, first.sync_source_id, first.attempt) == (2, "n2", 1)
            with pytest.raises(ServiceError, match=r"not master yet: .* from sync source n2"):
                node.check_writable()
            answers = 1

            async def taken() -> bool:
                nonlocal answers
                await node.apply_role(take)  # the coordinator's renewal: joins the sync
                answers += 1
                progress = node.reorganization_progress()
                assert progress is None or progress.attempt == 1
                # Taken: the master role held and the task done (the role is held from
                # just before the epoch-start entry is appended; its answer comes after).
                return (
                    node.role == common_pb2.ROLE_MASTER and node.reorganization_progress() is None
                )

            await _until(taken, "n1 took the master role")
            assert answers > 2
            meta = node.store.meta()
            assert (meta.last_lsn, meta.cluster_id, node.log_start_lsn) == (43, "cluster-1", 43)
            assert node.store.read_events("t", 0, 1000) == source.store.read_events("t", 0, 1000)
            # The snapshot's state was committed at the source: all of it is served.
            assert node.visible_end("t") is None
        finally:
            await node.stop()
            await server.stop()
            await source.stop()

    _run(test, tmp_path)


def test_another_command_cancels_the_sync_and_a_failed_sync_is_reported_once(
    tmp_path: Path,
) -> None:
    async def test(config: ClusterConfig) -> None:
        source = build_replica_node(config, config.node("n2"), _source_store())
        await source.start()
        server = await _serve(config, source)
        node = build_replica_node(config, config.node("n1"), Store.open_memory())
        await node.start()
        try:
            await node.apply_role(_command(common_pb2.ROLE_MASTER, 2, 1, master="n1", source="n2"))
            assert node.reorganization_progress() is not None
            await node.apply_role(_command(common_pb2.ROLE_INACTIVE, 0, 2))
            assert node.reorganization_progress() is None
            assert node.role == common_pb2.ROLE_INACTIVE
            assert node.command_seq == 2
            # The deactivated epoch is not taken again; a new one is.
            with pytest.raises(ServiceError, match="takes a new role only in an epoch above 2"):
                await node.apply_role(
                    _command(common_pb2.ROLE_MASTER, 2, 3, master="n1", source="n2")
                )
            # n3 serves nothing: the fetch fails, and the error reaches the coordinator
            # once (within this answer or the next); the next repetition tries again.
            unreachable = _command(common_pb2.ROLE_MASTER, 3, 4, master="n1", source="n3")
            errors: list[ServiceError] = []

            async def failed() -> bool:
                try:
                    await node.apply_role(unreachable)
                except ServiceError as exc:
                    errors.append(exc)
                return bool(errors)

            await _until(failed, "the failed sync was reported")
            assert errors[0].code == Code.UNAVAILABLE
            assert "sync source n3" in errors[0].message
            errors.clear()
            await _until(failed, "the repeated command tried again and failed again")
            assert "sync source n3" in errors[0].message
            assert node.role == common_pb2.ROLE_INACTIVE
            # A new command (another source) cancels that and completes.
            take = _command(common_pb2.ROLE_MASTER, 4, 5, master="n1", source="n2")

            async def taken() -> bool:
                await node.apply_role(take)
                # Taken: the master role held and the task done (the role is held from
                # just before the epoch-start entry is appended; its answer comes after).
                return (
                    node.role == common_pb2.ROLE_MASTER and node.reorganization_progress() is None
                )

            await _until(taken, "n1 took the master role of epoch 4")
            assert (node.epoch, node.store.meta().last_lsn) == (4, 43)
        finally:
            await node.stop()
            await server.stop()
            await source.stop()

    _run(test, tmp_path)


def test_a_started_replica_hides_what_it_never_knew_committed(tmp_path: Path) -> None:
    async def test(config: ClusterConfig) -> None:
        store = _source_store()  # LSNs 1..42, commit recorded at 42
        store.append([_publish(43, 200, 5), _publish(44, 205, 5)], sync=False, commit_lsn=42)
        node = build_replica_node(config, config.node("n2"), store)
        await node.start()
        try:
            assert (node.commit_lsn, node.visible_end("t")) == (42, 200)
        finally:
            await node.stop()
        # The same store after a snapshot install that held uncommitted publishes.
        target = Store.open_memory()
        with_list = node.store.snapshot_chunks()
        chunks = list(with_list)
        target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
        for chunk in chunks:
            target.install_chunk(chunk)
        target.finish_snapshot(chunks[-1].history, commit_lsn=42, uncommitted=[("t", 200, 44)])
        node = build_replica_node(config, config.node("n3"), target)
        await node.start()
        try:
            assert (node.commit_lsn, node.visible_end("t")) == (42, 200)
            assert node.store.read_events("t", 195, 20)[-1].offset == 209  # stored, hidden
        finally:
            await node.stop()

    _run(test, tmp_path)


def test_a_topic_hidden_from_its_first_offset_serves_nothing(tmp_path: Path) -> None:
    """A new topic whose first publish is not known committed is hidden from offset 0: a
    committed read serves nothing of it (0 must not read as "nothing hidden")."""

    async def test(config: ClusterConfig) -> None:
        store = _source_store()  # LSNs 1..42, commit recorded at 42
        create = _op(create_topic=replica_pb2.CreateTopicOp(name="fresh"))
        event = common_pb2.EventData(payload=b"x")
        publish = _op(publish=replica_pb2.PublishOp(topic="fresh", first_offset=0, events=[event]))
        entries = [make_entry(43, 1, create), make_entry(44, 1, publish)]
        store.append(entries, sync=False, commit_lsn=43)
        node = build_replica_node(config, config.node("n2"), store)
        await node.start()
        reader = Subscriber(node)

        async def offsets(topic: str, start: int, offset: int = 0) -> list[int]:
            request = broker_pb2.SubscribeRequest(topic=topic, start=start, offset=offset)  # type: ignore[arg-type]
            stream = reader.Subscribe(request, None)  # type: ignore[arg-type]
            return [e.offset async for r in stream for e in r.events]

        try:
            assert (node.visible_end("fresh"), node.visible_end("t")) == (0, None)
            assert await offsets("fresh", broker_pb2.START_POSITION_OFFSET) == []
            assert await offsets("fresh", broker_pb2.START_POSITION_EARLIEST) == []
            assert await offsets("t", broker_pb2.START_POSITION_OFFSET, 198) == [198, 199]
            node.gate.advance(44)
            assert await offsets("fresh", broker_pb2.START_POSITION_EARLIEST) == [0]
        finally:
            await node.stop()

    _run(test, tmp_path)


def test_a_new_master_sharing_no_entry_with_its_source_is_rebuilt_by_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """n1 holds LSNs 1..3 of epoch 1 that nobody else has; its sync source n2 holds epoch
    2 from LSN 1. The logs part before LSN 1, which truncate_after_lsn cannot say: n2
    sends a snapshot. n2 knew only LSNs up to 40 committed, so n1 hides the events of
    LSNs 41 and 42 until its own commit LSN passes them (never here: n3, whose ack a
    commit needs, is not running)."""

    caplog.set_level(logging.INFO, logger="squall.replica")

    async def test(config: ClusterConfig) -> None:
        source = build_replica_node(
            config, config.node("n2"), _source_store(epoch=2, commit_lsn=40)
        )
        await source.start()
        server = await _serve(config, source)
        own = Store.open_memory()
        start = _op(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
        create = _op(create_topic=replica_pb2.CreateTopicOp(name="t"))
        own.append(
            [make_entry(1, 1, start), make_entry(2, 1, create), _publish(3, 0, 2, 10)],
            sync=False,
            commit_lsn=0,
        )
        own.set_cluster_id("cluster-1")
        node = build_replica_node(config, config.node("n1"), own)
        await node.start()
        try:
            take = _command(common_pb2.ROLE_MASTER, 3, 1, master="n1", source="n2", others=("n3",))

            async def taken() -> bool:
                await node.apply_role(take)
                # Taken: the master role held and the task done (the role is held from
                # just before the epoch-start entry is appended; its answer comes after).
                return (
                    node.role == common_pb2.ROLE_MASTER and node.reorganization_progress() is None
                )

            await _until(taken, "n1 took the master role")
            meta = node.store.meta()
            assert [(b.epoch, b.start_lsn) for b in meta.history] == [(2, 1), (3, 43)]
            assert node.store.read_events("t", 0, 1000) == source.store.read_events("t", 0, 1000)
            assert (node.commit_lsn, node.visible_end("t")) == (40, 5 * 38)
            assert "a snapshot (its log shares no entry with this one)" in caplog.text
        finally:
            await node.stop()
            await server.stop()
            await source.stop()

    _run(test, tmp_path)


class _MalformedSource(replica_pb2_grpc.ReplicationServicer):
    """A sync source whose FetchLog answers with the batches it is given, as they are."""

    def __init__(self, batches: list[replica_pb2.EntryBatch]) -> None:
        self.batches = batches
        self.fetches = 0

    async def FetchLog(
        self, request: replica_pb2.FetchLogRequest, context: object
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]:
        self.fetches += 1
        for batch in self.batches:
            yield replica_pb2.FetchLogResponse(entries=batch, cluster_id="cluster-1")


def _topic(lsn: int, epoch: int) -> replica_pb2.LogEntry:
    return make_entry(lsn, epoch, _op(create_topic=replica_pb2.CreateTopicOp(name=f"t{lsn}")))


@pytest.mark.parametrize(
    ("entries", "refused"),
    [
        # LSN 4 is missing.
        ([_topic(3, 1), _topic(5, 1)], r"at LSN 5 \(LSN_GAP\): entry LSN 5 does not follow LSN 3"),
        # Epoch 2, then back to epoch 1.
        (
            [_topic(3, 2), _topic(4, 1)],
            r"at LSN 4 \(OLD_EPOCH\): entry of epoch 1 after an entry of epoch 2",
        ),
        # An entry of an epoch newer than the one being taken.
        ([_topic(3, 9)], r"at LSN 3 \(BAD_ENTRY_EPOCH\): entry of epoch 9"),
    ],
)
def test_a_malformed_fetched_log_is_refused_and_nothing_of_it_stored(
    tmp_path: Path, entries: list[replica_pb2.LogEntry], refused: str
) -> None:
    """The reorganization fetch holds the source's log to a streamed batch's rules: a gap,
    an epoch going backwards or one newer than the epoch taken refuses the master role
    with a status naming the source and the LSN, and the store is as it was."""

    async def test(config: ClusterConfig) -> None:
        source = _MalformedSource([replica_pb2.EntryBatch(entries=entries, commit_lsn=2)])
        server = ServiceServer(
            config.node("n2").replica_address,
            [replica_pb2.DESCRIPTOR.services_by_name["Replication"].full_name],
            config.limits.max_message_bytes,
        )
        replica_pb2_grpc.add_ReplicationServicer_to_server(source, server.server)
        await server.start()
        store = Store.open_memory()
        store.append([_topic(1, 1), _topic(2, 1)], sync=False, commit_lsn=2)
        store.set_cluster_id("cluster-1")
        store.set_epoch(1)
        node = build_replica_node(config, config.node("n1"), store)
        await node.start()
        try:
            take = _command(common_pb2.ROLE_MASTER, 3, 1, master="n1", source="n2")
            errors: list[ServiceError] = []

            async def failed() -> bool:
                try:
                    await node.apply_role(take)
                except ServiceError as exc:
                    errors.append(exc)
                return bool(errors)

            await _until(failed, "the refused fetch was reported")
            assert errors[0].code == Code.FAILED_PRECONDITION
            assert "cannot take the master role in epoch 3: sync source n2" in errors[0].message
            assert re.search(refused, errors[0].message), errors[0].message
            assert source.fetches == 1
            assert node.role == common_pb2.ROLE_INACTIVE
            meta = node.store.meta()
            assert (meta.last_lsn, meta.last_epoch) == (2, 1)
            assert [t.name for t in node.store.list_topics()] == ["t1", "t2"]
            with pytest.raises(ServiceError, match=r"not master yet|no role yet"):
                node.check_writable()
        finally:
            await node.stop()
            await server.stop()

    _run(test, tmp_path)
