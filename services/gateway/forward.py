"""Forwards the public broker API to the current master, byte for byte, retrying safely.

The gateway does not re-encode what it forwards: a generic handler passes serialized
requests and responses through, so forwarding costs one hop, and a status from the replica
(code, message, trailing metadata) reaches the app unchanged unless retrying changed it.

Unary calls go through a tenacity loop (`squall_server.gateway.retry` decides; this module
only calls and waits): each attempt goes to the master the group views name (waiting,
bounded, while there is none) or to the master a slave's redirect names; an indeterminate
attempt is retried only when the call is safe to repeat; retrying is bounded by the
[retry] section and by the caller's deadline. A deduplicated `Publish` (publisher id and a
sequence on every event) is not a call of its own to the master: each attempt is one
request on the stream the gateway keeps open to that master and shares between callers,
joined with theirs when they wait (`squall_server.gateway.shared_publish`), which spares
the master and the gateway a call's setup per event and the master a write per call.
Streams are forwarded once and not retried: the client library retries them on a fresh
stream.

With tracing on, each forwarded call gets a ``gateway.forward`` span (the master, its
epoch, the attempts and the status answered) between the call's server span and the
attempts' client spans, which carry the trace on to the master.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
import tenacity
from google.protobuf.message import DecodeError
from opentelemetry import context as otel_context
from opentelemetry import trace

from squall.v1 import broker_pb2
from squall.wire import stages as _stages
from squall.wire.long_poll import PULL_METHOD, pull_wait_s
from squall.wire.retry import Outcome, RetryPolicy, overall, status_lost
from squall_server.common.call_guard import CLIENT_PEER_KEY
from squall_server.common.grpc_server import Context
from squall_server.common.telemetry import Telemetry, current
from squall_server.gateway import retry
from squall_server.gateway.master import (
    Master,
    MasterTracker,
    NoMasterError,
    pairs,
    redirect_address,
)
from squall_server.gateway.reads import (
    READ_NODE_KEY,
    ReadSpread,
    Replica,
    UnknownReadFrom,
    spreads,
)
from squall_server.gateway.shared_publish import SharedPublishStreams, SharedStreamError
from squall_server.gateway.telemetry import GatewayInstruments, instruments

log = logging.getLogger("squall.gateway")

# Metadata the gRPC runtime owns; everything else (trace context, app headers) is passed on.
_RESERVED_PREFIXES = (":", "grpc-")
_RESERVED_KEYS = {"user-agent", "content-type", "te", "host"}

FORWARDED_SERVICES = ("TopicManager", "Publisher", "Subscriber", "PushSubscriptions")

# A retry is not started with less of the caller's deadline left than this.
_DEADLINE_SLACK_S = 0.01

_Metadata = tuple[tuple[str, str | bytes], ...]


def _forwardable(context: Context) -> _Metadata:
    # The app's token goes on (a replica checks it when it cannot see a gateway
    # certificate), and the app's connection is named so a replica applies the per-client
    # limits to the app, not to this gateway (services/common/call_guard.py).
    kept = tuple(
        (key, value)
        for key, value in pairs(context.invocation_metadata())
        if key not in _RESERVED_KEYS
        and not key.startswith(_RESERVED_PREFIXES)
        and key != CLIENT_PEER_KEY
    )
    return (*kept, (CLIENT_PEER_KEY, context.peer()))


async def _relay_error(context: Context, error: grpc.aio.AioRpcError) -> None:
    trailing = error.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(tuple(pairs(trailing)))
    await context.abort(error.code(), error.details() or "")


# grpcio's aio client replaces the status a server ended a stream with by an INTERNAL
# error (squall.wire.retry.status_lost) when a request was still being written at that
# moment (grpc/grpc#36066): the master refused one request of a publish stream and ended
# it while this gateway was forwarding the next. The refusal is lost; what is known is
# that requests without a response may or may not have been applied, which is UNKNOWN
# (retry with the same publisher id and sequence), never INTERNAL.
_LOST_STATUS_DETAILS = (
    "the master ended the stream while the gateway was still forwarding requests, and its "
    "reason was lost in transit; requests without a response may or may not have been "
    "applied: retry them with the same publisher id and sequence"
)


def _lost_stream_status(error: grpc.aio.AioRpcError) -> bool:
    """The forwarded stream's own status was overwritten by a failed write (see above)."""
    return status_lost(error.code().name, error.details() or "")


