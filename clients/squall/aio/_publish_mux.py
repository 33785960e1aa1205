"""One publish stream per asyncio client, shared by the lone publishes of all its publishers.

The asyncio counterpart of `squall._publish_mux` (its docstring gives the reasons and the
rules; the joining itself is `squall._publish_join`'s, shared by both). Every gateway
publisher of one `squall.aio.Client` sends its lone `publish()` calls here: a call that
finds a free slot in the window goes out at once as a request of its own (no timer, no
waiting for others); calls that arrive while the window is full wait, and when a slot
frees they go out together as one request, one part per publisher id and topic
(`PublishRequest.parts`), which the master publishes part by part and answers apart.

Rules kept, as in the threaded stream: per-publisher order (a publisher submits with no
`await` between assigning a sequence and queuing the event, and its own stream sends
nothing while one of its publishes is here); errors stay with their caller (failures are
answered inline, a refusal shared with others is `JoinRefused` and sent again alone);
retries are the caller's (`Publisher._publish_muxed`, same publisher id and sequence,
so the master's deduplication stores the event once); a part answered as by a master
that is no longer one abandons the stream; a caller past its timeout abandons the stream
its event went on (or withdraws the event if it was never sent).

Cancellation: a task cancelled while its event waits for a slot withdraws the event (it
is never sent; its sequence is skipped, which the master allows). Once sent, the event
stays on the stream: it is stored or refused as if the caller still waited, and nobody
retries it; the publisher's later events still follow it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from squall._errors import Indeterminate, SquallError, error_for, rpc_status
from squall._publish_join import (
    INLINE_ERRORS_METADATA,
    SHARED_INFLIGHT_MAX,
    Entry,
    Sent,
    answers,
    build_request,
    entry_key,
    fail_ended,
    inline_error,
    mismatch_error,
    new_entry,
    refuses_parts,
    request_key,
    settle,
    take_next,
)
from squall._publish_rules import abandon_stream, new_session_token, not_sent_error
from squall._types import Receipt
from squall.v1 import broker_pb2, common_pb2
from squall.wire import stages as _stages

log = logging.getLogger("squall")

MuxEntry = Entry[asyncio.Future[Receipt]]
_Sent = Sent[asyncio.Future[Receipt]]


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Marks the exception of a future nobody awaits any more (a cancelled caller's) as
    seen, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class _MuxStream:
    """One open PublishStream: its request queue, unanswered requests and reader task."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.session_token = new_session_token("shared")
        # Bounded by the window: a request is only queued with a free slot.
        self.requests: asyncio.Queue[broker_pb2.PublishRequest | None] = asyncio.Queue()
        self.pending: collections.deque[_Sent] = collections.deque()
        self.dead = False
        self.abort_error: SquallError | None = None
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None

    async def iter_requests(self) -> AsyncIterator[broker_pb2.PublishRequest]:
        """The request iterator gRPC consumes; ends at the None sentinel."""
        while (request := await self.requests.get()) is not None:
            if _stages.ENABLED:
                _stages.mark("c.wire", request_key(request))
            yield request


