"""Checks that run around every public call: authentication and permissions, per-client limits.

One server interceptor serves the gateway (whose forwarding handlers see serialized
bytes) and the replica and coordinator (whose servicers see messages): a guard opens a
session per call, sees each request (decoded from bytes only when a guard needs a field),
may rewrite a response (ListTopics keeps the topics the principal may see) and is closed
when the call ends. A refusal before the call ends it with the guard's status and
changes nothing. A refused request on a client stream (PublishStream) ends the stream
for reading: requests already taken are answered, then the call ends with the refusal.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from squall.v1 import broker_pb2, coordinator_pb2, gateway_pb2  # noqa: F401  (registers types)
from squall_server.common.auth import (
    METHOD_RULES,
    Decision,
    TokenBook,
    bearer_token,
    decide,
    decide_publish_into,
    decide_publisher_id,
    may_see,
)
from squall_server.common.auth_config import AuthConfig, PrincipalConfig
from squall_server.common.config import ClusterConfig, LimitsConfig
from squall_server.common.grpc_server import Context
from squall_server.common.names import show_name
from squall_server.common.peer_identity import HasAuthContext, peer_member_id
from squall_server.common.running_nodes import RunningNodes

log = logging.getLogger("squall.guard")

if TYPE_CHECKING:  # grpc's classes are generic in the stubs only
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor

# Set by the gateway on every forwarded call: the app's own connection, so a replica
# counts the app's streams, not the gateway's. Trusted only from members (or with auth off).
CLIENT_PEER_KEY = "squall-client-peer"

_LIST_TOPICS = "/squall.v1.TopicManager/ListTopics"
_PUBLISH = "/squall.v1.Publisher/Publish"
_PUBLISH_STREAM = "/squall.v1.Publisher/PublishStream"
_BROKER_SERVICES = (
    "/squall.v1.TopicManager/",
    "/squall.v1.Publisher/",
    "/squall.v1.Subscriber/",
    "/squall.v1.PushSubscriptions/",
)


class Refusal(Exception):
    """A call (or one request of a stream) refused with this status and sentence."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Call:
    """One call as the guards see it."""

    method: str
    context: Context
    streaming: bool
    # The cluster member a verified certificate names (None without mutual TLS).
    member: str | None


class Request:
    """One request, decoded from bytes the first time a guard asks for its message."""

    def __init__(self, method: str, raw: object) -> None:
        self._method = method
        self._raw = raw
        self._message: Message | None = raw if isinstance(raw, Message) else None

    def message(self) -> Message:
        if self._message is None:
            cls = _input_class(self._method)
            try:
                self._message = cls.FromString(bytes(self._raw))  # type: ignore[call-overload]
            except DecodeError:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid protobuf message"
                ) from None
        return self._message


class Session(Protocol):
    def request(self, request: Request) -> None: ...

    def response(self, response: Any) -> Any: ...

    def close(self) -> None: ...


class Guard(Protocol):
    def open(self, call: Call) -> Session | None:
        """A session for the call (None: not guarded); raises Refusal to refuse it."""


@functools.cache
def _input_class(method: str) -> type[Message]:
    service, _, name = method.lstrip("/").partition("/")
    found = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    cls: type[Message] = message_factory.GetMessageClass(found.input_type)
    return cls


def _member(context: Context, members: frozenset[str]) -> str | None:
    try:
        return peer_member_id(cast(HasAuthContext, context), members)
    except (AttributeError, TypeError):
        return None


# --------------------------------------------------------------------------- auth


