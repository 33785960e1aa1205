"""One publish stream per client, shared by the one-at-a-time publishes of all its publishers.

Many threads each publishing one event at a time with a `Publisher` of their own used to
cost a stream per publisher: one request per event on every hop, with a gRPC message, a
thread hand-off and a stream read each (bench/README.md, issue 16). Here every gateway
publisher of one `Client` sends its lone `publish()` calls on one `PublishStream`: a call
that finds a free slot in the window goes out at once as a request of its own (a lone
publish never waits for a timer or for others); calls that arrive while the window is
full wait, and when a slot frees they go out together as one request. That request joins
the events per publisher (one part per publisher id and topic, its events in call order)
and, when more than one publisher is in it, carries the parts in `PublishRequest.parts`:
the master publishes each part as a request of its own (its publisher id, sequences and
session token; deduplicated as always) and answers each part apart, so one part's refusal
fails that part's callers only.

Rules kept:

* Order per publisher: a publisher hands its events over under its own lock, in sequence
  order, and they stay in that order here, on the wire and in the master.
* Errors stay with their caller: the stream asks for failed requests to be answered
  inline (`squall-publish-errors: inline`), so a refusal does not end the stream; a
  refused part of several events (or a whole joined request refused, e.g. by a server
  that knows no parts) is not blamed on all of them: each event is sent again alone
  (`JoinRefused`, nothing was stored), and only the culprit's caller sees the refusal.
* Retries are the caller's (`Publisher`, under its retry policy) with the same publisher
  id and sequence, so an event whose outcome a broken stream left open is stored once.
  A part answered as by a master that is no longer one (a redirect, a deposition) also
  abandons the stream, so the retries reach the gateway's current master on a fresh one.
* The joining itself (which events go together, the request, splitting the answers) is
  `squall._publish_join`'s, shared with the asyncio client's `squall.aio._publish_mux`.
* Publisher proxies (`replicated=True/False`) keep streams of their own: each is bound to
  one replica and moves on its own (`on_rebind`), which one shared stream cannot follow.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import grpc

from squall._errors import Indeterminate, SquallError, error_for, rpc_status
from squall._publish_join import (
    INLINE_ERRORS_METADATA,
    JOIN_BYTES_MAX,
    JOIN_EVENTS_MAX,
    SHARED_INFLIGHT_MAX,
    Entry,
    JoinRefused,
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
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall.wire import stages as _stages

__all__ = [
    "INLINE_ERRORS_METADATA",
    "JOIN_BYTES_MAX",
    "JOIN_EVENTS_MAX",
    "SHARED_INFLIGHT_MAX",
    "JoinRefused",
    "PublishMux",
]

log = logging.getLogger("squall")

_Entry = Entry[Future[Receipt]]
_Sent = Sent[Future[Receipt]]


class _MuxStream:
    """One open PublishStream: its request queue, unanswered requests and reader thread."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.session_token = new_session_token("shared")
        self.requests: queue.SimpleQueue[broker_pb2.PublishRequest | None] = queue.SimpleQueue()
        self.pending: collections.deque[_Sent] = collections.deque()
        self.dead = False
        self.abort_error: SquallError | None = None
        self.call: Any = None

    def iter_requests(self) -> Iterator[broker_pb2.PublishRequest]:
        get = self.requests.get
        while (request := get()) is not None:
            if _stages.ENABLED:
                _stages.mark("c.wire", request_key(request))
            yield request