class PublishMux:
    """An asyncio client's shared publish stream for one-at-a-time publishes (see the
    module doc). Used from the one event loop the client runs on."""

    def __init__(
        self, stub: Any, *, timeout_s: float = 10.0, inflight_max: int = SHARED_INFLIGHT_MAX
    ) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._inflight_max = inflight_max
        self._stream: _MuxStream | None = None
        self._waiting: collections.deque[MuxEntry] = collections.deque()
        self._next_request_id = 1
        self._generation = 0
        # Off once a server refused a joined request whole (it knows no parts).
        self._joins = True
        self._closed = False
        # Requests sent with parts of more than one publisher, and streams opened.
        self.joined_requests = 0
        self.streams_opened = 0

    def submit(
        self, topic: str, publisher_id: str, event: common_pb2.EventData, *, alone: bool = False
    ) -> MuxEntry:
        """Queues one event (sent at once if a slot is free); its future gets the receipt
        or the error of this attempt. `alone` keeps it out of joined requests (after
        `JoinRefused`). No `await` here: events are queued in call order."""
        if self._closed:
            raise ValueError("the client is closed")
        future: asyncio.Future[Receipt] = asyncio.get_running_loop().create_future()
        entry = new_entry(topic, publisher_id, event, future, alone)
        stream = self._live_stream()
        self._waiting.append(entry)
        self._pump(stream)
        return entry

    async def result(self, entry: MuxEntry, timeout_s: float) -> Receipt:
        """Waits for one attempt's receipt; past the timeout the stream it went on is
        abandoned (every request on it becomes indeterminate, and is retried by its caller)
        and, if even that outcome does not come, `Indeterminate`. A cancelled caller's
        event is withdrawn if it was not sent yet (see the module doc)."""
        try:
            return await asyncio.wait_for(asyncio.shield(entry.future), timeout_s)
        except TimeoutError:
            if entry.stream is None and entry in self._waiting:
                # Never sent (the window stayed full): nothing to abandon.
                self._waiting.remove(entry)
                entry.future.set_exception(
                    error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "publish window stayed full")
                )
            elif entry.stream is not None:
                abandon_stream(
                    entry.stream,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no receipt within {timeout_s} s",
                )
        except asyncio.CancelledError:
            if entry.stream is None and entry in self._waiting:
                self._waiting.remove(entry)
                entry.future.set_exception(not_sent_error("the publishing task was cancelled"))
            entry.future.add_done_callback(_retrieved)
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(entry.future), timeout_s)
        except TimeoutError:
            raise Indeterminate(
                f"no receipt within {timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    async def close(self) -> None:
        """Half-closes the stream and waits (up to the timeout) for the answers to what
        was sent; events still waiting fail as not sent."""
        if self._closed:
            return
        self._closed = True
        stream, self._stream = self._stream, None
        waiting = list(self._waiting)
        self._waiting.clear()
        for entry in waiting:
            entry.future.set_exception(not_sent_error("the client was closed"))
        if stream is None:
            return
        stream.requests.put_nowait(None)  # half-close: the server ends the stream
        if stream.reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(stream.reader), self._timeout_s)
            except TimeoutError:
                stream.call.cancel()

    # -- sending ----------------------------------------------------------------------

    def _live_stream(self) -> _MuxStream:
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        self._generation += 1
        stream = _MuxStream(self._generation)
        stream.call = self._stub.PublishStream(
            stream.iter_requests(), metadata=grpc.aio.Metadata(*INLINE_ERRORS_METADATA)
        )
        self._stream = stream
        self.streams_opened += 1
        stream.reader = asyncio.get_running_loop().create_task(
            self._read(stream), name="squall-publish-shared"
        )
        return stream

    def _pump(self, stream: _MuxStream) -> None:
        """Sends what waits while the window has room: the lone event at once, the events
        that gathered while it was full as one request."""
        waiting = self._waiting
        while waiting and len(stream.pending) < self._inflight_max and not stream.dead:
            request_id = self._next_request_id
            self._next_request_id += 1
            request, sent = build_request(
                take_next(waiting, self._joins), stream.session_token, request_id, stream
            )
            self.joined_requests += sent.joined
            stream.pending.append(sent)
            if _stages.ENABLED:
                _stages.mark("c.queued", request_key(request))
            stream.requests.put_nowait(request)

    # -- the reader task --------------------------------------------------------------

    async def _read(self, stream: _MuxStream) -> None:
        """Hands each response's receipts (or errors) to their callers, in request order."""
        code = grpc.StatusCode.UNKNOWN
        details = "the server closed the publish stream without answering"
        try:
            async for response in stream.call:
                sent = stream.pending.popleft() if stream.pending else None
                if sent is None or not answers(sent, response):
                    if sent is not None:
                        stream.pending.appendleft(sent)
                    stream.abort_error = mismatch_error(response)
                    stream.call.cancel()
                    break
                self._pump(stream)  # the slot this answer freed
                if _stages.ENABLED:
                    _stages.mark("c.resp", entry_key(sent.groups[0][0]))
                if refuses_parts(sent, response) and self._joins:
                    # A server without parts: join no more, each event goes again alone.
                    log.info(
                        "squall: the server refused a joined publish (%s)",
                        inline_error(response.error),
                    )
                    self._joins = False
                if settle(sent, response) is not None:
                    abandon_stream(
                        stream,
                        grpc.StatusCode.UNAVAILABLE,
                        "the master answered a publish as no longer master",
                    )
        except grpc.aio.AioRpcError as err:
            code, details = rpc_status(err)
        except asyncio.CancelledError:
            # grpc.aio raises this when the call was cancelled here (by abandon_stream,
            # which gave a reason) or by the loop shutting down.
            if stream.abort_error is None:
                stream.abort_error = Indeterminate(
                    "the publish stream was cancelled", grpc.StatusCode.CANCELLED
                )
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come.
            log.exception("squall: the shared publish stream's reader failed")
            abandon_stream(
                stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
            )
        self._fail(stream, code, details)

    def _fail(self, stream: _MuxStream, code: grpc.StatusCode, details: str) -> None:
        """Ends a stream: its oldest request gets the status, the others are indeterminate,
        and events still waiting fail as not sent (their callers send them again)."""
        stream.dead = True
        pending = list(stream.pending)
        stream.pending.clear()
        waiting: list[MuxEntry] = []
        if self._stream is stream or self._stream is None:
            self._stream = None
            waiting = list(self._waiting)
            self._waiting.clear()
        stream.requests.put_nowait(None)  # ends gRPC's request consumer, waiting on our queue
        fail_ended(pending, code, details, stream.abort_error)
        unsent = not_sent_error(details)
        for entry in waiting:
            if not entry.future.done():
                entry.future.set_exception(unsent)
