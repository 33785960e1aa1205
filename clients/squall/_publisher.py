"""Publishing: one long-lived, pipelined PublishStream per Publisher, with idempotent sequences.

A `Publisher` owns a publisher id and the next sequence number. Every event it sends
carries `(publisher_id, sequence)`, so the master stores a resent event once. All sends go
over one bidirectional `PublishStream` call kept open across calls (a unary call per event
tops out at a few thousand events per second in Python; the stream does not pay a call's
setup per batch). At most `inflight_batches_max` batches are unanswered at a time.

A publisher made by a `Client` sends its lone `publish()` calls on a stream the client
shares instead (`squall._publish_mux`: through the gateway, the one all its gateway
publishers share; a proxy, the one to the replica its binding names for that attempt),
while nothing of its own is in flight on its own stream; its other calls wait until those
have finished, so its sequences reach the master in order either way.

Ordering rule: sequences are assigned and requests queued under one lock, so the order
on the wire is the order of the sequences. Responses come back in request order (the
proto's contract); a reader thread matches each to the oldest unanswered batch.

When the stream fails, the oldest unanswered batch gets the stream's status (so a bad
event fails with `InvalidArgument`), every other sent batch is indeterminate, and events
that were buffered were not sent. A new stream gets a new session token (the token marks
where per-publisher ordering may change).

Retries (issue 5, STYLE.md point 6): a batch whose outcome is indeterminate is sent again,
as the same request (same publisher id and sequences, so the master stores it once), on a
fresh stream, under the `RetryPolicy` (tenacity: a time budget, `total_ms_max`, and full-
jitter exponential backoff; a retry after a slave's redirect goes at once). A definite
failure is raised at once and never retried. Only when the budget runs out does the app
see `Indeterminate` (maybe_stored=True); a definite answer to a retry after an
indeterminate attempt is still `Indeterminate`, because the earlier attempt may have
stored the events (`squall.wire.retry.overall`). Retried batches may land after later ones,
so order across a retry can change, as across any failover.

Where streams go (issue 5, item 1; `squall._proxy`): through the gateway by default, or
straight to a replica of a publisher proxy. A replicated proxy moves to another replica
when a stream ends indeterminately and follows a slave's redirect; the retries above then
carry the batches over. The first stream on a new replica that answers is a move: the
app's `on_rebind(old, new)` runs before the receipt is handed over (in the stream's
reader thread; for a lone `publish()` on the client's shared stream, in the caller's
thread) and that first receipt has `rebound=True`. A non-replicated proxy never moves: once
its master is lost every batch fails with `PublisherLost` (maybe_stored as the attempt
left it) and the app asks for a new publisher.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Literal

import grpc
import tenacity

from squall._errors import (
    Indeterminate,
    SquallError,
    error_for,
    rpc_status,
)
from squall._proxy import (
    Binding,
    Endpoint,
    GatewayBinding,
    ProxyBinding,
    RebindCallback,
)
from squall._publish_mux import JoinRefused, ProxyMuxes, PublishMux, _Entry
from squall._publish_rules import (
    BATCH_EVENTS_DEFAULT,
    BATCH_EVENTS_MAX,
    INFLIGHT_BATCHES_MAX_DEFAULT,
    RECEIPT_STALL_AFTER_S,
    RECEIPT_STALL_CHECK_S,
    UNSENT_STREAM_MOVES_MAX,
    EventLike,
    Moves,
    NotSent,
    RetryRun,
    abandon_stream,
    add_events,
    check_batch_events,
    check_publisher_args,
    copy_for_retry,
    mark_rebound,
    moved_trailing,
    new_publisher_id,
    new_request,
    new_session_token,
    not_sent_error,
    response_mismatch,
    stream_end_errors,
    watch_stalls,
    worth_retrying,
)
from squall._types import Receipt, receipts_from_pb
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall.wire import stages as _stages
from squall.wire.retry import RetryPolicy

__all__ = [
    "BATCH_EVENTS_DEFAULT",
    "BATCH_EVENTS_MAX",
    "INFLIGHT_BATCHES_MAX_DEFAULT",
    "RECEIPT_STALL_AFTER_S",
    "RECEIPT_STALL_CHECK_S",
    "EventLike",
    "Publisher",
    "new_publisher_id",
]

log = logging.getLogger("squall")


class _Batch:
    """One sent request waiting for its response."""

    __slots__ = ("count", "future", "is_async", "request", "request_id", "sent_at")

    def __init__(
        self,
        request: broker_pb2.PublishRequest,
        future: Future[list[Receipt]],
        is_async: bool,
        sent_at: float,
    ) -> None:
        self.request = request
        # When it was queued (time.monotonic, the clock the watchdog waits on): a proxy
        # asks who the master is once its oldest batch is RECEIPT_STALL_AFTER_S old.
        self.sent_at = sent_at
        self.request_id = request.request_id
        self.count = len(request.events)
        self.future = future
        # Async batches are retried by the reader that saw their stream end; a sync batch
        # is retried by the caller waiting on it.
        self.is_async = is_async


class _Stream:
    """One open PublishStream call: its request queue, unanswered batches and reader thread."""

    def __init__(self, publisher_id: str, endpoint: Endpoint | None = None) -> None:
        # The replica this stream is bound to (None: through the gateway).
        self.endpoint = endpoint
        self.answered = False
        # Bounded by the in-flight window: a request is only queued with a free slot.
        self.requests: queue.SimpleQueue[broker_pb2.PublishRequest | None] = queue.SimpleQueue()
        self.pending: collections.deque[_Batch] = collections.deque()
        self.session_token = new_session_token(publisher_id)
        self.dead = False
        # Set before cancelling the call on purpose, so the reader reports why.
        self.abort_error: SquallError | None = None
        # Set when the stream was abandoned because another replica is master now: the
        # binding follows it as it would a slave's redirect.
        self.moved_to = ""
        self.call: Any = None
        self.reader: threading.Thread | None = None
        # A proxy stream's stall watchdog thread (see Publisher._watch), and what wakes
        # it: a batch sent while none was pending, or the stream's end.
        self.watchdog: threading.Thread | None = None
        self.woken = threading.Event()

    def put(self, request: broker_pb2.PublishRequest | None) -> None:
        """Queues a request (None half-closes the stream)."""
        self.requests.put(request)

    def iter_requests(self) -> Iterator[broker_pb2.PublishRequest]:
        """The request iterator gRPC consumes; ends at the None sentinel."""
        get = self.requests.get
        while (request := get()) is not None:
            if _stages.ENABLED:
                _stages.mark("c.wire", _request_key(request))
            yield request


def _request_key(request: broker_pb2.PublishRequest) -> str:
    """The request's key in the latency budget's stage marks (squall.wire.stages)."""
    first = request.events[0].sequence if request.events else 0
    return _stages.request_key(request.publisher_id, first)


def _ready_future() -> Future[Any]:
    """A future the caller cannot cancel (we resolve it from the reader thread)."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    return future


