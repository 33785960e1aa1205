"""Push delivery on the master: calls each push subscriber's own gRPC service.

Runs only while this replica is the master of an epoch whose start entry committed (the
node starts it then and stops it when the role goes), so every event it reads is
committed and every subscription it sees is the group's. One supervisor task keeps one
worker per push subscriber in the store (rescanning when a subscribe or unsubscribe is
made here, and every `_RESCAN_S`); each worker:

* reads committed events from its subscriber's position (replicated topics: below the
  commit gate, as `Subscribe` does; transient topics: the live ring, from its end at the
  worker's start), at most `limits.push_batch_max_events` / `push_batch_max_bytes` per
  batch;
* offers a round of batches (`push_policy.DeliveryState`: one when ordered, up to
  `limits.push_inflight_batches_max` at once otherwise), each a `PushSubscriber.Deliver`
  call bounded by `timeouts.push_deliver_timeout_ms`; a round of one batch, while
  tracing is off, goes as a request on the subscriber's `DeliverStream` instead (kept
  open between rounds, the same bound per result), which skips gRPC's set-up of a new
  call on both sides, unless the endpoint refuses the stream (push.proto);
* moves the durable cursor through the log (`PushCursor`), at most one write in flight
  per subscriber, each carrying the newest position: under load one log entry covers
  many batches, never one per event (transient topics keep no cursor); the write rides
  with the master's next commit batch, or goes alone after `_CURSOR_RIDE_S`;
* after a failed round waits a jittered, doubling backoff (`timeouts.push_retry_backoff_*`)
  and offers the failed batches again; when the QoS says so (`push_policy.after_failure`)
  it removes the subscriber with a logged `PushUnsubscribe` and stops.

The failure count is replicated: every cursor write carries it (`PushCursorOp.failures`),
and a failed round writes it even when the cursor did not move, so a new master continues
the count where the log left it (at most the rounds whose write had not committed when the
old master failed are not counted). Delivery is at-least-once: batches delivered but not
yet covered by a committed cursor are offered again by the next master.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING

import grpc

from squall.v1 import common_pb2, push_pb2, push_pb2_grpc
from squall.wire import stages as _stages
from squall.wire.trace_context import end_call_span, with_context
from squall_server.common.errors import Code, ServiceError
from squall_server.common.tls import handshake_failure, transport
from squall_server.replica import commands
from squall_server.replica.master_tasks import MasterTasks
from squall_server.replica.push_policy import (
    DeliveryState,
    Offered,
    Qos,
    backoff_ms,
)
from squall_server.replica.store import PushSubscriber, StoreError, UnknownTopicError
from squall_server.replica.telemetry import push_span

if TYPE_CHECKING:
    from squall_server.replica.endpoints import DeliveryEndpoint

log = logging.getLogger("squall.replica.push")

# How often the supervisor rescans the store for push subscribers without being told.
_RESCAN_S = 1.0
# How long an idle worker waits for a commit before it rechecks its subscription.
_IDLE_RECHECK_S = 1.0
# A cursor write waits at most this long to ride with the next commit batch (a publish's,
# usually) instead of paying an append and a replication round of its own per lone
# delivery; a failover re-offers at most the deliveries of this wait more (at-least-once).
# On a 2-core VM riding brought publish -> push endpoint from ~1.23x to ~1.03x of publish ->
# subscriber (bench/README.md, *A push cursor rides with the next write*).
_CURSOR_RIDE_S = 0.05
# Longest status detail from a subscriber kept in logs, status and removal reasons.
_DETAIL_CHARS_MAX = 200

# Status code number -> name, for DeliverStream's results.
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
# A DeliverStream refused before answering anything with these: Deliver from then on.
_STREAM_REFUSED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A refused stream is tried again after this long, Deliver meanwhile: a
# refusal for want of a thread (RESOURCE_EXHAUSTED: the threaded PushEndpoint holds one
# per open stream) passes once the endpoint's other streams end, and may reach us as
# INTERNAL (grpc/grpc#36066: the status lost to our write in flight). For an app that
# serves Deliver alone it costs one refused stream per interval.
_STREAM_RETRY_S = 30.0

_WorkerKey = tuple[str, str, int]  # topic, subscriber id, LSN of its subscribe


def _channel_options(max_message_bytes: int, reconnect_max_ms: int) -> list[tuple[str, int]]:
    # No keepalive pings: an app's gRPC server refuses frequent pings by default, and the
    # Deliver deadline already bounds how long a dead subscriber can hold a batch. The
    # reconnect backoff is capped so a subscriber that comes back is reached again soon.
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_max_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, reconnect_max_ms)),
        ("grpc.max_reconnect_backoff_ms", reconnect_max_ms),
    ]


def _detail(error: grpc.aio.AioRpcError) -> str:
    return " ".join((error.details() or "").split())[:_DETAIL_CHARS_MAX]


def _push_channel(
    node: DeliveryEndpoint, endpoint: str, options: list[tuple[str, int]]
) -> grpc.aio.Channel:
    """A channel to an app's endpoint: TLS unless [tls] is off or tls.push is "plaintext"."""
    return transport(node.config, node.node.id).push_channel(endpoint, options=options)


