"""The replica's gRPC servicers: thin adapters from requests to the node, each through
the narrow interface it names (``endpoints``: ``TopicsEndpoint``, ``PublishEndpoint``,
``SubscribeEndpoint``; ``control_endpoints``: ``ControlEndpoint`` for ``ReplicaControl``).

Every refusal is a ServiceError raised where the reason is known; `_answering` turns it
into the status the client sees. Nothing here decides anything about the data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, NoReturn

import grpc

from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    replica_pb2,
    replica_pb2_grpc,
)
from squall.wire import stages as _stages
from squall_server.common.errors import (
    INLINE_ERRORS,
    PUBLISH_ERRORS_KEY,
    Code,
    ServiceError,
    invalid,
)
from squall_server.common.grpc_server import Context
from squall_server.common.loss import loss_to_proto
from squall_server.replica import commands, handoff, link_rules, remote, seek, shutdown
from squall_server.replica.control_endpoints import ControlEndpoint
from squall_server.replica.endpoints import (
    FaultSink,
    PublishEndpoint,
    SubscribeEndpoint,
    TopicsEndpoint,
)
from squall_server.replica.node import UNREACHABLE_KEY
from squall_server.replica.shared_master import SharedMaster
from squall_server.replica.store import CorruptRecordError, TopicInfo, UnknownTopicError
from squall_server.replica.telemetry import DeliveryWatch, JoinedWatch, PublishWatch

log = logging.getLogger("squall.replica")

# How long a following subscriber waits for a commit before it rechecks its topic.
_FOLLOW_RECHECK_S = 1.0
# Requests a pipelined publish stream may have in flight before it stops reading.
_STREAM_INFLIGHT_MAX = 64
# Left of a call's deadline for the answer after holding it for a role.
_HOLD_SLACK_S = 0.2
# Trailing metadata on a Subscribe stream ended (ABORTED) by a seek: the new cursor.
SEEK_CURSOR_METADATA = "squall-seek-cursor"


async def abort(context: Context, exc: ServiceError) -> NoReturn:
    """Ends the call with the error's status, message and metadata."""
    if exc.metadata:
        context.set_trailing_metadata(exc.metadata)
    await context.abort(grpc.StatusCode[exc.code.value], exc.message)
    raise AssertionError("unreachable: context.abort raises")


class _translating:  # lowercase: called like the function it replaced
    """Maps store errors that reach a handler to ServiceErrors; a checksum error is also a
    fault of this node's store, which quarantines the node. (A class, not a generator
    context manager: every publish request and every subscriber read passes through.)"""

    __slots__ = ("_node",)

    def __init__(self, node: FaultSink) -> None:
        self._node = node

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, CorruptRecordError):
            self._node.report_fault(f"checksum error serving a read: {exc}")
            raise ServiceError(Code.DATA_LOSS, f"corrupt record, not served: {exc}") from exc
        if isinstance(exc, UnknownTopicError):
            # The topic was destroyed between the caller's lookup and the read.
            raise ServiceError(Code.NOT_FOUND, str(exc)) from exc


def _deadline_in_ms(context: Context) -> int | None:
    """The caller's deadline in milliseconds from now (None: it set none)."""
    remaining: float | None = context.time_remaining()
    return None if remaining is None else int(remaining * 1000)


def _committed_end(hidden: int | None, next_offset: int) -> int:
    """Where committed reads of a topic end: its first hidden offset, else its end."""
    return next_offset if hidden is None else hidden


def topic_message(topic: TopicInfo, next_offset: int | None = None) -> common_pb2.Topic:
    """The wire form of a topic."""
    return common_pb2.Topic(
        name=topic.name,
        kind=topic.kind,
        next_offset=topic.next_offset if next_offset is None else next_offset,
        first_offset=topic.first_offset,
        created_ms=topic.created_ms,
        size_bytes=topic.size_bytes or 0,
        # A transient topic's events are not stored, so its store count means nothing.
        size_known=topic.size_bytes is not None and topic.kind != common_pb2.TOPIC_KIND_TRANSIENT,
    )