class _AuthSession:
    def __init__(
        self,
        call: Call,
        principal: PrincipalConfig | None,
        field_name: str,
        publish_field: str = "",
        publisher_field: str = "",
    ) -> None:
        self._call = call
        self._principal = principal
        self._field = field_name
        self._publish_field = publish_field
        self._publisher_field = publisher_field

    def request(self, request: Request) -> None:
        if self._field:  # methods without a topic were decided when the call opened
            message = request.message()
            self.check(str(getattr(message, self._field)))
            into = str(getattr(message, self._publish_field)) if self._publish_field else ""
            if into:
                call = self._call
                decision = decide_publish_into(call.method, into, self._principal, call.member)
                self._refuse_unless(decision, into)
            if self._publisher_field:
                publisher_id = str(getattr(message, self._publisher_field))
                decision = decide_publisher_id(publisher_id, self._principal, self._call.member)
                self._refuse_unless(decision, str(getattr(message, self._field)))
                # A joined publish (PublishRequest.parts): each part is a publish of its own.
                for part in getattr(message, "parts", ()):
                    self.check(str(getattr(part, self._field)))
                    part_id = str(getattr(part, self._publisher_field))
                    decision = decide_publisher_id(part_id, self._principal, self._call.member)
                    self._refuse_unless(decision, str(getattr(part, self._field)))

    def check(self, topic: str) -> None:
        """Refusal unless the caller may make this call on this topic; logs a refusal."""
        self._refuse_unless(
            decide(self._call.method, topic, self._principal, self._call.member), topic
        )

    def _refuse_unless(self, decision: Decision, topic: str) -> None:
        if decision.allowed:
            return
        # The principal's name, never its token.
        log.info(
            "refused %s%s for principal %s: %s",
            self._call.method,
            f" on topic {show_name(topic)}" if topic else "",
            self._principal.name if self._principal else "(none)",
            decision.verdict.value,
        )
        raise Refusal(grpc.StatusCode[decision.verdict.value], decision.message)

    def response(self, response: Any) -> Any:
        if self._call.method != _LIST_TOPICS or self._principal is None:
            return response
        principal = self._principal
        if isinstance(response, bytes):
            listed = broker_pb2.ListTopicsResponse.FromString(response)
        else:
            listed = response
        visible = [t for t in listed.topics if may_see(principal, t.name)]
        filtered = broker_pb2.ListTopicsResponse(topics=visible)
        return filtered.SerializeToString() if isinstance(response, bytes) else filtered

    def close(self) -> None:
        pass


class AuthGuard:
    """Refuses calls without a known token, or whose principal lacks the permission."""

    def __init__(self, config: AuthConfig) -> None:
        self._book = TokenBook(config.principals)

    def open(self, call: Call) -> Session | None:
        rule = METHOD_RULES.get(call.method)
        if rule is None:
            return None
        principal = None
        if call.member is None:
            principal = self._book.principal(bearer_token(call.context.invocation_metadata()))
        session = _AuthSession(
            call, principal, rule.topic_field, rule.publish_field, rule.publisher_field
        )
        if not rule.topic_field or (principal is None and call.member is None):
            # Decided without the request: no topic, or refused whatever the topic.
            session.check("")
        return session


# --------------------------------------------------------------------------- limits


@dataclass
class _Counts:
    streams: dict[str, int] = field(default_factory=dict)
    publishes: dict[str, int] = field(default_factory=dict)


def _add(counts: dict[str, int], key: str, delta: int) -> int:
    value = counts.get(key, 0) + delta
    if value <= 0:
        counts.pop(key, None)
        return 0
    counts[key] = value
    return value


class _LimitSession:
    def __init__(self, guard: ClientLimitsGuard, call: Call, key: str) -> None:
        self._guard = guard
        self._call = call
        self._key = key
        self._stream = False
        self._publishes = 0

    def open(self) -> None:
        limits = self._guard.limits
        if self._call.streaming:
            self._stream = True
            if _add(self._guard.counts.streams, self._key, 1) > limits.client_streams_max:
                raise Refusal(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this client already has {limits.client_streams_max} streams open: "
                    f"limits.client_streams_max is {limits.client_streams_max}",
                )
        if self._call.method == _PUBLISH:
            self._take_publish()

    def _take_publish(self) -> None:
        limit = self._guard.limits.client_inflight_publishes_max
        self._publishes += 1
        if _add(self._guard.counts.publishes, self._key, 1) > limit:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client already has {limit} publish requests awaiting receipts: "
                f"limits.client_inflight_publishes_max is {limit}",
            )

    def request(self, request: Request) -> None:
        if self._call.method == _PUBLISH_STREAM:
            self._take_publish()

    def response(self, response: Any) -> Any:
        if self._call.method == _PUBLISH_STREAM and self._publishes:
            self._publishes -= 1
            _add(self._guard.counts.publishes, self._key, -1)
        return response

    def close(self) -> None:
        if self._stream:
            self._stream = False
            _add(self._guard.counts.streams, self._key, -1)
        if self._publishes:
            _add(self._guard.counts.publishes, self._key, -self._publishes)
            self._publishes = 0


class ClientLimitsGuard:
    """Bounds each client's open streams and publish requests awaiting receipts.

    A client is one connection (its peer address); through a gateway, the app's
    connection as the gateway names it (CLIENT_PEER_KEY), believed only from a cluster
    member or while authentication is off.
    """

    def __init__(self, limits: LimitsConfig, auth_enabled: bool) -> None:
        self.limits = limits
        self.counts = _Counts()
        self._auth_enabled = auth_enabled

    def open(self, call: Call) -> Session | None:
        if not call.method.startswith(_BROKER_SERVICES):
            return None
        key = call.context.peer()
        if call.member is not None or not self._auth_enabled:
            for name, value in call.context.invocation_metadata() or ():
                if name == CLIENT_PEER_KEY:
                    key = value.decode() if isinstance(value, bytes) else value
        session = _LimitSession(self, call, key)
        try:
            session.open()
        except Refusal:
            session.close()
            raise
        return session


