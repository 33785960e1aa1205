"""The replica's side of quarantine and leadership transfer, on a one-node ReplicaNode over
the in-memory store twin.

Goals: a store write that fails fail-stops the replica, records a fault (kept beside the
store, so a restart still reports it) and makes the replica refuse every role; the same
fault reported twice is one fault, a different one is new. A master's write fence refuses
writes as "not stored" while it holds, and lifts on cancel, on its deadline and when the
role goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.clock import ManualClock
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import commands, handoff
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.faults import FAULT_FILE_NAME, load_fault
from squall_server.replica.store import Store, StoreError


def _config(tmp_path: Path) -> ClusterConfig:
    text = (
        '[cluster]\nname = "t"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        'coordinator_address = "127.0.0.1:1"\nreplica_address = "127.0.0.1:2"\n'
        'data_dir = "n1"\n\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:3"\n'
    )
    config = parse_config(text, tmp_path / "cluster.toml")
    config.nodes[0].data_dir.mkdir(parents=True, exist_ok=True)
    return config


def _master_command(epoch: int) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        role=common_pb2.ROLE_MASTER,
        epoch=epoch,
        master=common_pb2.NodeEndpoint(node_id="n1"),
        members=[common_pb2.NodeEndpoint(node_id="n1")],
        seq=epoch,
        cluster_id="c-test",  # the coordinator's, as every master role carries one
    )


class _FailingAppend:
    """Wraps a store so that appends fail like a dying disk."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> object:
        if name == "append":

            def fail(*args: object, **kwargs: object) -> None:
                raise StoreError("I/O error writing data.mdb")

            return fail
        return getattr(self._store, name)


