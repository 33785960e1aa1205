"""The asyncio publisher: one pipelined PublishStream per Publisher, idempotent sequences.

Same semantics as the threaded `squall.Publisher` (see `squall._publisher`'s docstring),
with the same rules from `squall._publish_rules`: every event carries `(publisher_id,
sequence)`; batches are pipelined over one `PublishStream` call, at most
`inflight_batches_max` unanswered; a batch whose outcome is indeterminate is sent again
as the same request on a fresh stream within the client's retry time budget (a retry
after a slave's redirect goes at once); a definite failure is raised at once; the app
sees `Indeterminate` only when the budget ran out. Bindings (gateway, replicated and
non-replicated proxies) are `squall._proxy`'s, shared with the threaded client.

What differs is waiting: one event loop, no threads. Sequences are assigned and the
request queued with no `await` in between, so the order on the wire is the order of the
sequences even when many tasks publish at once. A reader task per stream matches each
response to the oldest unanswered batch. Publishing from several tasks at once pipelines
their batches on the one stream; `publish_async` queues single events that go out as
one batch when a slot frees, as in the threaded publisher, and a task of the publisher
retries such batches (in sequence order) when their stream ends.

A publisher made by a `Client` sends its lone `publish()` calls on a stream its client
shares instead (`squall.aio._publish_mux`: through the gateway, the one all its gateway
publishers share; a proxy, the one to the replica its binding names at each attempt),
while nothing of its own is in flight on its own stream; its other calls wait until
those have finished, so its sequences reach the master in order either way.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal

import grpc
import grpc.aio
import tenacity

from squall._errors import Indeterminate, SquallError, error_for, rpc_status
from squall._proxy import Binding, Endpoint, GatewayBinding, ProxyBinding, RebindCallback
from squall._publish_join import JoinRefused
from squall._publish_rules import (
    BATCH_EVENTS_DEFAULT,
    BATCH_EVENTS_MAX,
    INFLIGHT_BATCHES_MAX_DEFAULT,
    UNSENT_STREAM_MOVES_MAX,
    EventLike,
    Moves,
    NotSent,
    RetryRun,
    add_events,
    check_batch_events,
    check_publisher_args,
    copy_for_retry,
    mark_rebound,
    moved_trailing,
    new_request,
    new_session_token,
    not_sent_error,
    response_mismatch,
    status_lost_trailing,
    stream_end_errors,
    worth_retrying,
)
from squall._types import Receipt, receipts_from_pb
from squall.aio._deadline import within
from squall.aio._publish_mux import MuxEntry, ProxyMuxes, PublishMux
from squall.aio._stall_watch import MasterCheck, watch_stalls
from squall.v1 import broker_pb2, common_pb2
from squall.wire import stages as _stages
from squall.wire.retry import RetryPolicy

log = logging.getLogger("squall")

Sleep = Callable[[float], Awaitable[None]]


class _Batch:
    """One sent request waiting for its response."""

    __slots__ = ("count", "future", "is_async", "request", "request_id", "sent_at")

    def __init__(
        self,
        request: broker_pb2.PublishRequest,
        future: asyncio.Future[list[Receipt]],
        is_async: bool,
        sent_at: float,
    ) -> None:
        self.request = request
        # When it was queued, on the event loop's clock (the one the watchdog sleeps on):
        # a proxy asks who the master is once its oldest batch is RECEIPT_STALL_AFTER_S old.
        self.sent_at = sent_at
        self.request_id = request.request_id
        self.count = len(request.events)
        self.future = future
        # Buffered events' batches are retried by a task of the publisher when their
        # stream ends; any other batch is retried by the caller waiting on it.
        self.is_async = is_async


class _Stream:
    """One open PublishStream call: its request queue, unanswered batches and reader task."""

    def __init__(self, publisher_id: str, endpoint: Endpoint | None) -> None:
        # The replica this stream is bound to (None: through the gateway).
        self.endpoint = endpoint
        self.answered = False
        # Bounded by the in-flight window: a request is only queued with a free slot.
        self.requests: asyncio.Queue[broker_pb2.PublishRequest | None] = asyncio.Queue()
        self.pending: collections.deque[_Batch] = collections.deque()
        self.session_token = new_session_token(publisher_id)
        self.dead = False
        # Set before cancelling the call on purpose, so the reader reports why.
        self.abort_error: SquallError | None = None
        # Set when abandoned because another replica is master now: the binding follows
        # it as it would a slave's redirect.
        self.moved_to = ""
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None
        # A proxy stream's stall watchdog (see Publisher._watch), and what wakes it: a
        # batch sent while none was pending, or the stream's end.
        self.watchdog: asyncio.Task[None] | None = None
        self.woken = asyncio.Event()

    async def iter_requests(self) -> AsyncIterator[broker_pb2.PublishRequest]:
        """The request iterator gRPC consumes; ends at the None sentinel."""
        while (request := await self.requests.get()) is not None:
            yield request


# A buffered batch to retry: its future, the request as sent, the error it ended with.
_Retry = tuple[asyncio.Future[list[Receipt]], broker_pb2.PublishRequest, SquallError]


def _dispatch(futures: list[asyncio.Future[Receipt]], batch: asyncio.Future[list[Receipt]]) -> None:
    """Resolves the per-event futures of a buffered batch from the batch's outcome; a
    future the app cancelled is skipped (the event is published anyway)."""
    error = batch.exception()
    if error is not None:
        for future in futures:
            if not future.done():
                future.set_exception(error)
        return
    for future, receipt in zip(futures, batch.result(), strict=False):
        if not future.done():
            future.set_result(receipt)


def _settled(future: asyncio.Future[Any]) -> None:
    """Marks a failed future's exception as seen: a caller that raised on an earlier batch
    does not await the later ones, and asyncio would log each as never retrieved."""
    if future.done() and not future.cancelled():
        future.exception()


class Publisher:
    """Publishes events to one topic with a publisher id and increasing sequences (asyncio).

    Made by `squall.aio.Topic.publisher`; use it as `async with` (or `await close()`).
    """

    def __init__(
        self,
        binding: Binding,
        topic: str,
        publisher_id: str,
        *,
        start_sequence: int = 1,
        timeout_s: float = 10.0,
        inflight_batches_max: int = INFLIGHT_BATCHES_MAX_DEFAULT,
        on_close: Callable[[Publisher], None] | None = None,
        retry: RetryPolicy | None = None,
        on_rebind: RebindCallback | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        check_master: MasterCheck | None = None,
        mux: PublishMux | None = None,
        proxy_muxes: ProxyMuxes | None = None,
    ) -> None:
        check_publisher_args(publisher_id, start_sequence, inflight_batches_max, timeout_s)
        self._retry = retry if retry is not None else RetryPolicy()
        self._retry.validate()
        # The retry budget's clock and the backoff's sleep (a test passes fakes).
        self._monotonic = monotonic
        self._sleep = sleep
        self._binding = binding
        # A proxy's check of the master when a receipt is late (RECEIPT_STALL_CHECK_S).
        self._check_master = check_master if isinstance(binding, ProxyBinding) else None
        self._moves = Moves(publisher_id, on_rebind)
        self._topic = topic
        self._publisher_id = publisher_id
        self._timeout_s = timeout_s
        self._inflight_max = inflight_batches_max
        self._on_close = on_close
        self._next_sequence = start_sequence
        self._next_request_id = 1
        self._stream: _Stream | None = None
        self._closed = False
        self._streams_opened = 0
        # Batch futures not yet resolved, sent or buffered (flush waits for zero).
        self._unresolved = 0
        # Events from publish_async waiting for a window slot, sequences assigned.
        self._buffer: list[common_pb2.EventData] = []
        self._buffer_futures: list[asyncio.Future[Receipt]] = []
        # Tasks retrying buffered batches after their stream ended (kept referenced).
        self._retry_tasks: set[asyncio.Task[None]] = set()
        self._resends = 0
        # Set and replaced on every change waiters care about (a slot freed, a stream
        # died, a batch resolved): one loop, so no check can miss a wake-up.
        self._changed = asyncio.Event()
        # The client's shared stream for lone publishes (squall.aio._publish_mux): through
        # the gateway, one; a proxy uses the client's shared stream to the replica its
        # binding names at each attempt, so it still moves on its own.
        self._mux = mux if isinstance(binding, GatewayBinding) else None
        self._proxy_muxes = proxy_muxes if isinstance(binding, ProxyBinding) else None
        # publish() calls on the shared stream not finished yet (retries included, and a
        # cancelled caller's event until its outcome): the publisher's own stream sends
        # nothing meanwhile, so its sequences stay in order.
        self._muxed = 0
        # The shared stream (replica address, generation) that last answered this
        # publisher: counted in streams_opened, and for a proxy its first answer there is
        # what a stream of its own's first answer is (a move, if to another replica).
        self._mux_stream: tuple[str, int] = ("", 0)

    # -- public API -------------------------------------------------------------------

    @property
    def topic(self) -> str:
        """The topic this publisher writes to."""
        return self._topic

    @property
    def publisher_id(self) -> str:
        """The id stored with every event and used for deduplication."""
        return self._publisher_id

    @property
    def next_sequence(self) -> int:
        """The sequence the next event will get."""
        return self._next_sequence

    @property
    def resends(self) -> int:
        """How many batches were sent again after an indeterminate outcome (0 if none)."""
        return self._resends

    @property
    def replicated(self) -> bool:
        """False for a non-replicated proxy (no silent failover: it raises PublisherLost)."""
        return self._binding.replicated

    @property
    def endpoint(self) -> Endpoint | None:
        """The replica whose stream last answered (None through the gateway, or before)."""
        return self._moves.endpoint

    @property
    def rebinds(self) -> int:
        """How many times this publisher moved to another replica."""
        return self._moves.count

    @property
    def streams_opened(self) -> int:
        """How many PublishStream calls this publisher has opened (1 while nothing failed),
        counting each of its client's shared streams its `publish()` calls went on."""
        return self._streams_opened

    async def publish(
        self, payload: bytes, key: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Receipt:
        """Publishes one event and waits for its receipt.

        Many tasks awaiting `publish` at once share the stream: their events are
        pipelined, up to `inflight_batches_max` unanswered; while the window is full, an
        event waits with the others that arrive meanwhile and they go out as one request
        when a slot frees (as `publish_async` events do), so many tasks publishing one
        event at a time share requests, commits and replication batches.

        While nothing of this publisher is in flight on its own stream, the event goes on
        a stream its client shares (`squall.aio._publish_mux`; a proxy's, the one to the
        replica its binding names): concurrent publishes of many publishers share
        requests the same way, each event keeping its publisher id and sequence.
        Cancelling the task withdraws the event if it is still waiting for a slot; once
        sent it is stored (or refused) as if the caller still waited, without retries.
        """
        sharing = self._mux is not None or self._proxy_muxes is not None
        if sharing and self._unresolved == 0 and not self._buffer:
            self._check_open()
            # Before the sequence is taken: a lost proxy raises PublisherLost here.
            mux, endpoint = self._shared_mux()
            event = common_pb2.EventData(
                key=key or b"", payload=payload, headers=headers, sequence=self._next_sequence
            )
            entry = self._submit(mux, event)
            self._next_sequence += 1
            self._muxed += 1
            return await self._publish_muxed(event, [entry], endpoint)
        stream = self._stream
        if (
            stream is not None
            and not stream.dead
            and (bool(self._buffer) or len(stream.pending) >= self._inflight_max)
        ):
            return await self._publish_joined(payload, key, headers)
        receipts = await self._publish_batches([(key, payload, headers)], BATCH_EVENTS_DEFAULT)
        return receipts[0]

    def _shared_mux(self) -> tuple[PublishMux, Endpoint | None]:
        """The shared stream an attempt goes on and the endpoint it is bound to: the
        gateway's (None), or for a proxy the one to the replica its binding names now
        (PublisherLost once the binding is lost). The endpoint is the binding's own (the
        stream's may name the same address under another node id)."""
        if self._mux is not None:
            return self._mux, None
        binding = self._binding
        assert self._proxy_muxes is not None and isinstance(binding, ProxyBinding)
        endpoint = binding.target()
        return self._proxy_muxes.get(endpoint, binding.new_channel), endpoint

    def _submit(
        self, mux: PublishMux, event: common_pb2.EventData, *, alone: bool = False
    ) -> MuxEntry:
        """Queues one attempt on a shared stream; a proxy's binding gives the metadata and
        stall check of a stream it opens, as it does for a stream of the proxy's own."""
        if mux.endpoint is None:
            return mux.submit(self._topic, self._publisher_id, event, alone=alone)
        return mux.submit(
            self._topic,
            self._publisher_id,
            event,
            alone=alone,
            metadata=self._binding.metadata(),
            check_master=self._check_master,
        )

    async def _publish_muxed(
        self, event: common_pb2.EventData, held: list[MuxEntry], endpoint: Endpoint | None
    ) -> Receipt:
        """Waits for an event sent on a shared stream of the client; retries it as a batch
        of its own is retried (same id and sequence, under the retry policy), each retry
        on the shared stream its binding names then (a proxy may have moved). `held` holds
        the entry of the latest attempt."""
        try:
            try:
                return await self._mux_attempt(event, held, endpoint)
            except SquallError as first:
                request = new_request(self._topic, self._publisher_id)
                request.events.append(event)

                async def again() -> list[Receipt]:
                    return [await self._mux_attempt(event, held, None, again=True)]

                return (await self._retry_batch(request, first, again))[0]
        finally:
            entry = held[0]
            if entry.future.done():
                self._unmux()
            else:
                # A cancelled caller's event is on the stream: what the publisher sends
                # next on its own stream waits for its outcome.
                entry.future.add_done_callback(lambda _future: self._unmux())

    async def _mux_attempt(
        self,
        event: common_pb2.EventData,
        held: list[MuxEntry],
        endpoint: Endpoint | None,
        *,
        again: bool = False,
    ) -> Receipt:
        """One attempt on a shared stream; a refusal shared with others is checked by
        sending the event again alone (nothing was stored). A proxy's binding hears how
        the attempt's stream ended, and its first answer, as from a stream of its own."""
        if again:
            self._resends += 1
            target, endpoint = self._shared_mux()
            held[0] = self._submit(target, event)
        mux: PublishMux = held[0].mux  # the joining keeps it untyped (squall._publish_join)
        try:
            try:
                receipt = await mux.result(held[0], self._timeout_s)
            except JoinRefused:
                held[0] = self._submit(mux, event, alone=True)
                receipt = await mux.result(held[0], self._timeout_s)
        except SquallError:
            ended = held[0].ended
            if ended is not None and endpoint is not None:
                self._binding.stream_failed(endpoint, *ended)
            raise
        if _stages.ENABLED:
            _stages.mark("c.return", _stages.request_key(self._publisher_id, event.sequence))
        stream = held[0].stream
        generation = stream.generation if stream is not None else 0
        answered = (endpoint.address if endpoint is not None else "", generation)
        if answered == self._mux_stream:
            return receipt
        self._mux_stream = answered
        self._streams_opened += 1
        # An answer from a replica the binding has since left is old news.
        binding = self._binding
        if endpoint is None or not isinstance(binding, ProxyBinding):
            return receipt
        if binding.current() != endpoint:
            return receipt
        binding.stream_answered(endpoint)
        moved_from = self._moves.answered(endpoint)
        if moved_from is None:
            return receipt
        receipts = [receipt]
        mark_rebound(receipts)
        self._moves.report(moved_from, endpoint)
        return receipts[0]

    def _unmux(self) -> None:
        self._muxed -= 1
        self._notify()

    async def _wait_unmuxed(self) -> None:
        """Waits until no publish() of this publisher is on the shared stream, so that
        what goes on its own stream next comes after it."""
        wait_s = 2 * self._timeout_s + self._retry.total_ms_max / 1000
        if not await self._wait_until(lambda: self._muxed == 0, wait_s):
            raise error_for(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "a publish on the client's shared stream did not finish",
            )

    async def _publish_joined(
        self, payload: bytes, key: bytes | None, headers: Mapping[str, str] | None
    ) -> Receipt:
        """One event sent with the others waiting for a slot; waits for its receipt.

        Its batch is retried like an async batch (by a task of the publisher, under the
        retry policy). Past the timeout the stream is abandoned, which settles every batch
        on it; if even that outcome does not come within the retry budget, `Indeterminate`.
        """
        future = await self.publish_async(payload, key, headers)
        try:
            return await within(future, self._timeout_s)
        except TimeoutError:
            if self._stream is not None:
                self._abort(
                    self._stream,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no receipt within {self._timeout_s} s",
                )
        try:
            return await within(future, self._timeout_s + self._retry.total_ms_max / 1000)
        except TimeoutError:
            raise Indeterminate(
                f"no receipt within {self._timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    async def publish_many(
        self, events: Iterable[EventLike], batch_events: int = BATCH_EVENTS_DEFAULT
    ) -> list[Receipt]:
        """Publishes events in batches pipelined over the stream; receipts in input order.

        Indeterminate batches are retried within the time budget. Raises the first
        failure in input order; batches before it are stored, later ones may be. After an
        `Indeterminate`, republishing the same events with the same sequences (a publisher
        with this id and `start_sequence`) stores each one at most once.
        """
        check_batch_events(batch_events)
        return await self._publish_batches(events, batch_events)

    async def publish_async(
        self, payload: bytes, key: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> asyncio.Future[Receipt]:
        """Queues one event and returns a future for its receipt (await it, or `flush()`).

        The asyncio `publish_async` of the threaded client: events queued while the
        in-flight window is full go out together as one batch when a slot frees, so many
        small publishes batch themselves; their batches are retried like any other
        (here by a task of the publisher). Awaiting this call waits only while
        BATCH_EVENTS_MAX events are already queued (DeadlineExceeded after the timeout).
        """
        future: asyncio.Future[Receipt] = asyncio.get_running_loop().create_future()
        if self._muxed:
            await self._wait_unmuxed()
        while True:
            self._check_open()
            stream = self._live_stream()
            if len(self._buffer) < BATCH_EVENTS_MAX:
                break
            # Buffer and window full: wait for the reader to drain it.
            if not await self._wait_until(
                lambda: len(self._buffer) < BATCH_EVENTS_MAX, self._timeout_s
            ):
                raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "publish window stayed full")
        # Built here so a bad payload type raises in the caller, not the reader task.
        self._buffer.append(
            common_pb2.EventData(
                key=key or b"", payload=payload, headers=headers, sequence=self._next_sequence
            )
        )
        self._next_sequence += 1
        self._buffer_futures.append(future)
        if len(stream.pending) < self._inflight_max:
            self._send_buffer(stream)
        return future

    async def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every publish so far (from any task, publish_async's included) has
        its outcome.

        On timeout the stream is abandoned (its batches are retried under the retry
        policy) and `Indeterminate` is raised.
        """
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        if await self._wait_until(
            lambda: not self._buffer and self._unresolved == 0 and self._muxed == 0, wait_s
        ):
            return
        if self._stream is not None:
            self._abort(
                self._stream, grpc.StatusCode.DEADLINE_EXCEEDED, f"flush took over {wait_s} s"
            )
        raise Indeterminate(f"flush took over {wait_s} s", grpc.StatusCode.DEADLINE_EXCEEDED)

    async def close(self) -> None:
        """Waits for publishes in flight (up to the timeout), then closes the stream."""
        if self._closed:
            return
        try:
            await self.flush()
        except SquallError:
            pass
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.requests.put_nowait(None)  # half-close: the server ends the stream
            if stream.reader is not None:
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await asyncio.shield(stream.reader)
                except TimeoutError:
                    stream.call.cancel()
        if isinstance(self._binding, ProxyBinding):
            for channel in self._binding.release():
                await channel.close()
        if self._on_close is not None:
            self._on_close(self)

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"aio.Publisher(topic={self._topic!r}, publisher_id={self._publisher_id!r})"

    # -- waiting ----------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Waits until `ready()` holds; False if it still does not after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                return ready()
        return True

    # -- sending ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the publisher is closed")

    async def _publish_batches(self, events: Iterable[Any], batch_events: int) -> list[Receipt]:
        """Sends events in batches over one stream, then collects receipts in order.

        If the stream ends under the call, the batches it sent are settled (retried on a
        fresh stream when indeterminate) and the rest go out on the fresh stream.
        """
        loop = asyncio.get_running_loop()
        receipts: list[Receipt] = []
        sent: list[tuple[_Stream, asyncio.Future[list[Receipt]], broker_pb2.PublishRequest]] = []
        source = iter(events)
        held: list[Any] | None = None  # taken from the source, not yet sent
        while True:
            chunk = held if held is not None else list(itertools.islice(source, batch_events))
            held = None
            if not chunk:
                break
            self._check_open()
            stream = await self._stream_with_slot(sent[0][0] if sent else None)
            if stream is None:
                if not sent:
                    # The window stayed full, or two streams died while this call waited.
                    raise error_for(
                        grpc.StatusCode.UNAVAILABLE,
                        "the publish stream failed; the remaining events were not sent",
                    )
                # The stream this call started on ended: its batches' outcomes come first
                # (retried as needed), then the rest goes out on a fresh stream.
                held = chunk
                receipts.extend(await self._settle_all(sent))
                sent = []
                continue
            self._check_open()
            if self._muxed:
                # A publish() went on the client's shared stream while this call waited
                # for a slot: its event goes first.
                await self._wait_unmuxed()
                held = chunk
                continue
            # From here to _send, no await: sequences go on the wire in order.
            request = new_request(self._topic, self._publisher_id, stream.session_token)
            add_events(request, chunk, self._next_sequence)
            self._next_sequence += len(chunk)
            future: asyncio.Future[list[Receipt]] = loop.create_future()
            self._send(stream, request, future)
            sent.append((stream, future, request))
        receipts.extend(await self._settle_all(sent))
        return receipts

    async def _settle_all(
        self,
        sent: list[tuple[_Stream, asyncio.Future[list[Receipt]], broker_pb2.PublishRequest]],
    ) -> list[Receipt]:
        """The receipts of sent batches in order; raises the first failure left after retries."""
        receipts: list[Receipt] = []
        for stream, future, request in sent:
            try:
                receipts.extend(await self._result(stream, future))
            except Indeterminate as error:
                receipts.extend(await self._retry_batch(request, error))
        return receipts

    async def _retry_batch(
        self,
        request: broker_pb2.PublishRequest,
        first: SquallError,
        again: Callable[[], Awaitable[list[Receipt]]] | None = None,
    ) -> list[Receipt]:
        """Sends a batch again until it succeeds, fails definitely, or the budget runs out
        (the rules are `squall._publish_rules.RetryRun`, as in the threaded publisher).
        `again` makes one more attempt (default: on the publisher's own stream)."""
        run = RetryRun(
            self._retry,
            self._binding,
            first,
            monotonic=self._monotonic,
            closed=lambda: self._closed,
            publisher_id=self._publisher_id,
        )
        run.begin()
        try:
            async for attempt in tenacity.AsyncRetrying(sleep=self._sleep, **run.tenacity_args()):
                with attempt:
                    number = attempt.retry_state.attempt_number
                    if number == 1:
                        raise first
                    try:
                        if again is not None:
                            return await again()
                        stream, future = await self._resend(request)
                        return await self._result(stream, future)
                    except SquallError as error:
                        run.failed(error, request, number)
                        raise
        except SquallError as error:
            final = run.final(error)
            if final is error:
                raise
            raise final from error
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _resend(
        self, request: broker_pb2.PublishRequest
    ) -> tuple[_Stream, asyncio.Future[list[Receipt]]]:
        """Sends a copy of a batch (same events and sequences) on a live stream."""
        if self._closed:
            raise NotSent(
                "the publisher was closed while a batch was being retried",
                grpc.StatusCode.CANCELLED,
            )
        stream = await self._stream_with_slot(None)
        if stream is None:
            raise NotSent(
                "no publish stream could take the retried batch", grpc.StatusCode.UNAVAILABLE
            )
        # The events now travel under the fresh stream's binding.
        again = copy_for_retry(request, stream.session_token)
        future: asyncio.Future[list[Receipt]] = asyncio.get_running_loop().create_future()
        self._send(stream, again, future)
        self._resends += 1
        return stream, future

    async def _result(
        self, stream: _Stream, future: asyncio.Future[list[Receipt]]
    ) -> list[Receipt]:
        """Waits for one batch; on timeout abandons its stream, making it Indeterminate.

        A proxy's stream whose receipt is late is abandoned sooner by its watchdog when
        the gateway names another master (`_watch`); the batch is then retried there.
        """
        try:
            return await within(future, self._timeout_s)
        except TimeoutError:
            self._abort(
                stream, grpc.StatusCode.DEADLINE_EXCEEDED, f"no receipt within {self._timeout_s} s"
            )
        try:
            return await within(future, self._timeout_s)
        except TimeoutError:
            raise Indeterminate(
                f"no receipt within {self._timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    async def _watch(self, stream: _Stream) -> None:
        """A proxy stream's stall watchdog (`squall.aio._stall_watch`): it watches the
        stream, not a caller, so every batch on it is covered, also the ones of
        `publish_async` and of callers waiting for a slot."""
        endpoint = stream.endpoint
        check = self._check_master
        if endpoint is not None and check is not None:
            await watch_stalls(stream, endpoint, check, self._publisher_id)

    def _live_stream(self) -> _Stream:
        """The open stream, opening one if there is none."""
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        stub: Any
        stub, endpoint = self._binding.open()
        stream = _Stream(self._publisher_id, endpoint)
        metadata = self._binding.metadata()
        stream.call = stub.PublishStream(
            stream.iter_requests(), metadata=grpc.aio.Metadata(*metadata) if metadata else None
        )
        self._stream = stream
        self._streams_opened += 1
        loop = asyncio.get_running_loop()
        stream.reader = loop.create_task(self._read(stream), name=f"squall-publish-{self._topic}")
        if endpoint is not None and self._check_master is not None:
            stream.watchdog = loop.create_task(
                self._watch(stream), name=f"squall-publish-watch-{self._topic}"
            )
        return stream

    async def _stream_with_slot(self, current: _Stream | None) -> _Stream | None:
        """A live stream with a free slot.

        `current` is the stream this call already sent on; if it dies, None (the call
        stops). A call that has sent nothing yet moves to a new stream each time the one it
        waited on died for someone else's batch, as the retry policy allows (its time
        budget and attempts; once without retries), as the threaded publisher does; None
        also when the window stays full for the whole timeout.
        """
        dead_streams = 0
        started = self._monotonic()
        # Bounded: every pass waits for a slot (at most timeout_s), and sends the buffer
        # or ends; buffered events hold earlier sequences and go out first.
        for _pass in range(10_000):
            stream = self._live_stream()
            if current is not None and stream is not current:
                return None
            waited = await self._wait_slot(stream)
            if waited == "ok" and self._buffer:
                self._send_buffer(stream)
                continue
            if waited == "ok":
                return stream
            dead_streams += 1
            if waited == "timeout" or current is not None:
                return None
            # Nothing of this call was sent: moving to a fresh stream is always safe.
            if not self._retry.retries:
                if dead_streams >= 2:
                    return None
            elif dead_streams >= UNSENT_STREAM_MOVES_MAX or self._retry.exhausted(
                dead_streams, (self._monotonic() - started) * 1000
            ):
                return None
        return None

    async def _wait_slot(self, stream: _Stream) -> Literal["ok", "dead", "timeout"]:
        """Waits for a free in-flight slot on the stream."""
        ok = await self._wait_until(
            lambda: stream.dead or len(stream.pending) < self._inflight_max, self._timeout_s
        )
        if not ok:
            # The oldest batch went unanswered for the whole timeout: the stream is stuck.
            self._abort(
                stream, grpc.StatusCode.DEADLINE_EXCEEDED, f"no receipt within {self._timeout_s} s"
            )
            return "timeout"
        return "dead" if stream.dead else "ok"

    def _send(
        self,
        stream: _Stream,
        request: broker_pb2.PublishRequest,
        future: asyncio.Future[list[Receipt]],
        *,
        is_async: bool = False,
    ) -> None:
        """Queues one request on the stream."""
        request.request_id = self._next_request_id
        self._next_request_id += 1
        if not stream.pending:
            stream.woken.set()
        sent_at = asyncio.get_running_loop().time()
        stream.pending.append(_Batch(request, future, is_async, sent_at))
        self._track(future)
        stream.requests.put_nowait(request)

    def _track(self, future: asyncio.Future[Any]) -> None:
        """Counts a batch future until it resolves, for flush()."""
        self._unresolved += 1
        future.add_done_callback(self._resolved)

    def _resolved(self, _future: asyncio.Future[Any]) -> None:
        self._unresolved -= 1
        self._notify()

    def _send_buffer(self, stream: _Stream) -> None:
        """Sends the buffered events as one batch (a slot is free)."""
        buffered, futures = self._buffer, self._buffer_futures
        self._buffer, self._buffer_futures = [], []
        request = new_request(self._topic, self._publisher_id, stream.session_token)
        request.events.extend(buffered)
        batch = self._buffered_batch(futures)
        self._send(stream, request, batch, is_async=True)

    def _buffered_batch(
        self, futures: list[asyncio.Future[Receipt]]
    ) -> asyncio.Future[list[Receipt]]:
        """A batch future that resolves the events' own futures when it resolves."""
        batch: asyncio.Future[list[Receipt]] = asyncio.get_running_loop().create_future()

        def done(finished: asyncio.Future[list[Receipt]]) -> None:
            _dispatch(futures, finished)
            _settled(finished)

        batch.add_done_callback(done)
        return batch

    def _abort(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """Abandons a stream: its reader fails its batches with this reason."""
        if stream.dead or stream.abort_error is not None:
            return
        stream.abort_error = Indeterminate(details, code)
        stream.call.cancel()

    # -- the reader task --------------------------------------------------------------

    async def _read(self, stream: _Stream) -> None:
        """Matches responses to batches in order until the stream ends, then fails the rest."""
        code = grpc.StatusCode.UNKNOWN
        details = "the server closed the publish stream without answering"
        trailing: Any = None
        try:
            async for response in stream.call:
                batch = stream.pending.popleft() if stream.pending else None
                mismatch = response_mismatch(
                    batch.request_id if batch is not None else None,
                    batch.count if batch is not None else 0,
                    response,
                )
                if batch is None or mismatch is not None:
                    if batch is not None:
                        stream.pending.appendleft(batch)
                    stream.abort_error = mismatch
                    stream.call.cancel()
                    break
                moved_from: Endpoint | None = None
                if not stream.answered:
                    stream.answered = True
                    self._binding.stream_answered(stream.endpoint)
                    moved_from = self._moves.answered(stream.endpoint)
                receipts = receipts_from_pb(response)
                if moved_from is not None and stream.endpoint is not None:
                    mark_rebound(receipts)
                    self._moves.report(moved_from, stream.endpoint)
                if not batch.future.done():
                    batch.future.set_result(receipts)
                if self._buffer and self._stream is stream:
                    self._send_buffer(stream)  # the slot this answer freed
                self._notify()
        except grpc.aio.AioRpcError as err:
            code, details = rpc_status(err)
            trailing = status_lost_trailing(code, details, err.trailing_metadata())
        except asyncio.CancelledError:
            # grpc.aio raises this when the call was cancelled here: by _abort (which
            # gave a reason) or by the loop shutting down.
            if stream.abort_error is None:
                stream.abort_error = Indeterminate(
                    "the publish stream was cancelled", grpc.StatusCode.CANCELLED
                )
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come.
            self._abort(
                stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
            )
        if stream.abort_error is not None:
            code = stream.abort_error.code
        if stream.moved_to:
            trailing = moved_trailing(stream.moved_to)
        self._binding.stream_failed(stream.endpoint, code, trailing)
        self._fail(stream, code, details)

    def _fail(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """Ends a stream: its unanswered batches fail (their callers retry them; buffered
        events' batches, and the events not yet sent, are retried by a task here)."""
        stream.dead = True
        stream.woken.set()
        retries: list[_Retry] = []
        # The unsent events hold later sequences than any sent batch: retried last.
        unsent_retry: list[_Retry] = []
        if self._stream is stream or self._stream is None:
            # The buffer waits for the current stream; a newer stream keeps its own.
            self._stream = None
            if self._buffer:
                unsent_events, futures = self._buffer, self._buffer_futures
                self._buffer, self._buffer_futures = [], []
                buffered = self._buffered_batch(futures)
                self._track(buffered)
                unsent = not_sent_error(details)
                if self._retry.retries and worth_retrying(unsent, self._closed):
                    request = new_request(self._topic, self._publisher_id)
                    request.events.extend(unsent_events)
                    unsent_retry.append((buffered, request, unsent))
                else:
                    not_sent = error_for(unsent.code, unsent.details)
                    buffered.set_exception(self._binding.lost_error(not_sent) or not_sent)
        pending = list(stream.pending)
        stream.pending.clear()
        stream.requests.put_nowait(None)  # ends gRPC's request consumer, waiting on our queue
        first, rest = stream_end_errors(code, details, stream.abort_error)
        for i, batch in enumerate(pending):
            error = first if i == 0 else rest
            if batch.future.done():
                continue
            if batch.is_async and self._retry.retries and worth_retrying(error, self._closed):
                retries.append((batch.future, batch.request, error))
                continue
            batch.future.set_exception(self._binding.lost_error(error) or error)
            _settled(batch.future)
        retries += unsent_retry
        if retries:
            task = asyncio.get_running_loop().create_task(self._retry_in_order(retries))
            self._retry_tasks.add(task)
            task.add_done_callback(self._retry_tasks.discard)
        self._notify()

    async def _retry_in_order(self, retries: list[_Retry]) -> None:
        """Retries buffered batches of an ended stream one after another, in sequence order,
        and resolves each batch future with the final outcome."""
        for future, request, error in retries:
            try:
                future.set_result(await self._retry_batch(request, error))
            except SquallError as final:
                future.set_exception(final)
            except Exception as exc:
                # A bug must not leave the app's futures waiting for ever.
                future.set_exception(
                    Indeterminate(f"client failed retrying a batch: {exc!r}", error.code)
                )


def gateway_binding(stub: Any) -> Binding:
    """The binding of a publisher that goes through the gateway (an asyncio stub)."""
    return GatewayBinding(stub)