class TopicManager(broker_pb2_grpc.TopicManagerServicer):
    """Topic administration and publisher proxies."""

    def __init__(self, node: TopicsEndpoint) -> None:
        self.node = node

    def _message(self, topic: TopicInfo) -> common_pb2.Topic:
        if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
            return topic_message(
                topic, self.node.transient.next_offset(topic.name, topic_id=topic.topic_id)
            )
        return topic_message(topic)

    async def CreateTopic(
        self, request: broker_pb2.CreateTopicRequest, context: Context
    ) -> broker_pb2.CreateTopicResponse:
        kind = request.kind or common_pb2.TOPIC_KIND_REPLICATED
        try:
            await self.node.write(commands.CreateTopic(request.name, kind))
        except ServiceError as exc:
            await abort(context, exc)
        log.info(
            "created topic '%s' (epoch=%d lsn=%d)",
            request.name,
            self.node.epoch,
            self.node.last_lsn,
        )
        return broker_pb2.CreateTopicResponse(topic=self._message(self.node.topic(request.name)))

    async def RetrieveTopic(
        self, request: broker_pb2.RetrieveTopicRequest, context: Context
    ) -> broker_pb2.RetrieveTopicResponse:
        try:
            with _translating(self.node):
                topic = self.node.topic(request.name)
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.RetrieveTopicResponse(topic=self._message(topic))

    async def ListTopics(
        self, request: broker_pb2.ListTopicsRequest, context: Context
    ) -> broker_pb2.ListTopicsResponse:
        try:
            with _translating(self.node):
                topics = self.node.store.list_topics()
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.ListTopicsResponse(topics=[self._message(t) for t in topics])

    async def DestroyTopic(
        self, request: broker_pb2.DestroyTopicRequest, context: Context
    ) -> broker_pb2.DestroyTopicResponse:
        try:
            await self.node.write(commands.DestroyTopic(request.name))
        except ServiceError as exc:
            await abort(context, exc)
        self.node.transient.drop(request.name)
        log.info(
            "destroyed topic '%s' (epoch=%d lsn=%d)",
            request.name,
            self.node.epoch,
            self.node.last_lsn,
        )
        return broker_pb2.DestroyTopicResponse()

    async def LinkTopic(
        self, request: broker_pb2.LinkTopicRequest, context: Context
    ) -> broker_pb2.LinkTopicResponse:
        try:
            to_kind = None
            if request.to_cluster:
                to_kind = await self._probe_remote(request.to_cluster, request.to_topic)
            plan = await self.node.write(
                commands.LinkTopic(
                    request.from_topic,
                    request.to_topic,
                    request.cost,
                    to_cluster=request.to_cluster,
                    to_kind=to_kind,
                )
            )
        except ServiceError as exc:
            await abort(context, exc)
        assert plan.link is not None
        self.node.links.refresh()
        log.info(
            "linked topic '%s' to '%s' with cost %d from offset %d (epoch=%d lsn=%d)",
            request.from_topic,
            link_rules.link_target(request.to_cluster, request.to_topic),
            request.cost,
            plan.link.start_offset,
            self.node.epoch,
            plan.link.created_lsn,
        )
        return broker_pb2.LinkTopicResponse(link=self._link_info(plan.link))

    async def UnlinkTopic(
        self, request: broker_pb2.UnlinkTopicRequest, context: Context
    ) -> broker_pb2.UnlinkTopicResponse:
        try:
            await self.node.write(
                commands.UnlinkTopic(request.from_topic, request.to_topic, request.to_cluster)
            )
        except ServiceError as exc:
            await abort(context, exc)
        self.node.links.refresh()
        log.info(
            "unlinked topic '%s' from '%s' (epoch=%d lsn=%d)",
            request.from_topic,
            link_rules.link_target(request.to_cluster, request.to_topic),
            self.node.epoch,
            self.node.last_lsn,
        )
        return broker_pb2.UnlinkTopicResponse()

    async def GetLinkInfo(
        self, request: broker_pb2.GetLinkInfoRequest, context: Context
    ) -> broker_pb2.GetLinkInfoResponse:
        try:
            with _translating(self.node):
                if request.topic:
                    self.node.topic(request.topic)
                links = self.node.store.list_links(request.topic or None)
                infos = [self._link_info(link) for link in links]
        except ServiceError as exc:
            await abort(context, exc)
        infos.sort(key=lambda i: (i.from_topic, i.to_cluster, i.to_topic))
        return broker_pb2.GetLinkInfoResponse(links=infos)

    async def RetryLink(
        self, request: broker_pb2.RetryLinkRequest, context: Context
    ) -> broker_pb2.RetryLinkResponse:
        try:
            self.node.check_writable()  # a slave redirects: only the master forwards
            with _translating(self.node):
                self.node.topic(request.from_topic)
                link = self._one_link(request.from_topic, request.to_topic, request.to_cluster)
            stopped_reason = await self.node.links.retry(link)
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.RetryLinkResponse(
            link=self._link_info(link), was_stopped=bool(stopped_reason)
        )

    def _one_link(self, from_topic: str, to_topic: str, to_cluster: str) -> replica_pb2.LinkTopicOp:
        for link in self.node.store.list_links(from_topic):
            if (link.to_topic, link.to_cluster) == (to_topic, to_cluster):
                return link
        target = link_rules.link_target(to_cluster, to_topic)
        raise ServiceError(Code.NOT_FOUND, f"topic '{from_topic}' is not linked to '{target}'")

    async def _probe_remote(
        self, to_cluster: str, to_topic: str
    ) -> common_pb2.TopicKind.ValueType | None:
        """The remote topic's kind (None: it does not exist there), checked before the
        link is written; ServiceError naming an unknown remote or what the remote said."""
        config = self.node.config.remote(to_cluster)
        if config is None:
            configured = ", ".join(r.name for r in self.node.config.remotes) or "none"
            raise invalid(
                f"no [[remotes]] entry named '{to_cluster}' in the cluster file "
                f"(configured: {configured}); nothing was linked"
            )
        self.node.check_writable()  # a slave redirects before calling anyone
        try:
            return await remote.probe(config, to_topic, self.node.config.limits.max_message_bytes)
        except ServiceError as exc:
            if exc.code == Code.NOT_FOUND:
                return None
            raise ServiceError(exc.code, f"{exc.message}; nothing was linked") from None

    def _link_info(self, link: replica_pb2.LinkTopicOp) -> broker_pb2.LinkInfo:
        position, lag_events, lag_ms = self.node.links.lag(link)
        return broker_pb2.LinkInfo(
            from_topic=link.from_topic,
            to_topic=link.to_topic,
            cost=link.cost,
            start_offset=link.start_offset,
            next_offset=position,
            lag_events=lag_events,
            publisher_id=link_rules.link_publisher_id(
                link.created_lsn, self.node.config.name if link.to_cluster else ""
            ),
            created_lsn=link.created_lsn,
            to_cluster=link.to_cluster,
            lag_ms=lag_ms,
            stopped_reason=self.node.links.stopped_reason(link),
        )

    def _proxy(self, topic: str, replicated: bool) -> broker_pb2.GetPublisherResponse:
        self.node.topic(topic)
        master = self.node.master
        if master is None:
            raise ServiceError(Code.UNAVAILABLE, "no master is elected; try again shortly")
        nodes = [master] + [n for n in self.node.config.nodes if n.id != master.id]
        if not replicated:
            nodes = [master]
        return broker_pb2.GetPublisherResponse(
            topic=topic,
            endpoints=[
                common_pb2.NodeEndpoint(
                    node_id=n.id,
                    replica_address=n.replica_address,
                    coordinator_address=n.coordinator_address,
                    priority=n.priority,
                )
                for n in nodes
            ],
            replicated=replicated,
            epoch=self.node.epoch,
        )

    async def GetPublisher(
        self, request: broker_pb2.GetPublisherRequest, context: Context
    ) -> broker_pb2.GetPublisherResponse:
        try:
            return self._proxy(request.topic, replicated=True)
        except ServiceError as exc:
            await abort(context, exc)

    async def GetNonReplicatedPublisher(
        self, request: broker_pb2.GetPublisherRequest, context: Context
    ) -> broker_pb2.GetPublisherResponse:
        try:
            return self._proxy(request.topic, replicated=False)
        except ServiceError as exc:
            await abort(context, exc)


