"""A coordinator reaches a peer that restarted within a few heartbeats.

The lead-back benchmark (bench/fault_gaps.py) found slow trials where a member's Accept to
a restarted master was dropped: its channel to that master, which had been down a few
seconds, was still waiting out a reconnect backoff of up to a second, and gRPC fails
every call at once meanwhile. The merge then waited out member_timeout_ms and a second
election round followed. Real gRPC servers on loopback, free ports.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from squall.v1 import coordinator_pb2, coordinator_pb2_grpc
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.common.grpc_server import reconnect_options
from squall_server.coordinator.messages import (
    Accept,
    AreYouCoordinator,
    MemberReport,
    PeerMessage,
    StoreState,
)
from squall_server.coordinator.node import GrpcPeers
from tests.unit.held_port import held_port

# How long the peer stays down, sent to every heartbeat: long enough for a backoff that
# doubles from 100 ms to reach a one-second cap.
_DOWN_S = 3.0
_HEARTBEAT_S = 0.1
# When, after the peer serves again, one message is sent: a few heartbeats.
_SEND_AFTER_S = 0.35
_WAIT_S = 5.0


def _config(tmp_path: Path, peer_port: int, heartbeat_ms: int = 100) -> ClusterConfig:
    text = (
        '[cluster]\nname = "t"\n\n'
        '[[nodes]]\nid = "n1"\npriority = 2\ncoordinator_address = "127.0.0.1:1"\n'
        'replica_address = "127.0.0.1:2"\ndata_dir = "n1"\n\n'
        f'[[nodes]]\nid = "n2"\npriority = 1\ncoordinator_address = "127.0.0.1:{peer_port}"\n'
        'replica_address = "127.0.0.1:4"\ndata_dir = "n2"\n\n'
        '[[gateways]]\nid = "g1"\naddress = "127.0.0.1:5"\n\n'
        f"[timeouts]\nheartbeat_interval_ms = {heartbeat_ms}\n"
        f"member_timeout_ms = {4 * heartbeat_ms}\nreplica_timeout_ms = {3 * heartbeat_ms}\n"
        f"store_stall_timeout_ms = {20 * heartbeat_ms}\n"
    )
    return parse_config(text, tmp_path / "cluster.toml")


class _Peer(coordinator_pb2_grpc.CoordinatorServicer):
    """A coordinator that only counts what is delivered to it."""

    def __init__(self) -> None:
        self.delivered: list[coordinator_pb2.PeerMessage] = []

    async def Deliver(
        self, request: coordinator_pb2.PeerMessage, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DeliverResponse:
        self.delivered.append(request)
        return coordinator_pb2.DeliverResponse()


async def _serve(port: int, peer: _Peer) -> grpc.aio.Server:
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(peer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _delivered(peer: _Peer, count: int) -> bool:
    for _ in range(int(_WAIT_S / 0.02)):
        if len(peer.delivered) >= count:
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_message_sent_soon_after_a_peer_restarts_is_delivered(tmp_path: Path) -> None:
    message = PeerMessage("n1", "n2", AreYouCoordinator("n1:g", 2))

    async def scenario(port: int) -> None:
        peer = _Peer()
        server = await _serve(port, peer)
        peers = GrpcPeers(_config(tmp_path, port), "n1")
        try:
            peers.send(message)
            assert await _delivered(peer, 1), "the peer never got the first message"
            await server.stop(None)
            # The peer is down; the node keeps sending, as probes and heartbeats do.
            for _ in range(int(_DOWN_S / _HEARTBEAT_S)):
                peers.send(message)
                await asyncio.sleep(_HEARTBEAT_S)
            restarted = _Peer()
            server = await _serve(port, restarted)
            await asyncio.sleep(_SEND_AFTER_S)
            peers.send(message)
            assert await _delivered(restarted, 1), (
                f"a message sent {_SEND_AFTER_S} s after the peer was back was dropped: the "
                "channel was still waiting out its reconnect backoff"
            )
        finally:
            await peers.close()
            await server.stop(None)

    with held_port() as port:
        asyncio.run(scenario(port))


def test_the_reconnect_backoff_follows_the_heartbeat_but_never_shortens_connects() -> None:
    assert dict(reconnect_options(100)) == {
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.min_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 100,
    }
    assert dict(reconnect_options(2000))["grpc.max_reconnect_backoff_ms"] == 2000
    # gRPC reads the minimum as the shortest connect timeout: a fast heartbeat must not
    # make connects to a distant peer time out.
    assert dict(reconnect_options(20))["grpc.min_reconnect_backoff_ms"] == 100


def test_a_peer_heard_from_is_sent_to_at_once_whatever_the_backoff(tmp_path: Path) -> None:
    """A message from a peer proves it is up: a channel to it still backing off (here up to
    a ten-second heartbeat) is replaced by one that dials now, so the answer to that
    message, or an invitation, is not dropped. Without it a coordinator that started
    before its peers lost its first invitation to each, and every start with slow
    heartbeats waited out member_timeout_ms (20 s in test_replica_reads.py)."""
    message = PeerMessage("n1", "n2", AreYouCoordinator("n1:g", 2))

    async def scenario(port: int) -> None:
        peers = GrpcPeers(_config(tmp_path, port, heartbeat_ms=10_000), "n1")
        server: grpc.aio.Server | None = None
        try:
            # The peer is not up yet: the sends fail and the backoff grows past a second.
            for _ in range(int(1.5 / _HEARTBEAT_S)):
                peers.send(message)
                await asyncio.sleep(_HEARTBEAT_S)
            peer = _Peer()
            server = await _serve(port, peer)
            peers.heard_from("n2")  # its first message arrived
            peers.send(message)
            assert await _delivered(peer, 1), "the message right after the peer's was dropped"
        finally:
            await peers.close()
            if server is not None:
                await server.stop(None)

    with held_port() as port:
        asyncio.run(scenario(port))


def test_a_peer_that_moves_is_followed_and_its_old_channel_closed(tmp_path: Path) -> None:
    """A membership change moves n2 to a new machine: messages go to its new address, and
    the channel to the old one is closed rather than kept open until the node stops."""
    message = PeerMessage("n1", "n2", AreYouCoordinator("n1:g", 2))

    async def scenario(old_port: int, new_port: int) -> None:
        old_peer, new_peer = _Peer(), _Peer()
        old_server = await _serve(old_port, old_peer)
        new_server = await _serve(new_port, new_peer)
        peers = GrpcPeers(_config(tmp_path, old_port), "n1")
        moved_to = ""
        peers.address_of = lambda peer: moved_to if peer == "n2" else ""
        try:
            peers.send(message)
            assert await _delivered(old_peer, 1), "the peer at its first address got nothing"
            old_channel = peers._channels["n2"]
            moved_to = f"127.0.0.1:{new_port}"
            peers.send(message)
            assert await _delivered(new_peer, 1), "the moved peer got nothing at its new address"
            for _ in range(int(_WAIT_S / 0.02)):  # bounded: the close runs in the background
                if old_channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN:
                    break
                await asyncio.sleep(0.02)
            assert old_channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN
            assert len(old_peer.delivered) == 1
        finally:
            await peers.close()
            await old_server.stop(None)
            await new_server.stop(None)

    with held_port() as old_port, held_port() as new_port:
        asyncio.run(scenario(old_port, new_port))


def test_an_election_message_a_peer_never_gets_is_logged_and_a_probe_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A merge waits member_timeout_ms for an accept that is lost, so its loss is said
    (at most once a second per peer and kind); probes to a dead peer stay quiet."""
    report = MemberReport("n1", "c-1", 1, 7, StoreState.DIRTY, 1, 1)
    accept = PeerMessage("n1", "n2", Accept("n2:g", report))
    probe = PeerMessage("n1", "n2", AreYouCoordinator("n1:g", 2))

    async def scenario(port: int) -> None:
        peers = GrpcPeers(_config(tmp_path, port), "n1")  # nobody listens on the port
        try:
            for _ in range(3):
                peers.send(probe)
                peers.send(accept)
            await asyncio.sleep(1.5)  # bounded: each send fails within member_timeout_ms
        finally:
            await peers.close()

    with caplog.at_level(logging.INFO, logger="squall.coordinator"), held_port() as port:
        asyncio.run(scenario(port))
    said = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("coordinator n1: accept to n2 not delivered: UNAVAILABLE")