def _tls_hint(node: DeliveryEndpoint, error: grpc.aio.AioRpcError) -> str:
    """What an app must serve when a probe failed in the TLS handshake."""
    if not node.config.tls.push_tls or not handshake_failure(error.details()):
        return ""
    return (
        '; with tls.push = "tls" the endpoint must serve TLS with a certificate for its '
        "host from the cluster's push CA (squall.PushEndpoint(tls=...), docs/security.md)"
    )


class PushDelivery(MasterTasks[_WorkerKey, PushSubscriber, "_Worker", "DeliveryEndpoint"]):
    """The master's push delivery: a supervisor and one worker per push subscriber
    (the lifecycle, `start`/`stop`/`close`/`refresh`/`active`, is `MasterTasks`')."""

    def __init__(self, node: DeliveryEndpoint, rng: random.Random | None = None) -> None:
        super().__init__(node, "push delivery", log)
        self._rng = rng or random.Random()

    def rescan_s(self) -> float:
        return _RESCAN_S

    def wanted(self) -> dict[_WorkerKey, PushSubscriber]:
        return {
            (s.topic, s.subscriber_id, s.lsn): s for s in self._node.store.list_push_subscribers()
        }

    def make(self, key: _WorkerKey, item: PushSubscriber, epoch: int) -> _Worker:
        return _Worker(self, item, epoch)

    def status(self, topic: str, subscriber_id: str) -> tuple[int, str]:
        """(failed rounds in a row, last error) of a subscriber delivered from here."""
        for (worker_topic, worker_id, _), worker in self._workers.items():
            if worker_topic == topic and worker_id == subscriber_id:
                return worker.state.failures, worker.state.last_error
        return 0, ""

    # --- the probe at subscribe time

    async def probe(self, topic: str, subscriber_id: str, endpoint: str) -> None:
        """Calls the endpoint once with an empty probe; FAILED_PRECONDITION if it fails."""
        node = self._node
        timeouts = node.config.timeouts
        options = _channel_options(
            node.config.limits.max_message_bytes, timeouts.push_retry_backoff_max_ms
        )
        request = push_pb2.PushDeliverRequest(
            topic=topic,
            subscriber_id=subscriber_id,
            probe=True,
            master_id=node.node.id,
            epoch=node.epoch,
        )
        async with _push_channel(node, endpoint, options) as channel:
            try:
                await push_pb2_grpc.PushSubscriberStub(channel).Deliver(
                    request, timeout=timeouts.push_deliver_timeout_ms / 1000
                )
            except grpc.aio.AioRpcError as exc:
                raise ServiceError(
                    Code.FAILED_PRECONDITION,
                    f"push subscriber '{subscriber_id}' at {endpoint} cannot be reached or "
                    f"refused the subscribe probe ({exc.code().name}: {_detail(exc)})"
                    f"{_tls_hint(node, exc)}; nothing was registered",
                ) from None

    def _jitter(self) -> float:
        return self._rng.random()