class Publisher(broker_pb2_grpc.PublisherServicer):
    """Unary and pipelined publishing."""

    def __init__(self, node: PublishEndpoint) -> None:
        self.node = node

    async def _hold(self, context: Context) -> None:
        """Holds a publisher proxy's call while this replica has no master to offer it.

        Only calls that name unreachable replicas are held (a proxy failing over): the
        wait ends at the next role command, the call's deadline less a margin, or
        `timeouts.rpc_timeout_ms`, whichever comes first; then the call is served,
        redirected or refused as usual.
        """
        unreachable = frozenset(
            address
            for key, value in context.invocation_metadata() or ()
            if key == UNREACHABLE_KEY
            for address in (value.decode() if isinstance(value, bytes) else value).split(",")
            if address
        )
        if not unreachable:
            return
        timeout_s = self.node.config.timeouts.rpc_timeout_ms / 1000
        remaining = context.time_remaining()
        if remaining is not None:
            timeout_s = min(timeout_s, remaining - _HOLD_SLACK_S)
        await self.node.wait_for_role(unreachable, timeout_s)

    def _start(
        self, request: broker_pb2.PublishRequest
    ) -> asyncio.Future[broker_pb2.PublishResponse]:
        """Begins one publish; the future resolves to its response once committed."""
        observed = self.node.telemetry
        watch = (
            PublishWatch(observed, request, *self._where(), published=self.node.published_traces)
            if observed.active
            else None
        )
        try:
            receipt = self.node.start_publish(request, watch.traced if watch else None)
        except BaseException as exc:
            if watch is not None:
                watch.failed(exc)
            raise
        request_id = request.request_id
        compact = request.compact_receipts
        key = _stage_key(request) if _stages.ENABLED else ""
        # Chained by callbacks, not a task: one publish at a time pays no task per event.
        answer: asyncio.Future[broker_pb2.PublishResponse] = (
            asyncio.get_running_loop().create_future()
        )

        def respond(done: asyncio.Future[common_pb2.BatchReceipt]) -> None:
            if answer.done():
                return  # the caller gave up
            if done.cancelled():
                if watch is not None:
                    watch.failed(asyncio.CancelledError())
                answer.cancel()
                return
            error = done.exception()
            if error is not None:
                if watch is not None:
                    watch.failed(error)
                answer.set_exception(error)
                return
            got = done.result()
            if watch is not None:
                watch.done(got)
            if key:
                _stages.mark("m.resp", key)
            try:
                response = (
                    broker_pb2.PublishResponse(batch=got, request_id=request_id)
                    if compact
                    else broker_pb2.PublishResponse(
                        receipts=commands.expand_receipt(got), request_id=request_id
                    )
                )
            except Exception as exc:  # the caller hears it rather than waiting for ever
                answer.set_exception(exc)
                return
            answer.set_result(response)

        def answered(ended: asyncio.Future[broker_pb2.PublishResponse]) -> None:
            # One callback (one loop handle per publish) for both: the caller gave up
            # (cancelled: the write's wait is cancelled too), or the outcome is seen.
            if ended.cancelled():
                receipt.cancel()
            else:
                _seen(ended)

        receipt.add_done_callback(respond)
        answer.add_done_callback(answered)
        return answer

    def _where(self) -> tuple[str, int]:
        return self.node.node.id, self.node.epoch

    def _start_parts(
        self, request: broker_pb2.PublishRequest
    ) -> asyncio.Future[broker_pb2.PublishResponse]:
        """Begins a joined request's parts, each as a publish of its own, in order; the
        future resolves to one response with an answer per part (a failed part's answer is
        its error: it fails alone). ServiceError for a malformed joined request."""
        parts = request.parts
        limit = self.node.config.limits.max_batch_events
        if request.events:
            raise invalid("a publish request carries events or parts, not both")
        if len(parts) > limit:
            raise invalid(f"{len(parts)} parts in one request exceed max_batch_events ({limit})")
        if any(part.parts for part in parts):
            raise invalid("a part of a publish request cannot have parts of its own")
        if not self.node.telemetry.tracing:
            return self._start_joined(request)
        loop = asyncio.get_running_loop()
        started: list[asyncio.Future[broker_pb2.PublishResponse]] = []
        for part in parts:
            try:
                with _translating(self.node):
                    started.append(self._start(part))
            except ServiceError as exc:
                failed: asyncio.Future[broker_pb2.PublishResponse] = loop.create_future()
                failed.set_exception(exc)
                started.append(failed)
        answer: asyncio.Future[broker_pb2.PublishResponse] = loop.create_future()
        request_id = request.request_id
        left = [len(started)]

        def part_done(_: asyncio.Future[broker_pb2.PublishResponse]) -> None:
            left[0] -= 1
            if left[0] or answer.done():
                return
            response = broker_pb2.PublishResponse(request_id=request_id)
            for part, future in zip(parts, started, strict=True):
                response.parts.append(_part_answer(part, future))
            answer.set_result(response)

        for future in started:
            future.add_done_callback(part_done)
        answer.add_done_callback(
            lambda ended: [f.cancel() for f in started] if ended.cancelled() else None
        )
        return answer

    def _start_joined(
        self, request: broker_pb2.PublishRequest
    ) -> asyncio.Future[broker_pb2.PublishResponse]:
        """Begins an untraced joined request's parts as one write (``start_publish_parts``);
        the answers (and, metering, the metrics) are what ``_start`` would give each part."""
        parts = request.parts
        observed = self.node.telemetry
        watch = JoinedWatch(observed, self.node.node.id) if observed.metering else None
        outcomes = self.node.start_publish_parts(parts)
        answer: asyncio.Future[broker_pb2.PublishResponse] = (
            asyncio.get_running_loop().create_future()
        )
        request_id = request.request_id
        key = _stages.ENABLED

        def respond(done: asyncio.Future[list[common_pb2.BatchReceipt | BaseException]]) -> None:
            if answer.done():
                return  # the caller gave up
            if done.cancelled():
                answer.cancel()
                return
            response = broker_pb2.PublishResponse(request_id=request_id)
            try:
                for part, outcome in zip(parts, done.result(), strict=True):
                    if key:
                        _stages.mark("m.resp", _stage_key(part))
                    if watch is not None and not isinstance(outcome, BaseException):
                        watch.done(len(part.events))
                    response.parts.append(_joined_answer(part, outcome))
            except Exception as exc:  # the caller hears it rather than waiting for ever
                answer.set_exception(exc)
                return
            answer.set_result(response)

        outcomes.add_done_callback(respond)
        answer.add_done_callback(lambda ended: outcomes.cancel() if ended.cancelled() else None)
        return answer

    def _begin(self, request: broker_pb2.PublishRequest, *, alone: bool = False) -> _Begun:
        """Begins a publish request, plain or joined (PublishRequest.parts): a future and
        what turns its result into the response.

        An untraced plain publish (telemetry off) waits on the writer's own future and
        builds its response where it is awaited: no future, callback or loop turn of its
        own between the commit and the answer (issue 16); ``alone``, nothing else of its
        caller's in flight, lets the write begin at once (``Writer.submit``). A traced one
        (its watch hears the outcome as it happens, awaited or not) and a joined one
        resolve to the response itself."""
        if request.parts:
            return self._start_parts(request), _same
        if self.node.telemetry.active:
            return self._start(request), _same
        planned = self.node.begin_publish(request, alone=alone)
        return planned, _Respond(request, _stage_key(request) if _stages.ENABLED else "")

    async def Publish(
        self, request: broker_pb2.PublishRequest, context: Context
    ) -> broker_pb2.PublishResponse:
        await self._hold(context)
        try:
            with _translating(self.node):
                future, respond = self._begin(request, alone=True)
                # A caller that gives up cancels the future: the write's wait with it.
                return respond(await future)
        except ServiceError as exc:
            await abort(context, exc)

    async def PublishStream(
        self,
        request_iterator: AsyncIterator[broker_pb2.PublishRequest],
        context: Context,
    ) -> AsyncIterator[broker_pb2.PublishResponse]:
        inflight: asyncio.Queue[_Begun | None] = asyncio.Queue(maxsize=_STREAM_INFLIGHT_MAX)
        loop = asyncio.get_running_loop()
        await self._hold(context)
        inline = any(
            key == PUBLISH_ERRORS_KEY and value == INLINE_ERRORS
            for key, value in context.invocation_metadata() or ()
        )
        # Requests begun and not yet answered on this stream.
        unanswered = 0

        async def read_requests() -> None:
            nonlocal unanswered
            try:
                async for request in request_iterator:
                    if _stages.ENABLED:
                        _stages.mark("m.in", _stage_key(request))
                    try:
                        with _translating(self.node):
                            # Alone: the stream has no earlier request unanswered.
                            begun = self._begin(request, alone=not unanswered)
                    except ServiceError as exc:
                        future: asyncio.Future[Any] = loop.create_future()
                        future.set_exception(exc)
                        future.add_done_callback(_seen)
                        begun = future, _same
                    unanswered += 1
                    try:
                        await inflight.put(begun)
                    except BaseException:
                        begun[0].add_done_callback(_seen)  # nobody will await it
                        raise
            finally:
                await inflight.put(None)

        reader = asyncio.create_task(read_requests())
        reader.add_done_callback(_seen)
        try:
            while True:
                begun = await inflight.get()
                if begun is None:
                    break
                future, respond = begun
                try:
                    response = respond(await future)
                except ServiceError as exc:
                    if not inline:
                        await abort(context, exc)
                    response = broker_pb2.PublishResponse(
                        error=broker_pb2.PublishError(
                            code=exc.code.value, message=exc.message, metadata=dict(exc.metadata)
                        )
                    )
                unanswered -= 1
                yield response
            await reader
        finally:
            reader.cancel()
            # Futures the stream ended before awaiting (it ends at the first failure):
            # their outcomes have nobody left to tell (`_seen`).
            for _ in range(inflight.qsize()):  # bounded: nothing is added any more
                left = inflight.get_nowait()
                if left is not None:
                    left[0].add_done_callback(_seen)


