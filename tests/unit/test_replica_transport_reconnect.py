"""A replica reaches another replica that restarted within a few heartbeats.

Found on a three-node cluster under acks "group": a slave node killed, down six
seconds, then restarted, rejoined its group at once, but the master's replication
stream to it failed for seconds more. The master's channel to it was waiting out gRPC's
default reconnect backoff, which grows by 1.6 times per failed attempt, and gRPC fails
every call at once meanwhile. Every commit waited for the new member until its
coordinator dropped it as cut off (2.4 s without a write acknowledged), and it stayed out
for its hold-off. Real gRPC servers on loopback, free ports.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from squall.v1 import replica_pb2, replica_pb2_grpc
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.replica.transport import GrpcReplicaTransport, ReplicaCallError
from tests.unit.held_port import held_port

# How long the peer stays down while the master keeps opening streams to it, as its
# reconnect backoff does (at most a second apart): long enough for gRPC's default
# backoff to grow past several seconds.
_DOWN_S = 6.0
_RETRY_S = 0.5
# When, after the peer serves again, the call is made: a few heartbeats.
_CALL_AFTER_S = 0.35


def _config(tmp_path: Path, peer_port: int) -> ClusterConfig:
    text = (
        '[cluster]\nname = "t"\n\n'
        '[[nodes]]\nid = "n1"\npriority = 2\ncoordinator_address = "127.0.0.1:1"\n'
        'replica_address = "127.0.0.1:2"\ndata_dir = "n1"\n\n'
        '[[nodes]]\nid = "n2"\npriority = 1\ncoordinator_address = "127.0.0.1:3"\n'
        f'replica_address = "127.0.0.1:{peer_port}"\ndata_dir = "n2"\n\n'
        '[[gateways]]\nid = "g1"\naddress = "127.0.0.1:5"\n\n'
        "[timeouts]\nheartbeat_interval_ms = 100\n"
    )
    return parse_config(text, tmp_path / "cluster.toml")


class _Replica(replica_pb2_grpc.ReplicationServicer):
    """A replica that answers a fetch with one empty message."""

    async def FetchLog(
        self, request: replica_pb2.FetchLogRequest, context: grpc.aio.ServicerContext
    ) -> object:
        yield replica_pb2.FetchLogResponse()


async def _serve(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicationServicer_to_server(_Replica(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _fetch(replicas: GrpcReplicaTransport) -> str:
    """'ok', or the status the call failed with."""
    call = replicas.fetch_log("n2", replica_pb2.FetchLogRequest())
    try:
        await call.read()
    except ReplicaCallError as exc:
        return exc.status
    finally:
        call.cancel()
    return "ok"


def test_a_replica_restarted_after_seconds_down_is_reached_within_a_few_heartbeats(
    tmp_path: Path,
) -> None:

    async def scenario(port: int) -> None:
        server = await _serve(port)
        replicas = GrpcReplicaTransport(_config(tmp_path, port), "n1")
        try:
            assert await _fetch(replicas) == "ok"
            await server.stop(None)
            down = []
            for _ in range(int(_DOWN_S / _RETRY_S)):
                down.append(await _fetch(replicas))
                await asyncio.sleep(_RETRY_S)
            assert set(down) == {"UNAVAILABLE"}, down
            server = await _serve(port)
            await asyncio.sleep(_CALL_AFTER_S)
            assert await _fetch(replicas) == "ok", (
                f"a call {_CALL_AFTER_S} s after the peer was back failed: the channel was "
                "still waiting out its reconnect backoff"
            )
        finally:
            await replicas.close()
            await server.stop(None)

    with held_port() as port:
        asyncio.run(scenario(port))