class _Worker:
    """Delivers one push subscriber's events while this replica is master."""

    def __init__(self, delivery: PushDelivery, subscriber: PushSubscriber, epoch: int) -> None:
        self._delivery = delivery
        self._node = delivery._node
        self._subscriber = subscriber
        self._epoch = epoch
        limits = self._node.config.limits
        qos = Qos(ordered=subscriber.ordered, retry_count=subscriber.retry_count)
        self.state = DeliveryState(subscriber.cursor, qos, limits.push_inflight_batches_max)
        # The failures the log recorded (under an earlier master too) count on here.
        self.state.failures = subscriber.failures
        self._durable = subscriber.cursor  # the cursor the log holds (or will)
        self._wanted = subscriber.cursor  # the newest cursor to write
        self._durable_failures = subscriber.failures  # the failure count the log holds
        self._wanted_failures = subscriber.failures  # the newest failure count to write
        self._cursor_task: asyncio.Task[None] | None = None
        self._attempts: dict[int, int] = {}  # first offset of a failed batch -> failures
        timeouts = self._node.config.timeouts
        self._channel = _push_channel(
            self._node,
            subscriber.endpoint,
            _channel_options(limits.max_message_bytes, timeouts.push_retry_backoff_max_ms),
        )
        self._stub = push_pb2_grpc.PushSubscriberStub(self._channel)
        # Deliveries go on one DeliverStream while the endpoint serves it (see _offer).
        self._stream: (
            grpc.aio.StreamStreamCall[push_pb2.PushDeliverRequest, push_pb2.PushDeliverResult]
            | None
        ) = None
        self._stream_answered = False  # the current stream answered a request
        self._stream_refused = False  # this batch's stream failed unanswered (see _offer)
        self._streams_served = True
        # When a refused stream is tried again (the node's monotonic clock, ms).
        self._streams_retry_ms = 0
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"push-{subscriber.topic}-{subscriber.subscriber_id}"
        )

    def cancel(self) -> None:
        self.task.cancel()
        if self._cursor_task is not None:
            self._cursor_task.cancel()

    @property
    def _where(self) -> str:
        s = self._subscriber
        return f"push subscriber '{s.subscriber_id}' of topic '{s.topic}' at {s.endpoint}"

    async def _run(self) -> None:
        try:
            await self._deliver_loop()
        except asyncio.CancelledError:
            raise
        except (StoreError, ServiceError) as exc:
            # The supervisor starts a new worker at its next scan if still subscribed.
            log.warning(
                "replica %s: %s: delivery stopped: %s", self._node.node.id, self._where, exc
            )
        finally:
            await self._channel.close(None)

    def _subscribed(self) -> bool:
        s = self._subscriber
        current = self._node.store.get_push_subscriber(s.topic, s.subscriber_id)
        return current is not None and current.lsn == s.lsn

    async def _deliver_loop(self) -> None:
        node, s, state = self._node, self._subscriber, self.state
        topic = node.store.get_topic(s.topic)
        if topic is None:
            return
        transient = topic.kind == common_pb2.TOPIC_KIND_TRANSIENT
        if transient:
            # IceStorm's event model: a transient topic's events go to the subscribers
            # there are now, from the live end.
            state.position = node.transient.next_offset(s.topic, topic_id=topic.topic_id)
        timeouts = node.config.timeouts
        # One round per pass; ends with the role or the subscription.
        while self._delivery.active(self._epoch):
            signal = node.commit_signal()
            if not self._subscribed():
                return
            batches = self._read(transient, topic.topic_id)
            if not batches:
                # asyncio.timeout, not wait_for: no task per wait, the commit wakes this one.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IDLE_RECHECK_S):
                        await signal.wait()
                continue
            # One batch (the usual case for a subscriber keeping up) is offered in this
            # task; several at once, each in its own.
            outcomes = (
                [await self._offer(*batches[0], alone=True)]
                if len(batches) == 1
                else await asyncio.gather(
                    *(self._offer(first, end, events) for first, end, events in batches)
                )
            )
            if not self._delivery.active(self._epoch):
                return
            result = state.finish_round(outcomes)
            for outcome in outcomes:
                if outcome.code == "OK":
                    self._attempts.pop(outcome.first, None)
                else:
                    self._attempts[outcome.first] = self._attempts.get(outcome.first, 0) + 1
            if result.action == "remove":
                await self._remove(result.reason)
                return
            if not transient and (
                result.cursor > self._wanted or result.failures != self._wanted_failures
            ):
                self._advance(max(result.cursor, self._wanted), result.failures)
            if result.action == "backoff":
                delay_ms = backoff_ms(
                    result.failures,
                    timeouts.push_retry_backoff_initial_ms,
                    timeouts.push_retry_backoff_max_ms,
                    self._delivery._jitter(),
                )
                # As IceStorm: a warning when a subscriber goes offline, quieter after.
                log.log(
                    logging.WARNING if result.failures == 1 else logging.DEBUG,
                    "replica %s: %s: delivery failed (%d in a row, retryCount %d): %s; "
                    "retrying in %d ms",
                    node.node.id,
                    self._where,
                    result.failures,
                    s.retry_count,
                    state.last_error,
                    delay_ms,
                )
                await asyncio.sleep(delay_ms / 1000)

    def _read(
        self, transient: bool, topic_id: int
    ) -> list[tuple[int, int, list[common_pb2.Event]]]:
        """The round's batches: failed ones again first, then new committed events, all
        of the topic's incarnation topic_id (a topic created again under its name is
        another topic, with other subscribers)."""
        node, s, state = self._node, self._subscriber, self.state
        limits = node.config.limits
        batches: list[tuple[int, int, list[common_pb2.Event]]] = []
        try:
            for first, end in state.retry_batches():
                if transient:
                    events = node.transient.read(s.topic, first, end - first, topic_id=topic_id)
                    events = [e for e in events if e.offset < end]
                else:
                    events = node.store.read_events(
                        s.topic, first, end - first, end, topic_id=topic_id
                    )
                batches.append((first, end, events))
            position = state.position
            for _ in range(state.new_batches()):
                if transient:
                    events = node.transient.read(
                        s.topic,
                        position,
                        limits.push_batch_max_events,
                        topic_id=topic_id,
                        max_bytes=limits.push_batch_max_bytes,
                    )
                else:
                    hidden = node.visible_end(s.topic)
                    if hidden is not None and position >= hidden:
                        break
                    events = node.store.read_events(
                        s.topic,
                        position,
                        limits.push_batch_max_events,
                        hidden or 0,
                        max_bytes=limits.push_batch_max_bytes,
                        topic_id=topic_id,
                    )
                if not events:
                    break
                end = events[-1].offset + 1
                batches.append((position, end, events))
                position = end
        except UnknownTopicError:
            return []  # destroyed meanwhile: the next pass sees the subscription gone
        return batches

    async def _offer(
        self, first: int, end: int, events: list[common_pb2.Event], alone: bool = False
    ) -> Offered:
        """One delivery (`alone` in its round: on the subscriber's stream if it can be); its
        outcome as the policy sees it."""
        if not events:
            return Offered(first, end, "OK")  # nothing left to deliver in that range
        node, s = self._node, self._subscriber
        request = push_pb2.PushDeliverRequest(
            topic=s.topic,
            subscriber_id=s.subscriber_id,
            events=events,
            attempt=self._attempts.get(first, 0),
            master_id=node.node.id,
            epoch=self._epoch,
        )
        if _stages.ENABLED:
            _stages.mark("p.out", f"off/{s.topic}/{events[0].offset}")
        span = push_span(
            node.telemetry,
            node.published_traces,
            node.node.id,
            s.subscriber_id,
            s.topic,
            events,
            request.attempt,
        )
        code, detail = "CANCELLED", "the delivery was cancelled (the role went)"
        try:
            if not self._streams_served and node.clock.monotonic_ms() >= self._streams_retry_ms:
                self._streams_served = True
            # A traced delivery's context goes in its call's metadata: a call of its own.
            offered = (
                await self._offer_on_stream(request)
                if alone and span is None and self._streams_served
                else None
            )
            if offered is None:
                await self._stub.Deliver(
                    request,
                    timeout=node.config.timeouts.push_deliver_timeout_ms / 1000,
                    # The app's server span (if it traces) joins the delivery's trace.
                    metadata=with_context(None, span) if span is not None else None,
                )
                offered = "OK", ""
                if self._stream_refused and self._streams_served:
                    # Reachable, but its stream failed unanswered (an interceptor that
                    # knows Deliver alone, say, or a refusal whose status was lost).
                    self._refuse_streams("it failed before answering")
            code, detail = offered
        except grpc.aio.AioRpcError as exc:
            code, detail = exc.code().name, _detail(exc)
        finally:
            if span is not None:
                end_call_span(span, code, detail)
        if _stages.ENABLED and code == "OK":
            _stages.mark("p.ack", f"off/{s.topic}/{events[0].offset}")
        return Offered(first, end, code, detail)

    async def _offer_on_stream(
        self, request: push_pb2.PushDeliverRequest
    ) -> tuple[str, str] | None:
        """One delivery on the subscriber's DeliverStream (opened if none is): its (code,
        detail), or None when the stream failed and the batch is to go by Deliver."""
        timeout_s = self._node.config.timeouts.push_deliver_timeout_ms / 1000
        self._stream_refused = False
        if self._stream is not None and self._stream.done():
            self._stream = None  # ended while idle (the endpoint restarted, say)
        if self._stream is None:
            self._stream = self._stub.DeliverStream(None)
            self._stream_answered = False
        stream = self._stream
        try:
            async with asyncio.timeout(timeout_s):
                await stream.write(request)
                result = await stream.read()
        except TimeoutError:
            # Its result could still come: a new stream for the next batch.
            self._drop_stream()
            return "DEADLINE_EXCEEDED", "Deadline Exceeded"
        except grpc.aio.AioRpcError as exc:
            self._drop_stream()
            if not self._stream_answered and exc.code() in _STREAM_REFUSED:
                # No stream here (an app serving Deliver alone, or no thread to spare).
                self._refuse_streams(f"{exc.code().name}: {_detail(exc)}")
            # Any other failure before an answer, unless the endpoint was away: refused,
            # if Deliver then gets through.
            self._stream_refused = (
                not self._stream_answered and exc.code() != grpc.StatusCode.UNAVAILABLE
            )
            return None
        except asyncio.InvalidStateError:  # it ended between the check and the write
            self._drop_stream()
            return None
        except asyncio.CancelledError:
            self._drop_stream()
            raise
        if not isinstance(result, push_pb2.PushDeliverResult):  # EOF: the endpoint closed it
            self._drop_stream()
            return None
        self._stream_answered = True
        detail = " ".join(result.details.split())[:_DETAIL_CHARS_MAX]
        return _STATUS_NAMES.get(result.code, "UNKNOWN"), detail

    def _refuse_streams(self, why: str) -> None:
        """Deliver calls until the stream is tried again (`_STREAM_RETRY_S`)."""
        self._streams_served = False
        self._streams_retry_ms = self._node.clock.monotonic_ms() + int(_STREAM_RETRY_S * 1000)
        log.info(
            "replica %s: %s: the endpoint refused a delivery stream (%s); delivering by "
            "Deliver calls, the stream tried again in %g s",
            self._node.node.id,
            self._where,
            why,
            _STREAM_RETRY_S,
        )

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    async def _remove(self, reason: str) -> None:
        """Removes the subscriber through the log (replicated, like any unsubscribe)."""
        node, s = self._node, self._subscriber
        log.warning("replica %s: removing %s: %s", node.node.id, self._where, reason)
        try:
            await node.write(commands.PushUnsubscribe(s.topic, s.subscriber_id, reason, s.lsn))
        except ServiceError as exc:
            # Lost the role or already unsubscribed: the next master decides again.
            log.info("replica %s: removing %s did not commit: %s", node.node.id, self._where, exc)

    # --- the durable cursor

    def _advance(self, cursor: int, failures: int) -> None:
        self._wanted = cursor
        self._wanted_failures = failures
        if self._cursor_task is None or self._cursor_task.done():
            self._cursor_task = asyncio.get_running_loop().create_task(self._write_cursor())

    async def _write_cursor(self) -> None:
        """Writes the newest wanted cursor and failure count until the log holds them; one
        write at a time."""
        node, s = self._node, self._subscriber
        # Each pass writes a newer cursor or count than the last: bounded by the rounds made.
        while (
            self._wanted > self._durable or self._wanted_failures != self._durable_failures
        ) and self._delivery.active(self._epoch):
            target, failures = self._wanted, self._wanted_failures
            try:
                plan = await node.write_with_next(
                    commands.PushCursor(s.topic, s.subscriber_id, target, s.lsn, failures),
                    _CURSOR_RIDE_S,
                )
            except ServiceError as exc:
                log.debug(
                    "replica %s: %s: cursor %d not written: %s",
                    node.node.id,
                    self._where,
                    target,
                    exc,
                )
                return
            self._durable = max(self._durable, plan.cursor)
            self._durable_failures = failures