# A publish begun: what it waits on, and what makes the response of its result.
_Begun = tuple["asyncio.Future[Any]", "Callable[[Any], broker_pb2.PublishResponse]"]


def _same(response: broker_pb2.PublishResponse) -> broker_pb2.PublishResponse:
    """The response of a future that resolves to the response itself."""
    return response


class _Respond:
    """The response to an untraced plain publish, from its committed plan (as
    ``Publisher._start``'s callback builds it for a traced one)."""

    __slots__ = ("_compact", "_key", "_request_id")

    def __init__(self, request: broker_pb2.PublishRequest, key: str) -> None:
        self._request_id = request.request_id
        self._compact = request.compact_receipts
        self._key = key

    def __call__(self, plan: commands.Planned) -> broker_pb2.PublishResponse:
        got = plan.receipt
        if got is None:
            raise AssertionError("a planned publish always has a receipt")
        if self._key:
            _stages.mark("m.resp", self._key)
        if self._compact:
            return broker_pb2.PublishResponse(batch=got, request_id=self._request_id)
        return broker_pb2.PublishResponse(
            receipts=commands.expand_receipt(got), request_id=self._request_id
        )


def _part_answer(
    part: broker_pb2.PublishRequest, done: asyncio.Future[broker_pb2.PublishResponse]
) -> broker_pb2.PublishResponse:
    """One part's answer in a joined response: its receipts, or its error inline."""
    if done.cancelled():
        return broker_pb2.PublishResponse(
            request_id=part.request_id,
            error=broker_pb2.PublishError(code="CANCELLED", message="the publish was cancelled"),
        )
    error = done.exception()
    if error is None:
        return done.result()
    return _error_answer(part, error)


