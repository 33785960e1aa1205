"""Refuses internal calls from peers whose verified certificate does not allow them.

With mutual TLS on, gRPC has already checked a caller's certificate chain against the
cluster CA before this runs; this interceptor decides whether the certificate's name may
make the call, and whether it is the name the message claims. A coordinator takes
`Deliver` only from a node whose certificate names the message's sender; a replica takes a
replication stream only from the node its Hello names, `FetchLog` only for the node
asking, and role commands only from its own node's coordinator. Only the internal
methods are listed here; app-facing calls are the business of services/common/auth.py.

The pure election and replication cores never see a refused message.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from squall_server.common.clock import SYSTEM_CLOCK, Clock
from squall_server.common.config import ClusterConfig
from squall_server.common.peer_identity import peer_identities
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.tls import ADMIN_ID

if TYPE_CHECKING:
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor

log = logging.getLogger("squall.tls")

# Who may call: cluster nodes, gateways, the operator's `admin` certificate, or only this
# process's own node (its coordinator driving its replica).
NODES = "nodes"
GATEWAYS = "gateways"
ADMIN = "admin"
SELF = "self"

# The same refusal is logged at most once per this many seconds per caller and method.
_LOG_INTERVAL_S = 10.0
_LOGGED_MAX = 1024


def _from_node(request: Any) -> str:
    return str(request.from_node)


def _hello_master(request: Any) -> str:
    if request.WhichOneof("body") != "hello":
        return ""  # the servicer refuses a stream that does not open with a Hello
    return str(request.hello.master_id)


def _fetch_node(request: Any) -> str:
    return str(request.node_id)


@dataclass(frozen=True)
class Rule:
    """Who may call a method, and the field of its (first) request that names the caller."""

    allowed: frozenset[str]
    claimed: Callable[[Any], str] | None = None
    claim_name: str = ""


RULES: dict[str, Rule] = {
    "/squall.v1.Coordinator/Deliver": Rule(frozenset({NODES}), _from_node, "sender"),
    "/squall.v1.Replication/Replicate": Rule(frozenset({NODES}), _hello_master, "master"),
    "/squall.v1.Replication/FetchLog": Rule(frozenset({NODES}), _fetch_node, "node"),
    "/squall.v1.ReplicaControl/SetRole": Rule(frozenset({SELF})),
    "/squall.v1.ReplicaControl/PrepareHandoff": Rule(frozenset({SELF})),
    "/squall.v1.ReplicaControl/FreezeForShutdown": Rule(frozenset({NODES, ADMIN})),
    "/squall.v1.ReplicaControl/FinishShutdown": Rule(frozenset({NODES, ADMIN})),
    "/squall.v1.ReplicaControl/AbortShutdown": Rule(frozenset({NODES, ADMIN})),
    "/squall.v1.ReplicaControl/GetReplicaState": Rule(frozenset({NODES, GATEWAYS, ADMIN})),
}


class Refused(Exception):
    """A call the guard refuses: the status and the one line the caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PeerGuard(_ServerInterceptor):
    """Checks the internal calls of one node's server (coordinator or replica)."""

    def __init__(
        self,
        config: ClusterConfig,
        own_id: str,
        service: str,
        clock: Clock = SYSTEM_CLOCK,
        nodes: RunningNodes | None = None,
    ) -> None:
        """clock: paces the refusal log (at most one line per interval per caller);
        nodes: the node ids in force, which follow the running node set (the file's when
        not given)."""
        self._own_id = own_id
        self._clock = clock
        self._service = service
        self._running = nodes or RunningNodes(node.id for node in config.nodes)
        self._gateways = frozenset(gateway.id for gateway in config.gateways)
        self._logged: dict[tuple[str, str], float] = {}

    def check(self, method: str, names: frozenset[str], request: Any | None) -> str | None:
        """The member id the caller is (None for admin), or Refused naming the problem."""
        rule = RULES[method]
        short = method.lstrip("/").replace("squall.v1.", "")
        if not names:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{short} needs a client certificate from the cluster CA; none was presented",
            )
        node = _one(names & self._running.ids)
        shown = ", ".join(sorted(names))
        if SELF in rule.allowed:
            if node != self._own_id:
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{short} is taken only from node {self._own_id}'s own coordinator; "
                    f"the client certificate names {shown}",
                )
            return node
        if NODES in rule.allowed and node is not None:
            if rule.claimed is not None and request is not None:
                claimed = rule.claimed(request)
                if claimed and claimed != node:
                    raise Refused(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"{short}: the client certificate names node {node} but the message's "
                        f"{rule.claim_name} is {claimed!r}",
                    )
            return node
        gateway = _one(names & self._gateways)
        if GATEWAYS in rule.allowed and gateway is not None:
            return gateway
        if ADMIN in rule.allowed and ADMIN_ID in names:
            return None
        who = " or ".join(sorted(rule.allowed - {SELF}))
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{short} is for cluster {who}; the client certificate names {shown}",
        )

    def _note(self, method: str, names: frozenset[str], refused: Refused) -> None:
        """Logs a refusal, at most once per interval per caller and method."""
        key = (method, ",".join(sorted(names)))
        now = self._clock.monotonic_ms() / 1000
        if now - self._logged.get(key, -_LOG_INTERVAL_S) < _LOG_INTERVAL_S:
            return
        if len(self._logged) >= _LOGGED_MAX:
            self._logged.clear()
        self._logged[key] = now
        log.warning(
            "%s %s refused a call: %s: %s",
            self._service,
            self._own_id,
            refused.code.name,
            refused.message,
        )

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """Wraps the handlers of the internal methods in RULES; others pass untouched."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in RULES:
            return handler
        guard = self

        async def refuse(context: Any, names: frozenset[str], refused: Refused) -> None:
            guard._note(method, names, refused)
            await context.abort(refused.code, refused.message)

        if handler.request_streaming and handler.response_streaming:
            behaviour: Any = handler.stream_stream

            async def stream_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
                names = peer_identities(context)
                # The first message names the caller (a Hello); look before the handler.
                first = await anext(aiter(requests), None)
                try:
                    guard.check(method, names, first)
                except Refused as refused:
                    await refuse(context, names, refused)
                    return

                async def replay() -> AsyncIterator[Any]:
                    if first is not None:
                        yield first
                    async for request in requests:
                        yield request

                async for response in behaviour(replay(), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                stream_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.response_streaming:
            unary_stream_behaviour: Any = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                names = peer_identities(context)
                try:
                    guard.check(method, names, request)
                except Refused as refused:
                    await refuse(context, names, refused)
                    return
                async for response in unary_stream_behaviour(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        unary: Any = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            names = peer_identities(context)
            try:
                guard.check(method, names, request)
            except Refused as refused:
                await refuse(context, names, refused)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _one(names: frozenset[str]) -> str | None:
    """The single name of a set, None when it is empty or ambiguous."""
    return next(iter(names)) if len(names) == 1 else None


def guards(
    config: ClusterConfig, own_id: str, service: str, nodes: RunningNodes | None = None
) -> list[Any]:
    """The interceptors a node's server takes: the guard while TLS is on, none otherwise."""
    return [PeerGuard(config, own_id, service, nodes=nodes)] if config.tls.enabled else []
