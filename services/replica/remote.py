"""Reaching another Squall cluster's gateways for a topic link between clusters.

A `[[remotes]]` entry of the cluster file (docs/configuration.md) names the other cluster,
its gateways, the CA its gateways' certificates come from and the token it wants. This
module opens the channel, checks a link's destination at link time (`probe`: the topic
exists there, the TLS identity and the token are accepted) and turns what the other side
answers into errors that name the remote cluster and the problem.
"""

from __future__ import annotations

import grpc

from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall.wire.auth import read_token_file, token_metadata
from squall_server.common.config import RemoteConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.tls import handshake_failure

# Deadline of one call to a remote gateway (the probe, one forwarded batch).
REMOTE_CALL_TIMEOUT_MS = 5_000
# The channel's reconnect backoff cap: a remote cluster back after a partition is
# reached again within this.
_RECONNECT_MAX_MS = 2_000


def remote_channel(remote: RemoteConfig, max_message_bytes: int) -> grpc.aio.Channel:
    """One channel over every gateway of the remote (round robin), TLS when it has a CA."""
    target = "ipv4:" + ",".join(remote.gateways)
    if not all(g[0].isdigit() for g in remote.gateways):
        target = remote.gateways[0]  # DNS names: the first (a load balancer, typically)
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", _RECONNECT_MAX_MS),
    ]
    if remote.ca_file is None:
        return grpc.aio.insecure_channel(target, options=options)
    if remote.server_name:
        options.append(("grpc.ssl_target_name_override", remote.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=remote.ca_file.read_bytes())
    return grpc.aio.secure_channel(target, credentials, options=options)


def remote_metadata(remote: RemoteConfig) -> tuple[tuple[str, str], ...]:
    """The token the remote's [auth] wants, read now (a rotated file is picked up)."""
    if remote.token_file is None:
        return ()
    return token_metadata(read_token_file(str(remote.token_file)))


def remote_error(remote: RemoteConfig, error: grpc.aio.AioRpcError, doing: str) -> ServiceError:
    """What an app hears when the remote cluster failed `doing`, naming the cause."""
    details = " ".join((error.details() or "").split())[:200]
    where = f"remote cluster '{remote.name}' at {', '.join(remote.gateways)}"
    code = error.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return ServiceError(Code.NOT_FOUND, f"{where}: {details}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        hint = (
            "no token is configured (remotes.token_file)"
            if remote.token_file is None
            else (f"the token in {remote.token_file} was refused")
        )
        return ServiceError(
            Code.FAILED_PRECONDITION, f"{where} refused {doing}: {hint} ({code.name}: {details})"
        )
    if handshake_failure(details):
        identity = remote.server_name or "each gateway's host"
        return ServiceError(
            Code.FAILED_PRECONDITION,
            f"{where}: the TLS handshake failed: its gateways must present a certificate for "
            f"{identity} from the CA in {remote.ca_file} ({details})",
        )
    return ServiceError(
        Code.FAILED_PRECONDITION, f"{where} could not {doing} ({code.name}: {details})"
    )


async def probe(
    remote: RemoteConfig, topic: str, max_message_bytes: int
) -> common_pb2.TopicKind.ValueType:
    """The kind of `topic` on the remote; ServiceError naming the problem otherwise."""
    try:
        metadata = remote_metadata(remote)
        channel = remote_channel(remote, max_message_bytes)
    except (ValueError, OSError) as exc:  # an unreadable token or CA file
        raise ServiceError(
            Code.FAILED_PRECONDITION, f"remote cluster '{remote.name}': {exc}"
        ) from None
    async with channel:
        try:
            response = await broker_pb2_grpc.TopicManagerStub(channel).RetrieveTopic(
                broker_pb2.RetrieveTopicRequest(name=topic),
                timeout=REMOTE_CALL_TIMEOUT_MS / 1000,
                metadata=metadata or None,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError as exc:
            raise remote_error(remote, exc, f"find topic '{topic}'") from None
    return response.topic.kind