def _error_answer(
    part: broker_pb2.PublishRequest, error: BaseException
) -> broker_pb2.PublishResponse:
    """A failed part's answer: its error inline."""
    if isinstance(error, ServiceError):
        return broker_pb2.PublishResponse(
            request_id=part.request_id,
            error=broker_pb2.PublishError(
                code=error.code.value, message=error.message, metadata=dict(error.metadata)
            ),
        )
    # Anything else is a bug on this side: the caller hears an indeterminate failure (its
    # publish may have been planned) and retries under the same ids.
    return broker_pb2.PublishResponse(
        request_id=part.request_id,
        error=broker_pb2.PublishError(code="UNKNOWN", message=f"publish failed: {error!r}"),
    )


def _joined_answer(
    part: broker_pb2.PublishRequest, outcome: common_pb2.BatchReceipt | BaseException
) -> broker_pb2.PublishResponse:
    """One part's answer in a joined response, as ``_start`` and ``_part_answer`` give it:
    its receipts (compact or one per event, as the part asked), or its error inline."""
    if isinstance(outcome, BaseException):
        return _error_answer(part, outcome)
    if part.compact_receipts:
        return broker_pb2.PublishResponse(batch=outcome, request_id=part.request_id)
    return broker_pb2.PublishResponse(
        receipts=commands.expand_receipt(outcome), request_id=part.request_id
    )


def _stage_key(request: broker_pb2.PublishRequest) -> str:
    """A publish request's key in the latency budget's stage marks (squall.wire.stages)."""
    first = request.events[0].sequence if request.events else 0
    return _stages.request_key(request.publisher_id, first)


def _seen(future: asyncio.Future[Any]) -> None:
    """Marks a finished publish (or a stream's request reader) as observed.

    A pipelined stream answers in request order and ends at the first failure: when a
    deposed master fails every write in flight at once, the first failure ends the stream
    with its status (the client then treats every unanswered request as indeterminate and
    retries it with the same ids), and the later failures have nobody left to tell. Without
    this, each of them would be logged as "Task exception was never retrieved" when
    collected; the stream's writer still awaits, and answers, every one it reaches.
    """
    if not future.cancelled():
        future.exception()