# --------------------------------------------------------------------------- interceptor


def guards_for(config: ClusterConfig) -> list[Guard]:
    """The guards a service runs: authentication when [auth] enables it, and client limits."""
    guards: list[Guard] = []
    if config.auth.enabled:
        guards.append(AuthGuard(config.auth))
    guards.append(ClientLimitsGuard(config.limits, config.auth.enabled))
    return guards


def members_of(config: ClusterConfig) -> frozenset[str]:
    """Every node and gateway id: the names a member's certificate may carry."""
    return frozenset(n.id for n in config.nodes) | frozenset(g.id for g in config.gateways)


class _Sessions:
    """The open sessions of one call, driven together."""

    def __init__(self, sessions: Sequence[Session], method: str) -> None:
        self._sessions = sessions
        self._method = method

    def request(self, raw: object) -> None:
        request = Request(self._method, raw)
        for session in self._sessions:
            session.request(request)

    def response(self, response: Any) -> Any:
        for session in self._sessions:
            response = session.response(response)
        return response

    def close(self) -> None:
        for session in self._sessions:
            session.close()


class GuardInterceptor(_ServerInterceptor):
    """Runs the guards around every call they guard."""

    def __init__(self, guards: Sequence[Guard], members: RunningNodes) -> None:
        self._guards = list(guards)
        self._members = members

    def _open(self, method: str, context: Context, streaming: bool) -> _Sessions:
        call = Call(method, context, streaming, _member(context, self._members.members))
        opened: list[Session] = []
        try:
            for guard in self._guards:
                session = guard.open(call)
                if session is not None:
                    opened.append(session)
        except Refusal:
            for session in opened:
                session.close()
            raise
        return _Sessions(opened, method)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if handler is None or not (method in METHOD_RULES or method.startswith(_BROKER_SERVICES)):
            return handler
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._stream_stream(method, handler.stream_stream), **kwargs
            )
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._unary_stream(method, handler.unary_stream), **kwargs
            )
        if handler.request_streaming:
            return handler  # no client-streaming method in the public API
        return grpc.unary_unary_rpc_method_handler(
            self._unary_unary(method, handler.unary_unary), **kwargs
        )

    def _unary_unary(self, method: str, inner: Any) -> Any:
        async def behaviour(request: Any, context: Context) -> Any:
            try:
                sessions = self._open(method, context, streaming=False)
            except Refusal as refused:
                await context.abort(refused.code, refused.message)
            try:
                sessions.request(request)
                return sessions.response(await inner(request, context))
            except Refusal as refused:
                await context.abort(refused.code, refused.message)
            finally:
                sessions.close()

        return behaviour

    def _unary_stream(self, method: str, inner: Any) -> Any:
        async def behaviour(request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                sessions = self._open(method, context, streaming=True)
            except Refusal as refused:
                await context.abort(refused.code, refused.message)
            try:
                try:
                    sessions.request(request)
                except Refusal as refused:
                    await context.abort(refused.code, refused.message)
                async for response in inner(request, context):
                    yield sessions.response(response)
            finally:
                sessions.close()

        return behaviour

    def _stream_stream(self, method: str, inner: Any) -> Any:
        async def behaviour(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            try:
                sessions = self._open(method, context, streaming=True)
            except Refusal as refused:
                await context.abort(refused.code, refused.message)
            refusals: list[Refusal] = []

            async def checked() -> AsyncIterator[Any]:
                async for request in requests:
                    try:
                        sessions.request(request)
                    except Refusal as refused:
                        # Stop reading: what was taken is answered, then the refusal.
                        refusals.append(refused)
                        return
                    yield request

            try:
                async for response in inner(checked(), context):
                    yield sessions.response(response)
            finally:
                sessions.close()
            if refusals:
                await context.abort(refusals[0].code, refusals[0].message)

        return behaviour


def guard_interceptors(
    config: ClusterConfig, nodes: RunningNodes | None = None
) -> list[_ServerInterceptor]:
    """The interceptor a service's ServiceServer takes (see guards_for); ``nodes``: the
    node ids in force, following the running node set (the file's when not given)."""
    running = nodes or RunningNodes((n.id for n in config.nodes), (g.id for g in config.gateways))
    return [GuardInterceptor(guards_for(config), running)]
