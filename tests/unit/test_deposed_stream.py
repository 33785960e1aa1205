"""A deposed master ends every publish stream at once, with a status the client retries.

Issue 14, item 3: when the master of a three-node group is deposed (here: its coordinator
makes it a slave of another node in a newer epoch), every publish waiting for its commit
fails as indeterminate. Each pipelined `PublishStream` with requests in flight must end
with that status right away (not at the client's own deadline), and the failures of the
requests behind the first one, which nobody is left to hear, must not be left as asyncio
task exceptions that were never retrieved.

One ReplicaNode over the in-memory store with its real Publisher servicer on a loopback
gRPC server; the two other members are configured but never started, so writes stay
uncommitted until the deposition. The clients are plain synchronous stubs in threads, as
the library uses them.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from deploy.processes import free_ports
from squall import classify_code
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.replica import commands, server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.store import Store

# Far beyond how long the test waits for the streams: a stream that only ended at its
# deadline fails the test.
_CALL_DEADLINE_S = 120.0
_STREAM_END_WAIT_S = 30.0
_STREAMS = 2
_REQUESTS_PER_STREAM = 4


def _config(tmp_path: Path) -> ClusterConfig:
    ports = iter(free_ports(7))
    text = '[cluster]\nname = "t"\n'
    for i in (1, 2, 3):
        text += (
            f'\n[[nodes]]\nid = "n{i}"\npriority = {4 - i}\n'
            f'coordinator_address = "127.0.0.1:{next(ports)}"\n'
            f'replica_address = "127.0.0.1:{next(ports)}"\ndata_dir = "n{i}"\n'
        )
    text += f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
    config = parse_config(text, tmp_path / "cluster.toml")
    for node in config.nodes:
        node.data_dir.mkdir(parents=True, exist_ok=True)
    return config


def _master(epoch: int, seq: int, members: tuple[str, ...]) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        role=common_pb2.ROLE_MASTER,
        epoch=epoch,
        master=common_pb2.NodeEndpoint(node_id="n1"),
        members=[common_pb2.NodeEndpoint(node_id=m) for m in members],
        seq=seq,
        lease_ms=600_000,
        cluster_id="c-test",  # the coordinator's, as every master role carries one
    )


class _StreamClient:
    """One PublishStream with requests in flight, read in its own thread."""

    def __init__(self, address: str, stream: int) -> None:
        self._channel = grpc.insecure_channel(address)
        self._requests: queue.SimpleQueue[broker_pb2.PublishRequest | None] = queue.SimpleQueue()
        for i in range(_REQUESTS_PER_STREAM):
            self._requests.put(
                broker_pb2.PublishRequest(
                    topic="t",
                    publisher_id=f"pub-{stream}",
                    request_id=i + 1,
                    compact_receipts=True,
                    events=[common_pb2.EventData(payload=b"x", sequence=i + 1)],
                )
            )
        self.answered = 0
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._stub = broker_pb2_grpc.PublisherStub(self._channel)

    def _iter(self) -> Iterator[broker_pb2.PublishRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def _run(self) -> None:
        call = self._stub.PublishStream(self._iter(), timeout=_CALL_DEADLINE_S)
        try:
            for _ in call:
                self.answered += 1
        except grpc.RpcError as err:
            self.error = err
        finally:
            self._requests.put(None)
            self._channel.close()


def test_a_deposed_master_ends_every_stream_at_once_as_indeterminate(tmp_path: Path) -> None:
    config = _config(tmp_path)
    unobserved: list[dict[str, Any]] = []

    async def scenario() -> list[_StreamClient]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: unobserved.append(context))
        node = build_replica_node(config, config.node("n1"), Store.open_memory())
        await node.start()
        grpc_server = grpc.aio.server()
        broker_pb2_grpc.add_PublisherServicer_to_server(server.Publisher(node), grpc_server)
        address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
        await grpc_server.start()
        clients = [_StreamClient(address, s) for s in range(_STREAMS)]
        try:
            await node.apply_role(_master(1, 1, ("n1",)))
            await node.write(commands.CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
            # n2 and n3 never answer: from here on nothing commits.
            await node.apply_role(_master(2, 2, ("n1", "n2", "n3")))
            for client in clients:
                client.thread.start()
            for _ in range(600):  # bounded: until every request is waiting for its commit
                driver = node.state.master
                if driver is not None and driver.core.pending_writes >= (
                    _STREAMS * _REQUESTS_PER_STREAM
                ):
                    break
                await asyncio.sleep(0.05)
            assert all(c.error is None and c.answered == 0 for c in clients)

            # n2 took the lead in epoch 3: n1's coordinator makes it n2's slave.
            await node.apply_role(
                replica_pb2.RoleCommand(
                    role=common_pb2.ROLE_SLAVE,
                    epoch=3,
                    master=common_pb2.NodeEndpoint(node_id="n2"),
                    seq=3,
                    lease_ms=600_000,
                )
            )
            for _ in range(int(_STREAM_END_WAIT_S / 0.05)):
                if not any(c.thread.is_alive() for c in clients):
                    break
                await asyncio.sleep(0.05)
        finally:
            await grpc_server.stop(None)
            await node.stop()
            # Collected now, so a never-retrieved exception is reported inside this loop.
            gc.collect()
            await asyncio.sleep(0)
        return clients

    clients = asyncio.run(scenario())
    for client in clients:
        client.thread.join(5)
        assert not client.thread.is_alive(), "the stream waited for its own deadline"
        assert client.error is not None and client.answered == 0
        code = client.error.code()
        assert classify_code(code.name, sent=True) == "indeterminate", client.error
        assert "deposed" in (client.error.details() or ""), client.error.details()
    assert unobserved == [], [c.get("message") for c in unobserved]
