"""The master's joined publishes (PublishRequest.parts): each part a publish of its own.

A client's shared publish stream joins one-event publishes of several publishers into one
request. The master must publish every part as if it were a request of its own (its
topic, publisher id, sequences: deduplicated per part) and answer each apart, a refused
part failing alone. One ReplicaNode over the in-memory store, master of a one-node group
(so writes commit at once), with its real Publisher servicer on a loopback gRPC server.
"""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.processes import free_ports
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall_server.common.config import parse_config
from squall_server.replica import commands, server
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store
from tests.unit.test_writer_riders import role_command


def _new_node(config: Any, store: Store) -> Any:
    """Node n1's replica over `store`: built by `assembly.build_replica_node` where that
    builder exists (main since the node-builder merge), else by `ReplicaNode` itself."""
    try:
        assembly = importlib.import_module("squall_server.replica.assembly")
    except ModuleNotFoundError:
        return ReplicaNode(config, config.node("n1"), store)
    return assembly.build_replica_node(config, config.node("n1"), store)


def _part(
    topic: str, publisher_id: str, sequence: int, payload: bytes = b"x"
) -> broker_pb2.PublishRequest:
    return broker_pb2.PublishRequest(
        topic=topic,
        publisher_id=publisher_id,
        session_token=f"{publisher_id}/s1",
        compact_receipts=True,
        events=[common_pb2.EventData(payload=payload, sequence=sequence)],
    )


def test_each_part_is_published_deduplicated_and_answered_apart(tmp_path: Path) -> None:
    ports = iter(free_ports(3))
    text = (
        '[cluster]\nname = "t"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        f'coordinator_address = "127.0.0.1:{next(ports)}"\n'
        f'replica_address = "127.0.0.1:{next(ports)}"\ndata_dir = "n1"\n'
        f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
        "\n[limits]\nmax_event_bytes = 64\n"
    )
    config = parse_config(text, tmp_path / "cluster.toml")
    config.node("n1").data_dir.mkdir(parents=True, exist_ok=True)

    async def scenario() -> None:
        node = _new_node(config, Store.open_memory())
        await node.start()
        grpc_server = grpc.aio.server()
        broker_pb2_grpc.add_PublisherServicer_to_server(server.Publisher(node), grpc_server)
        address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
        await grpc_server.start()
        try:
            await node.apply_role(role_command(common_pb2.ROLE_MASTER, 1, 1))
            for name in ("a", "b"):
                await node.write(commands.CreateTopic(name, common_pb2.TOPIC_KIND_REPLICATED))
            async with grpc.aio.insecure_channel(address) as channel:
                stub = broker_pb2_grpc.PublisherStub(channel)
                joined = broker_pb2.PublishRequest(
                    topic="a",
                    request_id=7,
                    parts=[
                        _part("a", "p1", 1),
                        _part("b", "p2", 1),
                        _part("a", "p3", 1, payload=b"y" * 65),  # over max_event_bytes
                        _part("nope", "p4", 1),  # no such topic
                        _part("a", "p5", 1),
                    ],
                )
                for number, part in enumerate(joined.parts, 1):
                    part.request_id = number
                call = stub.PublishStream()
                await call.write(joined)
                first = await call.read()
                # The same parts again (a retry after a lost answer): the stored ones are
                # duplicates, at their first offsets; nothing new is stored.
                await call.write(joined)
                again = await call.read()
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
                # A malformed joined request is refused whole, naming the problem.
                bad = broker_pb2.PublishRequest(topic="a", parts=[_part("a", "p1", 9)])
                bad.events.add(payload=b"z", sequence=1)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Publish(bad)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "events or parts, not both" in (refused.value.details() or "")
                nested = broker_pb2.PublishRequest(topic="a", parts=[joined])
                with pytest.raises(grpc.aio.AioRpcError, match="cannot have parts"):
                    await stub.Publish(nested)
        finally:
            await grpc_server.stop(None)
            await node.stop()

        assert first.request_id == 7 and len(first.parts) == 5
        assert [p.request_id for p in first.parts] == [1, 2, 3, 4, 5]
        ok = [first.parts[i].batch for i in (0, 1, 4)]
        assert [(b.count, b.first_offset) for b in ok] == [(1, 0), (1, 0), (1, 1)]
        assert first.parts[2].error.code == "INVALID_ARGUMENT"
        assert "max_event_bytes" in first.parts[2].error.message
        assert first.parts[3].error.code == "NOT_FOUND"
        dup = [again.parts[i].batch for i in (0, 1, 4)]
        assert all(len(b.duplicates) == 1 for b in dup)
        assert [b.duplicates[0].offset for b in dup] == [0, 0, 1]
        topic_a = node.store.read_events("a", 0, 10)
        assert [(e.publisher_id, e.sequence, e.session_token) for e in topic_a] == [
            ("p1", 1, "p1/s1"),
            ("p5", 1, "p5/s1"),
        ]

    asyncio.run(scenario())