class PublishMux:
    """A client's shared publish stream for one-at-a-time publishes (see the module doc)."""

    def __init__(
        self,
        stub: broker_pb2_grpc.PublisherStub,
        *,
        inflight_max: int = SHARED_INFLIGHT_MAX,
    ) -> None:
        self._stub = stub
        self._inflight_max = inflight_max
        self._lock = threading.Lock()
        self._stream: _MuxStream | None = None
        self._waiting: collections.deque[_Entry] = collections.deque()
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
    ) -> tuple[Future[Receipt], _Entry]:
        """Queues one event; its future gets the receipt or the error of this attempt.

        `alone` keeps it out of joined requests (after `JoinRefused`). The caller holds its
        publisher's lock, so one publisher's events arrive here in sequence order.
        """
        future: Future[Receipt] = Future()
        future.set_running_or_notify_cancel()
        entry = new_entry(topic, publisher_id, event, future, alone)
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            stream = self._live_stream()
            self._waiting.append(entry)
            self._pump(stream)
        return future, entry

    def result(self, entry: _Entry, timeout_s: float) -> Receipt:
        """Waits for one attempt's receipt; past the timeout the stream it went on is
        abandoned (every request on it becomes indeterminate, and is retried by its caller)
        and, if even that outcome does not come, `Indeterminate`."""
        try:
            return entry.future.result(timeout_s)
        except FutureTimeoutError:
            with self._lock:
                stream = entry.stream
                if stream is None and entry in self._waiting:
                    # Never sent (the window stayed full): nothing to abandon.
                    self._waiting.remove(entry)
                    entry.future.set_exception(
                        error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "publish window stayed full")
                    )
                elif stream is not None:
                    self._abort(
                        stream,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no receipt within {timeout_s} s",
                    )
        try:
            return entry.future.result(timeout_s)
        except FutureTimeoutError:
            raise Indeterminate(
                f"no receipt within {timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    def close(self) -> None:
        """Half-closes the stream; events still waiting fail as not sent."""
        with self._lock:
            self._closed = True
            stream = self._stream
            self._stream = None
            waiting = list(self._waiting)
            self._waiting.clear()
        for entry in waiting:
            entry.future.set_exception(not_sent_error("the client was closed"))
        if stream is not None:
            stream.requests.put(None)

    # -- sending (lock held) ----------------------------------------------------------

    def _live_stream(self) -> _MuxStream:
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        self._generation += 1
        stream = _MuxStream(self._generation)
        stream.call = self._stub.PublishStream(
            stream.iter_requests(), metadata=INLINE_ERRORS_METADATA
        )
        self._stream = stream
        self.streams_opened += 1
        threading.Thread(
            target=self._read, args=(stream,), name="squall-publish-shared", daemon=True
        ).start()
        return stream

    def _pump(self, stream: _MuxStream) -> None:
        """Sends what waits while the window has room: the lone event at once, the events
        that gathered while it was full as one request."""
        waiting = self._waiting
        while waiting and len(stream.pending) < self._inflight_max and not stream.dead:
            self._send(stream, take_next(waiting, self._joins))

    def _send(self, stream: _MuxStream, entries: list[_Entry]) -> None:
        request_id = self._next_request_id
        self._next_request_id += 1
        request, sent = build_request(entries, stream.session_token, request_id, stream)
        self.joined_requests += sent.joined
        stream.pending.append(sent)
        if _stages.ENABLED:
            _stages.mark("c.queued", request_key(request))
        stream.requests.put(request)

    def _abort(self, stream: _MuxStream, code: grpc.StatusCode, details: str) -> None:
        abandon_stream(stream, code, details)

    # -- the reader thread ------------------------------------------------------------

    def _read(self, stream: _MuxStream) -> None:
        """Hands each response's receipts (or errors) to their callers, in request order."""
        code = grpc.StatusCode.UNKNOWN
        details = "the server closed the publish stream without answering"
        try:
            for response in stream.call:
                with self._lock:
                    sent = stream.pending.popleft() if stream.pending else None
                    if sent is None or not answers(sent, response):
                        if sent is not None:
                            stream.pending.appendleft(sent)
                        stream.abort_error = mismatch_error(response)
                        stream.call.cancel()
                        break
                    self._pump(stream)
                if _stages.ENABLED:
                    _stages.mark("c.resp", entry_key(sent.groups[0][0]))
                if self._settle(sent, response):
                    with self._lock:
                        self._abort(
                            stream,
                            grpc.StatusCode.UNAVAILABLE,
                            "the master answered a publish as no longer master",
                        )
        except grpc.RpcError as err:
            code, details = rpc_status(err)
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come.
            log.exception("squall: the shared publish stream's reader failed")
            with self._lock:
                self._abort(
                    stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
                )
        self._fail(stream, code, details)

    def _settle(self, sent: _Sent, response: broker_pb2.PublishResponse) -> bool:
        """Resolves the futures of one answered request; True if the master is gone."""
        if refuses_parts(sent, response):
            # A server without parts: join no more, each event goes again alone.
            with self._lock:
                if self._joins:
                    log.info(
                        "squall: the server refused a joined publish (%s)",
                        inline_error(response.error),
                    )
                self._joins = False
        return settle(sent, response)

    def _fail(self, stream: _MuxStream, code: grpc.StatusCode, details: str) -> None:
        """Ends a stream: its oldest request gets the status, the others are indeterminate,
        and events still waiting fail as not sent (their callers send them again)."""
        with self._lock:
            stream.dead = True
            pending = list(stream.pending)
            stream.pending.clear()
            waiting: list[_Entry] = []
            if self._stream is stream or self._stream is None:
                self._stream = None
                waiting = list(self._waiting)
                self._waiting.clear()
        stream.requests.put(None)  # ends gRPC's request-consumer thread
        fail_ended(pending, code, details, stream.abort_error)
        unsent = not_sent_error(details)
        for entry in waiting:
            entry.future.set_exception(unsent)