def _cancel_call(call: grpc.aio.Call, _done: object) -> None:
    call.cancel()


def _detach(tokens: list[object]) -> None:
    """Detaches the span context a forwarded stream attached, once."""
    while tokens:
        otel_context.detach(tokens.pop())  # type: ignore[arg-type]


def _asked_wait_s(path: str, request: bytes) -> float:
    """How long the master may wait because the request asks it to: a Pull's wait_ms
    (squall.wire.long_poll), which the forward's deadline must cover on top of its own."""
    if path != PULL_METHOD:
        return 0.0
    try:
        return pull_wait_s(broker_pb2.PullRequest.FromString(request).wait_ms)
    except DecodeError:
        return 0.0  # the master refuses it at once


def _remaining_s(context: Context) -> float | None:
    """The caller's deadline, in seconds from now (None: no deadline)."""
    remaining: float | None = context.time_remaining()
    return remaining


class _DeadlineNear(tenacity.stop.stop_base):
    """Stops retrying once the caller's deadline has (almost) passed."""

    def __init__(self, context: Context) -> None:
        self._context = context

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        remaining = _remaining_s(self._context)
        return remaining is not None and remaining <= _DEADLINE_SLACK_S


class _BudgetSpent(tenacity.stop.stop_base):
    """Stops retrying once the policy's time budget (or its optional attempt cap) is spent.

    Made when a call's first attempt starts; time is read from `monotonic` (a test passes
    a fake clock).
    """

    def __init__(
        self, policy: RetryPolicy, monotonic: Callable[[], float], started: float | None = None
    ) -> None:
        self._policy = policy
        self._monotonic = monotonic
        self._started = monotonic() if started is None else started

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        elapsed_ms = (self._monotonic() - self._started) * 1000
        return self._policy.exhausted(retry_state.attempt_number, elapsed_ms)


@dataclass
class _Failure:
    """How one attempt ended, as the app would see it if it is the last."""

    code: str
    details: str
    trailing: _Metadata = ()


class _Retry(Exception):
    """An attempt whose failure the policy retries."""

    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.details)
        self.failure = failure


class _Answer(Exception):
    """An attempt whose failure goes back to the app."""

    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.details)
        self.failure = failure


@dataclass
class _Call:
    """One forwarded unary call across its attempts."""

    method: str
    safe: bool
    effects: bool
    metadata: _Metadata
    outcomes: list[Outcome] = field(default_factory=list)
    # The master a slave named on the last attempt: the next attempt goes there.
    redirect: str = ""
    # The next attempt goes without backoff (a shared stream ended on another call).
    at_once: bool = False
    # Set for a publish that goes over the master's shared publish stream
    # (squall_server.gateway.shared_publish): the forwarded metadata without the app's
    # connection, which names the stream's link.
    shared_metadata: _Metadata | None = None
    # The status the app got.
    answered: str = "OK"


async def _marked(
    requests: AsyncIterator[bytes], keys: collections.deque[str]
) -> AsyncIterator[bytes]:
    """A publish stream's requests, each marked for the latency budget (squall.wire.stages)
    and its key queued for the response that answers it (responses come in order)."""
    async for raw in requests:
        request = broker_pb2.PublishRequest.FromString(raw)
        key = _stages.request_key(
            request.publisher_id, request.events[0].sequence if request.events else 0
        )
        _stages.mark("g.in", key)
        keys.append(key)
        yield raw


