"""Builds the gRPC server every Squall service runs: health checking, reflection, limits.

Standard tools (grpcurl, grpc_health_probe, load balancers) work against any service
because each one registers `grpc.health.v1.Health` and server reflection here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from squall_server.common import reflection_v1, sd_notify
from squall_server.common.grpc_tracing import server_interceptors
from squall_server.common.request_decoding import DecodeGuard

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The options every Squall channel and server use: message limits and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Dead peers must be noticed without waiting for TCP's minutes-long timeouts.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# The first (and shortest) reconnect backoff of the channels between a node's services
# and between nodes, in ms.
_RECONNECT_MIN_MS = 100


def reconnect_options(heartbeat_interval_ms: int) -> list[tuple[str, int]]:
    """Channel options that dial a dead peer again at least every heartbeat interval (and
    at most every `_RECONNECT_MIN_MS`): for a coordinator's channels to the other
    coordinators and to its replica, and for a replica's to the other replicas.

    While a channel waits out its reconnect backoff, gRPC fails every call on it at once
    (UNAVAILABLE) without dialling, and its default backoff grows by 1.6 times per failed
    attempt to two minutes. A peer down a few seconds and then restarted could not be
    reached for seconds after it was back:

    * the Accept of a member whose channel to a restarted master was still backing off
      was dropped, so that master's merge waited out member_timeout_ms, went NORMAL
      without the member, and a second election round followed (the slow lead_back
      trials of bench/fault_gaps.py);
    * a master's replication stream to a slave node restarted after six seconds down
      failed for seconds after the node rejoined its group: the slave caught up that
      much later, and under acks "group", where every commit then waited for every
      member, writes stalled until its coordinator dropped it as cut off.

    Capping the backoff at a heartbeat bounds that window by one heartbeat, for one
    refused connection per heartbeat per dead peer.
    """
    return [
        ("grpc.initial_reconnect_backoff_ms", _RECONNECT_MIN_MS),
        # gRPC also takes this as the shortest connect timeout: kept, not lowered.
        ("grpc.min_reconnect_backoff_ms", _RECONNECT_MIN_MS),
        ("grpc.max_reconnect_backoff_ms", max(heartbeat_interval_ms, _RECONNECT_MIN_MS)),
    ]


class ServiceServer:
    """An aio gRPC server with health and reflection, bound to one address."""

    def __init__(
        self,
        address: str,
        service_names: Sequence[str],
        max_message_bytes: int,
        *,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[Any] = (),
        metadata_bytes_max: int | None = None,
    ) -> None:
        self.address = address
        # TLS when given (squall_server.common.tls builds them from [tls]); plaintext otherwise.
        self._credentials = credentials
        options: list[tuple[str, int]] = [
            *channel_options(max_message_bytes),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.so_reuseport", 0),
        ]
        if metadata_bytes_max is not None:
            # limits.metadata_bytes_max: gRPC refuses a call whose headers are larger.
            # The soft and hard limits are the same so the refusal is not probabilistic.
            options.append(("grpc.max_metadata_size", metadata_bytes_max))
            options.append(("grpc.absolute_max_metadata_size", metadata_bytes_max))
        self.server = grpc.aio.server(
            options=options,
            # Requests that do not parse are INVALID_ARGUMENT (request_decoding.py); then the
            # caller's checks (peer identity, authentication, per-client limits); then
            # tracing when [telemetry] turned it on.
            interceptors=[DecodeGuard(), *interceptors, *server_interceptors()],
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_names)
        # Reflection v1 and v1alpha: grpcurl and the other languages' tools ask for either.
        reflection_v1.enable(
            [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name],
            self.server,
        )
        self.port = 0

    async def start(self) -> None:
        """Binds and starts serving; the port is known afterwards (useful with port 0)."""
        if self._credentials is None:
            self.port = self.server.add_insecure_port(self.address)
        else:
            self.port = self.server.add_secure_port(self.address, self._credentials)
        if self.port == 0:
            raise OSError(f"cannot bind {self.address}: address in use or not local")
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        """Marks every registered service (and the server as a whole) serving or not."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)
        # Under a Type=notify systemd unit (deploy/systemd/), serving is "ready": units
        # ordered after this one (a node's coordinator after its replica) start now.
        if serving:
            sd_notify.ready(f"serving on {self.address}")

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stops accepting calls and waits up to grace_s for running ones."""
        sd_notify.stopping(f"stopping (was serving on {self.address})")
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def run_until_signalled(
    serve: Callable[[asyncio.Event], Awaitable[None]],
) -> None:
    """Runs `serve(stop_event)`; SIGTERM and SIGINT set the event for a clean stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(stop)


# The servicer context type, with grpc-stubs' type parameters filled in once.
Context = grpc.aio.ServicerContext[Any, Any]