class Subscriber(broker_pb2_grpc.SubscriberServicer):
    """Committed reads from an offset or a durable cursor, and acks."""

    def __init__(self, node: SubscribeEndpoint) -> None:
        self.node = node
        self.shared = SharedMaster(node)

    async def _start_offset(
        self, request: broker_pb2.SubscribeRequest, topic: TopicInfo
    ) -> tuple[int, int]:
        """Where the stream starts, and the durable cursor's seek generation (0 if none)."""
        transient = topic.kind == common_pb2.TOPIC_KIND_TRANSIENT
        next_offset = (
            self.node.transient.next_offset(topic.name, topic_id=topic.topic_id)
            if transient
            else topic.next_offset
        )
        start = request.start
        if start == broker_pb2.START_POSITION_LATEST:
            # The committed end: events stored above it (a slave holds them before it
            # learns their commit) may still be truncated and their offsets reused by the
            # next master's events, which a reader placed past them would skip.
            offset = (
                next_offset
                if transient
                else _committed_end(self.node.visible_end(topic.name), next_offset)
            )
        elif start == broker_pb2.START_POSITION_OFFSET:
            if request.offset > next_offset and not transient:
                if self.node.role != common_pb2.ROLE_MASTER:
                    # Only a master's store has every committed event. A slave may lag its
                    # master, and a node taking the master role may be reached (the gateway
                    # follows the coordinators' view) before it has fetched the log: a
                    # reader resuming after a failover was refused there, its subscription
                    # ended, though its offset was good.
                    raise ServiceError(
                        Code.UNAVAILABLE,
                        f"offset {request.offset} is beyond what replica {self.node.node.id} "
                        f"holds of topic '{topic.name}' (next offset {next_offset}), and it is "
                        "not the master: it may be behind; retry",
                    )
                raise invalid(
                    f"offset {request.offset} is beyond the end of topic '{topic.name}' "
                    f"(next offset {next_offset})"
                )
            offset = request.offset
        elif transient:
            # IceStorm's event model: a transient topic's events go to the subscribers
            # there are now; the ring only lets a briefly slow one catch up.
            offset = next_offset
        elif start == broker_pb2.START_POSITION_TIMESTAMP:
            # The first event at or after the time; clamped to the oldest held, as a seek.
            offset = seek.resolve(
                topic,
                start,
                offset=0,
                timestamp_ms=request.timestamp_ms,
                now_ms=self.node.clock.wall_ms(),
                lookup=lambda ms: self.node.store.offset_at_time(topic.name, ms),
            ).cursor
        elif start in (broker_pb2.START_POSITION_UNSPECIFIED, broker_pb2.START_POSITION_EARLIEST):
            offset = topic.first_offset
        else:
            raise invalid(f"unknown start position {start}")
        if not request.subscription:
            return offset, 0
        if transient:
            raise invalid(f"topic '{topic.name}' is transient: it has no durable subscriptions")
        if self.node.store.get_shared_settings(topic.name, request.subscription) is not None:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"subscription '{request.subscription}' on topic '{topic.name}' is shared: "
                "read it with Pull",
            )
        state = self.node.store.get_cursor_state(topic.name, request.subscription)
        if state is not None:
            return state
        plan = await self.node.write(
            commands.SetCursor(topic.name, request.subscription, offset, create=True)
        )
        state = self.node.store.get_cursor_state(topic.name, request.subscription)
        return state if state is not None else (plan.cursor, 0)

    def _transient_here(self, topic: str) -> None:
        """Refuses a transient topic's stream anywhere but on the master: its events live
        in the master's memory only, so a slave would serve nothing. The refusal names the
        master (a gateway then reads from it)."""
        if self.node.role == common_pb2.ROLE_MASTER:
            return
        try:
            self.node.check_writable()
        except ServiceError as exc:
            raise ServiceError(
                exc.code,
                f"topic '{topic}' is transient: its events are only on the master; {exc.message}",
                metadata=exc.metadata,
            ) from None

    def _moved_by_seek(self, topic: str, subscription: str, generation: int) -> ServiceError | None:
        """ABORTED when a seek moved the durable cursor since the stream started.

        The stream's position is no longer where the subscription is: its reader starts
        again from the new cursor (the library does, at once) instead of reading on from
        the old place.
        """
        state = self.node.store.get_cursor_state(topic, subscription)
        if state is None or state[1] == generation:
            return None
        return ServiceError(
            Code.ABORTED,
            f"subscription '{subscription}' on topic '{topic}' was moved by a seek to "
            f"offset {state[0]} (generation {state[1]}): subscribe again to read from there",
            metadata=((SEEK_CURSOR_METADATA, str(state[0])),),
        )

    async def Subscribe(
        self, request: broker_pb2.SubscribeRequest, context: Context
    ) -> AsyncIterator[broker_pb2.SubscribeResponse]:
        node = self.node
        limits = node.config.limits
        batch = min(
            request.max_batch_events or limits.subscribe_batch_max_events,
            limits.subscribe_batch_max_events,
        )
        # Encoded bytes per response: by default under gRPC's default 4 MiB receive limit,
        # so an app with default channel options reads large events; more only on request.
        batch_bytes = min(
            request.max_batch_bytes or limits.subscribe_batch_default_bytes,
            limits.max_batch_bytes,
        )
        try:
            with _translating(self.node):
                topic = node.topic(request.topic)
                if topic.kind == common_pb2.TOPIC_KIND_TRANSIENT:
                    self._transient_here(topic.name)
                position, generation = await self._start_offset(request, topic)
        except ServiceError as exc:
            await abort(context, exc)
        transient = topic.kind == common_pb2.TOPIC_KIND_TRANSIENT
        end = request.end_offset
        delivery = (
            DeliveryWatch(node.telemetry, node.node.id, topic.name, node.published_traces)
            if node.telemetry.active
            else None
        )
        if not request.follow:
            # Committed reads: events above the commit LSN are not served yet.
            try:
                now_end = (
                    node.transient.next_offset(topic.name, topic_id=topic.topic_id)
                    if transient
                    else _committed_end(node.visible_end(topic.name), topic.next_offset)
                )
            except ServiceError as exc:
                await abort(context, exc)
            end = min(end, now_end) if end else now_end
            if not end:
                return  # nothing committed to serve (an end of 0 would read as "no end")
        durable = request.subscription
        # A follow stream a slave serves ends when the slave loses its role (cut off from its
        # master it would learn no commit, and its reader would wait for ever): the reader
        # subscribes again and is served by a replica that has a master.
        slave_read = request.follow and node.role == common_pb2.ROLE_SLAVE
        # Counted while open: a slave with following reads has its master tell it each
        # commit at once, so its readers do not wait for the next heartbeat.
        with node.following() if request.follow else contextlib.nullcontext():
            while not end or position < end:
                signal = node.commit_signal()
                if durable:
                    moved = self._moved_by_seek(topic.name, durable, generation)
                    if moved is not None:
                        await abort(context, moved)
                count = min(batch, end - position) if end else batch
                try:
                    with _translating(self.node):
                        if transient:
                            events = node.transient.read(
                                topic.name,
                                position,
                                count,
                                topic_id=topic.topic_id,
                                max_bytes=batch_bytes,
                            )
                        else:
                            hidden = node.visible_end(topic.name)
                            # end 0: no end; hidden None: nothing hidden (0: the whole topic).
                            stop = end if hidden is None else min(end, hidden) if end else hidden
                            bounded = bool(end) or hidden is not None
                            events = (
                                []
                                if bounded and position >= stop
                                else node.store.read_events(
                                    topic.name,
                                    position,
                                    count,
                                    stop,
                                    max_bytes=batch_bytes,
                                    topic_id=topic.topic_id,
                                )
                            )
                except ServiceError as exc:
                    await abort(context, exc)
                if events:
                    position = events[-1].offset + 1
                    span = delivery.start(events) if delivery is not None else None
                    if _stages.ENABLED:
                        # The first event only: a following subscriber gets one per response.
                        _stages.mark("d.out", f"off/{topic.name}/{events[0].offset}")
                    try:
                        yield broker_pb2.SubscribeResponse(
                            events=events, seek_generation=generation
                        )
                    finally:
                        if span is not None:
                            span.end()
                    continue
                if not request.follow:
                    return
                # Checked before each wait, not after it: a wake that finds events serves them
                # with one read (a destroyed topic's read fails, NOT_FOUND, in _translating),
                # and one that finds none comes back here before waiting again.
                current = node.store.get_topic(topic.name)
                if current is None or current.topic_id != topic.topic_id:
                    await abort(
                        context, ServiceError(Code.NOT_FOUND, f"topic '{topic.name}' was destroyed")
                    )
                if slave_read and node.role not in (common_pb2.ROLE_SLAVE, common_pb2.ROLE_MASTER):
                    await abort(
                        context,
                        ServiceError(
                            Code.UNAVAILABLE,
                            f"replica {node.node.id} lost its slave role (epoch {node.epoch}, "
                            f"commit LSN {node.commit_lsn}): subscribe again from offset "
                            f"{position}",
                        ),
                    )
                # asyncio.timeout, not wait_for: no task per wait, the commit wakes this one.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_FOLLOW_RECHECK_S):
                        await signal.wait()

    async def Ack(self, request: broker_pb2.AckRequest, context: Context) -> broker_pb2.AckResponse:
        try:
            if not request.subscription:
                raise invalid("ack needs a durable subscription name")
            if self.node.store.get_shared_settings(request.topic, request.subscription) is not None:
                raise ServiceError(
                    Code.FAILED_PRECONDITION,
                    f"subscription '{request.subscription}' on topic '{request.topic}' is "
                    "shared: acknowledge its events with AckMessages",
                )
            plan = await self.node.write(
                commands.SetCursor(
                    request.topic,
                    request.subscription,
                    request.offset + 1,
                    create=False,
                    seek_generation=(
                        request.seek_generation if request.HasField("seek_generation") else None
                    ),
                )
            )
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.AckResponse(cursor=plan.cursor)

    async def Seek(
        self, request: broker_pb2.SeekRequest, context: Context
    ) -> broker_pb2.SeekResponse:
        try:
            if not request.subscription:
                raise invalid("seek needs a durable subscription name")
            plan = await self.node.write(
                commands.SeekCursor(
                    request.topic,
                    request.subscription,
                    request.position,
                    offset=request.offset,
                    timestamp_ms=request.timestamp_ms,
                )
            )
        except ServiceError as exc:
            await abort(context, exc)
        done = plan.seek
        if done is None:  # the planner always says what a seek did
            await abort(context, ServiceError(Code.INTERNAL, "seek planned without an outcome"))
        log.info(
            "node %s: subscription '%s' on topic '%s' sought from %s to offset %d "
            "(generation %d%s)",
            self.node.node.id,
            request.subscription,
            request.topic,
            "(new)" if done.created else f"offset {done.previous_cursor}",
            done.cursor,
            done.seek_generation,
            f"; {done.note}" if done.note else "",
        )
        return broker_pb2.SeekResponse(
            cursor=done.cursor,
            seek_generation=done.seek_generation,
            created=done.created,
            clamped=done.clamped,
            note=done.note,
            previous_cursor=done.previous_cursor,
        )

    async def ListSubscriptions(
        self, request: broker_pb2.ListSubscriptionsRequest, context: Context
    ) -> broker_pb2.ListSubscriptionsResponse:
        try:
            with _translating(self.node):
                topic = self.node.topic(request.topic)
                subscriptions = self.node.store.list_subscription_states(request.topic)
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.ListSubscriptionsResponse(
            subscriptions=[
                broker_pb2.SubscriptionInfo(
                    name=name,
                    cursor=cursor,
                    seek_generation=generation,
                    backlog=max(0, topic.next_offset - cursor),
                    **self._shared_counts(topic.name, name),
                )
                for name, cursor, generation in subscriptions
            ]
        )

    def _shared_counts(self, topic: str, name: str) -> dict[str, Any]:
        settings = self.node.store.get_shared_settings(topic, name)
        if settings is None:
            return {}
        return {
            "shared": True,
            "outstanding": self.shared.outstanding(topic, name),
            "dead_lettered": settings.dead_lettered,
        }

    async def CreateSharedSubscription(
        self, request: broker_pb2.CreateSharedSubscriptionRequest, context: Context
    ) -> broker_pb2.CreateSharedSubscriptionResponse:
        try:
            if not request.subscription:
                raise invalid("a shared subscription needs a name")
            plan = await self.node.write(
                commands.CreateShared(
                    request.topic,
                    request.subscription,
                    ack_deadline_ms=request.ack_deadline_ms,
                    max_deliveries=request.max_deliveries,
                    dead_letter_topic=request.dead_letter_topic,
                    start=request.start,
                    offset=request.offset,
                    exclusive=request.exclusive,
                    exclusive_takeover_ms=request.exclusive_takeover_ms,
                )
            )
        except ServiceError as exc:
            await abort(context, exc)
        if plan.created:
            log.info(
                "node %s epoch %d: shared subscription '%s' on topic '%s' created at cursor %d "
                "(ack deadline %d ms, max deliveries %d, dead letters to '%s')",
                self.node.node.id,
                self.node.epoch,
                request.subscription,
                request.topic,
                plan.cursor,
                request.ack_deadline_ms,
                request.max_deliveries,
                request.dead_letter_topic,
            )
        return broker_pb2.CreateSharedSubscriptionResponse(created=plan.created, cursor=plan.cursor)

    async def Pull(
        self, request: broker_pb2.PullRequest, context: Context
    ) -> broker_pb2.PullResponse:
        try:
            with _translating(self.node):
                messages = await self.shared.pull(
                    request.topic,
                    request.subscription,
                    request.consumer_id,
                    request.max_messages,
                    request.wait_ms,
                    max_outstanding=request.max_outstanding,
                    max_bytes=request.max_bytes,
                    deadline_in_ms=_deadline_in_ms(context),
                )
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.PullResponse(messages=messages)

    async def AckMessages(
        self, request: broker_pb2.AckMessagesRequest, context: Context
    ) -> broker_pb2.AckMessagesResponse:
        try:
            with _translating(self.node):
                cursor = await self.shared.ack(
                    request.topic,
                    request.subscription,
                    request.consumer_id,
                    list(request.offsets),
                    request.lease_epoch,
                )
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.AckMessagesResponse(cursor=cursor)

    async def Nack(
        self, request: broker_pb2.NackRequest, context: Context
    ) -> broker_pb2.NackResponse:
        try:
            with _translating(self.node):
                dead = await self.shared.nack(
                    request.topic,
                    request.subscription,
                    request.consumer_id,
                    list(request.offsets),
                    request.lease_epoch,
                    delay_ms=request.delay_ms,
                    error=request.error,
                )
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.NackResponse(dead_lettered=dead)

    async def ExtendDeadline(
        self, request: broker_pb2.ExtendDeadlineRequest, context: Context
    ) -> broker_pb2.ExtendDeadlineResponse:
        try:
            with _translating(self.node):
                deadline = self.shared.extend(
                    request.topic,
                    request.subscription,
                    request.consumer_id,
                    list(request.offsets),
                    request.lease_epoch,
                    request.extension_ms,
                )
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.ExtendDeadlineResponse(deadline_ms=deadline)

    async def DeleteSubscription(
        self, request: broker_pb2.DeleteSubscriptionRequest, context: Context
    ) -> broker_pb2.DeleteSubscriptionResponse:
        try:
            await self.node.write(commands.DeleteSubscription(request.topic, request.subscription))
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.DeleteSubscriptionResponse()