class Forwarder:
    """Builds the generic handlers that forward every broker method to the master."""

    def __init__(
        self,
        masters: MasterTracker,
        timeout_s: float,
        *,
        master_wait_s: float = 2.0,
        policy: RetryPolicy | None = None,
        gateway_id: str = "",
        observability: Telemetry | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        read_from: str = "master",
        shared: SharedPublishStreams | None = None,
    ) -> None:
        self._masters = masters
        # Deduplicated unary publishes share one stream per master (None: unary calls).
        self._shared = shared
        # Where a Subscribe that does not say goes ("master" or "replicas"), and the
        # streams open per replica that spreading them counts.
        self._read_from = read_from
        self._spread = ReadSpread()
        # The retry budget's clock (a test passes a fake).
        self._monotonic = monotonic
        self._timeout_s = timeout_s
        self._master_wait_s = master_wait_s
        self._policy = policy or RetryPolicy()
        self._policy.validate()
        self._gateway_id = gateway_id
        observed = observability or current()
        self._tracer = observed.tracer if observed.tracing else None
        self._instruments: GatewayInstruments | None = (
            instruments(observed) if observed.metering else None
        )

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        """One generic handler per forwarded service, covering all of its methods."""
        result = []
        for service_name in FORWARDED_SERVICES:
            service = broker_pb2.DESCRIPTOR.services_by_name[service_name]
            methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                methods[method.name] = self._handler(
                    path, method.name, method.client_streaming, method.server_streaming
                )
            result.append(grpc.method_handlers_generic_handler(service.full_name, methods))
        return result

    def _handler(
        self, path: str, name: str, client_stream: bool, server_stream: bool
    ) -> grpc.RpcMethodHandler[Any, Any]:
        make: Callable[..., grpc.RpcMethodHandler[Any, Any]]
        if client_stream and server_stream:
            make, behaviour = grpc.stream_stream_rpc_method_handler, self._stream_stream(path)
        elif server_stream:
            make, behaviour = grpc.unary_stream_rpc_method_handler, self._unary_stream(path)
        elif client_stream:
            raise ValueError(f"{path}: client-streaming methods are not forwarded")
        else:
            make, behaviour = grpc.unary_unary_rpc_method_handler, self._unary_unary(path, name)
        return make(behaviour)

    def _master_wait(self, context: Context) -> float:
        """How long a call may wait for a master: the configured bound or the deadline."""
        remaining = _remaining_s(context)
        if remaining is None:
            return self._master_wait_s
        return max(0.0, min(self._master_wait_s, remaining - _DEADLINE_SLACK_S))

    async def _master(self, context: Context) -> grpc.aio.Channel:
        try:
            return await self._masters.channel(self._master_wait(context))
        except NoMasterError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise

    # --- unary calls: attempts under the retry policy

    def _unary_unary(self, path: str, method: str) -> Callable[..., Any]:
        effects = retry.has_effects(method)
        shareable = method == "Publish"

        async def forward(request: bytes, context: Context) -> bytes:
            call = _Call(
                method=method,
                safe=retry.repeatable(method, request),
                effects=effects,
                metadata=_forwardable(context),
            )
            if shareable and call.safe and self._shared is not None and self._tracer is None:
                # Only a deduplicated publish: a stream shared with other callers can end
                # on another call's failure, and this one is then sent again. With
                # tracing on, each call keeps its own (traced) call to the master.
                call.shared_metadata = call.metadata[:-1]
            span, token = self._start_span(method)
            try:
                return await self._attempts(path, request, context, call)
            except (_Retry, _Answer) as ended:
                await self._answer(context, call, ended.failure)
                raise
            finally:
                self._finish(span, token, call)

        return forward

    def _start_span(self, method: str) -> tuple[trace.Span | None, object]:
        """The call's gateway.forward span, made current (None while tracing is off)."""
        if self._tracer is None:
            return None, None
        master = self._masters.master
        span = self._tracer.start_span(
            "gateway.forward",
            attributes={
                "squall.gateway": self._gateway_id,
                "rpc.method": method,
                "squall.master": master.node_id if master else "",
                "squall.epoch": master.epoch if master else 0,
            },
        )
        return span, otel_context.attach(trace.set_span_in_context(span))

    def _finish(self, span: trace.Span | None, token: object, call: _Call) -> None:
        """Counts the call and ends its span with the attempts and the status answered."""
        if self._instruments is not None:
            self._instruments.calls.add(
                1, {"node": self._gateway_id, "method": call.method, "code": call.answered}
            )
            if len(call.outcomes) > 1:
                self._instruments.retries.add(
                    len(call.outcomes) - 1, {"node": self._gateway_id, "method": call.method}
                )
        if span is None:
            return
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
        span.set_attribute("squall.attempts", len(call.outcomes))
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[call.answered].value[0])
        if call.answered != "OK":
            span.set_status(trace.Status(trace.StatusCode.ERROR, call.answered))
        span.end()

    async def _attempts(self, path: str, request: bytes, context: Context, call: _Call) -> bytes:
        """Runs attempts until one answers or the policy stops; raises the last failure.

        The first attempt runs outside tenacity: setting up its loop costs about as much
        as the forwarding itself, and nearly every call answers at the first attempt.
        A first attempt to retry is handed to tenacity as its own first attempt (raised
        again there), so the stop rules and the wait see exactly what they would have.
        """
        started = self._monotonic()
        try:
            return await self._attempt(path, request, context, call)
        except _Retry as failed:
            first: _Retry | None = failed
        policy = self._policy
        backoff = tenacity.wait_random_exponential(
            multiplier=policy.backoff_initial_ms / 1000, max=policy.backoff_max_ms / 1000
        )

        def wait_s(state: tenacity.RetryCallState) -> float:
            # A slave's redirect names a master that can take the call now; a shared
            # stream that ended on another call's definite failure left the master fine.
            if call.redirect or call.at_once:
                return 0.0
            return float(backoff(state))

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_any(
                _BudgetSpent(policy, self._monotonic, started), _DeadlineNear(context)
            ),
            wait=wait_s,
            retry=tenacity.retry_if_exception_type(_Retry),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if first is not None:
                    replayed, first = first, None
                    raise replayed
                return await self._attempt(path, request, context, call)
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _attempt(self, path: str, request: bytes, context: Context, call: _Call) -> bytes:
        """One attempt: to the redirect target, else to the master (waiting for one)."""
        address, call.redirect = call.redirect, ""
        if not address:
            master = await self._masters.wait_master(self._master_wait(context))
            if master is None:
                call.outcomes.append(
                    retry.attempt_outcome("UNAVAILABLE", redirected=False, forwarded=False)
                )
                raise _Answer(
                    _Failure(
                        "UNAVAILABLE",
                        "no master is elected (or reachable) right now; the call was not forwarded",
                    )
                )
            address = master.replica_address
        remaining = _remaining_s(context)
        own = self._timeout_s + _asked_wait_s(path, request)
        timeout_s = own if remaining is None else min(own, remaining)
        call.at_once = False
        link = (
            self._shared.stream(address, call.shared_metadata, CLIENT_PEER_KEY)
            if self._shared is not None and call.shared_metadata is not None
            else None
        )
        if link is not None:
            try:
                shared: bytes = await link.publish(request, timeout_s)
            except SharedStreamError as error:
                call.at_once = error.collateral
                self._failed(
                    call, address, error.code, error.details, error.trailing, error.forwarded
                )
            call.outcomes.append("ok")
            return shared
        try:
            response: bytes = await self._masters.channel_to(address).unary_unary(path, None, None)(
                request, timeout=timeout_s, metadata=call.metadata
            )
        except grpc.aio.AioRpcError as error:
            trailing = tuple(pairs(error.trailing_metadata()))
            self._failed(call, address, error.code().name, error.details() or "", trailing)
        call.outcomes.append("ok")
        return response

    def _failed(
        self,
        call: _Call,
        address: str,
        code: str,
        details: str,
        trailing: _Metadata,
        forwarded: bool = True,
    ) -> NoReturn:
        """Records a failed attempt and raises _Retry or _Answer as the policy says."""
        target = redirect_address(trailing)
        redirected = bool(target) and self._masters.knows(target) and target != address
        call.outcomes.append(
            retry.attempt_outcome(code, redirected=redirected, forwarded=forwarded)
        )
        failure = _Failure(code, details, trailing)
        if code == "UNAVAILABLE" and not redirected and not call.at_once:
            self._masters.suspect(address)
        if retry.after_attempt(code, redirected=redirected, safe=call.safe) == "retry":
            call.redirect = target if redirected else ""
            log.debug(
                "gateway: %s attempt %d to %s failed with %s; retrying%s",
                call.method,
                len(call.outcomes),
                address,
                code,
                f" at {target}" if redirected else "",
            )
            raise _Retry(failure) from None
        raise _Answer(failure) from None

    async def _answer(self, context: Context, call: _Call, failure: _Failure) -> None:
        """Ends the call with the last failure, marked indeterminate where it must be."""
        code = retry.answer_code(call.outcomes, failure.code, effects=call.effects)
        call.answered = code
        details = failure.details
        attempts = len(call.outcomes)
        if attempts > 1:
            maybe = call.effects and overall(call.outcomes) == "indeterminate"
            details += f" (after {attempts} attempts through the gateway"
            details += "; an earlier attempt may have been applied)" if maybe else ")"
            log.info(
                "gateway: %s answered %s after %d attempts (master %s, epoch=%d)",
                call.method,
                code,
                attempts,
                self._masters.master_id or "-",
                self._masters.epoch,
            )
        if failure.trailing:
            context.set_trailing_metadata(failure.trailing)
        await context.abort(grpc.StatusCode[code], details)

    # --- streams: forwarded once

    def _unary_stream(self, path: str) -> Callable[..., Any]:
        method = path.rpartition("/")[2]
        reads = method == "Subscribe"

        async def forward(request: bytes, context: Context) -> AsyncIterator[bytes]:
            replica = await self._read_replica(request, context) if reads else None
            channel = await self._master(context) if replica is None else None
            stream = _Call(method=method, safe=False, effects=False, metadata=())
            span, token = self._start_span(method)
            # The first call starts (and its client span takes its parent) with the span's
            # context attached; it is detached right after.
            tokens = [token] if token is not None else []
            marked = _delivery_topic(request) if reads and _stages.ENABLED else None
            try:
                if replica is not None:
                    responses = self._spread_stream(path, request, context, replica, stream, tokens)
                else:
                    assert channel is not None  # no replica chosen: the master's channel
                    responses = self._relayed(path, request, context, channel, stream, tokens)
                async for response in responses:
                    if marked is not None:
                        _mark_delivery(marked, response)
                    yield response
            finally:
                _detach(tokens)
                stream.outcomes.append("ok")
                self._finish(span, None, stream)

        return forward

    async def _relayed(
        self,
        path: str,
        request: bytes,
        context: Context,
        channel: grpc.aio.Channel,
        stream: _Call,
        tokens: list[object],
    ) -> AsyncIterator[bytes]:
        """One forwarded server stream, its status relayed to the app."""
        try:
            call = channel.unary_stream(path, None, None)(request, metadata=_forwardable(context))
        finally:
            _detach(tokens)
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            stream.answered = error.code().name
            if _lost_stream_status(error):
                await context.abort(grpc.StatusCode.UNKNOWN, _LOST_STATUS_DETAILS)
            await _relay_error(context, error)
        finally:
            call.cancel()

    async def _read_replica(self, request: bytes, context: Context) -> Replica | None:
        """The replica a Subscribe that may be spread goes to (None: the master's path)."""
        try:
            parsed = broker_pb2.SubscribeRequest.FromString(request)
        except DecodeError:
            return None  # the replica answers a bad request
        try:
            spread = spreads(parsed.read_from, self._read_from)
        except UnknownReadFrom as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not spread:
            return None
        master = await self._masters.wait_master(self._master_wait(context))
        if master is None:
            return None  # the master's path says so
        members = [Replica(node_id, address) for node_id, address in self._masters.group()]
        return self._spread.choose(members, master.node_id)

    async def _spread_stream(
        self,
        path: str,
        request: bytes,
        context: Context,
        replica: Replica,
        stream: _Call,
        tokens: list[object],
    ) -> AsyncIterator[bytes]:
        """A Subscribe served by `replica`; if it fails before its first response (a slave
        that died, that has not yet applied the topic, or is asked to create a durable
        subscription, which only the master can), once more by the master.

        Nothing was delivered before the first response, so the master starts the stream
        exactly where the replica would have.
        """
        metadata = _forwardable(context)
        attempts = [replica]
        master = self._masters.master
        if master is not None and master.node_id != replica.node_id:
            attempts.append(Replica(master.node_id, master.replica_address))
        for index, target in enumerate(attempts):
            last = index == len(attempts) - 1
            channel = self._masters.channel_to(target.address)
            try:
                call = channel.unary_stream(path, None, None)(request, metadata=metadata)
            finally:
                _detach(tokens)
            self._spread.opened(target.node_id)
            answered = False
            left: asyncio.Future[Master] | None = None
            if master is None or target.node_id != master.node_id:
                left = asyncio.ensure_future(self._masters.left_group(target.node_id))
                left.add_done_callback(functools.partial(_cancel_call, call))
            try:
                async for response in call:
                    if not answered:
                        answered = True
                        await context.send_initial_metadata(((READ_NODE_KEY, target.node_id),))
                    yield response
                if not answered:
                    await context.send_initial_metadata(((READ_NODE_KEY, target.node_id),))
                return
            except asyncio.CancelledError:
                if left is None or not left.done() or left.cancelled():
                    raise  # the app went away
                now = left.result()
                if answered or last:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the replica {target.node_id} serving this read left the master's "
                        f"group (master {now.node_id}, epoch {now.epoch}); subscribe again "
                        "from the last offset read",
                    )
                log.info(
                    "gateway %s: read from %s ended before its first response: it left the "
                    "master's group; reading from the master %s",
                    self._gateway_id,
                    target.node_id,
                    attempts[-1].node_id,
                )
            except grpc.aio.AioRpcError as error:
                if answered or last:
                    stream.answered = error.code().name
                    if _lost_stream_status(error):
                        await context.abort(grpc.StatusCode.UNKNOWN, _LOST_STATUS_DETAILS)
                    await _relay_error(context, error)
                log.info(
                    "gateway %s: read from %s failed before its first response (%s: %s); "
                    "reading from the master %s",
                    self._gateway_id,
                    target.node_id,
                    error.code().name,
                    error.details(),
                    attempts[-1].node_id,
                )
            finally:
                if left is not None:
                    left.cancel()
                call.cancel()
                self._spread.closed(target.node_id)

    def _stream_stream(self, path: str) -> Callable[..., Any]:
        method = path.rpartition("/")[2]
        # A publish stream ends when the master moves (see MasterTracker.moved_from).
        follows_master = method == "PublishStream"

        async def forward(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            keys: collections.deque[str] | None = None
            if _stages.ENABLED and follows_master:
                keys = collections.deque()
                requests = _marked(requests, keys)
            channel = await self._master(context)
            forwarded_to = self._masters.master
            stream = _Call(method=method, safe=False, effects=False, metadata=())
            span, token = self._start_span(method)
            try:
                call = channel.stream_stream(path, None, None)(
                    requests, metadata=_forwardable(context)
                )
            finally:
                if token is not None:
                    otel_context.detach(token)  # type: ignore[arg-type]
            moved: asyncio.Task[Master] | None = None
            if follows_master and forwarded_to is not None:
                moved = asyncio.ensure_future(
                    self._masters.moved_from(forwarded_to.replica_address)
                )
                moved.add_done_callback(lambda _done: call.cancel())
            try:
                async for response in call:
                    if keys:
                        _stages.mark("g.resp", keys.popleft())
                    yield response
                if moved is not None and moved.done() and not moved.cancelled():
                    await self._master_moved(context, forwarded_to, moved.result())
            except grpc.aio.AioRpcError as error:
                stream.answered = error.code().name
                if _lost_stream_status(error):
                    await context.abort(grpc.StatusCode.UNKNOWN, _LOST_STATUS_DETAILS)
                await _relay_error(context, error)
            except asyncio.CancelledError:
                if moved is None or not moved.done() or moved.cancelled():
                    raise  # the app went away
                await self._master_moved(context, forwarded_to, moved.result())
            finally:
                if moved is not None:
                    moved.cancel()
                call.cancel()
                stream.outcomes.append("ok")
                self._finish(span, None, stream)

        return forward

    async def _master_moved(self, context: Context, old: Master | None, new: Master) -> None:
        """Ends a publish stream whose master was replaced: the app retries on a new one."""
        was = f"{old.node_id} (epoch {old.epoch})" if old is not None else "?"
        log.info(
            "gateway: publish stream to %s ended: the master is now %s (epoch=%d)",
            was,
            new.node_id,
            new.epoch,
        )
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"the master moved from {was} to {new.node_id} (epoch {new.epoch}) while this "
            "publish stream was open; requests without a response may or may not have been "
            "applied: retry them with the same publisher id and sequence",
        )


def _delivery_topic(request: bytes) -> str | None:
    """The topic of a Subscribe whose deliveries get stage marks (None if unparsable)."""
    try:
        return broker_pb2.SubscribeRequest.FromString(request).topic
    except DecodeError:
        return None


def _mark_delivery(topic: str, response: bytes) -> None:
    """Stage mark "g.d": a delivery read from the replica, keyed by its first event's
    offset as the replica's "d.out" is (stage marks on only: it parses the response)."""
    try:
        events = broker_pb2.SubscribeResponse.FromString(response).events
    except DecodeError:
        return
    if events:
        _stages.mark("g.d", f"off/{topic}/{events[0].offset}")
