"""A publish stream the gateway forwards ends when the group views name another master.

Issue 14, item 3: a master that hangs (paused, a stuck disk) after the group elected a new
one cannot end its publish streams itself, and the publishers on them used to wait for
their own receipt timeout (10 s). The gateway follows the views: when they name a master
other than the one a stream was forwarded to, it ends the stream with UNAVAILABLE, which
the client library treats as indeterminate and retries, with the same publisher id and
sequences, on a fresh stream to the new master.

In process: a stand-in "replica" that takes publish requests and never answers (the hung
master), the gateway's real Forwarder and MasterTracker on loopback, and group views fed to
the tracker as its coordinator watches would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from deploy import processes
from squall import classify_code
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2, coordinator_pb2
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.gateway.forward import Forwarder
from squall_server.gateway.master import MasterTracker

_WAIT_S = 30.0


def _config(tmp_path: Path, hung_address: str) -> ClusterConfig:
    # Distinct ports, none the hung replica's: a config naming one address twice is refused.
    hung_port = int(hung_address.rpartition(":")[2])
    ports = iter([p for p in processes.free_ports(7) if p != hung_port][:6])
    text = '[cluster]\nname = "t"\n'
    for i in (1, 2, 3):
        replica = hung_address if i == 1 else f"127.0.0.1:{next(ports)}"
        text += (
            f'\n[[nodes]]\nid = "n{i}"\npriority = {4 - i}\n'
            f'coordinator_address = "127.0.0.1:{next(ports)}"\n'
            f'replica_address = "{replica}"\ndata_dir = "n{i}"\n'
        )
    text += f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
    return parse_config(text, tmp_path / "cluster.toml")


def _view(node: str, epoch: int, master: str) -> coordinator_pb2.GroupView:
    view = coordinator_pb2.GroupView(
        node_id=node, state=common_pb2.NODE_STATE_NORMAL, epoch=epoch, group_name="g"
    )
    view.master.node_id = master
    return view


class _HungMaster(broker_pb2_grpc.PublisherServicer):
    """Reads publish requests and never answers them."""

    def __init__(self) -> None:
        self.received = asyncio.Event()

    async def PublishStream(  # type: ignore[override]
        self, request_iterator: AsyncIterator[broker_pb2.PublishRequest], context: object
    ) -> AsyncIterator[broker_pb2.PublishResponse]:
        async for _request in request_iterator:
            self.received.set()
        await asyncio.Event().wait()  # hung: only the caller's cancel ends this
        yield broker_pb2.PublishResponse()  # pragma: no cover


def test_a_forwarded_publish_stream_ends_when_the_views_name_a_new_master(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        hung = _HungMaster()
        replica_server = grpc.aio.server()
        broker_pb2_grpc.add_PublisherServicer_to_server(hung, replica_server)
        hung_address = f"127.0.0.1:{processes.free_port()}"
        replica_server.add_insecure_port(hung_address)
        await replica_server.start()
        config = _config(tmp_path, hung_address)
        masters = MasterTracker(config, "g1")
        masters._observe("n1", _view("n1", 1, "n1"))
        gateway_server = grpc.aio.server()
        gateway_server.add_generic_rpc_handlers(Forwarder(masters, 5.0).handlers())
        gateway_address = config.gateways[0].address
        gateway_server.add_insecure_port(gateway_address)
        await gateway_server.start()
        channel = grpc.aio.insecure_channel(gateway_address)
        try:
            requests: asyncio.Queue[broker_pb2.PublishRequest | None] = asyncio.Queue()
            await requests.put(
                broker_pb2.PublishRequest(
                    topic="t",
                    publisher_id="p",
                    request_id=1,
                    events=[common_pb2.EventData(payload=b"x", sequence=1)],
                )
            )

            async def send() -> AsyncIterator[broker_pb2.PublishRequest]:
                while (request := await requests.get()) is not None:
                    yield request

            call = broker_pb2_grpc.PublisherStub(channel).PublishStream(send(), timeout=120)
            await asyncio.wait_for(hung.received.wait(), _WAIT_S)

            # A renewal of the same master changes nothing: the stream stays open.
            masters._observe("n2", _view("n2", 1, "n1"))
            reading = asyncio.ensure_future(call.read())
            await asyncio.sleep(0.3)
            assert not reading.done()

            # n2 was elected in epoch 2 (n1 hangs): the stream ends at once, retryable.
            masters._observe("n2", _view("n2", 2, "n2"))
            masters._observe("n3", _view("n3", 2, "n2"))
            try:
                await asyncio.wait_for(reading, _WAIT_S)
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert classify_code(error.code().name, sent=True) == "indeterminate"
                assert "master moved from n1 (epoch 1) to n2 (epoch 2)" in (
                    error.details() or ""
                ), error.details()
            else:
                raise AssertionError("the stream went on after the master moved")
            await requests.put(None)
        finally:
            await channel.close()
            await gateway_server.stop(None)
            await replica_server.stop(None)
            await masters.close()

    asyncio.run(scenario())


def _view_with(
    node: str, epoch: int, master: str, members: tuple[str, ...]
) -> coordinator_pb2.GroupView:
    view = _view(node, epoch, master)
    for member in members:
        view.members.add(node_id=member)
    return view


def test_a_read_spread_to_a_slave_is_released_when_the_slave_leaves_the_group(
    tmp_path: Path,
) -> None:
    """`left_group` is what ends a read the gateway spread to a slave whose replica hangs:
    it must wait while the slave is still a member (also across a renewal of the same
    master) and answer with the master once the views leave the slave out."""

    async def scenario() -> None:
        config = _config(tmp_path, f"127.0.0.1:{processes.free_port()}")
        masters = MasterTracker(config, "g1")
        try:
            masters._observe("n1", _view_with("n1", 3, "n1", ("n1", "n2", "n3")))
            waiting = asyncio.ensure_future(masters.left_group("n3"))
            await asyncio.sleep(0.2)
            assert not waiting.done()

            # n2's view of the same group, n3 still in it: the read goes on.
            masters._observe("n2", _view_with("n2", 3, "n1", ("n1", "n2", "n3")))
            await asyncio.sleep(0.2)
            assert not waiting.done()

            # n3's replica hung; its coordinator dropped it from the group.
            masters._observe("n1", _view_with("n1", 3, "n1", ("n1", "n2")))
            master = await asyncio.wait_for(waiting, _WAIT_S)
            assert (master.node_id, master.epoch) == ("n1", 3)

            # A member that stays in the group is never released.
            staying = asyncio.ensure_future(masters.left_group("n2"))
            await asyncio.sleep(0.2)
            assert not staying.done()
            staying.cancel()
        finally:
            await masters.close()

    asyncio.run(scenario())