def test_a_failed_store_write_fail_stops_records_a_fault_and_refuses_roles(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path)
    data_dir = config.nodes[0].data_dir

    async def run() -> None:
        store = Store.open_memory()
        node = build_replica_node(config, config.nodes[0], store, ManualClock())
        await node.start()
        try:
            await node.apply_role(_master_command(1))
            await node.write(commands.CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
            node.store = _FailingAppend(store)  # type: ignore[assignment]
            with pytest.raises(ServiceError) as error:
                await node.write(commands.CreateTopic("u", common_pb2.TOPIC_KIND_REPLICATED))
            assert error.value.code is Code.UNKNOWN
            assert node.failed_reason and node.fault is not None
            assert "fail-stop" in node.fault.reason and "I/O error" in node.fault.reason
            with pytest.raises(ServiceError) as refused:
                await node.apply_role(_master_command(2))
            assert refused.value.code is Code.FAILED_PRECONDITION
            assert "fail-stopped" in refused.value.message
            first = node.fault
            node.report_fault(first.reason)
            assert node.fault is first  # the same fault again is one fault
            node.report_fault("checksum error serving a read: events/...")
            assert node.fault is not first and node.fault.fault_id != first.fault_id
        finally:
            await node.stop()

    asyncio.run(run())
    recorded = load_fault(data_dir)
    assert recorded is not None and "checksum error" in recorded.reason
    assert (data_dir / FAULT_FILE_NAME).exists()


def test_a_damaged_fault_record_still_counts_as_a_fault(tmp_path: Path) -> None:
    (tmp_path / FAULT_FILE_NAME).write_text("{not json")
    fault = load_fault(tmp_path)
    assert fault is not None and "unreadable" in fault.reason
    assert load_fault(tmp_path / "elsewhere") is None


def test_the_write_fence_refuses_writes_until_cancelled_or_expired(tmp_path: Path) -> None:
    config = _config(tmp_path)

    async def run() -> None:
        clock = ManualClock()
        node = build_replica_node(config, config.nodes[0], Store.open_memory(), clock)
        await node.start()
        try:
            await node.apply_role(_master_command(1))
            with pytest.raises(ServiceError) as not_slave:
                await handoff.prepare(
                    node,
                    replica_pb2.PrepareHandoffRequest(epoch=1, target_node_id="n2", timeout_ms=100),
                )
            assert not_slave.value.code is Code.FAILED_PRECONDITION
            assert "not a slave" in not_slave.value.message
            with pytest.raises(ServiceError) as wrong_epoch:
                await handoff.prepare(
                    node,
                    replica_pb2.PrepareHandoffRequest(epoch=7, target_node_id="n2", timeout_ms=1),
                )
            assert "not the master of epoch 7" in wrong_epoch.value.message
            # The fence itself (set as prepare sets it once the target is known).
            node.core.fence.until_ms, node.core.fence.target, node.core.fence.epoch = (
                clock.monotonic_ms() + 1000,
                "n2",
                1,
            )
            with pytest.raises(ServiceError) as fenced:
                node.check_writable()
            assert fenced.value.code is Code.UNAVAILABLE
            assert "handing the leadership to n2" in fenced.value.message
            await handoff.prepare(
                node, replica_pb2.PrepareHandoffRequest(epoch=1, target_node_id="n2", cancel=True)
            )
            node.check_writable()
            node.core.fence.until_ms, node.core.fence.epoch = clock.monotonic_ms() + 1000, 1
            clock.advance(1001)
            node.check_writable()  # expired: writes resume by themselves
            node.core.fence.until_ms, node.core.fence.epoch = clock.monotonic_ms() + 1000, 1
            await node.roles.deactivate("test")
            assert node.core.fence.until_ms == 0
        finally:
            await node.stop()

    asyncio.run(run())


def test_a_handlers_store_errors_become_statuses_and_a_checksum_error_is_a_fault() -> None:
    """What reaches a servicer from the store: a checksum error is DATA_LOSS and a fault of
    this node (reported once, with the record); a topic gone under a read is NOT_FOUND;
    anything else passes through untouched."""
    from squall_server.replica.server import _translating
    from squall_server.replica.store import CorruptRecordError, UnknownTopicError

    class _Sink:
        faults: list[str] = []

        def report_fault(self, reason: str) -> None:
            self.faults.append(reason)

    sink = _Sink()
    with pytest.raises(ServiceError) as corrupt, _translating(sink):
        raise CorruptRecordError("events", b"k", "crc mismatch")
    assert corrupt.value.code == Code.DATA_LOSS and "crc mismatch" in corrupt.value.message
    assert len(sink.faults) == 1 and "checksum error serving a read" in sink.faults[0]
    with pytest.raises(ServiceError) as gone, _translating(sink):
        raise UnknownTopicError("topic 't' was destroyed (and created again)")
    assert gone.value.code == Code.NOT_FOUND and "destroyed" in gone.value.message
    with pytest.raises(ValueError), _translating(sink):
        raise ValueError("not a store error")
    with _translating(sink):
        pass
    assert len(sink.faults) == 1


def test_a_fetch_that_meets_a_checksum_error_ends_in_data_loss_and_is_a_fault() -> None:
    """A new master's reorganization fetch from a source whose log fails its checksum: the
    source reports the fault and ends the fetch with DATA_LOSS (the new master counts it as
    a refusal: every retry would meet the same record); another store error stays
    UNAVAILABLE (worth retrying)."""
    from squall_server.replica.replication_server import serve_fetch_log
    from squall_server.replica.store import CorruptRecordError

    class _Source:
        def __init__(self, error: StoreError) -> None:
            self.error = error
            self.faults: list[str] = []
            self.node = type("N", (), {"id": "n1"})()

        async def fetch_log(self, request: object) -> AsyncIterator[replica_pb2.FetchLogResponse]:
            yield replica_pb2.FetchLogResponse()
            raise self.error

        def report_fault(self, reason: str) -> None:
            self.faults.append(reason)

    async def served(source: _Source) -> tuple[int, ServiceError]:
        count = 0
        with pytest.raises(ServiceError) as error:
            async for _ in serve_fetch_log(source, replica_pb2.FetchLogRequest()):  # type: ignore[arg-type]
                count += 1
        return count, error.value

    corrupt = _Source(CorruptRecordError("log", (7).to_bytes(8, "big"), "checksum mismatch"))
    count, error = asyncio.run(served(corrupt))
    assert count == 1 and error.code == Code.DATA_LOSS
    assert "failed a checksum" in error.message and "0000000000000007" in error.message
    assert len(corrupt.faults) == 1 and "checksum error serving a fetch" in corrupt.faults[0]

    full = _Source(StoreError("MDB_MAP_FULL"))
    count, error = asyncio.run(served(full))
    assert error.code == Code.UNAVAILABLE and "MDB_MAP_FULL" in error.message
    assert full.faults == []