def _dispatch(futures: list[Future[Receipt]], batch: Future[list[Receipt]]) -> None:
    """Resolves the per-event futures of an async batch from the batch's outcome.

    A future the app cancelled is skipped: cancelling only stops the waiting, the event
    is published anyway.
    """
    err = batch.exception()
    outcomes: Iterable[Any] = itertools.repeat(err) if err is not None else batch.result()
    for future, outcome in zip(futures, outcomes, strict=False):
        try:
            if err is not None:
                future.set_exception(err)
            else:
                future.set_result(outcome)
        except InvalidStateError:
            pass  # the app cancelled it


class Publisher:
    """Publishes events to one topic with a publisher id and increasing sequences."""

    def __init__(
        self,
        stub: broker_pb2_grpc.PublisherStub | Binding,
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
        sleep: Callable[[float], None] = time.sleep,
        mux: PublishMux | None = None,
        proxy_muxes: ProxyMuxes | None = None,
    ) -> None:
        check_publisher_args(publisher_id, start_sequence, inflight_batches_max, timeout_s)
        self._retry = retry if retry is not None else RetryPolicy()
        self._retry.validate()
        # The retry budget's clock and the backoff's sleep (a test passes fakes).
        self._monotonic = monotonic
        self._sleep = sleep
        self._binding: Binding = (
            stub if isinstance(stub, GatewayBinding | ProxyBinding) else GatewayBinding(stub)
        )
        # The endpoint whose stream last answered: a stream on another one that answers is
        # a move (reported once, by on_rebind and Receipt.rebound).
        self._moves = Moves(publisher_id, on_rebind)
        self._topic = topic
        self._publisher_id = publisher_id
        self._timeout_s = timeout_s
        self._inflight_max = inflight_batches_max
        self._on_close = on_close
        self._cond = threading.Condition()
        self._next_sequence = start_sequence
        self._next_request_id = 1
        self._stream: _Stream | None = None
        # Async events waiting for a window slot, sequences already assigned.
        self._buffer: list[common_pb2.EventData] = []
        self._buffer_futures: list[Future[Receipt]] = []
        self._closed = False
        self._streams_opened = 0
        # Batches sent whose futures are not yet resolved (flush waits for zero).
        self._unresolved = 0
        # Requests sent again after an indeterminate outcome.
        self._resends = 0
        # The client's shared stream for lone publishes (squall._publish_mux): through the
        # gateway, one; a proxy uses the client's shared stream to the replica its binding
        # names at each attempt, so it still moves on its own.
        self._mux = mux if isinstance(self._binding, GatewayBinding) else None
        self._proxy_muxes = proxy_muxes if isinstance(self._binding, ProxyBinding) else None
        # publish() calls on the shared stream not finished yet (retries included): the
        # publisher's own stream sends nothing meanwhile, so its sequences stay in order.
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
        with self._cond:
            return self._next_sequence

    @property
    def resends(self) -> int:
        """How many batches were sent again after an indeterminate outcome (0 if none)."""
        with self._cond:
            return self._resends

    @property
    def replicated(self) -> bool:
        """False for a non-replicated proxy (no silent failover: it raises PublisherLost)."""
        return self._binding.replicated

    @property
    def endpoint(self) -> Endpoint | None:
        """The replica whose stream last answered (None through the gateway, or before)."""
        with self._cond:
            return self._moves.endpoint

    @property
    def rebinds(self) -> int:
        """How many times this publisher moved to another replica."""
        with self._cond:
            return self._moves.count

    @property
    def streams_opened(self) -> int:
        """How many PublishStream calls this publisher has opened (1 while nothing failed),
        counting each of its client's shared streams its `publish()` calls went on."""
        with self._cond:
            return self._streams_opened

    def publish(
        self, payload: bytes, key: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Receipt:
        """Publishes one event and waits for its receipt.

        Callers in several threads share the publisher's stream: while its in-flight
        window is full, an event waits with the others that arrive meanwhile and they go
        out as one request when a slot frees (as `publish_async` events do), so many
        threads publishing one event at a time share requests, commits and replication
        batches instead of queuing one request each.

        While nothing of this publisher is in flight on its own stream, the event goes on
        a stream its client shares (`squall._publish_mux`; a proxy's, the one to the replica
        its binding names): concurrent publishes of many publishers share requests the
        same way, each event keeping its publisher id and sequence.
        """
        with self._cond:
            muxed: tuple[common_pb2.EventData, _Entry, Endpoint | None] | None = None
            if self._sharing() and self._unresolved == 0 and not self._buffer:
                self._check_open()
                # Before the sequence is taken: a lost proxy raises PublisherLost here.
                mux, endpoint = self._shared_mux()
                event = common_pb2.EventData(
                    key=key or b"", payload=payload, headers=headers, sequence=self._next_sequence
                )
                self._next_sequence += 1
                self._muxed += 1
                try:
                    entry = self._submit(mux, event)
                except BaseException:
                    self._muxed -= 1
                    self._cond.notify_all()
                    raise
                muxed = (event, entry, endpoint)
        if muxed is not None:
            return self._publish_muxed(*muxed)
        with self._cond:
            stream = self._stream
            crowded = (
                stream is not None
                and not stream.dead
                and (bool(self._buffer) or len(stream.pending) >= self._inflight_max)
            )
        if crowded:
            return self._publish_joined(payload, key, headers)
        receipts = self._publish_batches([(key, payload, headers)], BATCH_EVENTS_DEFAULT)
        return receipts[0]

    def _sharing(self) -> bool:
        """Whether lone publishes go on a shared stream of the client."""
        return self._mux is not None or self._proxy_muxes is not None

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
    ) -> _Entry:
        """Queues one attempt on a shared stream; a proxy's binding gives the metadata and
        stall check of a stream it opens, as it does for a stream of the proxy's own."""
        binding = self._binding
        if mux.endpoint is None or not isinstance(binding, ProxyBinding):
            entry = mux.submit(self._topic, self._publisher_id, event, alone=alone)
            return entry
        check = binding.check_master if binding.can_check_master() else None
        entry = mux.submit(
            self._topic,
            self._publisher_id,
            event,
            alone=alone,
            metadata=binding.metadata(),
            check_master=check,
        )
        return entry

    def _publish_muxed(
        self, event: common_pb2.EventData, entry: _Entry, endpoint: Endpoint | None
    ) -> Receipt:
        """Waits for an event sent on a shared stream of the client; retries it as a batch
        of its own is retried (same id and sequence, under the retry policy), each retry on
        the shared stream its binding names then (a proxy may have moved)."""
        try:
            try:
                return self._mux_attempt(event, entry, endpoint)
            except SquallError as first:
                request = new_request(self._topic, self._publisher_id)
                request.events.append(event)
                again = functools.partial(self._mux_attempt, event, None, None)
                return self._retry_batch(request, first, lambda: [again()])[0]
        finally:
            with self._cond:
                self._muxed -= 1
                self._cond.notify_all()

    def _mux_attempt(
        self, event: common_pb2.EventData, entry: _Entry | None, endpoint: Endpoint | None
    ) -> Receipt:
        """One attempt on a shared stream; a refusal shared with others is checked by
        sending the event again alone (nothing was stored). A proxy's binding hears how
        the attempt's stream ended, and its first answer, as from a stream of its own."""
        if entry is None:
            with self._cond:
                self._resends += 1
                target, endpoint = self._shared_mux()
                entry = self._submit(target, event)
        mux: PublishMux | None = entry.mux  # the joining keeps it untyped (squall._publish_join)
        assert mux is not None
        try:
            try:
                receipt = mux.result(entry, self._timeout_s)
            except JoinRefused:
                entry = self._submit(mux, event, alone=True)
                receipt = mux.result(entry, self._timeout_s)
        except SquallError:
            if entry.ended is not None and endpoint is not None:
                self._binding.stream_failed(endpoint, *entry.ended)
            raise
        if _stages.ENABLED:
            _stages.mark("c.return", _stages.request_key(self._publisher_id, event.sequence))
        generation = entry.stream.generation if entry.stream is not None else 0
        answered = (endpoint.address if endpoint is not None else "", generation)
        moved_from: Endpoint | None = None
        with self._cond:
            if answered != self._mux_stream:
                self._mux_stream = answered
                self._streams_opened += 1
                # An answer from a replica the binding has since left is old news.
                if endpoint is not None and self._bound_to(endpoint):
                    self._binding.stream_answered(endpoint)
                    moved_from = self._moves.answered(endpoint)
        if moved_from is not None and endpoint is not None:
            receipts = [receipt]
            mark_rebound(receipts)
            self._moves.report(moved_from, endpoint)
            return receipts[0]
        return receipt

    def _bound_to(self, endpoint: Endpoint) -> bool:
        """Whether a proxy's binding still names `endpoint` for its next stream."""
        binding = self._binding
        return isinstance(binding, ProxyBinding) and binding.current() == endpoint

    def _wait_unmuxed(self) -> None:
        """Waits until no publish() of this publisher is on the shared stream (lock held),
        so that what goes on the own stream next comes after it."""
        if self._muxed == 0:
            return
        wait_s = 2 * self._timeout_s + self._retry.total_ms_max / 1000
        if not self._cond.wait_for(lambda: self._muxed == 0, wait_s):
            raise error_for(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "a publish on the client's shared stream did not finish",
            )

    def _publish_joined(
        self, payload: bytes, key: bytes | None, headers: Mapping[str, str] | None
    ) -> Receipt:
        """One event sent with the others waiting for a slot; waits for its receipt.

        Its batch is retried like an async batch (by the reader thread, under the retry
        policy). Past the timeout the stream is abandoned, which settles every batch on it;
        if even that outcome does not come within the retry budget, `Indeterminate`.
        """
        future = self.publish_async(payload, key, headers)
        try:
            return future.result(self._timeout_s)
        except FutureTimeoutError:
            with self._cond:
                if self._stream is not None:
                    self._abort(
                        self._stream,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no receipt within {self._timeout_s} s",
                    )
        try:
            return future.result(self._timeout_s + self._retry.total_ms_max / 1000)
        except FutureTimeoutError:
            raise Indeterminate(
                f"no receipt within {self._timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    def publish_many(
        self, events: Iterable[EventLike], batch_events: int = BATCH_EVENTS_DEFAULT
    ) -> list[Receipt]:
        """Publishes events in batches pipelined over the stream; receipts in input order.

        Indeterminate batches are retried (see the module docstring). Raises the first
        failure in input order; batches before it are stored, later ones may be. After an
        `Indeterminate`, republishing the same events with the same sequences (a publisher
        with this id and `start_sequence`) stores each one at most once.
        """
        check_batch_events(batch_events)
        return self._publish_batches(events, batch_events)

    def publish_async(
        self, payload: bytes, key: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Future[Receipt]:
        """Queues one event and returns a future for its receipt.

        Events queued while the in-flight window is full go out together as one batch when
        a slot frees, so many small async publishes batch themselves.
        """
        future: Future[Receipt] = Future()
        with self._cond:
            self._wait_unmuxed()
            while True:
                self._check_open()
                stream = self._live_stream()
                if len(self._buffer) < BATCH_EVENTS_MAX:
                    break
                # Buffer full and window full: wait for the reader to drain it.
                if not self._cond.wait(self._timeout_s) and len(self._buffer) >= BATCH_EVENTS_MAX:
                    raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "publish window stayed full")
            # Built here so a bad payload type raises in the caller, not the reader thread.
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

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every event published so far is answered (each future holds its outcome).

        On timeout the stream is abandoned and `Indeterminate` is raised; its unanswered
        batches are retried under the retry policy, and each future gets the final outcome.
        """
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        with self._cond:
            if self._cond.wait_for(
                lambda: not self._buffer and self._unresolved == 0 and self._muxed == 0, wait_s
            ):
                return
            if self._stream is not None:
                self._abort(
                    self._stream, grpc.StatusCode.DEADLINE_EXCEEDED, f"flush took over {wait_s} s"
                )
        raise Indeterminate(f"flush took over {wait_s} s", grpc.StatusCode.DEADLINE_EXCEEDED)

    def close(self) -> None:
        """Waits for outstanding events (up to the timeout), then closes the stream."""
        with self._cond:
            if self._closed:
                return
        try:
            self.flush()
        except SquallError:
            pass
        with self._cond:
            self._closed = True
            stream = self._stream
            self._stream = None
        if stream is not None:
            stream.put(None)
            if stream.reader is not None:
                stream.reader.join(self._timeout_s)
            if stream.reader is not None and stream.reader.is_alive():
                stream.call.cancel()
        self._binding.close()
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Publisher(topic={self._topic!r}, publisher_id={self._publisher_id!r})"

    # -- sending ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the publisher is closed")

    def _publish_batches(self, events: Iterable[Any], batch_events: int) -> list[Receipt]:
        """Sends events in batches over one stream, then collects receipts in order.

        If the stream ends under the call, the batches it sent are settled (retried on a
        fresh stream when indeterminate) and the rest go out on the fresh stream.
        """
        receipts: list[Receipt] = []
        sent: list[tuple[_Stream, Future[list[Receipt]], broker_pb2.PublishRequest]] = []
        source = iter(events)
        held: list[Any] | None = None  # taken from the source, not yet sent
        while True:
            chunk = held if held is not None else list(itertools.islice(source, batch_events))
            held = None
            if not chunk:
                break
            with self._cond:
                self._check_open()
                self._wait_unmuxed()
                stream = self._stream_with_slot(sent[0][0] if sent else None)
                if stream is not None:
                    future: Future[list[Receipt]] = _ready_future()
                    request = new_request(self._topic, self._publisher_id, stream.session_token)
                    add_events(request, chunk, self._next_sequence)
                    self._next_sequence += len(chunk)
                    self._send(stream, request, future)
            if stream is None:
                if not sent:
                    # The window stayed full, or two streams died while this call waited.
                    raise self._not_sent_error("the publish stream failed")
                # The stream this call started on ended: its batches' outcomes come first
                # (retried there as needed), then the rest goes out on a fresh stream.
                held = chunk
                receipts.extend(self._settle_all(sent))
                sent = []
                continue
            sent.append((stream, future, request))
        receipts.extend(self._settle_all(sent))
        return receipts

    def _settle_all(
        self, sent: list[tuple[_Stream, Future[list[Receipt]], broker_pb2.PublishRequest]]
    ) -> list[Receipt]:
        """The receipts of sent batches in order; raises the first failure left after retries."""
        receipts: list[Receipt] = []
        for stream, future, request in sent:
            try:
                receipts.extend(self._result(stream, future))
            except Indeterminate as error:
                receipts.extend(self._retry_batch(request, error))
            if _stages.ENABLED:
                _stages.mark("c.return", _request_key(request))
        return receipts

    def _not_sent_error(self, why: str) -> SquallError:
        return error_for(grpc.StatusCode.UNAVAILABLE, f"{why}; the remaining events were not sent")

    # -- retrying ---------------------------------------------------------------------

    def _worth_retrying(self, error: BaseException) -> bool:
        """Only indeterminate or unsent attempts are repeated, and not once closed."""
        with self._cond:
            closed = self._closed
        return worth_retrying(error, closed)

    def _retry_batch(
        self,
        request: broker_pb2.PublishRequest,
        first: SquallError,
        again: Callable[[], list[Receipt]] | None = None,
    ) -> list[Receipt]:
        """Sends a batch again until it succeeds, fails definitely, or the policy runs out.

        `again` makes one more attempt (default: a copy of the request on the own stream).

        `first` is the failure of the attempt already made (indeterminate, or not sent at
        all). Runs in the caller's thread (sync batches) or in the reader thread of the
        stream that ended (async batches), so a batch's retries happen in order.
        """
        run = RetryRun(
            self._retry,
            self._binding,
            first,
            monotonic=self._monotonic,
            closed=self._is_closed,
            publisher_id=self._publisher_id,
        )
        run.begin()
        try:
            for attempt in tenacity.Retrying(sleep=self._sleep, **run.tenacity_args()):
                with attempt:
                    number = attempt.retry_state.attempt_number
                    if number == 1:
                        raise first
                    try:
                        if again is not None:
                            return again()
                        stream, future = self._resend(request)
                        return self._result(stream, future)
                    except SquallError as error:
                        run.failed(error, request, number)
                        raise
        except SquallError as error:
            final = run.final(error)
            if final is error:
                raise
            raise final from error
        raise AssertionError("unreachable: tenacity either returns or raises")

    def _is_closed(self) -> bool:
        with self._cond:
            return self._closed

    def _resend(self, request: broker_pb2.PublishRequest) -> tuple[_Stream, Future[list[Receipt]]]:
        """Sends a copy of a batch (same events and sequences) on a live stream."""
        with self._cond:
            if self._closed:
                raise NotSent(
                    "the publisher was closed while a batch was being retried",
                    grpc.StatusCode.CANCELLED,
                )
            stream = self._stream_with_slot(None)
            if stream is None:
                raise NotSent(
                    "no publish stream could take the retried batch",
                    grpc.StatusCode.UNAVAILABLE,
                )
            # The events now travel under the fresh stream's binding.
            again = copy_for_retry(request, stream.session_token)
            future: Future[list[Receipt]] = _ready_future()
            self._send(stream, again, future)
            self._resends += 1
            return stream, future

    def _result(self, stream: _Stream, future: Future[list[Receipt]]) -> list[Receipt]:
        """Waits for one batch; on timeout abandons its stream, making it Indeterminate.

        A proxy's stream whose receipt is late is abandoned sooner by its watchdog when
        the gateway names another master (`_watch`); the batch is then retried there.
        """
        try:
            return future.result(self._timeout_s)
        except FutureTimeoutError:
            with self._cond:
                self._abort(
                    stream,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no receipt within {self._timeout_s} s",
                )
        try:
            return future.result(self._timeout_s)
        except FutureTimeoutError:
            raise Indeterminate(
                f"no receipt within {self._timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    def _watch(self, stream: _Stream) -> None:
        """A proxy stream's stall watchdog (its own thread): once the oldest unanswered
        batch is RECEIPT_STALL_AFTER_S old, asks every RECEIPT_STALL_CHECK_S who the master
        is and abandons the stream as soon as the gateway names another replica.

        It watches the stream, not a caller, so every batch on it is covered, also the
        ones of `publish_async` and of callers waiting for a slot: a master that hangs
        after the group elected another cannot end its streams itself.
        """
        endpoint = stream.endpoint
        if endpoint is not None:
            check = self._binding.check_master
            watch_stalls(stream, self._cond, endpoint, check, self._publisher_id, self._abort)

    def _live_stream(self) -> _Stream:
        """The open stream, opening one if there is none (caller holds the lock)."""
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        stub, endpoint = self._binding.open()
        stream = _Stream(self._publisher_id, endpoint)
        stream.call = stub.PublishStream(
            stream.iter_requests(), metadata=self._binding.metadata() or None
        )
        stream.reader = threading.Thread(
            target=self._read, args=(stream,), name=f"squall-publish-{self._topic}", daemon=True
        )
        self._stream = stream
        self._streams_opened += 1
        stream.reader.start()
        if endpoint is not None and self._binding.can_check_master():
            stream.watchdog = threading.Thread(
                target=self._watch,
                args=(stream,),
                name=f"squall-publish-watch-{self._topic}",
                daemon=True,
            )
            stream.watchdog.start()
        return stream

    def _stream_with_slot(self, current: _Stream | None) -> _Stream | None:
        """A live stream with a free slot and no older async events queued (lock held).

        `current` is the stream this call already sent on; if it dies, None (the call
        stops). A call that has sent nothing yet moves to a new stream each time the one it
        waited on died for someone else's batch (under many threads, several streams may
        die while one waits), as the retry policy allows: its time budget and attempts,
        once without retries; None also when the window stays full for the whole timeout.
        """
        started = self._monotonic()
        attempt = 0
        while True:
            attempt += 1
            stream = self._live_stream()
            if current is not None and stream is not current:
                return None
            if self._buffer:
                # Async events hold earlier sequences and must go out first.
                waited = self._wait_slot(stream)
                if waited == "ok":
                    self._send_buffer(stream)
            else:
                waited = "ok"
            if waited == "ok":
                waited = self._wait_slot(stream)
            if waited == "ok":
                return stream
            if waited == "timeout" or current is not None:
                return None
            # Nothing of this call was sent: moving to a fresh stream is always safe.
            if not self._retry.retries:
                if attempt >= 2:
                    return None
            elif attempt >= UNSENT_STREAM_MOVES_MAX or self._retry.exhausted(
                attempt, (self._monotonic() - started) * 1000
            ):
                return None

    def _wait_slot(self, stream: _Stream) -> Literal["ok", "dead", "timeout"]:
        """Waits for a free in-flight slot on the stream (lock held)."""
        ok = self._cond.wait_for(
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
        future: Future[list[Receipt]],
        *,
        is_async: bool = False,
    ) -> None:
        """Queues one request on the stream (lock held)."""
        request.request_id = self._next_request_id
        self._next_request_id += 1
        if not stream.pending:
            stream.woken.set()
        stream.pending.append(_Batch(request, future, is_async, time.monotonic()))
        self._unresolved += 1
        if _stages.ENABLED:
            _stages.mark("c.queued", _request_key(request))
        stream.put(request)

    def _send_buffer(self, stream: _Stream) -> None:
        """Sends the buffered async events as one batch (lock held, slot free)."""
        buffered, futures = self._buffer, self._buffer_futures
        self._buffer, self._buffer_futures = [], []
        request = new_request(self._topic, self._publisher_id, stream.session_token)
        request.events.extend(buffered)
        batch: Future[list[Receipt]] = _ready_future()
        batch.add_done_callback(lambda done: _dispatch(futures, done))
        self._send(stream, request, batch, is_async=True)

    def _abort(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """Abandons a stream: the reader fails its batches with this reason (lock held)."""
        abandon_stream(stream, code, details)

    # -- the reader thread ------------------------------------------------------------

    def _read(self, stream: _Stream) -> None:
        """Matches responses to batches in order until the stream ends, then fails the rest."""
        code = grpc.StatusCode.UNKNOWN
        details = "the server closed the publish stream without answering"
        trailing: Any = None
        try:
            for response in stream.call:
                moved_from: Endpoint | None = None
                with self._cond:
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
                    if self._buffer and self._stream is stream:
                        self._send_buffer(stream)
                    if not stream.answered:
                        stream.answered = True
                        self._binding.stream_answered(stream.endpoint)
                        moved_from = self._moves.answered(stream.endpoint)
                    self._cond.notify_all()
                if _stages.ENABLED:
                    _stages.mark("c.resp", _request_key(batch.request))
                receipts = receipts_from_pb(response)
                if moved_from is not None and stream.endpoint is not None:
                    mark_rebound(receipts)
                    self._moves.report(moved_from, stream.endpoint)
                batch.future.set_result(receipts)
                self._resolved(1)
        except grpc.RpcError as err:
            code, details = rpc_status(err)
            trailing_fn = getattr(err, "trailing_metadata", None)
            trailing = trailing_fn() if callable(trailing_fn) else None
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come.
            with self._cond:
                self._abort(
                    stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
                )
        if stream.abort_error is not None:
            code = stream.abort_error.code
        if stream.moved_to:
            trailing = moved_trailing(stream.moved_to)
        self._binding.stream_failed(stream.endpoint, code, trailing)
        self._fail(stream, code, details)

    def _resolved(self, count: int) -> None:
        """Counts batch futures resolved, for flush()."""
        with self._cond:
            self._unresolved -= count
            self._cond.notify_all()

    def _fail(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """Ends a stream: fails (or retries) its unanswered batches and the unsent buffer."""
        with self._cond:
            stream.dead = True
            stream.woken.set()
            unsent: list[Future[Receipt]] = []
            unsent_events: list[common_pb2.EventData] = []
            took_buffer = self._stream is stream or self._stream is None
            if took_buffer:
                # The buffer waits for the current stream; a newer stream keeps its own.
                self._stream = None
                unsent, unsent_events = self._buffer_futures, self._buffer
                self._buffer, self._buffer_futures = [], []
                # Counted like a batch, so flush() waits until these futures are settled too.
                self._unresolved += 1
            pending = list(stream.pending)
            stream.pending.clear()
            self._cond.notify_all()
        stream.put(None)  # ends gRPC's request-consumer thread, which waits on our queue
        first, rest = stream_end_errors(code, details, stream.abort_error)
        # Every waiting caller hears first, then the async batches are retried in order
        # (in this thread, which has nothing else left to do).
        retries: list[tuple[Future[list[Receipt]], broker_pb2.PublishRequest, SquallError]] = []
        for i, batch in enumerate(pending):
            error = first if i == 0 else rest
            if batch.is_async and self._retry.retries and self._worth_retrying(error):
                retries.append((batch.future, batch.request, error))
            else:
                batch.future.set_exception(self._binding.lost_error(error) or error)
        if unsent:
            buffered: Future[list[Receipt]] = _ready_future()
            buffered.add_done_callback(lambda done: _dispatch(unsent, done))
            unsent_error = not_sent_error(details)
            if self._retry.retries and self._worth_retrying(unsent_error):
                request = new_request(self._topic, self._publisher_id)
                request.events.extend(unsent_events)
                retries.append((buffered, request, unsent_error))
            else:
                # Without retries the app sees the plain status: nothing was sent.
                not_sent = error_for(unsent_error.code, unsent_error.details)
                buffered.set_exception(self._binding.lost_error(not_sent) or not_sent)
        for future, request, error in retries:
            try:
                future.set_result(self._retry_batch(request, error))
            except SquallError as final:
                future.set_exception(final)
            except Exception as exc:
                # A bug must not leave the app's futures waiting for ever.
                future.set_exception(
                    Indeterminate(f"client failed retrying a batch: {exc!r}", code)
                )
        self._resolved(len(pending) + (1 if took_buffer else 0))