class ReplicaControl(replica_pb2_grpc.ReplicaControlServicer):
    """Role commands from this node's coordinator."""

    def __init__(self, node: ControlEndpoint) -> None:
        self.node = node

    def _state(self) -> replica_pb2.ReplicaState:
        meta = self.node.store.meta()
        state = replica_pb2.ReplicaState(
            node_id=self.node.node.id,
            cluster_id=meta.cluster_id,
            last_epoch=meta.last_epoch,
            last_lsn=meta.last_lsn,
            store_state=meta.state,
            epoch=self.node.epoch,
            role=self.node.role,
            commit_lsn=self.node.commit_lsn,
            shutdown_id=meta.shutdown_id,
            command_seq=self.node.command_seq,
            master_id=self.node.master.id if self.node.master else "",
            slaves=[
                common_pb2.SlaveProgress(
                    node_id=s.progress.node_id,
                    state=s.progress.state.value,
                    received_lsn=s.progress.received_lsn,
                    written_lsn=s.progress.written_lsn,
                    synced_lsn=s.progress.synced_lsn,
                    lag_entries=s.lag_entries,
                    catch_up_entries_per_s=s.catch_up_entries_per_s,
                    eta_s=s.eta_s,
                    snapshot_lsn=s.progress.snapshot_lsn,
                    silent_ms=s.progress.silent_ms,
                    catching_up=s.progress.catching_up,
                )
                for s in self.node.slave_status()
            ],
            log_start_lsn=self.node.log_start_lsn,
            joined=self.node.joined,
            frozen_for_shutdown_id=self.node.frozen_for,
            freeze_remaining_ms=self.node.freeze_remaining_ms(),
            fault_id=self.node.fault.fault_id if self.node.fault else "",
            fault_reason=self.node.fault.reason if self.node.fault else "",
            losses=[loss_to_proto(r) for r in self.node.losses],
            store_stalled_ms=self.node.store_stalled_ms(),
            quorum_silent_ms=self.node.quorum_silent_ms(),
        )
        progress = self.node.reorganization_progress()
        if progress is not None:
            state.reorganization.CopyFrom(progress)
        return state

    async def GetReplicaState(
        self, request: replica_pb2.GetReplicaStateRequest, context: Context
    ) -> replica_pb2.ReplicaState:
        return self._state()

    async def SetRole(
        self, request: replica_pb2.RoleCommand, context: Context
    ) -> replica_pb2.RoleCommandResponse:
        try:
            await self.node.apply_role(request)
        except ServiceError as exc:
            await abort(context, exc)
        return replica_pb2.RoleCommandResponse(state=self._state())

    async def FreezeForShutdown(
        self, request: replica_pb2.FreezeForShutdownRequest, context: Context
    ) -> replica_pb2.ReplicaState:
        try:
            await shutdown.freeze(
                self.node, request.shutdown_id, request.operator[:64], request.hold_ms
            )
        except ServiceError as exc:
            await abort(context, exc)
        return self._state()

    async def FinishShutdown(
        self, request: replica_pb2.FinishShutdownRequest, context: Context
    ) -> replica_pb2.FinishShutdownResponse:
        try:
            done = await shutdown.finish(
                self.node,
                request.shutdown_id,
                lsn=request.lsn,
                last_epoch=request.last_epoch,
                cluster_id=request.cluster_id,
                operator=request.operator[:64],
            )
        except ServiceError as exc:
            await abort(context, exc)
        return replica_pb2.FinishShutdownResponse(
            clean=done.clean, reason=done.reason, state=self._state()
        )

    async def AbortShutdown(
        self, request: replica_pb2.AbortShutdownRequest, context: Context
    ) -> replica_pb2.ReplicaState:
        try:
            shutdown.abort(self.node, request.shutdown_id)
        except ServiceError as exc:
            await abort(context, exc)
        return self._state()

    async def PrepareHandoff(
        self, request: replica_pb2.PrepareHandoffRequest, context: Context
    ) -> replica_pb2.PrepareHandoffResponse:
        try:
            return await handoff.prepare(self.node, request)
        except ServiceError as exc:
            await abort(context, exc)
